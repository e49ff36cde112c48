"""The CUDA low-latency backend's host path on CPU (fake extension and streams of ``benchmarks/bench_host_path.py``,
in a subprocess so that the fakes do not leak): per call mode, the launches each LL call asks the extension for
(phases, on the comm stream or the current one, whether the current stream waits after, outputs passed or
allocated), the ``record_stream`` batches, and that no Python stream or event object is touched by a synchronous
call."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
sys.path.insert(0, sys.argv[1])
import bench_host_path as bench
import torch
import torch.distributed as dist
ext = bench.make_fake_extension(torch)
sys.modules["deep_ep._C"] = ext
import deep_ep

calls = []
pending = []  # an error record the fake kernels left (the real runtime's launch then raises DeviceError)
class Recording(ext.LowLatencyRuntime):
    def dispatch(self, *args):
        if pending:
            raise ext.DeviceError("a low-latency kernel error is pending")
        phases, stream, current_after, outputs = args[-4:]
        calls.append(["dispatch", phases, stream != 0, current_after, len(outputs)])
        return super().dispatch(*args)
    def combine(self, *args):
        out, phases, stream, current_after = args[9], args[-3], args[-2], args[-1]
        calls.append(["combine", phases, stream != 0, current_after, out is not None])
        return super().combine(*args)
    def read_error(self):
        calls.append(["read_error"])
        return pending[0] if pending else None
ext.LowLatencyRuntime = Recording
ext.record_stream = lambda tensors, *stream: calls.append(["record_stream", len(tensors)])

os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(29400 + os.getpid() % 500)
dist.init_process_group("gloo", rank=0, world_size=1)
group = dist.new_group([0])
class Args:
    tokens, ll_hidden, topk, ll_experts = 16, 1024, 4, 8
x, topk_idx, topk_weights = bench.ll_scenario(torch, deep_ep, Args)
out = {}
with bench.patched(torch, cuda_tensors=True):
    os.environ["DEEP_EP_BACKEND"] = "cuda"
    buffer = deep_ep.Buffer(group, num_rdma_bytes=1 << 30, low_latency_mode=True)
    compute = torch.cuda.current_stream()
    def current_stream(device=None):
        calls.append(["current_stream"])
        return compute
    torch.cuda.current_stream = current_stream
    torch.cuda.Event = lambda *a, **k: calls.append(["Event"]) or bench.FakeEvent()
    for mode, kwargs in (("sync", {}), ("async", dict(async_finish=True)), ("hook", dict(return_recv_hook=True))):
        calls.clear()
        parities = []
        for use_fp8 in (True, False):
            parities.append(buffer._cuda_ll.parity)
            d = buffer.low_latency_dispatch(x, topk_idx, 16, 8, use_fp8=use_fp8, **kwargs)
            if d.hook is not None:
                d.hook()
            recv = d.recv_x[0] if use_fp8 else d.recv_x
            y = torch.empty(recv.shape, dtype=torch.bfloat16)
            parities.append(buffer._cuda_ll.parity)
            c = buffer.low_latency_combine(y, topk_idx, topk_weights, d.handle, **kwargs)
            if c.hook is not None:
                c.hook()
            hook_again = None
            if c.hook is not None:
                try:
                    c.hook()
                except RuntimeError as exc:
                    hook_again = str(exc)
        shapes = [list(recv.shape), list(d.packed_recv_count.shape), list(d.handle.packed_recv_src_info.shape),
                  list(d.handle.packed_recv_layout_range.shape), list(c.combined_x.shape)]
        fp8 = buffer.low_latency_dispatch(x, topk_idx, 16, 8, use_ue8m0=True, round_scale=True, **kwargs)
        if fp8.hook is not None:
            fp8.hook()
        scales = fp8.recv_x[1]
        out[mode] = dict(calls=list(calls), shapes=shapes, parities=parities, hook_again=hook_again,
                         event=c.event.event is not None, scales=[list(scales.shape), list(scales.stride()),
                                                                  str(scales.dtype)])
    pending.append(dict(code="timeout", message="ll_dispatch_wait_data: rank 0 peer 1 (fake)"))
    try:
        buffer.low_latency_dispatch(x, topk_idx, 16, 8)
    except Exception as exc:
        out["pending"] = [type(exc).__name__, str(exc)]
    buffer._release()
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_ll_launches_per_mode():
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", _PROBE, ROOT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # One launch per call, on comm (both phases), allocating its outputs; the current stream waits after it
    # unless async_finish. The FP8 dispatch then the BF16 one, each followed by its combine, then a UE8M0 dispatch.
    for mode, current_after in (("sync", True), ("async", False)):
        calls = out[mode]["calls"]
        launches = [c for c in calls if c[0] in ("dispatch", "combine")]
        pair = [["dispatch", 3, True, current_after, 0], ["combine", 3, True, current_after, False]]
        assert launches == pair * 2 + pair[:1], (mode, calls)
        records = [c[1] for c in calls if c[0] == "record_stream"]
        assert records == ([] if mode == "sync" else [7, 6, 6, 6, 7]), (mode, calls)
        assert out[mode]["event"] == (mode == "async"), mode
    # Synchronous calls touch no Python stream or event and read no error record from Python (the launch checks
    # the record in C++); async calls make one event each.
    sync_calls = out["sync"]["calls"]
    assert not [c for c in sync_calls if c[0] in ("current_stream", "Event", "read_error")], sync_calls
    assert sum(c[0] == "Event" for c in out["async"]["calls"]) == 5
    # With the hook: the send phase on the current stream, allocating; hook() the receive phase on the current
    # stream with the same outputs (5 with FP8 scales, 4 in BF16; combine passes its output).
    hook = out["hook"]["calls"]
    launches = [c for c in hook if c[0] in ("dispatch", "combine")]
    assert launches == [["dispatch", 1, False, False, 0], ["dispatch", 2, False, False, 5],
                        ["combine", 1, False, False, False], ["combine", 2, False, False, True],
                        ["dispatch", 1, False, False, 0], ["dispatch", 2, False, False, 4],
                        ["combine", 1, False, False, False], ["combine", 2, False, False, True],
                        ["dispatch", 1, False, False, 0], ["dispatch", 2, False, False, 5]], hook
    assert out["hook"]["hook_again"] == "this low-latency receive hook was already called"
    # A kernel error left by an earlier call becomes its typed exception at the next launch.
    assert out["pending"] == ["CommTimeoutError", "ll_dispatch_wait_data: rank 0 peer 1 (fake)"]
    for mode in ("sync", "async", "hook"):
        # Parity flips on every call (dispatch, combine, dispatch, combine).
        parities = out[mode]["parities"]
        assert parities in ([0, 1, 0, 1], [1, 0, 1, 0]), (mode, parities)
        assert out[mode]["shapes"] == [[8, 16, 1024], [8], [8, 16], [8, 1], [16, 1024]], mode
        # UE8M0 scales: [L, R*T, H/512] int32, column-major.
        assert out[mode]["scales"] == [[8, 16, 2], [32, 1, 16], "torch.int32"], mode
