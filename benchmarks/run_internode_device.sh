#!/usr/bin/env bash
# One device call for the internode CUDA backend on the 2 x H200 machine (2 virtual nodes x 1 GPU):
# build with NVSHMEM, GPU property tests against reference, a short intranode regression, the benchmark.
# Logs and JSON go to $OUT (default ./out-internode); every step has its own timeout; the total stays under 540 s.
#
#   bash benchmarks/run_internode_device.sh            (from the repository root)
#
# Exit status: 0 when every step passed, else the number of failed steps. A summary is in $OUT/summary.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/out-internode}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu
failed=0
start=$(date +%s)

step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $(( $(date +%s) - t0 ))s (limit ${limit}s)" | tee -a "$OUT/summary.log"
    [[ $rc -ne 0 ]] && failed=$((failed + 1))
    return $rc
}

: > "$OUT/summary.log"
nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/summary.log" 2>&1
if ! step build 200 env MAX_JOBS=32 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace; then
    tail -40 "$OUT/build.log"
    exit 1
fi
python3 -c "import deep_ep._C as c; assert c.HAS_LOW_LATENCY, 'built without NVSHMEM'; print('NVSHMEM kernels built')" \
    >> "$OUT/summary.log" 2>&1 || { echo "no NVSHMEM in the build" | tee -a "$OUT/summary.log"; exit 1; }

# Internode property tests (hypothesis vs reference) and the benchmark shape, 2 virtual nodes x 1 GPU.
step test_internode 190 env DEEP_EP_GPU_EXAMPLES_INTERNODE=8 \
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_internode.py
# The intranode backend shares the changed handle hooks: a short regression on 2 GPUs.
step test_intranode 50 env DEEP_EP_GPU_EXAMPLES_2GPU=3 \
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_intranode.py -k "test_two_gpus and not back_to_back"
# Benchmark: intranode then internode on the same GPUs, simulator prediction alongside.
step bench_internode 90 python3 benchmarks/bench_internode.py --json "$OUT/bench_internode.json"

echo "total $(( $(date +%s) - start ))s, failed steps: $failed" | tee -a "$OUT/summary.log"
tail -25 "$OUT/bench_internode.log"
exit $failed
