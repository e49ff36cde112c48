"""tests/gpu/sanitize.sh's verdicts, with stand-ins for compute-sanitizer and Python (no GPU needed).

The sanitizer stand-in writes one log per instrumented process (its own pid): the pytest process of the single-rank
tests, and each worker that the Python stand-in starts through the worker wrapper (``TEST_WORKER_EXECUTABLE``), as
multiprocessing does in the two-rank tests. Both print a pytest result line. The script must say PASS only for clean
summaries of tests that ran, from every process, and FAIL (exit status 1) with the first report otherwise.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "gpu" / "sanitize.sh"

FAKE_SANITIZER = r"""#!/usr/bin/env bash
case "$1" in --version) echo "stand-in"; exit 0;; --help) exit 0;; esac
tool=$2; log=""
while [ $# -gt 0 ]; do
    case "$1" in --log-file) log=$2; shift 2;; --*) shift 2;; *) break;; esac
done
file=${log/\%p/$$}
if [ "$tool" = racecheck ]; then
    echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" > "$file"
elif [ -n "$FAKE_ERRORS" ] && [ "${FAKE_WORKER:-}" = 2 ]; then
    printf '========= Invalid __global__ write of size 4 bytes\n========= ERROR SUMMARY: 2 errors\n' > "$file"
else
    echo "========= ERROR SUMMARY: 0 errors" > "$file"
fi
[ -z "${FAKE_WORKER:-}" ] && echo "$FAKE_PYTEST_LINE"
exit 0
"""

FAKE_PYTHON = r"""#!/usr/bin/env bash
if [ "$1" = -c ]; then echo "$0"; exit 0; fi
for i in $(seq 1 "${FAKE_WORKERS:-4}"); do FAKE_WORKER=$i "$TEST_WORKER_EXECUTABLE" -c pass; done
echo "$FAKE_PYTEST_LINE"
"""


def _run(tmp_path: Path, tool: str, errors: bool, pytest_line: str, workers: int = 4) -> subprocess.CompletedProcess:
    fake, python = tmp_path / "compute-sanitizer", tmp_path / "python"
    fake.write_text(FAKE_SANITIZER)
    python.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    python.chmod(0o755)
    env = dict(os.environ, SANITIZER=str(fake), PYTHON=str(python), SANITIZER_OUT=str(tmp_path / "logs"),
               FAKE_ERRORS="1" if errors else "", FAKE_PYTEST_LINE=pytest_line, FAKE_WORKERS=str(workers))
    return subprocess.run(["bash", str(SCRIPT), tool], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_clean_summaries_pass(tmp_path, tool):
    done = _run(tmp_path, tool, errors=False, pytest_line="3 passed in 9.0s")
    assert done.returncode == 0, done.stdout + done.stderr
    summaries = 5 if tool == "memcheck" else 1  # memcheck: pytest and four workers; racecheck: pytest
    assert f"sanitize {tool}: PASS" in done.stdout and f"{summaries} process summaries" in done.stdout


def test_reported_errors_fail_with_the_first_report(tmp_path):
    done = _run(tmp_path, "memcheck", errors=True, pytest_line="3 passed in 9.0s")
    assert done.returncode == 1, done.stdout
    assert "sanitize memcheck: FAIL" in done.stdout and "2 errors" in done.stdout
    assert "Invalid __global__ write" in done.stdout


def test_nothing_run_is_not_a_pass(tmp_path):
    done = _run(tmp_path, "memcheck", errors=False, pytest_line="4 skipped in 1.0s")
    assert done.returncode == 1 and "sanitize memcheck: FAIL" in done.stdout, done.stdout


def test_missing_sanitizer_is_named(tmp_path):
    env = dict(os.environ, SANITIZER=str(tmp_path / "absent"))
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "compute-sanitizer not found" in done.stdout


def test_memcheck_without_the_workers_reports_fails(tmp_path):
    """Only the pytest process reported: the two-rank tests' workers ran unchecked, which is no pass."""
    done = _run(tmp_path, "memcheck", errors=False, pytest_line="4 passed in 9.0s", workers=0)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "sanitize memcheck: FAIL" in done.stdout and "1 process summaries" in done.stdout
