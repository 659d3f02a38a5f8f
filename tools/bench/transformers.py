"""A transformers model trained with commlib's Ring Attention against the same
model with PyTorch's SDPA in one process on the same cores.

    OPENBLAS_NUM_THREADS=1 mpiexec -bind-to core -n 2 python -m commlib.tools.bench.transformers
    python -m commlib.tools.bench.transformers --alone --threads 2   # sdpa, one process

A tiny Llama (hidden 512, 8 heads, 4 layers by default), one sequence,
forward + backward (+ the gradient sum over ranks), best of ``--repeats``
after a warm-up; peak resident memory of each process (``ru_maxrss``, the
model, activations and Python together), and the operators that dominate
one step (torch's profiler, by self CPU time).
"""

from __future__ import annotations

import resource

import click
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from commlib.tools.bench.timing import best_local


def _model(hidden: int, heads: int, layers: int, seq: int, attn: str):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=seq)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def _top_ops(step, count: int = 6) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return "\n".join(f"    {e.key:60s} {100 * e.self_cpu_time_total / total:5.1f}%"
                     for e in events[:count])


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@click.command()
@click.option("--seq", default=8192, show_default=True, help="Global sequence length.")
@click.option("--hidden", default=512, show_default=True)
@click.option("--heads", default=8, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch threads per process.")
@click.option("--alone", is_flag=True, help="Only the sdpa model, whole sequence, one process.")
def main(seq: int, hidden: int, heads: int, layers: int, repeats: int, threads: int,
         alone: bool) -> None:
    """Time and peak memory of a training step: commlib_ring on P ranks vs sdpa alone."""
    torch.set_num_threads(threads)
    data = torch.randint(1024, (1, seq), generator=torch.Generator().manual_seed(1))
    if alone:
        model = _model(hidden, heads, layers, seq, "sdpa")

        def step():
            model(input_ids=data, labels=data).loss.backward()
        step()
        seconds = best_local(step, repeats)
        print(f"sdpa, one process, {threads} threads, seq {seq}: {seconds:.3f} s per step, "
              f"peak RSS {_peak_mib():.0f} MiB")
        print("  top operators by self CPU time:\n" + _top_ops(step))
        return

    import commlib
    from commlib.bindings import transformers as cht

    comm = commlib.init()
    cht.register(comm)
    model = _model(hidden, heads, layers, seq, "commlib_ring")
    shard = cht.shard_batch({"input_ids": data}, comm, attn_implementation=model)

    def step():
        comm.barrier()  # the ranks start together
        model(**shard).loss.backward()
        cht.allreduce_gradients(model, comm)
    step()
    seconds = best_local(step, repeats)
    ops = _top_ops(step)
    peaks = comm.allgather(torch.tensor([_peak_mib()]))
    if comm.rank == 0:
        print(f"commlib_ring, {comm.size} ranks x {threads} threads, seq {seq}: "
              f"{seconds:.3f} s per step, peak RSS per rank "
              + ", ".join(f"{float(p):.0f}" for p in peaks.reshape(-1)) + " MiB")
        print("  top operators by self CPU time (rank 0):\n" + ops)
    comm.free()


if __name__ == "__main__":
    main()
