"""A script written only against DeepEP V1's documented API runs unchanged on ``deep_ep`` (4 gloo processes).

``tests/compat/deepep_v1_script.py`` mirrors DeepEP's own intranode and low-latency test flow (constructor
arguments, keyword names, tuple positions, event handling) and asserts DeepEP's results; this test runs it in a
subprocess and requires a clean exit and its success line.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "compat" / "deepep_v1_script.py"
REPO_ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(600)
def test_deepep_v1_script_runs_unchanged():
    env = dict(os.environ, PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               DEEP_EP_TIMEOUT_S="60", OMP_NUM_THREADS="1")
    env.pop("DEEP_EP_GPUS_PER_NODE", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--num-processes", "4", "--port", str(_free_port())],
                          env=env, capture_output=True, text=True, timeout=540)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{output[-6000:]}"
    assert "deepep_v1_script: all checks passed" in proc.stdout, output[-6000:]
