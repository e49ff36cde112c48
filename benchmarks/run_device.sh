#!/usr/bin/env bash
# Steps of a device call (nvidia-h200-x2), run in the order given, each with its own time limit, all under one
# deadline (BUDGET_S, default 560 s after the start). Logs and JSON go to $OUT; $OUT/summary.log has one line per
# step (rc, seconds) and the tables of the benchmarks.
#
#   OUT=$OUT bash benchmarks/run_device.sh build test_intranode test_ll bench_ll
#
# Steps:
#   build            the extension with NVSHMEM (pip wheel), sm_90a, 32 jobs
#   test_intranode   GPU property suite of the intranode kernels (both receive paths) + the host-path test
#   test_ll          GPU property suite of the low-latency kernels (LL_EXAMPLES examples per property, default 5)
#   test_ll_put      the same suite with DEEP_EP_LL_PUT_ONLY=1: the RDMA code path (staging, put-with-signal) between
#                    the two GPUs (LL_PUT_EXAMPLES, default 3), then the LL bench at T = 128 on that path -> ll_put.json
#   test_ll_shared   the low-latency suite's 2-rank cases with both ranks on one GPU (TEST_RANKS_PER_GPU=2; NVSHMEM
#                    runs two processes per GPU time-sliced): correctness when only nvidia-h200 is lent, never timing
#   test_internode   GPU property suite of the internode backend on 2 virtual nodes x 1 GPU
#   test_internode_put  the same suite with DEEP_EP_INTERNODE_PUT_ONLY=1: the path of peers behind a NIC (staged
#                    records, put-with-signal, signal twins) between the two GPUs (INTERNODE_PUT_EXAMPLES, default 6)
#   test_composed    GPU tests of the composed internode path (CUDA stages), 4 ranks on GPUs 0,1,0,1 as 2 x 2
#                    (one per GPU on 4+ GPUs; with 8+ GPUs also 8 ranks as 2 x 4 and 4 x 2), COMPOSED_EXAMPLES
#                    hypothesis examples (default 6)
#   test_internode_shared  the internode suite (2 x 1) with both ranks on one GPU (TEST_RANKS_PER_GPU=2): correctness
#                    only, on the one-GPU machine
#   test_many_nodes  the internode suite's many-node tests: INTERNODE_MANY_NODES (default 24) virtual nodes of one GPU
#                    sharing the GPUs (TEST_RANKS_PER_GPU = that count; NVSHMEM time-slices the PEs): correctness only,
#                    on any machine (MANY_NODES_EXAMPLES hypothesis examples, default 4); then the composed path's
#                    COMPOSED_MANY_NODES (default 9) nodes x 2 GPUs, rail over IPC, NVSHMEM and torch
#                    (-> test_many_composed)
#   test_composed_shared  the composed suite with its 4 ranks sharing fewer GPUs (TEST_RANKS_PER_GPU=2; on one GPU
#                    all four: NVSHMEM and the IPC stages time-sliced), the NVSHMEM rail included: correctness only
#   bench_intranode  Buffer defaults (direct receive) at 24, 16 and 8 SMs, DeepEP's EP2 workload -> intra.json
#   bench_ll         LL sweep of tokens per rank 1..256 (128 is the bar) -> ll.json
#   bench_internode  2 virtual nodes x 1 GPU next to the intranode kernels, simulator prediction -> inter.json
#   bench_internode_put  2 virtual nodes x 1 GPU: the internode backend's pointer path next to its put path
#                    (DEEP_EP_INTERNODE_PUT_ONLY=1), no intranode phase -> inter_put.json
#   bench_composed   composed path (CUDA stages) next to the torch backend, 4 ranks sharing 2 GPUs as 2 x 2,
#                    1024 tokens per rank -> composed.json
#   test_ep          EP4/EP8 property tests, one rank per GPU (intranode + LL; issue 7: x4 / x8 machines)
#   bench_ep         EP<all GPUs> intranode (24 SMs) and LL (T=128) benchmarks -> ep_intra.json, ep_ll.json
#   trace_ll         debug rebuild, LL T=128 with the kernels' section trace (tools/ll_trace.py); run it last
#   trace_intra      debug rebuild, BF16 dispatch + combine at 16 channels with the intranode kernels' role trace
#                    (tools/intra_trace.py); run it last (~150 s with the rebuild)
#   launch_floor     duration of a near-empty cooperative 1-CTA-per-SM grid (the LL kernels' fixed-cost floor)
#   nvlink           copy-engine ceiling (every pair and all-to-all) -> nvlink.json
#   burst            one burst of 14336-byte rows each way by SM stores (benchmarks/nvlink_burst.cu): the floor under the
#                    LL combine's send phase, with and without a release-ordered signal per row, and a full exchange
#                    with that signal against LL128-style lines (flag per 128-byte line) -> burst.txt
#   bench_tree       A/B in one call: builds another checkout TREE (a git worktree inside this one, named in the
#                    device tool's `carry`) and runs its intranode benchmark with TREE_ARGS (default: INTRA_ARGS'
#                    default) -> tree.json; run bench_intranode in the same call for this tree's side
# Exit status: the number of failed steps (the build failing stops the call).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/out-device}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu DEEP_EP_TIMEOUT_S="${DEEP_EP_TIMEOUT_S:-20}"
T0=$(date +%s)
END=$((T0 + ${BUDGET_S:-560}))
S="$OUT/summary.log"
# The intranode benchmark's default points (bench_intranode and bench_tree).
INTRA_DEFAULT="--sms 24 16 8 --dispatch-chunks 32 --combine-chunks 8 --receive direct"
# The extension build (build, the debug rebuilds, build_tree); prefix DEEP_EP_DEBUG_BUILD=1 for a debug build.
BUILD=(env MAX_JOBS=32 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace)
failed=0

# limit WANT: WANT seconds, or what is left before the deadline when that is less (at least 5).
limit() { local l=$((END - $(date +%s))); [ "$l" -gt "$1" ] && echo "$1" || echo $(( l > 5 ? l : 5 )); }

run_step() {  # run_step NAME WANT_S COMMAND...
    local name=$1 want=$2
    shift 2
    local t0=$(date +%s)
    timeout --kill-after=10 "$(limit "$want")" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "[$(( $(date +%s) - T0 )) s] $name rc=$rc ($(( $(date +%s) - t0 )) s)" | tee -a "$S"
    [ $rc -ne 0 ] && failed=$((failed + 1))
    return $rc
}

test_summary() {  # test_summary NAME [FAILURE_LOG]: a pytest step's result lines and failures into the summary
    tail -n 3 "$OUT/$1.log" >> "$S"
    [ -n "${2:-}" ] && [ -f "$2" ] && head -c 4000 "$2" >> "$S"
    grep -E "^E " "$OUT/$1.log" | head -30 >> "$S"
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$S" 2>&1
for step in "$@"; do
    case "$step" in
    build)  # DEEP_EP_DEBUG_BUILD=1 in the environment: the LL kernels' section trace (tools/ll_trace.py)
        if ! run_step build 220 "${BUILD[@]}"; then
            grep -iE "error|fatal" "$OUT/build.log" | head -20 >> "$S"
            exit 1
        fi
        # Without importing torch first: the extension finds torch's libraries through its rpath (setup.py).
        python3 -c "import deep_ep._C as c; print('HAS_LOW_LATENCY', c.HAS_LOW_LATENCY)" >> "$S" 2>&1 ;;
    test_intranode)
        run_step test_intranode 170 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_intranode.py \
            tests/test_cuda_host_path.py
        test_summary test_intranode ;;
    test_ll)
        # LL_FAILURE_LOG: each failing example's text as it happens (the summary at the end is lost if the step is
        # killed at its time limit).
        run_step test_ll 220 env LL_EXAMPLES="${LL_EXAMPLES:-5}" LL_FAILURE_LOG="$OUT/ll_failures.log" \
            python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_low_latency.py
        test_summary test_ll "$OUT/ll_failures.log" ;;
    test_ll_shared)
        run_step test_ll_shared 240 env TEST_RANKS_PER_GPU=2 LL_EXAMPLES="${LL_EXAMPLES:-5}" \
            LL_FAILURE_LOG="$OUT/ll_shared_failures.log" python3 -m pytest -q -rfE -p no:cacheprovider \
            -m multi_gpu tests/gpu/test_low_latency.py
        test_summary test_ll_shared "$OUT/ll_shared_failures.log" ;;
    test_ll_put)
        run_step test_ll_put 200 env DEEP_EP_LL_PUT_ONLY=1 LL_EXAMPLES="${LL_PUT_EXAMPLES:-3}" \
            LL_FAILURE_LOG="$OUT/ll_put_failures.log" python3 -m pytest -q -rfE -p no:cacheprovider \
            tests/gpu/test_low_latency.py
        test_summary test_ll_put "$OUT/ll_put_failures.log"
        run_step bench_ll_put 60 env DEEP_EP_LL_PUT_ONLY=1 python3 benchmarks/bench_low_latency.py --tokens 128 \
            --warmups 10 --iters 20 --json "$OUT/ll_put.json"
        grep -vE "^LLTRACE|UserWarning|_warn_once" "$OUT/bench_ll_put.log" | tail -n 4 >> "$S" ;;
    test_internode|test_internode_shared)  # _shared: ranks share GPUs (TEST_RANKS_PER_GPU=2)
        run_step "$step" 200 env TEST_RANKS_PER_GPU="$([[ $step == *_shared ]] && echo 2 || echo 1)" \
            DEEP_EP_GPU_EXAMPLES_INTERNODE="${INTERNODE_EXAMPLES:-8}" \
            python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_internode.py
        test_summary "$step" ;;
    test_many_nodes)
        run_step test_many_nodes 300 env TEST_RANKS_PER_GPU="${INTERNODE_MANY_NODES:-24}" \
            INTERNODE_MANY_NODES="${INTERNODE_MANY_NODES:-24}" \
            DEEP_EP_GPU_EXAMPLES_MANY_NODES="${MANY_NODES_EXAMPLES:-4}" \
            python3 -m pytest -q -rfE -p no:cacheprovider -k many_virtual_nodes tests/gpu/test_internode.py
        test_summary test_many_nodes
        run_step test_many_composed 240 env TEST_RANKS_PER_GPU=$((2 * ${COMPOSED_MANY_NODES:-9})) \
            COMPOSED_MANY_NODES="${COMPOSED_MANY_NODES:-9}" DEEP_EP_GPU_EXAMPLES_MANY_NODES="${MANY_NODES_EXAMPLES:-4}" \
            python3 -m pytest -q -rfE -p no:cacheprovider -k many_nodes tests/gpu/test_composed.py
        test_summary test_many_composed ;;
    test_internode_put)
        run_step test_internode_put 190 env DEEP_EP_INTERNODE_PUT_ONLY=1 \
            DEEP_EP_GPU_EXAMPLES_INTERNODE="${INTERNODE_PUT_EXAMPLES:-6}" \
            python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_internode.py
        test_summary test_internode_put ;;
    test_composed|test_composed_shared)
        run_step "$step" 320 env TEST_RANKS_PER_GPU="$([[ $step == *_shared ]] && echo 2 || echo 1)" \
            DEEP_EP_GPU_EXAMPLES_COMPOSED="${COMPOSED_EXAMPLES:-6}" \
            python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_composed.py
        test_summary "$step" ;;
    bench_intranode)
        # INTRA_ARGS replaces the default: Buffer's defaults (tuned warps, channel cap) at 24, 16 and 8 SMs, direct
        # receive. A sweep of channels and warps: INTRA_ARGS="--uncapped --sms 24 20 16 12 8 --dispatch-warps 8 12 16
        # 20 24 --combine-warps 4 6 8 10 12 --dispatch-chunks 32 --combine-chunks 8 --receive direct".
        run_step bench_intranode 140 python3 benchmarks/bench_intranode.py ${INTRA_ARGS:-$INTRA_DEFAULT} \
            --json "$OUT/intra.json"
        grep -E "^(#|op|dispatch|combine|nccl)" "$OUT/bench_intranode.log" >> "$S" ;;
    bench_ll)
        run_step bench_ll 120 python3 benchmarks/bench_low_latency.py --tokens "${LL_TOKENS:-1,2,4,8,16,32,64,128,256}" \
            --warmups 10 --iters 20 --json "$OUT/ll.json"
        grep -vE "^LLTRACE|UserWarning|_warn_once" "$OUT/bench_ll.log" | tail -n 26 >> "$S"
        grep -q LLTRACE "$OUT/bench_ll.log" && python3 tools/ll_trace.py "$OUT/bench_ll.log" >> "$S" ;;
    bench_internode)
        run_step bench_internode 100 python3 benchmarks/bench_internode.py --json "$OUT/inter.json"
        tail -n 14 "$OUT/bench_internode.log" >> "$S" ;;
    bench_internode_put)
        run_step bench_internode_put 100 python3 benchmarks/bench_internode.py --skip-intranode --put \
            --json "$OUT/inter_put.json"
        tail -n 10 "$OUT/bench_internode_put.log" >> "$S" ;;
    bench_composed)
        run_step bench_composed 120 python3 benchmarks/bench_internode.py --composed --num-processes 4 \
            --num-tokens 1024 --json "$OUT/composed.json"
        tail -n 10 "$OUT/bench_composed.log" >> "$S" ;;
    test_ep)
        run_step test_ep 240 python3 -m pytest -q -rfE -p no:cacheprovider -k one_rank_per_gpu \
            tests/gpu/test_intranode.py tests/gpu/test_low_latency.py
        test_summary test_ep ;;
    bench_ep)
        gpus=$(nvidia-smi -L | wc -l)
        run_step bench_ep_intra 150 python3 benchmarks/bench_intranode.py --num-processes "$gpus" --sms 24 \
            --dispatch-chunks 32 --combine-chunks 8 --dispatch-warps 12 16 24 --combine-warps 6 8 \
            --receive rings direct --json "$OUT/ep_intra.json"
        grep -E "^(#|op|dispatch|combine|nccl)" "$OUT/bench_ep_intra.log" >> "$S"
        run_step bench_ep_ll 90 python3 benchmarks/bench_low_latency.py --num-processes "$gpus" --tokens 128 \
            --warmups 10 --iters 20 --json "$OUT/ep_ll.json"
        grep -vE "UserWarning|_warn_once" "$OUT/bench_ep_ll.log" | tail -n 3 >> "$S" ;;
    trace_ll)  # debug rebuild (the LL kernels' section trace), T=128, summary by tools/ll_trace.py; leaves a debug build
        run_step build_debug 220 env DEEP_EP_DEBUG_BUILD=1 "${BUILD[@]}" || continue
        run_step trace_ll 90 env DEEP_EP_TRACE_DIR="$OUT/trace_ll" python3 benchmarks/bench_low_latency.py \
            --tokens 128 --warmups 10 --iters 20
        grep -vE "^LLTRACE|UserWarning|_warn_once" "$OUT/trace_ll.log" | tail -n 3 >> "$S"
        python3 tools/ll_trace.py "$OUT"/trace_ll/rank*.log >> "$S" ;;
    trace_intra)  # debug rebuild (the intranode kernels' role trace), EP2 at 16 channels; leaves a debug build
        run_step build_debug 200 env DEEP_EP_DEBUG_BUILD=1 "${BUILD[@]}" || continue
        echo "note: the extension is now a DEBUG build (INTRATRACE printf in every intranode CTA); run the build" \
            "step before any timing" >> "$S"
        run_step trace_intra 90 env DEEP_EP_TRACE_DIR="$OUT/trace_intra" python3 benchmarks/bench_intranode.py \
            --sms 16 --ops dispatch_bf16 combine_bf16 --iters "${TRACE_ITERS:-10}" --dispatch-chunks 32 \
            --combine-chunks 8 --receive direct --json "$OUT/trace_intra.json"
        grep -E "^(#|op|dispatch|combine)" "$OUT/trace_intra.log" >> "$S"
        python3 tools/intra_trace.py "$OUT"/trace_intra/rank*.log >> "$S" ;;
    launch_floor)
        run_step launch_floor 60 bash -c "nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
            benchmarks/launch_floor.cu -o /tmp/launch_floor && /tmp/launch_floor --json $OUT/launch_floor.json"
        tail -n 5 "$OUT/launch_floor.log" >> "$S" ;;
    bench_tree)
        if [ -z "${TREE:-}" ] || [ ! -f "${TREE}/setup.py" ]; then
            echo "bench_tree: TREE must name a checkout carried along, got '${TREE:-}'" | tee -a "$S"
            failed=$((failed + 1))
            continue
        fi
        run_step build_tree 150 env -C "$TREE" "${BUILD[@]}" || continue
        run_step bench_tree 140 bash -c "cd '$TREE' && python3 benchmarks/bench_intranode.py \
            ${TREE_ARGS:-$INTRA_DEFAULT} --json '$OUT/tree.json'"
        echo "tree $TREE ($(git -C "$TREE" log --oneline -1 2>/dev/null || echo 'no git metadata')):" >> "$S"
        grep -E "^(#|op|dispatch|combine|nccl|  sweep)" "$OUT/bench_tree.log" >> "$S" ;;
    burst)
        run_step burst 90 bash -c "nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/nvlink_burst.cu -o /tmp/burst && /tmp/burst"
        cp "$OUT/burst.log" "$OUT/burst.txt"
        cat "$OUT/burst.txt" >> "$S" ;;
    nvlink)
        run_step nvlink 60 python3 benchmarks/bench_nvlink.py --bytes 536870912 --repeats 5 --json "$OUT/nvlink.json"
        tail -n 8 "$OUT/nvlink.log" >> "$S" ;;
    *)
        echo "unknown step $step" | tee -a "$S"
        failed=$((failed + 1)) ;;
    esac
done
echo "[$(( $(date +%s) - T0 )) s] done, failed steps: $failed" | tee -a "$S"
exit $failed
