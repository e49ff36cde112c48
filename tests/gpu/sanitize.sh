#!/usr/bin/env bash
# compute-sanitizer over the GPU suite's single-rank and two-ranks-on-one-GPU cases.
#
#   bash tests/gpu/sanitize.sh [memcheck|racecheck|all]      # default: memcheck; run from anywhere in the repo
#
# memcheck runs the intranode and low-latency property tests with one rank and with two ranks time-slicing GPU 0;
# racecheck (shared-memory hazards) runs the single-rank cases. The single-rank tests run inside the instrumented
# pytest process; the two-rank tests' workers (multiprocessing spawn) each start under their own instance of the tool,
# through a wrapper that multiprocessing uses as its interpreter (TEST_WORKER_EXECUTABLE, read by tests/conftest.py).
# Every instrumented process writes its own log, $SANITIZER_OUT/<tool>.<pid>.log. A tool passes when pytest passes
# and every log's summary counts 0 errors (racecheck: 0 hazards). Prints one PASS/FAIL line per tool; exit status 0
# when every tool passed, 1 otherwise, 2 when compute-sanitizer is missing.
#
# Environment: SANITIZER (path of compute-sanitizer; default: on PATH, else /usr/local/cuda/bin), SANITIZER_OUT
# (log folder, default sanitizer-logs), PYTHON (default python3), SANITIZER_TIMEOUT_S (per tool, default 240),
# SANITIZER_EXAMPLES (hypothesis examples per test, default 2), SANITIZER_ARGS (extra compute-sanitizer options).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2

tools="${1:-memcheck}"
[ "$tools" = all ] && tools="memcheck racecheck"
SAN="${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
if [ ! -x "$SAN" ]; then
    echo "sanitize: compute-sanitizer not found at '$SAN' (set SANITIZER)"
    exit 2
fi
OUTDIR="${SANITIZER_OUT:-sanitizer-logs}"
PY="${PYTHON:-python3}"
LIMIT="${SANITIZER_TIMEOUT_S:-240}"
EXAMPLES="${SANITIZER_EXAMPLES:-2}"
mkdir -p "$OUTDIR"
"$SAN" --version | tail -n 1
# An instrumented Python process (pytest, a rank worker) may take long to reach the tool: a longer attach window
# where supported.
launch=()
"$SAN" --help 2>/dev/null | grep -q -- "--launch-timeout" && launch=(--launch-timeout 120)

single_rank=(tests/gpu/test_intranode.py::test_one_rank tests/gpu/test_low_latency.py::test_ll_one_rank)
two_ranks=("tests/gpu/test_intranode.py::test_ranks_sharing_one_gpu[2]" tests/gpu/test_low_latency.py::test_ll_two_ranks)

# Instrumented kernels run many times slower: the tests' wait budgets are stretched (TEST_TIMEOUT_SCALE) and the
# example counts cut. TEST_RANKS_PER_GPU=2 admits the two-rank tests on one GPU.
# NVSHMEM_DISABLE_NCCL: NVSHMEM would otherwise start NCCL for its teams, whose start-up probes kernel images with
# failing API calls that memcheck reports as errors of the program (none of them ours).
export NVSHMEM_DISABLE_NCCL=1
# The test workers exit through the interpreter (not os._exit), so that the tool writes each worker's report.
export TEST_WORKER_NORMAL_EXIT=1
export TEST_RANKS_PER_GPU=2 TEST_TIMEOUT_SCALE="${TEST_TIMEOUT_SCALE:-6}" TEST_EXAMPLES_1="$EXAMPLES" \
    TEST_EXAMPLES_SHARED="$EXAMPLES" TEST_EXAMPLES_LL="$EXAMPLES" PYTHONUNBUFFERED=1

PYEXE=$("$PY" -c 'import sys; print(sys.executable)')
ABSOUT=$(cd "$OUTDIR" && pwd)
status=0
for tool in $tools; do
    case "$tool" in
        memcheck) tests=("${two_ranks[@]}"); processes=5 ;;  # pytest and the two workers of each two-rank test
        racecheck) tests=(); processes=1 ;;
        *) echo "sanitize: unknown tool '$tool' (memcheck, racecheck or all)"; exit 2 ;;
    esac
    rm -f "$OUTDIR/$tool".*.log
    start=$(date +%s)
    # shellcheck disable=SC2086  # SANITIZER_ARGS is a list of options
    timeout --kill-after=20 "$LIMIT" "$SAN" --tool "$tool" "${launch[@]}" \
        --print-limit 100 --log-file "$OUTDIR/$tool.%p.log" ${SANITIZER_ARGS:-} \
        "$PY" -m pytest -q -p no:cacheprovider "${single_rank[@]}" > "$OUTDIR/pytest-$tool.txt" 2>&1
    rc=$?
    if [ "${#tests[@]}" -gt 0 ]; then
        wrapper="$ABSOUT/worker-$tool.sh"
        printf '#!/bin/sh\nexec "%s" --tool %s %s --print-limit 100 --log-file "%s/%s.%%p.log" %s "%s" "$@"\n' \
            "$SAN" "$tool" "${launch[*]}" "$ABSOUT" "$tool" "${SANITIZER_ARGS:-}" "$PYEXE" > "$wrapper"
        chmod +x "$wrapper"
        TEST_WORKER_EXECUTABLE="$wrapper" timeout --kill-after=20 "$LIMIT" \
            "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}" >> "$OUTDIR/pytest-$tool.txt" 2>&1
        rc2=$?
        [ "$rc" -eq 0 ] && rc=$rc2
    fi
    seconds=$(( $(date +%s) - start ))
    # Summary lines: memcheck "ERROR SUMMARY: N errors"; racecheck "RACECHECK SUMMARY: N hazards displayed (...)".
    found=$(cat "$OUTDIR/$tool".*.log 2>/dev/null | grep -hoE "(ERROR|RACECHECK) SUMMARY: [0-9]+" | awk '{s += $3; n += 1} END {print s + 0, n + 0}')
    read -r errors summaries <<< "$found"
    logs=$(find "$OUTDIR" -name "$tool.*.log" | wc -l)
    tested=$(grep -oE "[0-9]+ (passed|failed|skipped|errors?)" "$OUTDIR/pytest-$tool.txt" | paste -sd, -)
    passed=$(grep -oE "[0-9]+ passed" "$OUTDIR/pytest-$tool.txt" | awk '{s += $1} END {print s + 0}')
    # PASS needs tests that ran (not all skipped), pytest's success and a clean summary from every process that
    # ran kernels (the two-rank tests' workers included).
    if [ "$rc" -eq 0 ] && [ "$passed" -gt 0 ] && [ "$errors" -eq 0 ] && [ "$summaries" -ge "$processes" ]; then
        verdict=PASS
    else
        verdict=FAIL
        status=1
    fi
    echo "sanitize $tool: $verdict (pytest rc $rc${tested:+: $tested}; $errors errors in $summaries process summaries, $logs logs; ${seconds} s; logs in $OUTDIR)"
    if [ "$errors" -gt 0 ]; then  # the first reports, for the summary
        grep -h -m 3 -E "^========= (Invalid|Program hit|Error|Race|Warning|Saved host backtrace)" "$OUTDIR/$tool".*.log \
            | head -n 8 | sed 's/^/    /'
    fi
    [ "$rc" -eq 124 ] && echo "    cut by its ${LIMIT} s limit (SANITIZER_TIMEOUT_S)"
done
exit $status
