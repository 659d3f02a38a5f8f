#!/usr/bin/env bash
# The one command for a lent GPU machine, and its rehearsal on a CPU machine.
#
#   tools/gpu_check.sh --prepare    here, with the package registry: fetch into
#                                   .whl/ the wheels the GPU image lacks
#                                   (tools/gpu/wheels.txt), print their size
#   tools/gpu_check.sh              on the GPU machine (no network): install
#                                   commlib and .whl/, preflight, then the steps
#   tools/gpu_check.sh --rehearse   the same on a machine without a GPU: every
#                                   step runs, the GPU tests skip ("no CUDA
#                                   device here"); CI runs it (.ci/gpu_rehearsal)
#
# The GPU run, through the device tool: carry [".whl"], one call, e.g.
#   run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=480)
#
# Nothing runs from the source tree: commlib is installed (with its bindings/
# and tools/, which exist only in an install) under $GPU_CHECK_ENV, MPICH with
# its data files (libmpi, mpiexec) under --prefix, and every Python process
# runs with PYTHONSAFEPATH=1. A failed preflight stops the run at once, saying
# what to fix. Then the steps, the numbers the run exists for early: each under
# its own time limit (interrupted with SIGINT, so pytest still writes its junit
# report and the summary line says what ran, and which transport each launch
# chose), all of them within 7 minutes so that a rerun of the failed ones fits
# in the 15 minutes of device time (GPU_CHECK_STEPS=nccl2,graph runs only those
# after the preflight):
#   pytest_gpu   the single-process gpu tests (the size-1 NCCL communicator,
#                kernels, arrays)
#   bench        python -m commlib.tools.gpu.bench -> $OUT/gpu_check.json
#   mpi1 mpi2    tests/mpi -m gpu at 1 and 2 ranks on the staged MPI path (the
#                ranks share the one GPU, so backend "auto" falls back to MPI)
#   nccl2 nccl4  the same at 2 ranks, and the collectives and GPU faults at 4,
#                with NCCL between the ranks: NCCL 2.30+ lets ranks share a GPU
#                under NCCL_MULTI_RANK_GPU_ENABLE=1, and COMMLIB_EXPECT_BACKEND
#                =nccl fails every test of a launch that fell back to MPI. Not
#                run (and said so) with an older NCCL; mpi4 runs instead
#   hf_train     examples/hf_train.py: a transformers Qwen3-MoE in bfloat16
#   stall stall_nccl graph
#                a deliberately stalled transfer at 2 ranks (staged, then
#                NCCL: the in-flight deadline of a connected communicator),
#                then the CUDA-graph captures and replays (NCCL collectives, a
#                fixed-capacity MoE pair, a decode step over the sharded KV
#                cache), last: both can leave a GPU in a state the other steps
#                should not meet
# $OUT gets summary.txt (what this prints), gpu_check.json and logs.tgz (every
# step's log and junit reports, per rank), rewritten after each step so that a
# run killed from outside still returns what it did.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PYTHON:-python3}
MODE=gpu
case "${1:-}" in
    "") ;;
    --prepare) MODE=prepare ;;
    --rehearse) MODE=rehearse ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
esac
PINS=$(grep -o '^[^#[:space:]]*' tools/gpu/wheels.txt)

if [[ $MODE == prepare ]]; then
    rm -rf .whl && mkdir .whl
    # every pin is a py3-none wheel: the tags are the GPU image's (Python 3.12,
    # manylinux; mpich 5 is built for manylinux_2_28 only)
    # shellcheck disable=SC2086
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl $PINS \
        || { echo "gpu_check: --prepare: pip download failed (is the registry reachable?)"; exit 1; }
    ls -l .whl
    kib=$(du -sk .whl | cut -f1)
    echo "gpu_check: .whl holds $(ls .whl | wc -l) wheels, $((kib / 1024)) MiB (a device call" \
         "carries at most 64 MiB with the working tree); carry it: carry=[\".whl\"]"
    ((kib < 56 * 1024)) || { echo "gpu_check: .whl is too large to carry"; exit 1; }
    exit 0
fi

if [[ $MODE == rehearse ]]; then OUT=${OUT:-/tmp/gpu_check_rehearsal}; else OUT=${OUT:-/tmp/gpu_check}; fi
ENV_DIR=${GPU_CHECK_ENV:-/tmp/commlib-gpu-env}
LOGS=$ENV_DIR/logs
BUDGET_S=420
END=$((SECONDS + BUDGET_S))
rm -rf "$ENV_DIR" && mkdir -p "$OUT" "$LOGS"
: >"$OUT/summary.txt"
say() { echo "gpu_check: $*" | tee -a "$OUT/summary.txt"; }
keep_logs() { tar czf "$OUT/logs.tgz" -C "$ENV_DIR" logs; }
status=0

# -- install: nothing from the network, nothing run from the source tree ------
missing=""
for pin in $PINS; do
    name=${pin%%==*} version=${pin#*==}
    compgen -G ".whl/${name//-/_}-$version-*.whl" >/dev/null || missing+=" $pin"
done
if [[ -n $missing ]]; then
    say "install: .whl/ lacks$missing: run tools/gpu_check.sh --prepare where pip reaches" \
        "the registry, and carry .whl"
    exit 1
fi
wheel() { echo ".whl/${1//-/_}-"*.whl; }
pip_offline() { $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@" \
                    >>"$LOGS/install.log" 2>&1; }
# --prefix keeps the mpich wheel's data files (lib/libmpi.so, bin/mpiexec), which --target drops
others=$(for pin in $PINS; do case ${pin%%==*} in mpich|setuptools) ;; *) wheel "${pin%%==*}";; esac; done)
# shellcheck disable=SC2086
if pip_offline --prefix "$ENV_DIR/mpich" $(wheel mpich) \
        && pip_offline --target "$ENV_DIR/build" $(wheel setuptools) \
        && pip_offline --target "$ENV_DIR/site" $others \
        && PYTHONPATH=$ENV_DIR/build pip_offline --no-build-isolation --target "$ENV_DIR/site" .
then
    say "install: commlib and $(wc -w <<<"$PINS") carried wheels into $ENV_DIR"
else
    say "install failed:"; tail -20 "$LOGS/install.log"; keep_logs; exit 1
fi
export PYTHONPATH=$ENV_DIR/site PYTHONSAFEPATH=1 MPI4PY_LIBMPI=$ENV_DIR/mpich/lib \
    PATH=$ENV_DIR/site/bin:$ENV_DIR/mpich/bin:$PATH
# a missing framework is an error, not a skip (tests/requires.py); every GPU
# case runs (the full tier: the quick one samples some parametrized tests,
# tests/tiers.py); JAX would take 75% of the GPU at start, and several ranks
# share the one GPU
# COMMLIB_TIMEOUT under every step's limit: a hang ends in commlib's own
# diagnosis (which rank, which call), not in the step's SIGINT
export COMMLIB_TEST_REQUIRE=all COMMLIB_TEST_TIER=full COMMLIB_TIMEOUT=15 \
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

if [[ $MODE == gpu ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        | tee "$LOGS/gpu.txt" | sed 's/^/gpu_check: gpu: /' | tee -a "$OUT/summary.txt"
    rehearse="" device=cuda bench_size=""
else
    rehearse=--rehearse device=cpu bench_size=--quick
fi

# step NAME LIMIT_S COMMAND...: COMMAND under min(LIMIT_S, what is left of the
# budget), its output in logs/NAME.log; not started with under 15 s left
step() {
    local name=$1 limit=$2 left=$((END - SECONDS)) code=0 started=$SECONDS
    shift 2
    # GPU_CHECK_STEPS=a,b: only those (a rerun); 3 tells the caller nothing ran
    if [[ -n ${GPU_CHECK_STEPS:-} && ,$GPU_CHECK_STEPS, != *,$name,* ]]; then return 3; fi
    ((limit > left)) && limit=$left
    if ((limit < 15)); then
        say "$name: not run, ${left}s of the ${BUDGET_S}s budget left"; status=1; return 1
    fi
    timeout -s INT -k 15 "$limit" "$@" >"$LOGS/$name.log" 2>&1 || code=$?
    if ((code != 0)); then
        status=1
        say "$name: FAILED (exit $code$( ((code == 124)) && echo ", its ${limit}s limit")) in" \
            "$((SECONDS - started))s; the end of logs/$name.log:"
        tail -15 "$LOGS/$name.log"
    else
        say "$name: ok in $((SECONDS - started))s"
    fi
    keep_logs
    return $code
}
summary() { $PY -m commlib.tools.gpu.check summary "$@" | tee -a "$OUT/summary.txt"; }
# pytest_step NAME LIMIT_S PYTEST_ARGS...: one process
pytest_step() {
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" $PY -m pytest -p no:cacheprovider -q --junitxml="$LOGS/$name.xml" "$@"
    [[ -e $LOGS/$name.log ]] && summary "$name" "$LOGS/$name.xml"
}
# mpi_step NAME RANKS LIMIT_S PYTEST_ARGS...: under mpiexec, one report per rank
mpi_step() {
    local name=$1 ranks=$2 limit=$3
    shift 3
    mkdir -p "$LOGS/$name"
    step "$name" "$limit" mpiexec -n "$ranks" $PY tests/mpi_pytest.py "$LOGS/$name" "$@"
    [[ -e $LOGS/$name.log ]] && summary "$name" "$LOGS/$name"/rank*.xml
}

# imports, then pytest collecting every gpu test twice (tests/, tests/mpi/): about 60 s on a
# quiet 2-core machine, 112 s on a loaded one, where 90 s stopped the rehearsal
if step preflight 150 $PY -m commlib.tools.gpu.check preflight --site "$ENV_DIR/site" $rehearse
then
    grep -v "^  \.\.\. " "$LOGS/preflight.log" | tee -a "$OUT/summary.txt"
else
    say "stopped: the preflight failed (above)"; exit 1
fi

LAST="cuda_graph or never_arrives"  # the last steps' tests
pytest_step pytest_gpu 50 -m gpu -k "not ($LAST)" tests
step bench 60 $PY -m commlib.tools.gpu.bench --device $device $bench_size \
    --out "$OUT/gpu_check.json" && tail -4 "$LOGS/bench.log"
mpi_step mpi1 1 25 -m gpu -k "not ($LAST)" tests/mpi
mpi_step mpi2 2 45 -m gpu -k "not ($LAST)" tests/mpi
FOUR="tests/mpi/test_collectives_frameworks.py tests/mpi/test_gpu_faults.py"
# with_nccl STEP...: the step with NCCL between the ranks that share the GPU;
# on the GPU, a launch that falls back to MPI fails (COMMLIB_EXPECT_BACKEND);
# the rehearsal runs the same steps on the MPI path
with_nccl() {
    (export NCCL_MULTI_RANK_GPU_ENABLE=1 COMMLIB_EXPECT_BACKEND=${expect_nccl:-}
     "$@"; exit $status) || status=1
}
if peers=$($PY -m commlib.tools.gpu.check nccl-peers $rehearse 2>&1); then
    say "nccl: $peers"
    [[ $MODE == gpu ]] && expect_nccl=nccl
    with_nccl mpi_step nccl2 2 45 -m gpu -k "not ($LAST)" tests/mpi
    # shellcheck disable=SC2086
    with_nccl mpi_step nccl4 4 45 -m gpu -k "not ($LAST)" $FOUR
else
    say "nccl2, nccl4, stall_nccl: not run: $peers"
    peers=""
    # shellcheck disable=SC2086
    mpi_step mpi4 4 45 -m gpu -k "not ($LAST)" $FOUR
fi
step hf_train 30 $PY examples/hf_train.py --model qwen3_moe --device $device --dtype bfloat16 \
    --steps 3 && tail -2 "$LOGS/hf_train.log"
mpi_step stall 2 20 -m gpu -k never_arrives tests/mpi/test_gpu_faults.py
[[ -n $peers ]] && with_nccl mpi_step stall_nccl 2 25 -m gpu -k never_arrives \
    tests/mpi/test_gpu_faults.py
pytest_step graph 30 -m gpu -k cuda_graph tests/test_gpu_nccl.py tests/test_gpu_graphs.py
say "$SECONDS s in all ($MODE); $( ((status == 0)) && echo "every step passed" || echo \
    "some steps FAILED (above)"); logs in $OUT/logs.tgz"
exit $status
