#!/bin/bash
# One device call (2 x H200, <= 540 s) that verifies main + direct-to-output dispatch: build WITH NVSHMEM, the whole
# intranode GPU suite and the host-path test, the intranode benchmark of rings against direct at 24 and 8 SMs, then
# the low-latency GPU suite with the time that is left. Every step has a deadline-based time limit; logs and JSON go
# to $OUT (5 files: summary.log, build.log, tests.log, bench.log, intra.json).
#
#   run (nvidia-h200-x2): cd out/<copy> && OUT=$OUT bash benchmarks/run_d2o_device.sh
#
# bench.log / intra.json: ops dispatch_fp8, dispatch_bf16 (rings), dispatch_*_direct (pool), combine_bf16 (combine
# has one path). BUDGET_S (default 530) moves the deadline.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-out/d2o_results}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
T0=$(date +%s)
END=$((T0 + ${BUDGET_S:-530}))
S="$OUT/summary.log"

note() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$S"; }
# left WANT: WANT seconds, or what is left before the deadline when that is less (at least 5).
left() { local l=$((END - $(date +%s))); [ "$l" -gt "$1" ] && echo "$1" || echo $(( l > 5 ? l : 5 )); }

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$S" 2>&1
MAX_JOBS=32 TORCH_CUDA_ARCH_LIST=9.0a timeout 220 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1
rc=$?
note "build (NVSHMEM from the pip wheel) rc=$rc"
if [ $rc -ne 0 ]; then
    grep -iE "error|fatal" "$OUT/build.log" | head -20 >> "$S"
    exit 1
fi
python3 -c "import deep_ep._C as c; print('HAS_LOW_LATENCY', c.HAS_LOW_LATENCY)" >> "$S" 2>&1

# Intranode suite: both receive paths (Case.receive is drawn: auto, rings, direct, mixed), pool lifetime and
# fallback, graph capture (rings), bad routing, stalled peer; plus the host path's stream waits (CPU, fake ext).
DEEP_EP_TIMEOUT_S=20 HYPOTHESIS_PROFILE=gpu timeout "$(left 150)" python3 -m pytest -q -rA -p no:cacheprovider \
    tests/gpu/test_intranode.py tests/test_cuda_host_path.py > "$OUT/tests.log" 2>&1
note "intranode + host-path tests rc=$?"
tail -n 3 "$OUT/tests.log" >> "$S"

# Rings against direct, DeepEP's test workload (EP2, 4096 tokens, hidden 7168, top-8 of 256 experts; 2e9 bytes
# leave a 1.46 GB output pool).
timeout "$(left 130)" python3 benchmarks/bench_intranode.py --sms 24 8 --dispatch-chunks 16 --combine-chunks 8 \
    --dispatch-warps 12 16 --combine-warps 6 8 --receive rings direct --json "$OUT/intra.json" > "$OUT/bench.log" 2>&1
note "intranode bench rc=$?"
grep -E "^(op|dispatch|combine|nccl)" "$OUT/bench.log" >> "$S"

echo "=============== low-latency tests" >> "$OUT/tests.log"
DEEP_EP_TIMEOUT_S=20 LL_EXAMPLES=${LL_EXAMPLES:-5} HYPOTHESIS_PROFILE=gpu timeout "$(left 200)" \
    python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_low_latency.py >> "$OUT/tests.log" 2>&1
note "low-latency tests rc=$?"
tail -n 3 "$OUT/tests.log" >> "$S"
