#!/usr/bin/env bash
# Where is a hung GPU job stuck? For a hang that no bounded wait reports (a deadlock inside a kernel, e.g. a
# full-mask __shfl_sync that some lanes skip). Runs COMMAND; if it still runs after SECONDS, dumps for every python
# process of this user the Python and native stacks (py-spy, when installed) and, for processes with a CUDA
# context, cuda-gdb's view of the running kernels (`info cuda kernels` and `info cuda threads`: where every GPU
# thread is, as file:line when the extension was built with -lineinfo, i.e. DEEP_EP_DEBUG_BUILD=1), then kills
# COMMAND.
#
# Usage: tools/hang_dump.sh SECONDS OUTDIR COMMAND [ARGS...]
#   e.g. tools/hang_dump.sh 60 $OUT/hang python3 -m pytest -x -q tests/gpu/test_low_latency.py
# Writes OUTDIR/command.log (COMMAND's output), OUTDIR/pyspy.txt, OUTDIR/cuda_gdb_<pid>.txt, OUTDIR/nvidia_smi.txt.
# Exit status: COMMAND's when it finished in time, 124 when it was dumped and killed.
set -uo pipefail

if [[ $# -lt 3 ]]; then
    echo "usage: $0 SECONDS OUTDIR COMMAND [ARGS...]" >&2
    exit 2
fi
SECONDS_LIMIT=$1
OUTDIR=$2
shift 2
mkdir -p "$OUTDIR"

"$@" > "$OUTDIR/command.log" 2>&1 &
PID=$!

kill_tree() {  # kill_tree PID: the process and all its descendants, children first
    local child
    for child in $(pgrep -P "$1"); do kill_tree "$child"; done
    kill -9 "$1" 2>/dev/null
}
for _ in $(seq 1 "$SECONDS_LIMIT"); do
    sleep 1
    kill -0 "$PID" 2>/dev/null || { wait "$PID"; exit $?; }
done

echo "still running after ${SECONDS_LIMIT} s: dumping" | tee -a "$OUTDIR/command.log"
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv > "$OUTDIR/nvidia_smi.txt" 2>&1
PIDS=$(pgrep -u "$(id -u)" -f python || true)
for p in $PIDS; do
    echo "=== pid $p: $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | head -c 300)"
    if command -v py-spy > /dev/null; then py-spy dump --native --pid "$p" 2>&1 | head -120; fi
done > "$OUTDIR/pyspy.txt"
if command -v cuda-gdb > /dev/null; then
    for p in $PIDS; do
        # Only processes that hold a CUDA context (they map the driver library).
        grep -q libcuda "/proc/$p/maps" 2>/dev/null || continue
        timeout 120 cuda-gdb -p "$p" -batch -ex "info cuda kernels" -ex "info cuda threads" \
            > "$OUTDIR/cuda_gdb_$p.txt" 2>&1
    done
fi
kill_tree "$PID"
wait "$PID" 2>/dev/null
exit 124
