"""A script written only against DeepEP V1's documented API runs unchanged on ``deep_ep`` (4 gloo processes).

``tests/compat/deepep_v1_script.py`` calls ``deep_ep.Buffer`` with V1's constructor arguments, keyword names and
tuple positions and checks every result against all ranks' inputs; this test runs it in a subprocess and requires a
clean exit and its success line. The mutant runs load a ``sitecustomize`` that breaks one tuple position or the
low-latency weighting in every process, and require the script's own checks to fail.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

SCRIPT = Path(__file__).resolve().parent / "compat" / "deepep_v1_script.py"
REPO_ROOT = Path(__file__).resolve().parent.parent
SUCCESS_LINE = "deepep_v1_script: all checks passed"

# Each mutant replaces one Buffer method by a body that calls the genuine one (``_original``) and sets ``result``.
_CALL = "result = _original(self, *args, **kwargs)"
MUTANTS = {
    "dispatch: recv_topk_idx <-> recv_topk_weights": (
        "dispatch", [_CALL, "result = (result[0], result[2], result[1], *result[3:])"]),
    "low-latency handle: src_info <-> layout_range": (
        "low_latency_dispatch", [_CALL, "handle = (result[2][1], result[2][0], *result[2][2:])",
                                 "result = (*result[:2], handle, *result[3:])"]),
    "low-latency combine: top-k weights in reverse slot order": (
        "low_latency_combine", ["args = (*args[:2], args[2].flip(1), *args[3:])", _CALL]),
}
_WRAPPER = """import deep_ep

_original = deep_ep.Buffer.{method}


def _mutant(self, *args, **kwargs):
{body}
    return result


deep_ep.Buffer.{method} = _mutant
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_script(extra_path: Optional[Path] = None) -> subprocess.CompletedProcess:
    paths = [str(p) for p in (extra_path, REPO_ROOT) if p is not None] + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), DEEP_EP_TIMEOUT_S="60", OMP_NUM_THREADS="1")
    env.pop("DEEP_EP_GPUS_PER_NODE", None)
    return subprocess.run([sys.executable, str(SCRIPT), "--num-processes", "4", "--port", str(_free_port())],
                          env=env, capture_output=True, text=True, timeout=540)


@pytest.mark.timeout(600)
def test_deepep_v1_script_runs_unchanged():
    proc = _run_script()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{output[-6000:]}"
    assert SUCCESS_LINE in proc.stdout, output[-6000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_deepep_v1_script_catches_mutant(mutant: str, tmp_path: Path):
    method, body = MUTANTS[mutant]
    wrapper = _WRAPPER.format(method=method, body="\n".join("    " + line for line in body))
    (tmp_path / "sitecustomize.py").write_text(wrapper)
    proc = _run_script(tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and SUCCESS_LINE not in proc.stdout, f"the script missed: {mutant}"
    assert "AssertionError" in output, f"the script failed otherwise than by a check:\n{output[-6000:]}"
