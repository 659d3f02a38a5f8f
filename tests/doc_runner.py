"""Run several doc blocks in one launch, so that the docs test pays for
starting Python, torch and JAX once per rank count, not once per block.

    mpiexec -n 2 python tests/doc_runner.py OUTDIR block1.py block2.py ...

Each block runs as ``__main__`` in a fresh namespace; what it prints goes to
OUTDIR/<i>.rank<r>.out and a traceback, if it raised, to
OUTDIR/<i>.rank<r>.err. All ranks meet at a barrier between blocks so that
one block's messages never meet the next one's."""

import contextlib
import os
import runpy
import sys
import traceback

from mpi4py import MPI


def main() -> None:
    outdir, blocks = sys.argv[1], sys.argv[2:]
    rank = MPI.COMM_WORLD.Get_rank()
    for index, block in enumerate(blocks):
        prefix = os.path.join(outdir, f"{index}.rank{rank}")
        sys.argv = [block]
        with open(prefix + ".out", "w") as out, contextlib.redirect_stdout(out):
            try:
                runpy.run_path(block, run_name="__main__")
            except SystemExit as exit_:
                if exit_.code not in (None, 0):
                    _write(prefix + ".err", f"SystemExit({exit_.code!r})\n")
            except BaseException:
                _write(prefix + ".err", traceback.format_exc())
        MPI.COMM_WORLD.Barrier()


def _write(path: str, text: str) -> None:
    with open(path, "w") as err:
        err.write(text)


if __name__ == "__main__":
    main()
