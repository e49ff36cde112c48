"""tests/gpu/sanitize.sh's verdicts, with a stand-in for compute-sanitizer (no GPU needed).

The stand-in writes one log per "process" (the summaries a real run writes: pytest and, for memcheck, two rank
workers) and prints a pytest result line; the
script must say PASS only for clean summaries of tests that ran, and FAIL (exit status 1) with the first report
otherwise.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "gpu" / "sanitize.sh"

FAKE = r"""#!/usr/bin/env bash
case "$1" in --version) echo "stand-in"; exit 0;; --help) exit 0;; esac
tool=$2; log=""
while [ $# -gt 0 ]; do
    case "$1" in --log-file) log=$2; shift 2;; --*) shift 2;; *) break;; esac
done
for pid in ${FAKE_PIDS:-11 12 13}; do
    file=${log/\%p/$pid}
    if [ "$tool" = racecheck ]; then
        echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" > "$file"
    elif [ -n "$FAKE_ERRORS" ] && [ $pid = 12 ]; then
        printf '========= Invalid __global__ write of size 4 bytes\n========= ERROR SUMMARY: 2 errors\n' > "$file"
    else
        echo "========= ERROR SUMMARY: 0 errors" > "$file"
    fi
done
echo "$FAKE_PYTEST_LINE"
"""


def _run(tmp_path: Path, tool: str, errors: bool, pytest_line: str,
         pids: str = "11 12 13") -> subprocess.CompletedProcess:
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = dict(os.environ, SANITIZER=str(fake), SANITIZER_OUT=str(tmp_path / "logs"),
               FAKE_ERRORS="1" if errors else "", FAKE_PYTEST_LINE=pytest_line, FAKE_PIDS=pids)
    return subprocess.run(["bash", str(SCRIPT), tool], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_clean_summaries_pass(tmp_path, tool):
    done = _run(tmp_path, tool, errors=False, pytest_line="3 passed in 9.0s")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"sanitize {tool}: PASS" in done.stdout and "3 process summaries" in done.stdout


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
    done = _run(tmp_path, "memcheck", errors=False, pytest_line="4 passed in 9.0s", pids="11")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "sanitize memcheck: FAIL" in done.stdout and "1 process summaries" in done.stdout
