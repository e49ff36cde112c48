"""The CUDA backends' host path on CPU: which stream waits each call (normal mode and low-latency) asks the
extension for. The probes run in a subprocess, because they install a fake ``deep_ep._C`` and fake CUDA streams
(``tests/fake_cuda.py``) that must not leak into other tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fake_cuda import PROBE_HEAD, ROOT, probe_env, run_probe

pytest.importorskip("torch")

# Common head of the probes: the fake extension installed before deep_ep is imported.
_PRELUDE = PROBE_HEAD + r"""
import deep_ep
import deep_ep.testing
"""

# Runs every normal-mode call in each stream mode against the fake extension and prints, per mode, the stream
# flags (after_current, current_after) of every kernel entry point, the set_stream calls, the record_stream calls
# and the output-pool offsets (data, meta) each dispatch was given, as JSON; then the pool's live blocks while the
# results are held and after they are dropped.
_PROBE = _PRELUDE + r"""
import reference
from deep_ep.config import Topology

calls, offsets = [], []
class Recording(ext.Runtime):
    def get_dispatch_layout(self, *args):
        calls.append(["layout", *args[-2:]])
        return super().get_dispatch_layout(*args)
    def notify_dispatch(self, *args):
        calls.append(["notify", args[11]])  # after_current (the signature and its check follow)
    def dispatch(self, *args):
        calls.append(["dispatch", *args[20:22]])  # after_current, current_after (the signature hash follows)
        offsets.append(list(args[12:14]))
        return super().dispatch(*args)
    def combine(self, *args):
        calls.append(["combine", *args[12:14]])  # after_current, current_after (copy-engine arguments follow)
        return super().combine(*args)
ext.Runtime = Recording
ext.record_stream = lambda tensors, *stream: calls.append(["record_stream", len(tensors)])

os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(29400 + os.getpid() % 500)
dist.init_process_group("gloo", rank=0, world_size=1)
group = dist.new_group([0])
x, x_fp8, topk_idx, topk_weights = fake.scenario(torch, deep_ep, 16, 256, 4, 8)
real = reference.get_dispatch_layout(topk_idx, 8, Topology(1, 1))  # what the fake layout kernel leaves unset
out = {}
with fake.patched(torch, cuda_tensors=True):
    torch.cuda.set_stream = lambda stream: calls.append(["set_stream"])
    os.environ["DEEP_EP_BACKEND"] = "cuda"
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 30)
    runtime = buffer.runtime.runtime
    runtime.num_recv = int(real.is_token_in_rank.sum())
    runtime.per_expert = real.num_tokens_per_expert.tolist()
    counts = dict(num_tokens_per_rank=real.num_tokens_per_rank, is_token_in_rank=real.is_token_in_rank,
                  num_tokens_per_expert=real.num_tokens_per_expert)
    for mode, kwargs in (("sync", {}), ("sync+previous", dict(previous_event=buffer.capture())),
                         ("async", dict(async_finish=True)),
                         ("async+previous", dict(previous_event=buffer.capture(), async_finish=True)),
                         ("comm alloc", dict(previous_event=buffer.capture(), async_finish=True,
                                             allocate_on_comm_stream=True)),
                         ("sync rings", {})):
        calls.clear()
        offsets.clear()
        with deep_ep.testing.overrides(dispatch_receive="rings" if mode.endswith("rings") else None):
            layout = buffer.get_dispatch_layout(topk_idx, 8, **kwargs)
            first = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **counts, **kwargs)
            cached = buffer.dispatch(x_fp8, handle=first.handle, **kwargs)
            combined = buffer.combine(first.recv_x, first.handle, topk_weights=first.recv_topk_weights, **kwargs)
        shapes = [list(layout.is_token_in_rank.shape), list(first.recv_x.shape), list(cached.recv_x[1].shape),
                  list(combined.combined_x.shape), list(combined.combined_topk_weights.shape),
                  list(first.recv_topk_idx.shape), list(first.recv_topk_weights.shape),
                  list(first.handle.recv_src_idx.shape), list(first.handle.send_head.shape)]
        out[mode] = dict(calls=list(calls), shapes=shapes, async_event=cached.event.event is not None,
                         offsets=list(offsets))
    pool = buffer.runtime.output_pool
    held = pool.num_live
    del layout, first, cached, combined
    buffer.runtime.reclaim_pool_blocks()
    out["pool"] = dict(held=held, dropped=pool.num_live, pool_bytes=pool.num_bytes, free_bytes=pool.free_bytes)
    buffer._release()
dist.destroy_process_group()
print(json.dumps(out))
"""


# The low-latency backend: per call mode, the launches each LL call asks the extension for (phases, on the comm
# stream or the current one, whether the current stream waits after, outputs passed or allocated), the
# record_stream batches, the Python stream/event objects and error reads, and a pending kernel error.
_LL_PROBE = _PRELUDE + r"""

calls = []
init_args = []  # the runtime constructor's arguments
pending = []  # an error record the fake kernels left (the real runtime's launch then raises DeviceError)
class Recording(ext.LowLatencyRuntime):
    def __init__(self, *args):
        init_args.append(list(args))
        super().__init__(*args)
    def dispatch(self, *args):
        if pending:
            raise ext.DeviceError("a low-latency kernel error is pending")
        phases, stream, current_after, outputs = args[-5:-1]  # the signature hash follows
        calls.append(["dispatch", phases, stream != 0, current_after, len(outputs)])
        return super().dispatch(*args)
    def combine(self, *args):
        out, phases, stream, current_after = args[9], args[12], args[13], args[14]
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
x, _, topk_idx, topk_weights = fake.scenario(torch, deep_ep, 16, 1024, 4, 8)
out = {}
with fake.patched(torch, cuda_tensors=True):
    os.environ["DEEP_EP_BACKEND"] = "cuda"
    with deep_ep.testing.overrides(ll_put_only=True):
        buffer = deep_ep.Buffer(group, num_rdma_bytes=1 << 30, low_latency_mode=True)
    out["init"] = [a if isinstance(a, (bool, int, float)) else type(a).__name__ for a in init_args[0]]
    compute = torch.cuda.current_stream()
    def current_stream(device=None):
        calls.append(["current_stream"])
        return compute
    torch.cuda.current_stream = current_stream
    torch.cuda.Event = lambda *a, **k: calls.append(["Event"]) or fake.FakeEvent()
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



def test_stream_waits_per_mode():
    out = run_probe(_PROBE)
    # (after_current, current_after) of layout, notify (after_current only), non-cached dispatch, cached dispatch,
    # combine; then how often the stream was switched and how many record_stream batches were made.
    expected = {
        "sync": (True, True, False, True, True),
        "sync+previous": (False, False, False, False, True),
        "async": (True, True, False, True, False),
        "async+previous": (False, False, False, False, False),
        "comm alloc": (False, False, False, False, False),
        "sync rings": (True, True, False, True, True),
    }
    for mode, (after, notify_after, dispatch_after, cached_after, current_after) in expected.items():
        calls = out[mode]["calls"]
        launches = [c for c in calls if c[0] in ("layout", "notify", "dispatch", "combine")]
        assert launches == [["layout", after, current_after], ["notify", notify_after],
                            ["dispatch", dispatch_after, current_after], ["dispatch", cached_after, current_after],
                            ["combine", after, current_after]], (mode, calls)
        switches = sum(c[0] == "set_stream" for c in calls)
        records = [c[1] for c in calls if c[0] == "record_stream"]
        if mode == "comm alloc":
            assert switches == 8 and len(records) == 8 and all(n > 0 for n in records), (mode, calls)
        elif mode.startswith("async"):
            assert switches == 0 and len(records) == 4 and all(n > 0 for n in records), (mode, calls)
        else:
            assert switches == 0 and records == [], (mode, calls)
        assert out[mode]["async_event"] == mode.startswith(("async", "comm")), mode
        num_recv = out[mode]["shapes"][1][0]
        assert out[mode]["shapes"] == [[16, 1], [num_recv, 256], [num_recv, 2], [16, 256], [16, 4], [num_recv, 4],
                                       [num_recv, 4], [num_recv], [16, 1]], mode
        # The 1 GiB buffer has an output pool: 'auto' gives the non-cached dispatch a data and a meta block and the
        # cached one a data block (it reuses the handle's recv_src_idx); 'rings' gives none.
        (data, meta), (cached_data, cached_meta) = out[mode]["offsets"]
        if mode.endswith("rings"):
            assert [data, meta, cached_data, cached_meta] == [-1, -1, -1, -1], mode
        else:
            assert min(data, meta, cached_data) >= 0 and cached_meta == -1, (mode, out[mode]["offsets"])
            assert len({data, meta, cached_data}) == 3, (mode, out[mode]["offsets"])
    # Every block whose tensors are gone returns to the pool; only the blocks of live results stay taken.
    pool = out["pool"]
    assert pool["held"] > 0 and pool["dropped"] == 0 and pool["free_bytes"] == pool["pool_bytes"] > 0, pool


def test_ll_launches_per_mode():
    out = run_probe(_LL_PROBE)
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
    # The runtime gets (rank, num_ranks, num_rdma_bytes, timeout_s, enable_shrink, unique_id, put_only): the
    # ll_put_only override in force at construction reaches it as put_only.
    assert out["init"][:5] == [0, 1, 1 << 30, 100.0, False] and out["init"][6] is True, out["init"]
    # A kernel error left by an earlier call becomes its typed exception at the next launch.
    assert out["pending"] == ["CommTimeoutError", "ll_dispatch_wait_data: rank 0 peer 1 (fake)"]
    for mode in ("sync", "async", "hook"):
        # Parity flips on every call (dispatch, combine, dispatch, combine).
        parities = out[mode]["parities"]
        assert parities in ([0, 1, 0, 1], [1, 0, 1, 0]), (mode, parities)
        assert out[mode]["shapes"] == [[8, 16, 1024], [8], [8, 16], [8, 1], [16, 1024]], mode
        # UE8M0 scales: [L, R*T, H/512] int32, column-major.
        assert out[mode]["scales"] == [[8, 16, 2], [32, 1, 16], "torch.int32"], mode



# Head of the two-rank probes (argv: ROOT RANK PORT): the process group of ranks 0 and 1 (``group``).
_TWO_RANKS = _PRELUDE + r"""
rank, port = int(sys.argv[2]), sys.argv[3]
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
dist.init_process_group("gloo", rank=rank, world_size=2)
group = dist.new_group([0, 1])
"""


# Two ranks (argv: ROOT RANK PORT) whose fake kernels exchange the call signatures (tests/fake_cuda.py): the normal
# dispatch with a disagreement, a refusal, a worst-token disagreement, a cached dispatch with a disagreement, each
# followed by a correct call; then the low-latency dispatch with use_fp8 on rank 0 only, and one that rank 1 refuses.
# Prints, per step, the outcome and the kernels launched.
_AGREE_PROBE = _TWO_RANKS + r"""
import reference
from deep_ep.config import Topology

x, _, topk_idx, topk_weights = fake.scenario(torch, deep_ep, 16, 256, 4, 8)
real = reference.get_dispatch_layout(topk_idx, 8, Topology(2, 2))
wide = torch.cat([x, x], 1)
out = {}

def attempt(name, runtime, call):
    before = len(getattr(runtime, "launches", []))
    try:
        call()
        out[name] = ["ok", "", getattr(runtime, "launches", [])[before:]]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc), getattr(runtime, "launches", [])[before:]]

with fake.patched(torch, cuda_tensors=True):
    os.environ["DEEP_EP_BACKEND"] = "cuda"
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 30)
    runtime = buffer.runtime.runtime
    runtime.num_recv, runtime.per_expert = 16, [4] * 4
    counts = dict(num_tokens_per_rank=real.num_tokens_per_rank, is_token_in_rank=real.is_token_in_rank,
                  num_tokens_per_expert=real.num_tokens_per_expert)

    def dispatch(data=x, **kwargs):
        return buffer.dispatch(data, topk_idx=topk_idx, topk_weights=topk_weights, **{**counts, **kwargs})

    attempt("agree", runtime, dispatch)
    attempt("hidden", runtime, lambda: dispatch(wide if rank == 1 else x))
    attempt("after hidden", runtime, dispatch)
    bad_counts = real.num_tokens_per_rank.to(torch.int64) if rank == 1 else real.num_tokens_per_rank
    attempt("refused", runtime, lambda: dispatch(num_tokens_per_rank=bad_counts))
    attempt("after refused", runtime, dispatch)
    attempt("worst", runtime, lambda: dispatch(wide if rank == 1 else x, num_worst_tokens=64))
    attempt("worst next", runtime, dispatch)
    attempt("after worst", runtime, dispatch)
    made = {}
    attempt("cached handle", runtime, lambda: made.update(handle=dispatch()[4]))
    attempt("cached", runtime, lambda: buffer.dispatch(wide if rank == 1 else x, handle=made["handle"]))
    attempt("cached next", runtime, lambda: buffer.dispatch(x, handle=made["handle"]))
    attempt("after cached", runtime, lambda: buffer.dispatch(x, handle=made["handle"]))
    attempt("after cached next", runtime, dispatch)
    attempt("cached handle 2", runtime, lambda: made.update(handle=dispatch()[4]))
    attempt("cached refused", runtime, lambda: buffer.dispatch(x[:-1] if rank == 1 else x, handle=made["handle"]))
    attempt("cached refused next", runtime, lambda: buffer.dispatch(x, handle=made["handle"]))
    attempt("after cached refused", runtime, lambda: buffer.dispatch(x, handle=made["handle"]))
    buffer._release()

    ll = deep_ep.Buffer(group, num_rdma_bytes=1 << 30, low_latency_mode=True)
    x_ll, _, idx_ll, _ = fake.scenario(torch, deep_ep, 16, 1024, 4, 8)
    ll_runtime = ll._cuda_ll.runtime
    # The first call sets the carving (its agreement through the torch backend: _FIRST_CALL_PROBE); the calls after
    # it agree in the kernels' count messages.
    attempt("ll first", ll_runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8))
    attempt("ll fp8", ll_runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8, use_fp8=rank == 0))
    parity = ll._cuda_ll.parity
    attempt("ll next", ll_runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8))
    out["ll parity kept"] = ll._cuda_ll.parity == parity
    attempt("ll again", ll_runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8))
    attempt("ll clean", ll_runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    attempt("ll after", ll_runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8))
    too_many = torch.cat([x_ll, x_ll]) if rank == 1 else x_ll  # 32 tokens > T = 16: rank 1 refuses
    idx_many = torch.cat([idx_ll, idx_ll]) if rank == 1 else idx_ll
    attempt("ll refused", ll_runtime, lambda: ll.low_latency_dispatch(too_many, idx_many, 16, 8))
    attempt("ll refused next", ll_runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8))
    attempt("ll refused clean", ll_runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    made = {}
    attempt("ll after refused", ll_runtime,
            lambda: made.update(serial=ll.low_latency_dispatch(x_ll, idx_ll, 16, 8).handle.serial))
    out["ll state"] = [ll._cuda_ll.parity, ll._ll_generation, made.get("serial")]
    # Low-latency combine: use_logfmt on rank 0 only, then one that rank 1 refuses (float64 topk_weights).
    weights_ll = torch.ones(16, 4)
    y_ll = torch.zeros(4, 32, 1024, dtype=torch.bfloat16)

    def ll_combine(weights=weights_ll, foreign=False, **kwargs):
        handle = ll.low_latency_dispatch(x_ll, idx_ll, 16, 8).handle
        before = len(ll_runtime.launches)
        try:
            ll.low_latency_combine(y_ll, idx_ll, weights, tuple(handle) if foreign else handle, **kwargs)
        finally:
            out.setdefault("ll combine launches", []).append(ll_runtime.launches[before:])

    attempt("llc agree", ll_runtime, ll_combine)
    attempt("llc logfmt", ll_runtime, lambda: ll_combine(use_logfmt=rank == 0))
    attempt("llc logfmt next", ll_runtime, ll_combine)
    attempt("llc logfmt clean", ll_runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    attempt("llc after logfmt", ll_runtime, ll_combine)
    attempt("llc refused", ll_runtime, lambda: ll_combine(weights_ll.double() if rank == 1 else weights_ll))
    attempt("llc refused next", ll_runtime, ll_combine)
    attempt("llc refused clean", ll_runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    attempt("llc after refused", ll_runtime, ll_combine)
    out["llc state"] = [ll._cuda_ll.parity, ll._ll_generation, ll._num_handles]
    # Refusals before (T, H, E) or the handle passed: rank 1 passes num_experts 7 (not a multiple of the 2 ranks),
    # then a handle that is not the Buffer's; it launches over the (T, H, E) of its last low-latency call.
    attempt("ll early refused", ll_runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 7 if rank == 1 else 8))
    attempt("ll early refused next", ll_runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8))
    attempt("ll early refused clean", ll_runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    attempt("llc early refused", ll_runtime, lambda: ll_combine(foreign=rank == 1))
    attempt("llc early refused next", ll_runtime, ll_combine)
    attempt("llc early refused clean", ll_runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    attempt("llc after early refused", ll_runtime, ll_combine)
    out["early state"] = [ll._cuda_ll.parity, ll._ll_generation, ll._num_handles]
    # (T, H, E) keep the buffer's carving until a clean: rank 1 alone changes hidden (refused over the carving, so
    # rank 0's dispatch sees its refusal at once), then every rank does (all refuse alike: the next call works).
    wide_ll = torch.cat([x_ll, x_ll], 1)
    attempt("ll carving", ll_runtime, lambda: ll.low_latency_dispatch(wide_ll if rank == 1 else x_ll, idx_ll, 16, 8))
    attempt("ll carving next", ll_runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8))
    attempt("ll carving clean", ll_runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    attempt("ll carving all", ll_runtime, lambda: ll.low_latency_dispatch(wide_ll, idx_ll, 16, 8))
    attempt("ll carving all next", ll_runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8))
    attempt("ll carving new", ll_runtime, lambda: ll.clean_low_latency_buffer(16, 2048, 8))
    attempt("ll carving new call", ll_runtime, lambda: ll.low_latency_dispatch(wide_ll, idx_ll, 16, 8))
    attempt("ll carving back", ll_runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    ll._release()
dist.destroy_process_group()
print(json.dumps(out))
"""


def _run_two_ranks(script: str, port: int, *args: str) -> list:
    """Run ``script`` as ranks 0 and 1 (argv: ROOT RANK PORT, then ``args``); returns the JSON object each printed
    last."""
    procs = [subprocess.Popen([sys.executable, "-c", script, ROOT, str(rank), str(port), *args], cwd=ROOT,
                              env=probe_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def _check_ll_combine_refusal(step: list, rank: int, kind: str, prefix: str) -> None:
    """Rank 1 refused a low-latency combine (its own ``kind`` of error, the message starting with ``prefix``) and
    told rank 0 through the refusal kernel; rank 0's combine ran."""
    got, message, launches = step
    if rank == 1:
        assert got == kind and message.startswith(prefix) and launches[-1:] == ["refuse combine"], step
    else:
        assert got == "ok" and launches[-1:] == ["combine (16 tokens)"], step


def test_cuda_ranks_that_disagree_raise_on_every_rank():
    outs = _run_two_ranks(_AGREE_PROBE, 29900 + os.getpid() % 90)
    for rank, out in enumerate(outs):
        ok = ["ok", "", ["notify", "dispatch"]]
        assert out["agree"] == out["after hidden"] == out["after refused"] == out["after worst"] == ok, out
        # Hidden sizes differ: both ranks raise naming the argument and who holds what, after notify and before
        # any dispatch kernel.
        kind, message, launches = out["hidden"]
        assert kind == "ArgumentMismatchError" and launches == ["notify"], out["hidden"]
        assert "x.size(1) (hidden)" in message and "ranks [0]" in message and "=512" in message, message
        # Rank 1 refuses its own arguments: it launches the zero-count notify and raises its own error; rank 0
        # raises ArgumentMismatchError naming rank 1 and the argument.
        kind, message, launches = out["refused"]
        if rank == 1:
            assert kind in ("TypeError", "ValueError") and "num_tokens_per_rank" in message, out["refused"]
            assert launches == ["refuse"], out["refused"]
        else:
            assert kind == "ArgumentMismatchError" and "rank 1 (num_tokens_per_rank)" in message, out["refused"]
            assert launches == ["notify"], out["refused"]
        # Worst-token mode has no host wait: the notify's record raises at the next call, before its launches.
        assert out["worst"] == ["ok", "", ["notify", "dispatch"]], out["worst"]
        kind, message, launches = out["worst next"]
        assert kind == "ArgumentMismatchError" and launches == [] and "x.size(1) (hidden)" in message, out
        # Cached dispatch: the kernel compares the signature hashes in its output words (no host wait); the next
        # call awaits the kernel's verdict and raises on both ranks before its launches; then the calls work.
        assert out["cached handle"][0] == "ok" and out["cached"] == ["ok", "", ["dispatch"]], out["cached"]
        kind, message, launches = out["cached next"]
        assert kind == "ArgumentMismatchError" and launches == ["await"], out["cached next"]
        assert "cached dispatch" in message and f"peer {1 - rank}" in message, message
        assert out["after cached"] == ["ok", "", ["dispatch"]], out["after cached"]
        assert out["after cached next"] == ["ok", "", ["await", "notify", "dispatch"]], out["after cached next"]
        # Rank 1 refuses a cached dispatch (x has a row too few): it launches the kernel with its refusal's hash and
        # raises its own error; both ranks' next call raises ArgumentMismatchError (their calls stay paired).
        kind, message, launches = out["cached refused"]
        assert launches == ["dispatch"], out["cached refused"]
        assert kind == ("ValueError" if rank == 1 else "ok") and (rank == 0 or message.startswith("x must")), message
        kind, message, launches = out["cached refused next"]
        assert kind == "ArgumentMismatchError" and launches == ["await"] and f"peer {1 - rank}" in message, message
        assert out["after cached refused"][0] == "ok", out["after cached refused"]
        assert out["ll first"] == ["ok", "", ["dispatch (16 tokens)"]], out["ll first"]
        # Low latency: the hashes differ; every launch raises on both ranks, keeping the parity, until
        # clean_low_latency_buffer; then the calls work.
        assert out["ll fp8"][0] == "ok", out["ll fp8"]
        kind, message, _ = out["ll next"]
        assert kind == "ArgumentMismatchError" and "use_fp8" in message and f"rank {1 - rank}" in message, out
        assert "clean_low_latency_buffer" in message and out["ll parity kept"], out
        assert out["ll again"][0] == "ArgumentMismatchError", out["ll again"]
        assert out["ll clean"][0] == "ok" and out["ll after"][0] == "ok", out
        # Rank 1 refuses a low-latency dispatch (too many tokens): it launches the dispatch with no tokens and the
        # hash of its refusal, so rank 0's kernel sees a differing hash at once; both ranks then raise until clean.
        kind, message, launches = out["ll refused"]
        if rank == 1:
            assert kind == "ValueError" and message.startswith("x") and launches == ["dispatch (0 tokens)"], out
        else:
            assert kind == "ok" and launches == ["dispatch (16 tokens)"], out["ll refused"]
        kind, message, _ = out["ll refused next"]
        assert kind == "ArgumentMismatchError" and f"rank {1 - rank}" in message and "refused" in message, out
        assert out["ll refused clean"][0] == "ok" and out["ll after refused"][0] == "ok", out
        # Low-latency combine: the arrival words carry the hashes; the combine of the disagreement returns, every
        # later call raises on both ranks (before any launch) until clean_low_latency_buffer; then the calls work.
        assert out["llc agree"][0] == out["llc logfmt"][0] == "ok", out
        assert out["llc after logfmt"][0] == out["llc after refused"][0] == "ok", out
        kind, message, launches = out["llc logfmt next"]
        assert kind == "ArgumentMismatchError" and launches == [], out["llc logfmt next"]
        assert "low_latency_combine" in message and "clean_low_latency_buffer" in message, message
        assert out["llc logfmt clean"][0] == "ok", out["llc logfmt clean"]
        # Rank 1 refuses its combine (float64 weights) after its handle passed: it tells rank 0 through the
        # refusal kernel and raises its own error; both ranks then raise until clean.
        _check_ll_combine_refusal(out["llc refused"], rank, "TypeError", "topk_weights")
        kind, message, launches = out["llc refused next"]
        assert kind == "ArgumentMismatchError" and launches == [] and "low_latency_combine" in message, out
        assert out["llc refused clean"][0] == "ok", out["llc refused clean"]
        # The same refusals before (T, H, E) or the handle passed: over the last low-latency call's (T, H, E).
        kind, message, launches = out["ll early refused"]
        if rank == 1:
            assert kind == "ValueError" and "num_experts" in message and launches == ["dispatch (0 tokens)"], out
        else:
            assert kind == "ok" and launches == ["dispatch (16 tokens)"], out["ll early refused"]
        kind, message, _ = out["ll early refused next"]
        assert kind == "ArgumentMismatchError" and f"rank {1 - rank}" in message and "refused" in message, out
        _check_ll_combine_refusal(out["llc early refused"], rank, "ValueError", "handle was not returned")
        assert out["llc early refused next"][0] == "ArgumentMismatchError", out["llc early refused next"]
        assert out["ll early refused clean"][0] == out["llc early refused clean"][0] == "ok", out
        assert out["llc after early refused"][0] == "ok", out["llc after early refused"]
        kind, message, launches = out["ll carving"]
        if rank == 1:
            assert kind == "ValueError" and "clean_low_latency_buffer(16, 2048, 8)" in message, out["ll carving"]
            assert launches == ["dispatch (0 tokens)"], out["ll carving"]
        else:
            assert kind == "ok" and launches == ["dispatch (16 tokens)"], out["ll carving"]
        assert out["ll carving next"][0] == "ArgumentMismatchError", out["ll carving next"]
        assert out["ll carving all"][0] == "ValueError" and out["ll carving all next"][0] == "ok", out
        for step in ("ll carving clean", "ll carving new", "ll carving new call", "ll carving back"):
            assert out[step][0] == "ok", (step, out[step])
    # The refusing rank counted the call as its peer did: same parity, call number and handle number.
    assert outs[0]["ll state"] == outs[1]["ll state"], (outs[0]["ll state"], outs[1]["ll state"])
    assert outs[0]["llc state"] == outs[1]["llc state"], (outs[0]["llc state"], outs[1]["llc state"])
    assert outs[0]["early state"] == outs[1]["early state"], (outs[0]["early state"], outs[1]["early state"])


# Two ranks (argv: ROOT RANK PORT SHRINK) on the fake low-latency kernels, shrink mode when SHRINK is "1": the first
# call (no carving yet) and cleans (the kernels carry no signature for them) agree through the torch backend, one
# all-gather, or in shrink mode point to point with the ranks the kernels' mask leaves active. Prints, per step, the
# outcome, the launches and the cleans that ran.
_FIRST_CALL_PROBE = _TWO_RANKS + r"""
shrink = sys.argv[4] == "1"
out = {}

def attempt(name, runtime, call):
    before, cleans = len(runtime.launches), runtime.cleans
    try:
        call()
        out[name] = ["ok", "", runtime.launches[before:], runtime.cleans - cleans]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc), runtime.launches[before:], runtime.cleans - cleans]

with fake.patched(torch, cuda_tensors=True):
    os.environ["DEEP_EP_BACKEND"] = "cuda"
    ll = deep_ep.Buffer(group, num_rdma_bytes=1 << 30, low_latency_mode=True, enable_shrink=shrink)
    x_ll, _, idx_ll, _ = fake.scenario(torch, deep_ep, 16, 1024, 4, 8)
    runtime = ll._cuda_ll.runtime
    attempt("first refused", runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 7 if rank == 1 else 8))
    attempt("first hidden", runtime,
            lambda: ll.low_latency_dispatch(torch.cat([x_ll, x_ll], 1) if rank == 1 else x_ll, idx_ll, 16, 8))
    attempt("first", runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8))
    attempt("clean differs", runtime, lambda: ll.clean_low_latency_buffer(16, 2048 if rank == 1 else 1024, 8))
    attempt("clean refused", runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 9 if rank == 1 else 8))
    attempt("clean", runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    attempt("after clean", runtime, lambda: ll.low_latency_dispatch(x_ll, idx_ll, 16, 8))
    if shrink:
        # Each rank masks the other: a clean exchanges with nobody, so arguments that differ raise nowhere.
        ll.low_latency_update_mask_buffer(1 - rank, True)
        attempt("clean masked", runtime, lambda: ll.clean_low_latency_buffer(16, 2048 if rank == 1 else 1024, 8))
        ll.low_latency_clean_mask_buffer()
        attempt("clean unmasked", runtime, lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    ll._release()
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.parametrize("shrink", [False, True], ids=["all-gather", "shrink"])
def test_first_call_and_clean_agree_through_the_torch_backend(shrink):
    """The kernels carry no signature for a clean, and a first call has no carving for its count words: both agree
    through the torch backend (in shrink mode point to point with the ranks the kernels' mask leaves active), so a
    disagreement or a refusal raises at once on every rank and nothing runs; masked ranks are not waited for."""
    outs = _run_two_ranks(_FIRST_CALL_PROBE, 29700 + 2 * (os.getpid() % 45) + shrink, "1" if shrink else "0")
    for rank, out in enumerate(outs):
        kind, message, launches, _ = out["first refused"]
        assert launches == [] and kind == ("ValueError" if rank == 1 else "ArgumentMismatchError"), out
        assert "num_experts" in message and (rank == 1 or "rank 1 (num_experts)" in message), message
        kind, message, launches, _ = out["first hidden"]
        assert kind == "ArgumentMismatchError" and launches == [] and "x.size(1) (hidden)" in message, out
        assert out["first"][:3] == ["ok", "", ["dispatch (16 tokens)"]], out["first"]
        # Cleans whose arguments differ, or that one rank refuses, raise on both ranks before any clean runs.
        kind, message, _, cleans = out["clean differs"]
        assert kind == "ArgumentMismatchError" and "hidden" in message and "clean_low_latency_buffer" in message, out
        assert cleans == 0, out["clean differs"]
        kind, message, _, cleans = out["clean refused"]
        assert cleans == 0, out["clean refused"]
        if rank == 1:
            assert kind == "ValueError" and "num_experts" in message, out["clean refused"]
        else:
            assert kind == "ArgumentMismatchError" and "rank 1 (num_experts)" in message, out["clean refused"]
        assert out["clean"][0] == "ok" and out["clean"][3] == 1, out["clean"]
        assert out["after clean"][0] == "ok", out["after clean"]
        if shrink:
            assert out["clean masked"][0] == "ok" and out["clean masked"][3] == 1, out["clean masked"]
            assert out["clean unmasked"][0] == "ok" and out["clean unmasked"][3] == 1, out["clean unmasked"]


# Two ranks (argv: ROOT RANK PORT): rank 1 has no tokens and combines with use_logfmt flipped, so only rank 0
# receives rows of the other hash and rank 1 is told (its next kernel does nothing but record it). The ranks then
# make different numbers of low-latency calls before each raises, as the GPU test does; then both clean and run
# correct rounds. Also: a zero-copy combine buffer handed out before a clean. Prints, per step, the outcome, and the
# host state that the ranks' kernels must agree on (buffer half, next handle number) before and after the clean.
_TOLD_PROBE = _TWO_RANKS + r"""
x, _, idx, _ = fake.scenario(torch, deep_ep, 16, 1024, 4, 8)
tokens = 16 if rank == 0 else 0
x, idx, weights = x[:tokens], idx[:tokens], torch.ones(tokens, 4)
y = torch.zeros(4, 32, 1024, dtype=torch.bfloat16)
out = {}

def attempt(name, call):
    try:
        call()
        out[name] = ["ok", ""]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]

def state():
    return [ll._cuda_ll.parity, ll._num_handles]

def round_trip(**kwargs):
    handle = ll.low_latency_dispatch(x, idx, 16, 8).handle
    ll.low_latency_combine(y, idx, weights, handle, **kwargs)

with fake.patched(torch, cuda_tensors=True):
    os.environ["DEEP_EP_BACKEND"] = "cuda"
    ll = deep_ep.Buffer(group, num_rdma_bytes=1 << 30, low_latency_mode=True)
    out["fresh"] = state()
    attempt("told combine", lambda: round_trip(use_logfmt=rank == 1))
    for call in (1, 2):
        attempt(f"call {call}", lambda: ll.low_latency_dispatch(x, idx, 16, 8))
        if out[f"call {call}"][0] != "ok":
            break
    out["before clean"] = state()
    attempt("clean", lambda: ll.clean_low_latency_buffer(16, 1024, 8))
    out["after clean"] = state()
    attempt("round", round_trip)
    attempt("round 2", round_trip)
    handle = ll.low_latency_dispatch(x, idx, 16, 8).handle
    ll.get_next_low_latency_combine_buffer(handle)
    ll.clean_low_latency_buffer(16, 1024, 8)
    attempt("zero-copy across a clean", lambda: ll.low_latency_combine(y, idx, weights, handle, zero_copy=True))
    attempt("round 3", round_trip)
    out["end"] = state()
    ll._release()
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_ranks_agree_after_a_told_combine_disagreement_and_clean():
    """The ranks make different numbers of low-latency calls between a combine disagreement that one of them only
    hears of and the clean; the clean restarts the buffer half and the handle numbers, so that the ranks' next calls
    use the same half and agree on their handles, as after a fresh start."""
    outs = _run_two_ranks(_TOLD_PROBE, 29800 + os.getpid() % 90)
    assert outs[0]["told combine"] == outs[1]["told combine"] == ["ok", ""], outs
    # Rank 0 received rows of the other hash: its next call raises. Rank 1 received none: its next kernel does
    # nothing but record the tell (the call returns), the call after raises.
    kind, message = outs[0]["call 1"]
    assert kind == "ArgumentMismatchError" and "low_latency_combine agreement: rank 0 peer 1" in message, outs[0]
    assert outs[1]["call 1"] == ["ok", ""], outs[1]
    kind, message = outs[1]["call 2"]
    assert kind == "ArgumentMismatchError" and "told by a peer" in message and "peer 0" in message, outs[1]
    # So the ranks' counts differ before the clean, and agree with a fresh start's after it.
    assert outs[0]["before clean"] != outs[1]["before clean"], outs
    for out in outs:
        assert out["clean"] == ["ok", ""], out
        assert out["after clean"] == [out["fresh"][0], 1 * 10 ** 12], out
        assert out["round"] == out["round 2"] == out["round 3"] == ["ok", ""], out
        # The clean restarted the buffer half: a combine buffer handed out before it is no longer the next one.
        kind, message = out["zero-copy across a clean"]
        assert kind == "LowLatencyMisuseError" and "clean_low_latency_buffer" in message, out
    assert outs[0]["end"] == outs[1]["end"], outs


# Ranks (argv: ROOT RANK PORT MODE WORLD) whose fake combine kernels compare the hashes of the call signatures: a
# combine whose hidden size, topk_weights (given or not) or bias count differs between the ranks, combines that rank
# 1 refuses (a row too few, an FP16 x, a handle that is not the Buffer's) and one whose config rank 1 changes, each
# followed by the next call and a correct combine; a combine every rank refuses alike (their refusals agree: the
# next call works); then cached dispatches likewise (another hidden size, a row too
# few, a handle that is not the Buffer's). MODE: "intranode" (CudaBackend), "internode" (InternodeCuda, one GPU per
# node, pointer peers), "put" (InternodeCuda with internode_put_only: the peer is a put peer) or "fused"
# (FusedInternodeCuda, 2 x 2).
# Prints the backend and its put peers, and per step the outcome and the kernels launched.
_COMBINE_AGREE_PROBE = _PRELUDE + r"""
import reference
from deep_ep.config import Topology

rank, port, mode, world = int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
dist.init_process_group("gloo", rank=rank, world_size=world)
group = dist.new_group(list(range(world)))
topo = Topology.from_env(world)
x, _, topk_idx, topk_weights = fake.scenario(torch, deep_ep, 16, 256, 4, 8)
real = reference.get_dispatch_layout(topk_idx, 8, topo)
out = {}

def attempt(name, runtime, call):
    before = len(runtime.launches)
    try:
        call()
        out[name] = ["ok", "", runtime.launches[before:]]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc), runtime.launches[before:]]

with fake.patched(torch, cuda_tensors=True):
    os.environ["DEEP_EP_BACKEND"] = "cuda"
    sizes = dict(num_nvl_bytes=1 << 30) if not topo.is_internode else dict(num_nvl_bytes=1 << 20,
                                                                            num_rdma_bytes=1 << 30)
    with deep_ep.testing.overrides(internode_put_only=mode == "put"):
        buffer = deep_ep.Buffer(group, **sizes)
    out["backend"] = [type(buffer.runtime).__name__, list(buffer.runtime.put_peers)]
    runtime = buffer.runtime.runtime
    runtime.num_recv, runtime.per_expert, runtime.num_forward = 16, [4] * (8 // world), 8
    d = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=real.num_tokens_per_rank,
                        num_tokens_per_rdma_rank=real.num_tokens_per_rdma_rank, is_token_in_rank=real.is_token_in_rank,
                        num_tokens_per_expert=real.num_tokens_per_expert)
    y, handle = d.recv_x, d.handle
    wide, weights, bias = torch.cat([y, y], 1), torch.ones(16, 4), torch.zeros(16, 256, dtype=torch.bfloat16)
    other = rank == 1
    steps = {"hidden": dict(x=wide if other else y), "weights": dict(topk_weights=weights if other else None),
             "bias": dict(bias=bias if other else None), "refused": dict(x=y[:-1] if other else y),
             "dtype": dict(x=y.half() if other else y),
             "config": dict(config=deep_ep.Config(4, 8, 256) if other else None),
             "handle": dict(handle=tuple(handle) if other else handle)}
    attempt("agree", runtime, lambda: buffer.combine(y, handle))
    for name, kwargs in steps.items():
        attempt(name, runtime, lambda: buffer.combine(**{"x": y, "handle": handle, **kwargs}))
        attempt(name + " next", runtime, lambda: buffer.combine(y, handle))
        attempt("after " + name, runtime, lambda: buffer.combine(y, handle))
    # Every rank makes the same mistake (a handle that is not the Buffer's): each raises its own error, their
    # refusals agree, and the next call works.
    attempt("all refused", runtime, lambda: buffer.combine(y, tuple(handle)))
    attempt("after all refused", runtime, lambda: buffer.combine(y, handle))
    # Cached dispatch: another hidden size, a row too few and a handle that is not the Buffer's on rank 1.
    cached = {"cached hidden": dict(x=torch.cat([x, x], 1) if other else x),
              "cached refused": dict(x=x[:-1] if other else x),
              "cached handle": dict(handle=tuple(handle) if other else handle)}
    for name, kwargs in cached.items():
        attempt(name, runtime, lambda: buffer.dispatch(**{"x": x, "handle": handle, **kwargs}))
        attempt(name + " next", runtime, lambda: buffer.dispatch(x, handle=handle))
        attempt("after " + name, runtime, lambda: buffer.dispatch(x, handle=handle))
    buffer._release()
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.parametrize(("mode", "world", "per_node", "backend"), [
    ("intranode", 2, 8, "CudaBackend"), ("internode", 2, 1, "InternodeCuda"), ("put", 2, 1, "InternodeCuda"),
    ("fused", 4, 2, "FusedInternodeCuda")])
def test_cuda_combine_disagreement_raises_at_next_call_on_every_rank(mode, world, per_node, backend):
    """Every rank launches the combine kernel, a rank that refuses the call with its refusal's hash (over a stand-in
    handle when its own is not valid); the next call awaits the verdict and raises ArgumentMismatchError naming the
    combine and the first rank whose hash differs on every rank before it launches anything (the fused backend names
    that rank's node too), and the call after it runs. A cached dispatch likewise (the fused kernels compare the
    hashes in the same agreement words as the combine). Intranode and one GPU per node (pointer or put peer): two
    ranks; fused: 2 x 2."""
    port = str(29810 + os.getpid() % 80 + 100 * ["intranode", "internode", "put", "fused"].index(mode))
    procs = [subprocess.Popen([sys.executable, "-c", _COMBINE_AGREE_PROBE, ROOT, str(rank), port, mode, str(world)],
                              cwd=ROOT, env=probe_env(DEEP_EP_GPUS_PER_NODE=str(per_node)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    # Rank 1's own refusals: the exception type and the start of its message.
    refusals = {"refused": ("ValueError", "x must have the"), "dtype": ("TypeError", "x must have dtype"),
                "config": ("ValueError", "config.num_sms"), "handle": ("ValueError", "handle was not returned"),
                "cached refused": ("ValueError", "x must have the"),
                "cached handle": ("ValueError", "handle was not returned")}
    for rank, out in enumerate(outs):
        assert out["backend"] == [backend, [1 - rank] if mode == "put" else []], out["backend"]
        kind, message, launches = out["all refused"]
        assert kind == "ValueError" and message.startswith("handle was not returned"), out["all refused"]
        assert launches[-1:] == ["combine"], out["all refused"]
        assert out["after all refused"] == ["ok", "", ["await", "combine"]], out["after all refused"]
        assert out["agree"] == ["ok", "", ["combine"]], out["agree"]
        steps = [(name, "combine") for name in ("hidden", "weights", "bias", "refused", "dtype", "config", "handle")]
        steps += [(name, "dispatch") for name in ("cached hidden", "cached refused", "cached handle")]
        for name, kernel in steps:
            # The kernel compares the hashes (every rank launches it, a refusing rank with its refusal's hash, over a
            # stand-in handle when its own is not valid); the next call awaits the verdict and raises on every rank
            # before it launches anything.
            kind, message, launches = out[name]
            assert launches[-1:] == [kernel] and launches[:-1] in ([], ["await"]), (name, out[name])
            refused = name in refusals and rank == 1
            assert kind == (refusals[name][0] if refused else "ok"), (name, out[name])
            if refused:
                assert message.startswith(refusals[name][1]), message
            kind, message, launches = out[name + " next"]
            assert kind == "ArgumentMismatchError" and launches == ["await"], (name, out[name + " next"])
            peer = 0 if rank == 1 else 1  # the first rank whose hash differs from this rank's
            what = "combine" if kernel == "combine" else "cached dispatch"
            assert f"{what} call signatures differ" in message and f"peer {peer}" in message, message
            if backend == "FusedInternodeCuda":
                assert f"peer {peer} is node {peer // per_node}, local {peer % per_node}" in message, message
            assert out["after " + name] == ["ok", "", [kernel]], (name, out["after " + name])


# Two NVSHMEM Buffers in one process: the second joins the process's world without asking NVSHMEM for a new unique
# id (NVSHMEM is initialised once per process); a Buffer whose ranks differ from the world's raises RuntimeError on
# every rank before any NVSHMEM call, and the process lives on.
_WORLD_PROBE = _PRELUDE + r"""
from deep_ep.backends import cuda_common

ids = []
make_id = ext.ll_unique_id
ext.ll_unique_id = lambda: ids.append(1) or make_id()
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(29400 + os.getpid() % 500)
dist.init_process_group("gloo", rank=0, world_size=1)
group = dist.new_group([0])
x, _, topk_idx, _ = fake.scenario(torch, deep_ep, 16, 1024, 4, 8)
out = {}
with fake.patched(torch, cuda_tensors=True):
    os.environ["DEEP_EP_BACKEND"] = "cuda"
    first = deep_ep.Buffer(group, num_rdma_bytes=1 << 30, low_latency_mode=True)
    out["ids after first"] = len(ids)
    second = deep_ep.Buffer(group, num_rdma_bytes=1 << 30, low_latency_mode=True)
    out["ids after second"] = len(ids)
    out["second served by"] = type(second._cuda_ll).__name__
    second.low_latency_dispatch(x, topk_idx, 16, 8)
    # Rank 0 of a two-rank group, its peer's process in no world yet / in a world of its own.
    for name, peer_world in (("fresh peer", None), ("peer in another world", (0, 1))):
        def gather(obj, peer_world=peer_world):
            return [obj, (obj[0], peer_world)] if isinstance(obj, tuple) else [obj, obj]
        try:
            cuda_common.join_nvshmem_world(0, 1 << 30, 4, True, False, gather)
            out[name] = "joined"
        except RuntimeError as exc:
            out[name] = str(exc)
    out["ids at end"] = len(ids)
print(json.dumps(out))
"""


def test_a_second_nvshmem_buffer_joins_the_process_world():
    out = run_probe(_WORLD_PROBE)
    assert (out["ids after first"], out["ids after second"], out["ids at end"]) == (1, 1, 1), out
    assert out["second served by"] == "LowLatencyCuda", out
    for name in ("fresh peer", "peer in another world"):
        assert "rank 0's process joined one as PE 0 of 1" in out[name], out
        assert "initialised once per process" in out[name], out
