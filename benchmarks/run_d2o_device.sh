#!/bin/bash
# One device call for direct-to-output dispatch (branch d2o): build, a short correctness check of both receive
# paths, the benchmark of rings / direct / skipcopy (diagnostic) at 8, 16 and 24 SMs, then the whole GPU suite.
# Fits a 600 s call: every step has its own time limit. Logs and JSON go to $OUT (at most 8 files).
#
#   run (2 x H200): cd out/<copy> && OUT=$OUT bash benchmarks/run_d2o_device.sh
#
# Read bench.log: dispatch_* (rings), dispatch_*_direct, dispatch_*_skipcopy (receive copy skipped: wrong outputs,
# only the time matters; if it is much faster than rings, the receive copy is what limits the ring path).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-out/d2o_results}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
START=$SECONDS

step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND under a time limit, log in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc after $((SECONDS - START)) s" | tee -a "$OUT/summary.log"
    tail -n 6 "$OUT/$name.log"
    return $rc
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/summary.log" 2>&1
if ! step build 150 env DEEP_EP_DISABLE_NVSHMEM=1 MAX_JOBS=32 TORCH_CUDA_ARCH_LIST=9.0a \
        python3 setup.py build_ext --inplace; then
    tail -n 40 "$OUT/build.log"
    exit 1
fi

# Correctness first, briefly: both paths (Case.receive is drawn), pool exhaustion / lifetime, graph capture.
step smoke 150 env HYPOTHESIS_PROFILE=gpu DEEP_EP_GPU_EXAMPLES_2GPU=6 python3 -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_intranode.py -k "test_two_gpus and not back or pool_lifetime or cuda_graph"

# Issue 4 workload: EP2, 4096 tokens, hidden 7168, top-8 of 256 experts; 2e9 bytes leave a 1.46 GB output pool.
step bench 200 python3 benchmarks/bench_intranode.py --num-processes 2 --sms 8 16 24 --dispatch-chunks 16 \
    --combine-chunks 8 --receive rings direct skipcopy --json "$OUT/bench_d2o.json"
grep -E "^(op|dispatch|combine|nccl)" "$OUT/bench.log" | tee -a "$OUT/summary.log"

# The whole GPU suite with whatever time is left.
LEFT=$((570 - (SECONDS - START)))
if [ "$LEFT" -gt 30 ]; then
    step gpu_tests "$LEFT" env HYPOTHESIS_PROFILE=gpu DEEP_EP_GPU_EXAMPLES_1=4 DEEP_EP_GPU_EXAMPLES_SHARED=3 \
        DEEP_EP_GPU_EXAMPLES_2GPU=6 DEEP_EP_GPU_EXAMPLES_SEQ=2 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_intranode.py
fi
