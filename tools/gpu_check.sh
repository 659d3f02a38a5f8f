#!/usr/bin/env bash
# One command for a lent GPU machine (no network; torch with CUDA, CuPy, NCCL,
# JAX and mpi4py preinstalled): installs commlib and the wheels carried in
# .whl/, runs the gpu-marked tests, then the timings, under time limits.
# Everything it finds goes to $OUT (default /tmp/gpu_check): pytest logs and
# gpu_check.json. Carry the MPICH wheel (for mpiexec) and any missing test
# dependency in .whl/ as the device tool's README describes, e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_17_x86_64 -d .whl mpich mpi4py hypothesis ml_dtypes \
#       array-api-compat array-api-extra click
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 COMMLIB_TIMEOUT=120
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/commlib . \
    || { echo "gpu_check: installing commlib failed"; exit 1; }
export PYTHONPATH=/tmp/commlib${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
status=0
timeout 300 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels.py \
    tests/test_moe_routing.py 2>&1 | tee "$OUT/pytest_gpu.log" || status=1
if command -v mpiexec >/dev/null; then
    for n in 1 2; do
        mkdir -p "$OUT/mpi$n"
        timeout 300 mpiexec -n $n $PY tests/mpi_pytest.py "$OUT/mpi$n" tests/mpi \
            -m gpu -q || status=1
        tail -3 "$OUT/mpi$n/rank0.log"
    done
else
    echo "gpu_check: no mpiexec (carry the mpich wheel): multi-rank gpu tests not run"
fi
timeout 600 $PY -m commlib.tools.bench_gpu --out "$OUT/gpu_check.json" || status=1
exit $status
