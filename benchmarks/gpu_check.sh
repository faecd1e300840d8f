#!/usr/bin/env bash
# The cuda backend's checks on one GPU (an H200 or any sm89+ device), in under 8 minutes:
#
#   1. the GPU tests: tests/test_cuda.py, tests/test_scaled_mm_fine.py, tests/test_cuda_backend_gpu.py,
#      tests/test_grouped_gpu.py;
#   2. whether torch's grouped FP8 GEMM gives the bits of one scaled matmul per group, and its speed
#      (benchmarks/grouped_probe.py, at most 60 s);
#   3. the benchmarks (benchmarks/gpu_bench.py), in what is left of the time, as one summary table.
#
# Run from anywhere:  bash benchmarks/gpu_check.sh   (TOTAL_S=480 and TEST_S=270 by default)
# Exit status: that of the tests when they fail (or run out of time), else that of the benchmarks.
# The benchmarks run even when the tests fail, so one run on the GPU shows both.
set -u -o pipefail

cd "$(dirname "$0")/.."
TOTAL_S=${TOTAL_S:-480}
TEST_S=${TEST_S:-270}
PYTHON=${PYTHON:-python}
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

# The kernels must be compiled for the GPU, not interpreted on the CPU.
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1

echo "== versions =="
"$PYTHON" benchmarks/gpu_bench.py --versions || { echo "gpu_check: python or scalestate does not import"; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
    --format=csv,noheader

echo
echo "== tests (limit ${TEST_S} s) =="
timeout --signal=INT --kill-after=15 "$TEST_S" "$PYTHON" -m pytest -q -rs --durations=15 -p no:cacheprovider \
    tests/test_cuda.py tests/test_scaled_mm_fine.py tests/test_cuda_backend_gpu.py tests/test_grouped_gpu.py
tests_rc=$?
if [ "$tests_rc" -eq 124 ]; then
    echo "gpu_check: the tests ran out of their ${TEST_S} s"
fi
echo "[$(elapsed) s] tests exit status: $tests_rc"

echo
echo "== scaled_grouped_mm against one scaled matmul per group (limit 60 s) =="
timeout --signal=INT --kill-after=10 60 "$PYTHON" benchmarks/grouped_probe.py
echo "[$(elapsed) s] probe exit status: $?"

left=$(( TOTAL_S - $(elapsed) ))
budget=$(( left - 30 ))
echo
echo "== benchmarks (budget ${budget} s of ${left} s left) =="
if [ "$budget" -lt 30 ]; then
    echo "gpu_check: no time left for the benchmarks"
    bench_rc=1
else
    timeout --signal=INT --kill-after=10 "$(( left - 5 ))" "$PYTHON" benchmarks/gpu_bench.py --budget "$budget"
    bench_rc=$?
fi
echo "[$(elapsed) s] benchmarks exit status: $bench_rc"

if [ "$tests_rc" -ne 0 ]; then
    echo "gpu_check: FAILED (tests exit status $tests_rc)"
    exit "$tests_rc"
fi
if [ "$bench_rc" -ne 0 ]; then
    echo "gpu_check: the benchmarks did not finish (exit status $bench_rc)"
    exit "$bench_rc"
fi
echo "gpu_check: tests passed; goals: see the table above"
