"""Docs that are run: every fenced block of README.md and docs/*.md is run
by this test, or says why not, so that the docs cannot drift from the code.

The convention is a comment on the last non-blank line above a fence:

    <!-- run: mpiexec -n 2 -->   a python block, run under mpiexec at 2 ranks; several
                                 launches separated by `;` (`mpiexec -n 2; mpiexec -n 4`);
                                 `python` for one process without mpiexec; VAR=value
                                 settings may come first (`COMMLIB_RANKS_PER_NODE=2 mpiexec -n 4`)
    # mpiexec -n 3 python examples/x.py
                                 as a python block's FIRST LINE (no comment needed): run it
                                 at that launch; the block must equal examples/x.py
    <!-- output -->              what the python block run before it prints, ranks' output
                                 in rank order; with several launches one section per
                                 launch, each after its `$ mpiexec -n N ...` line
    <!-- run -->                 a bash block: run as a script, it must exit 0; a text
                                 block whose lines start with `$ command`: each command is
                                 run and what it prints compared with the lines after it
                                 (the ranks of `$ mpiexec -n N` print in any order)
    <!-- file: NAME -->          a file (NAME, in the working directory) that later blocks
                                 of the page read
    <!-- not-run: REASON -->     not run, and why: a GPU, srun or a cluster, an install, a
                                 benchmark of minutes, a fragment or a listing, a diagram

An unmarked block fails the test. Output is compared line by line, blank
lines and runs of spaces ignored: the text between numbers must be equal,
integers equal, other numbers within `atol + rtol * |shown|` (1e-5 + 1e-3
of the shown value; `rtol=`, `atol=` after `run:`/`output:` change it).
`timings` (`<!-- output: timings -->`, `<!-- run: timings -->`) leaves every
number free and compares the rest: for times and bandwidths.

Blocks with the same launch run in one launch (tests/doc_runner.py), under
COMMLIB_TIMEOUT=120, in a scratch directory that links examples/, tools/
and docs/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest
from doc_blocks import (
    CODE_LANGUAGES,
    ROOT,
    Check,
    Launch,
    Options,
    compare,
    docs,
    parse,
    plan,
    problems_of,
    prompt_ranks,
)

from launch import run as launch_run

# the full tier only (tests/tiers.py): every block of the docs, under mpiexec: minutes
pytestmark = pytest.mark.full

TIMEOUT_S = 600
# COLUMNS: click's help wraps at 80. PYTHONUNBUFFERED off: unbuffered, print()
# writes a line and its newline apart, and two ranks' lines can interleave in
# mpiexec's output ("...Brank 0: ..."); buffered, each rank's lines leave whole
ENV = {"COMMLIB_TIMEOUT": "120", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "COLUMNS": "80", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": ""}


def _environment(extra: Sequence[Tuple[str, str]] = ()) -> Dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return dict(os.environ, **ENV, PATH=path, **dict(extra))


def _workdir(base: Path, checks: Sequence[Check]) -> Path:
    """A scratch directory with the pages' files and links to the repository."""
    base.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "tools", "docs"):
        if not (base / name).exists():
            (base / name).symlink_to(ROOT / name)
    for check in checks:
        for name, text in check.files.items():
            (base / name).write_text(text)
    return base


class Runner:
    """Runs the python blocks of ``checks`` grouped by launch, each group
    once, on first demand."""

    def __init__(self, checks: Sequence[Check], workdir: Path):
        self.checks = [c for c in checks if c.block.language in CODE_LANGUAGES]
        self.workdir = _workdir(workdir, checks)
        self.results: Dict[Launch, Tuple[str, List[Tuple[str, str]]]] = {}

    def output(self, check: Check, launch: Launch) -> Tuple[str, str]:
        """(what the block printed, tracebacks and the launch's own output)."""
        if launch not in self.results:
            self.results[launch] = self._launch(launch)
        launcher_output, outputs = self.results[launch]
        group = [c for c in self.checks if launch in c.block.launches]
        printed, errors = outputs[group.index(check)]
        return printed, (errors + ("\n" + launcher_output if errors else "")).strip()

    def _launch(self, launch: Launch) -> Tuple[str, List[Tuple[str, str]]]:
        group = [c for c in self.checks if launch in c.block.launches]
        key = f"{'-'.join(k + v for k, v in launch.env)}n{launch.nprocs or 0}"
        outdir = self.workdir / f"out-{key}"
        outdir.mkdir(exist_ok=True)
        scripts = []
        for index, check in enumerate(group):
            script = outdir / f"block{index}.py"
            script.write_text(check.block.text + "\n")
            scripts.append(str(script))
        argv = [sys.executable, str(ROOT / "tests" / "doc_runner.py"), str(outdir), *scripts]
        env = _environment(launch.env)
        cwd = os.getcwd()
        os.chdir(self.workdir)
        try:
            if launch.nprocs is None:
                done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                      timeout=TIMEOUT_S)
                launcher_output, status = done.stdout + done.stderr, done.returncode
            else:
                done = launch_run(launch.nprocs, argv, timeout=TIMEOUT_S, env=env)
                launcher_output, status = done.stdout, done.returncode
        except subprocess.TimeoutExpired as late:  # recorded once for the whole group
            launcher_output, status = f"killed after {TIMEOUT_S} s:\n{late.output}", "killed"
        finally:
            os.chdir(cwd)
        ranks = launch.nprocs or 1
        started = [i for i in range(len(group)) if (outdir / f"{i}.rank0.out").exists()]
        outputs = []
        for index in range(len(group)):
            printed = "".join(_read(outdir / f"{index}.rank{r}.out") for r in range(ranks))
            errors = "".join(_read(outdir / f"{index}.rank{r}.err") for r in range(ranks))
            if status == "killed" and started and index == started[-1]:
                errors += f"the launch was killed after {TIMEOUT_S} s, in this block"
            if not (outdir / f"{index}.rank0.out").exists():
                errors += f"the block never ran (exit status {status})"
            outputs.append((printed, errors))
        return launcher_output, outputs


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def problems(check: Check, runner: Runner) -> List[str]:
    """Everything a check finds wrong: a failed run, or output unlike the doc's."""
    block = check.block
    if block.language in CODE_LANGUAGES:
        return _code_problems(check, runner)
    if block.text.startswith("$ "):
        return _command_problems(check, runner.workdir)
    done = subprocess.run(["bash", "-e", "-c", block.text], cwd=runner.workdir,
                          env=_environment(), capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        return [f"exit status {done.returncode}:\n{done.stdout}{done.stderr}"]
    return []


def _code_problems(check: Check, runner: Runner) -> List[str]:
    block, found = check.block, []
    if block.header_file:
        shown = ROOT / block.header_file
        if not shown.exists() or shown.read_text() != block.text + "\n":
            found.append(f"the block differs from {block.header_file}, which it names")
    sections = check.expected or [(None, None, Options())]
    if len(sections) not in (1, len(block.launches)):
        return found + [f"{len(sections)} output sections for {len(block.launches)} launches"]
    for launch, (prompt, shown, options) in zip(block.launches, sections * len(block.launches)):
        if prompt and prompt_ranks(prompt) != launch.nprocs:
            found.append(f"the doc shows `$ {prompt}` for the launch `{launch}`")
        printed, errors = runner.output(check, launch)
        if errors:
            found.append(f"{launch}: the block failed:\n{errors}")
        elif shown is not None:
            found += [f"{launch}: {p}" for p in compare(shown, printed, options)]
    return found


def _command_problems(check: Check, workdir: Path) -> List[str]:
    found = []
    for prompt, shown, options in check.expected:
        done = subprocess.run(["bash", "-c", prompt], cwd=workdir, env=_environment(),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        if done.returncode != 0:
            found.append(f"`{prompt}` exited {done.returncode}:\n{done.stdout}{done.stderr}")
        else:
            found += [f"`{prompt}`: {p}" for p in _compare_launched(prompt, shown, done.stdout,
                                                                  options)]
    return found


def _compare_launched(prompt: str, shown: str, got: str, options: Options) -> List[str]:
    """compare(), except that the lines of several ranks of one command may
    arrive in any order: then sorted lines that match pass too."""
    found = compare(shown, got, options)
    if found and (prompt_ranks(prompt) or 1) > 1:
        def ordered(text):
            return "\n".join(sorted(line.strip() for line in text.splitlines() if line.strip()))
        if not compare(ordered(shown), ordered(got), options):
            return []
    return found


PAGES = docs()
CHECKS = [check for page in PAGES for check in plan(page)]


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Runner:
    return Runner(CHECKS, tmp_path_factory.mktemp("docs"))


def test_every_block_is_run_or_says_why_not():
    found = [p for page in PAGES for block in parse(page) for p in problems_of(block)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.name)
def test_doc_block(check: Check, runner: Runner):
    found = problems(check, runner)
    assert not found, f"{check.name}:\n" + "\n".join(found)


# The checker itself, on a page written here: it must fail a drifted block.

DRIFTED = """
<!-- run: python -->
```python
import math
print(f"pi {math.pi:.4f}, rows 3")
print("took 12.5 ms")
```

<!-- output -->
```
pi PI, rows ROWS
took 99.0 ms
```
"""


def _page_problems(tmp_path: Path, text: str) -> List[str]:
    page = tmp_path / "page.md"
    page.write_text(text)
    checks = plan(page)
    return [p for check in checks for p in problems(check, Runner(checks, tmp_path / "run"))]


@pytest.mark.parametrize("pi, rows, wrong", [("3.1416", "3", None), ("3.1410", "3", "3.1416"),
                                            ("3.1416", "4", "3 where the doc shows 4")])
def test_a_drifted_block_fails(tmp_path, pi, rows, wrong):
    page = (DRIFTED.replace("PI", pi).replace("ROWS", rows)
            .replace("<!-- output -->", "<!-- output: rtol=1e-4 -->"))
    found = _page_problems(tmp_path, page)
    timing = [p for p in found if "99.0" in p]
    assert timing, "the timing line is not timings-marked, so its number must be checked"
    others = [p for p in found if p not in timing]
    assert (wrong in "\n".join(others)) if wrong else not others, found


def test_timings_leave_numbers_free_but_not_text(tmp_path):
    page = (DRIFTED.replace("PI", "2.0").replace("ROWS", "7")
            .replace("<!-- output -->", "<!-- output: timings -->"))
    assert _page_problems(tmp_path, page) == []
    cut = page.replace("took 99.0 ms\n", "")
    assert any("2 lines of output where the doc shows 1" in p
               for p in _page_problems(tmp_path, cut))
    renamed = page.replace("took 99.0", "spent 99.0")
    assert any("the text differs" in p for p in _page_problems(tmp_path, renamed))


def test_a_failing_block_fails(tmp_path):
    page = "<!-- run: python -->\n```python\nraise ValueError('x')\n```\n"
    found = _page_problems(tmp_path, page)
    assert any("ValueError: x" in p for p in found), found


def test_unmarked_and_unreasoned_blocks_are_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nprint(1)\n```\n\n<!-- not-run -->\n```bash\nsrun x\n```\n")
    found = [p for block in parse(page) for p in problems_of(block)]
    assert len(found) == 2 and "unmarked" in found[0] and "reason" in found[1], found


def test_a_block_must_equal_the_example_it_names(tmp_path):
    copy = (ROOT / "examples" / "torch_ring.py").read_text().replace("seed(0)", "seed(1)")
    page = tmp_path / "page.md"
    page.write_text(f"```python\n{copy}```\n")
    (check,) = plan(page)
    assert check.block.launches == [Launch((), 2)]
    assert any("differs from examples/torch_ring.py" in p
               for p in _code_problems(check, _NoRun())), "an edited copy must be caught"


class _NoRun:
    """A runner for checks whose run is beside the point."""

    def output(self, check: Check, launch: Launch) -> Tuple[str, str]:
        return "", ""


def test_ranks_lines_may_come_in_any_order_but_must_be_right():
    shown, swapped = "rank 0: 1.0\nrank 1: 2.0", "rank 1: 2.0\nrank 0: 1.0"
    assert _compare_launched("mpiexec -n 2 python x.py", shown, swapped, Options()) == []
    assert _compare_launched("python x.py", shown, swapped, Options()), "one process: in order"
    assert _compare_launched("mpiexec -n 2 python x.py", shown, "rank 1: 2.5\nrank 0: 1.0",
                             Options())
