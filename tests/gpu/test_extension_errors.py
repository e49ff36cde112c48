"""The CUDA extension's own argument checks reach Python as ``ValueError``: a check in the bindings
(csrc/python_api.cpp), in a host entry point (csrc/buffer.cpp) and in a kernel launcher (csrc/kernels/layout.cu),
each in a process of its own, so that a C++ exception the process cannot unwind shows as that process's signal
(and the step it was in) rather than ending the test run::

    python -m pytest tests/gpu/test_extension_errors.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]

# argv[1]: the step to run. Each step prints its name (flushed) before its C++ call.
_SCRIPT = r"""
import faulthandler
import sys

faulthandler.enable()
import torch

from deep_ep.backends.cuda_common import _C

step = sys.argv[1]
print(f"step {step}", file=sys.stderr, flush=True)
try:
    if step == "bindings":
        _C.num_channels_for_sms(0)
    elif step == "host entry":
        _C.Runtime(0, 1, 1000, 30.0)
    else:
        runtime = _C.Runtime(0, 1, 256 << 20, 30.0)
        runtime.sync([runtime.get_local_device_id()], [runtime.get_local_ipc_handle()])
        topk_idx = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
        try:
            runtime.get_dispatch_layout(topk_idx, 0, torch.cuda.current_stream().cuda_stream, False, False)
        finally:
            torch.cuda.synchronize()
            runtime.destroy()
except ValueError as exc:
    print(f"ValueError: {exc}", flush=True)
else:
    print("accepted", flush=True)
"""


@pytest.mark.parametrize(("step", "message"), [
    ("bindings", "config.num_sms must be in [1, "),
    ("host entry", "num_nvl_bytes must be a multiple of 128"),
    ("kernel launcher", "num_experts must be in [1, "),
])
def test_extension_argument_errors_raise_value_error(step, message):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, step], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"{step}: exit status {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    assert done.stdout.startswith("ValueError: ") and message in done.stdout, (step, done.stdout, done.stderr[-2000:])
