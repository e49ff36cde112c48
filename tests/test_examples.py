"""The runnable examples of the README: the CPU demo must finish and report that every rank's check passed."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("extra", [[], ["--gpus-per-node", "1"]], ids=["intranode", "internode-2x1"])
def test_cpu_demo_two_ranks(extra: list[str]) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "cpu_demo.py"), "--num-processes", "2",
           "--num-experts", "8", "--num-tokens", "32", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check: 2 of 2 ranks passed (OK)" in proc.stdout, proc.stdout
