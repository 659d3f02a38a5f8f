#!/usr/bin/env bash
# One command for a lent GPU machine (no network; torch with CUDA, CuPy, NCCL,
# JAX and mpi4py preinstalled): installs commlib and the wheels carried in
# .whl/, runs the gpu-marked tests, then the timings, each under a time limit
# and all of it within GPU_CHECK_BUDGET_S seconds (default 450: the script
# ends inside 8 minutes). Everything it finds goes to $OUT (default
# /tmp/gpu_check): nvidia-smi, one log per step, gpu_check.json. Carry the
# MPICH wheel (for mpiexec) and any missing test dependency in .whl/ as the
# device tool's README describes, e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_17_x86_64 -d .whl mpich mpi4py hypothesis ml_dtypes \
#       array-api-compat array-api-extra click
#
# Steps, most wanted first; each gets its own limit or what is left of the
# budget, whichever is less, and is not started with under 20 s left:
#   pytest_gpu   every single-process gpu test (tests/test_gpu_nccl.py: the
#                size-1 NCCL communicator; kernels, routing, arrays)
#   mpi1, mpi2   tests/mpi -m gpu at 1 and 2 ranks (2 ranks share the GPU:
#                the staged MPI path; collectives, faults, attention, MoE)
#   mpi4         the collectives and the GPU faults at 4 ranks on one GPU
#   bench        python -m commlib.tools.bench_gpu -> gpu_check.json
#   hf_train     examples/hf_train.py: a transformers MoE in bfloat16, one rank
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
END=$((SECONDS + BUDGET_S))
# JAX would take 75% of the GPU at start; several ranks share one here
export PYTHONUNBUFFERED=1 COMMLIB_TIMEOUT=60 XLA_PYTHON_CLIENT_PREALLOCATE=false
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/commlib . \
    || { echo "gpu_check: installing commlib failed"; exit 1; }
export PYTHONPATH=/tmp/commlib${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
status=0

# step NAME LIMIT_S COMMAND...: COMMAND under min(LIMIT_S, budget left),
# its output in $OUT/NAME.log
step() {
    local name=$1 limit=$2 left=$((END - SECONDS)) code=0
    shift 2
    ((limit > left)) && limit=$left
    if ((limit < 20)); then
        echo "gpu_check: $name not run: ${left}s of the ${BUDGET_S}s budget left" \
            | tee "$OUT/$name.log"
        status=1
        return
    fi
    echo "gpu_check: $name (at most ${limit}s)"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || code=$?
    tail -3 "$OUT/$name.log"
    if ((code != 0)); then
        echo "gpu_check: $name failed (exit $code$( ((code == 124)) && echo ": time limit"))"
        status=1
    fi
}

# mpi_step N LIMIT_S PYTEST_ARGS...: the gpu tests among PYTEST_ARGS under
# mpiexec -n N, as step mpi<N>; each rank's report in $OUT/mpi<N>/rank<r>.log
mpi_step() {
    local n=$1 limit=$2
    shift 2
    mkdir -p "$OUT/mpi$n"
    rm -f "$OUT/mpi$n"/rank*.log
    step "mpi$n" "$limit" mpiexec -n "$n" $PY tests/mpi_pytest.py "$OUT/mpi$n" "$@" -m gpu
    [[ -f "$OUT/mpi$n/rank0.log" ]] && tail -1 "$OUT/mpi$n/rank0.log"
}

step pytest_gpu 150 $PY -m pytest -m gpu -q -p no:cacheprovider tests
if command -v mpiexec >/dev/null; then
    mpi_step 1 100 tests/mpi
    mpi_step 2 150 tests/mpi
    mpi_step 4 75 tests/mpi/test_collectives_frameworks.py tests/mpi/test_gpu_faults.py
else
    echo "gpu_check: no mpiexec (carry the mpich wheel): multi-rank gpu tests not run"
fi
step bench 90 $PY -m commlib.tools.bench_gpu --out "$OUT/gpu_check.json"
# a transformers Qwen3-MoE (Ring + expert parallelism) in bfloat16 on the GPU
step hf_train 60 $PY examples/hf_train.py --model qwen3_moe --device cuda --dtype bfloat16 \
    --steps 5
echo "gpu_check: $((SECONDS))s in all; logs in $OUT"
exit $status
