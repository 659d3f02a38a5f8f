#!/usr/bin/env bash
# The GPU check, run by this path (docs/gpu.md, .ci/gpu_rehearsal): the script
# and its files are in tools/gpu/ (check.sh, check.py, bench.py, wheels.txt).
exec bash "$(dirname "$0")/gpu/check.sh" "$@"
