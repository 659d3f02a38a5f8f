"""The benchmarks, run on your own fabric under mpiexec, e.g.
``mpiexec -n 2 python -m commlib.tools.bench.moe throughput`` (docs/benchmarks.md).
Each times its contenders in the same launch through ``timing``; none imports
another (what two share lives in a helper: ``timing``, ``ops``, ``workload``;
the MoE benchmarks' ``moe.baselines`` and ``moe.workload``)."""
