"""Host (Python) cost per call of ``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine`` and of the
low-latency ``low_latency_dispatch`` / ``low_latency_combine``, on a CPU machine.

The GPU kernels are replaced by no-ops so that only the host path is timed:

* ``cuda`` rows: the CUDA backend's code (``deep_ep/cuda_backend.py`` behind the ``Buffer`` front) runs with a fake
  ``deep_ep._C`` whose entry points do nothing but allocate the outputs the real ones allocate (with ``torch.empty``
  on CPU, an upper bound of the C++ cost), fake streams and events, and CPU tensors that claim ``is_cuda``;
* ``cuda LL`` rows: the same for the low-latency backend (``deep_ep/cuda_low_latency.py``), one rank;
* ``torch`` rows: the same front calls on CPU tensors, routed to the torch backend whose communicating methods
  return precomputed results, so the number is the front's validation (with the torch backend's extra content
  checks) and nothing else.

Stream/event API calls cost nothing here; on a GPU each costs 1-3 us more (see docs/performance.md). The group is a
one-rank gloo group (the host path hardly depends on the rank count).

Usage::

    python benchmarks/bench_host_path.py [--iters 2000] [--json out.json] [--repo CHECKOUT] [--compare before.json]

``--repo`` times the ``deep_ep`` of another checkout (e.g. an export of an older commit); ``--compare`` prints
before/after columns against an earlier ``--json`` file.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import types
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------------------------------------------
# Fakes: the extension, streams and events
# ----------------------------------------------------------------------------------------------------------------
class FakeStream:
    """Stands in for ``torch.cuda.Stream``: every operation is free."""

    def __init__(self, *args, **kwargs) -> None:
        self.cuda_stream = 0x1000 + id(self) % 4096
        self.stream_id, self.device_index, self.device_type = self.cuda_stream, 0, 1
        self.priority = kwargs.get("priority", 0)

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else FakeEvent()

    def synchronize(self) -> None:
        pass


class FakeEvent:
    """Stands in for ``torch.cuda.Event``."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def make_fake_extension(torch):
    """A ``deep_ep._C`` whose kernels do nothing; entry points that allocate their outputs do so on CPU."""
    ext = types.ModuleType("deep_ep._C")
    ext.MAX_RANKS, ext.MAX_CHANNELS, ext.MAX_TOPK, ext.MAX_LOCAL_EXPERTS = 8, 128, 32, 1024
    ext.CONTROL_BYTES, ext.WORKSPACE_BYTES = 1 << 16, 1 << 20

    class HostTimeout(TimeoutError):
        pass

    class DeviceError(RuntimeError):
        pass

    def num_channels_for_sms(num_sms):
        if num_sms < 1 or num_sms > ext.MAX_CHANNELS:
            raise ValueError(f"config.num_sms must be in [1, {ext.MAX_CHANNELS}], got {num_sms}")
        return num_sms

    class Runtime:
        def __init__(self, rank, num_ranks, num_nvl_bytes, timeout_s):
            self.rank, self.num_ranks, self.num_nvl_bytes = rank, num_ranks, num_nvl_bytes
            self.num_recv = 0
            self.per_expert = []
            self.pool_blocks = {}  # offset -> weak references to the tensors viewing the block

        def get_local_device_id(self):
            return 0

        def get_local_ipc_handle(self):
            return b"\0" * 64

        def sync(self, device_ids, handles):
            pass

        def read_error(self):
            return None

        def destroy(self):
            pass

        # Output pool of direct-to-output dispatch. A block comes back once every tensor made on it is gone (the
        # real deleter runs when the last view dies), as if its stream work were complete.
        def get_pool_offset(self):
            from deep_ep.layout import intranode_pool_region
            return intranode_pool_region(self.num_nvl_bytes).offset

        def get_pool_bytes(self):
            from deep_ep.layout import intranode_pool_region
            return intranode_pool_region(self.num_nvl_bytes).num_bytes

        def collect_pool_blocks(self, comm_stream, ordered):
            ready = [offset for offset, refs in self.pool_blocks.items() if all(ref() is None for ref in refs)]
            for offset in ready:
                del self.pool_blocks[offset]
            return ready

        # Kernel entry points. Three generations are served so that an older checkout can be timed too: the first
        # took every output from Python; the second allocates some outputs itself and returns them; the third also
        # takes channel_prefix_matrix and the output-pool offsets of direct-to-output receive.
        def get_dispatch_layout(self, topk_idx, num_experts, *rest):
            if len(rest) != 3:
                return None
            return (torch.empty(self.num_ranks, dtype=torch.int32), torch.empty(num_experts, dtype=torch.int32),
                    torch.empty(topk_idx.size(0), self.num_ranks, dtype=torch.bool))

        def notify_dispatch(self, *args):
            pass

        def wait_recv_counts(self, num_local_experts):
            return self.num_recv, self.per_expert

        def pair_counts(self):
            return [self.num_recv] * (self.num_ranks * self.num_ranks)

        def dispatch(self, x, x_scales, topk_idx, *rest):
            if len(rest) == 17:  # the first generation: recv_x given, nothing returned
                return None
            data_offset = meta_offset = -1
            if len(rest) == 16:
                rows, recv_src_idx = rest[6], rest[7]
            else:
                rows, recv_src_idx, data_offset, meta_offset = rest[7:11]
            scales = None if x_scales is None else torch.empty(rows, x_scales.size(1), dtype=x_scales.dtype)
            if recv_src_idx is None:
                recv_src_idx = torch.empty(rows, dtype=torch.int32)
            recv_topk_idx = recv_topk_weights = None
            if topk_idx is not None:
                recv_topk_idx = torch.empty(rows, topk_idx.size(1), dtype=topk_idx.dtype)
                recv_topk_weights = torch.empty(rows, topk_idx.size(1))
            recv_x = torch.empty(rows, x.size(1), dtype=x.dtype)
            if data_offset >= 0:
                data = (recv_x, scales, recv_topk_idx, recv_topk_weights)
                self.pool_blocks[data_offset] = [weakref.ref(t) for t in data if t is not None]
            if meta_offset >= 0:
                self.pool_blocks[meta_offset] = [weakref.ref(recv_src_idx)]
            return recv_x, scales, recv_src_idx, recv_topk_idx, recv_topk_weights

        def combine(self, x, topk_weights, bias_0, bias_1, rank_prefix, recv_channel_prefix, send_head, *rest):
            if not isinstance(rest[0], int):
                return None
            weights = None if topk_weights is None else torch.empty(send_head.size(0), topk_weights.size(1))
            return torch.empty(send_head.size(0), x.size(1), dtype=x.dtype), weights

    class LowLatencyRuntime:
        """The LL runtime. Two generations again: the first took the outputs from Python and returned nothing (and
        Python did the stream waits); the current one allocates them and returns them."""

        def __init__(self, rank, num_ranks, num_rdma_bytes, timeout_s, enable_shrink, unique_id, put_only=False):
            self.num_ranks = num_ranks

        def required_bytes(self, num_max_tokens, hidden, num_experts):
            return 0

        def all_p2p(self):
            return True

        def num_blocks(self):
            return 132

        def read_error(self):
            return None

        def destroy(self):
            pass

        def dispatch(self, x, topk_idx, tokens, num_experts, *rest):
            if len(rest) != 10:
                return None
            use_fp8, use_ue8m0, outputs = rest[2], rest[4], rest[9]
            if outputs:
                return outputs[0], outputs[4] if use_fp8 else None, outputs[1], outputs[2], outputs[3]
            num_local, rows, hidden = num_experts // self.num_ranks, self.num_ranks * tokens, x.size(1)
            data = torch.empty(num_local, rows, hidden, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
            scales = None
            if use_fp8:
                cols = hidden // 128 // (4 if use_ue8m0 else 1)
                scales = torch.empty(num_local, cols, rows,
                                     dtype=torch.int32 if use_ue8m0 else torch.float32).transpose(1, 2)
            return (data, scales, torch.empty(num_local, dtype=torch.int32),
                    torch.empty(num_local, rows, dtype=torch.int32),
                    torch.empty(num_local, self.num_ranks, dtype=torch.int64))

        def combine(self, x, topk_idx, topk_weights, src_info, layout_range, tokens, num_experts, use_logfmt,
                    zero_copy, out, *rest):
            if len(rest) != 6:
                return None
            return out if out is not None else torch.empty(topk_idx.size(0), x.size(2), dtype=x.dtype)

    ext.Runtime = Runtime
    ext.HAS_LOW_LATENCY, ext.LL_MAX_TOPK, ext.LL_MAX_TOKENS = True, 16, 1024
    ext.LowLatencyRuntime = LowLatencyRuntime
    ext.ll_unique_id = lambda: b"\0" * 128
    ext.record_stream = lambda tensors, stream_id, device_index, device_type: None
    ext.HostTimeout, ext.DeviceError = HostTimeout, DeviceError
    ext.num_channels_for_sms = num_channels_for_sms
    return ext


@contextlib.contextmanager
def patched(torch, cuda_tensors: bool):
    """Install the fake CUDA API (and, with ``cuda_tensors``, make every tensor claim ``is_cuda``)."""
    saved = {name: getattr(torch.cuda, name) for name in
             ("is_available", "is_initialized", "Stream", "Event", "current_stream", "set_stream", "stream",
              "synchronize", "is_current_stream_capturing")}
    compute = FakeStream()
    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: True
    torch.cuda.Stream = FakeStream
    torch.cuda.Event = FakeEvent
    torch.cuda.current_stream = lambda device=None: compute
    torch.cuda.set_stream = lambda stream: None
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.is_current_stream_capturing = lambda: False
    record_stream = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda self, stream: None
    if cuda_tensors:
        torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        torch.Tensor.record_stream = record_stream
        if cuda_tensors:
            del torch.Tensor.is_cuda


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------
def per_call_us(fn, iters: int, repeats: int = 5) -> float:
    """Best over ``repeats`` of the mean CPU time of this thread over ``iters`` calls, in microseconds. CPU time
    (not wall time) leaves out the time the thread waits for a core, which on a shared machine is most of the
    noise; the host path does not block, so both agree on an idle machine."""
    for _ in range(min(iters, 200)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.thread_time_ns()
        for _ in range(iters):
            fn()
        samples.append((time.thread_time_ns() - start) / iters / 1e3)
    return min(samples)


def scenario(torch, deep_ep, num_tokens: int, hidden: int, num_topk: int, num_experts: int):
    """Inputs of one rank: BF16 and FP8 x, routing, and a combine input."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    x_fp8 = (x.to(torch.float8_e4m3fn), torch.ones(num_tokens, hidden // 128, dtype=torch.float32))
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk_idx = scores.topk(num_topk, dim=1).indices.to(deep_ep.topk_idx_t)
    topk_weights = torch.rand(num_tokens, num_topk, generator=gen)
    return x, x_fp8, topk_idx, topk_weights


def bench_cuda(torch, deep_ep, group, args) -> dict:
    """The CUDA backend's host path with no-op kernels."""
    from deep_ep import Buffer
    x, x_fp8, topk_idx, topk_weights = scenario(torch, deep_ep, args.tokens, args.hidden, args.topk, args.experts)
    out = {}
    with patched(torch, cuda_tensors=True):
        os.environ["DEEP_EP_BACKEND"] = "cuda"
        buffer = Buffer(group, num_nvl_bytes=1 << 30)
        assert type(buffer.runtime).__name__ == "CudaBackend", buffer.runtime
        runtime = buffer.runtime.runtime
        layout = buffer.get_dispatch_layout(topk_idx, args.experts)
        # The real layout kernel fills these; the fake leaves them as allocated, so give them real values.
        from deep_ep.handle import layout_from_topk
        from deep_ep.config import Topology
        real = layout_from_topk(topk_idx, args.experts, Topology(1, 1))
        counts = dict(num_tokens_per_rank=real.num_tokens_per_rank, is_token_in_rank=real.is_token_in_rank,
                      num_tokens_per_expert=real.num_tokens_per_expert)
        runtime.num_recv = int(real.is_token_in_rank.sum())
        runtime.per_expert = real.num_tokens_per_expert.tolist()
        first = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **counts)
        handle = first.handle
        first_fp8 = buffer.dispatch(x_fp8, topk_idx=topk_idx, topk_weights=topk_weights, **counts)
        handle_fp8 = first_fp8.handle
        recv = torch.empty(runtime.num_recv, args.hidden, dtype=torch.bfloat16)
        recv_w = torch.rand(runtime.num_recv, args.topk)
        event = buffer.capture()
        calls = {
            "get_dispatch_layout": lambda: buffer.get_dispatch_layout(topk_idx, args.experts),
            "dispatch (layout + top-k)": lambda: buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                                                 **counts),
            "dispatch cached BF16": lambda: buffer.dispatch(x, handle=handle),
            "dispatch cached FP8": lambda: buffer.dispatch(x_fp8, handle=handle_fp8),
            "dispatch cached BF16 async+previous": lambda: buffer.dispatch(
                x, handle=handle, previous_event=event, async_finish=True),
            "combine": lambda: buffer.combine(recv, handle),
            "combine + topk_weights": lambda: buffer.combine(recv, handle, topk_weights=recv_w),
            "combine async+previous": lambda: buffer.combine(recv, handle, previous_event=event, async_finish=True),
        }
        del layout
        for name, fn in calls.items():
            out[f"cuda: {name}"] = per_call_us(fn, args.iters)
        # The buffer has an output pool, so the rows above receive directly into it (mode 'auto'); these take the
        # rings (a checkout without direct-to-output receive ignores the setting).
        deep_ep.config.INTRANODE_DISPATCH_RECEIVE = "rings"
        try:
            for name in ("dispatch (layout + top-k)", "dispatch cached BF16"):
                out[f"cuda: {name} [rings]"] = per_call_us(calls[name], args.iters)
        finally:
            deep_ep.config.INTRANODE_DISPATCH_RECEIVE = None
        buffer._release()
    return out


def ll_scenario(torch, deep_ep, args):
    """LL inputs: T = ``--tokens`` tokens of hidden ``--ll-hidden``, top-``--topk`` of ``--ll-experts``."""
    x, _, topk_idx, topk_weights = scenario(torch, deep_ep, args.tokens, args.ll_hidden, args.topk, args.ll_experts)
    return x, topk_idx, topk_weights


def bench_cuda_low_latency(torch, deep_ep, group, args) -> dict:
    """The CUDA LL backend's host path (``deep_ep/cuda_low_latency.py`` behind the front) with no-op kernels."""
    from deep_ep import Buffer
    x, topk_idx, topk_weights = ll_scenario(torch, deep_ep, args)
    tokens, experts = args.tokens, args.ll_experts
    out = {}
    with patched(torch, cuda_tensors=True):
        os.environ["DEEP_EP_BACKEND"] = "cuda"
        buffer = Buffer(group, num_rdma_bytes=1 << 30, low_latency_mode=True)
        assert type(buffer._cuda_ll).__name__ == "LowLatencyCuda", buffer._cuda_ll
        first = buffer.low_latency_dispatch(x, topk_idx, tokens, experts)
        handle = first.handle
        y = torch.empty(first.recv_x[0].shape, dtype=torch.bfloat16)

        def dispatch_hook():
            buffer.low_latency_dispatch(x, topk_idx, tokens, experts, return_recv_hook=True).hook()

        def combine_hook():
            buffer.low_latency_combine(y, topk_idx, topk_weights, handle, return_recv_hook=True).hook()

        calls = {
            "dispatch FP8": lambda: buffer.low_latency_dispatch(x, topk_idx, tokens, experts),
            "dispatch BF16": lambda: buffer.low_latency_dispatch(x, topk_idx, tokens, experts, use_fp8=False),
            "dispatch FP8 async": lambda: buffer.low_latency_dispatch(x, topk_idx, tokens, experts,
                                                                      async_finish=True),
            "dispatch FP8 hook + hook()": dispatch_hook,
            "combine": lambda: buffer.low_latency_combine(y, topk_idx, topk_weights, handle),
            "combine async": lambda: buffer.low_latency_combine(y, topk_idx, topk_weights, handle, async_finish=True),
            "combine hook + hook()": combine_hook,
        }
        for name, fn in calls.items():
            out[f"cuda LL: {name}"] = per_call_us(fn, args.iters)
        buffer._release()
    return out


def bench_torch_front(torch, deep_ep, group, args) -> dict:
    """The front's validation on the torch backend's route (its communication replaced by canned results)."""
    from deep_ep import Buffer
    x, x_fp8, topk_idx, topk_weights = scenario(torch, deep_ep, args.tokens, args.hidden, args.topk, args.experts)
    os.environ["DEEP_EP_BACKEND"] = "torch"
    buffer = Buffer(group, num_nvl_bytes=1 << 30)
    layout = buffer.get_dispatch_layout(topk_idx, args.experts)
    counts = dict(num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                  num_tokens_per_expert=layout.num_tokens_per_expert)
    first = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **counts)
    handle = first.handle
    recv_x = first.recv_x
    combined = buffer.combine(recv_x, handle)
    backend = buffer._torch
    backend.get_dispatch_layout = lambda *a, **k: layout
    backend.dispatch = lambda *a, **k: first
    backend.combine = lambda *a, **k: combined
    calls = {
        "get_dispatch_layout": lambda: buffer.get_dispatch_layout(topk_idx, args.experts),
        "dispatch (layout + top-k)": lambda: buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                                             **counts),
        "dispatch cached BF16": lambda: buffer.dispatch(x, handle=handle),
        "combine": lambda: buffer.combine(recv_x, handle),
    }
    out = {f"torch front: {name}": per_call_us(fn, args.iters) for name, fn in calls.items()}
    buffer._release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000, help="calls per timed repeat")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--ll-hidden", type=int, default=1024, help="hidden size of the low-latency rows")
    parser.add_argument("--ll-experts", type=int, default=32, help="experts of the low-latency rows")
    parser.add_argument("--repo", default=os.path.dirname(HERE), help="checkout whose deep_ep is timed")
    parser.add_argument("--json", help="write {row: microseconds} here")
    parser.add_argument("--compare", help="an earlier --json file: print before/after")
    args = parser.parse_args()

    sys.path.insert(0, os.path.abspath(args.repo))
    import torch
    import torch.distributed as dist
    sys.modules["deep_ep._C"] = make_fake_extension(torch)
    import deep_ep
    deep_ep._C = sys.modules["deep_ep._C"]
    if not os.path.abspath(deep_ep.__file__).startswith(os.path.abspath(args.repo)):
        raise SystemExit(f"imported {deep_ep.__file__}, not the deep_ep of {args.repo}")
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.new_group([0])
    try:
        results = bench_cuda(torch, deep_ep, group, args)
        results.update(bench_cuda_low_latency(torch, deep_ep, group, args))
        results.update(bench_torch_front(torch, deep_ep, group, args))
    finally:
        dist.destroy_process_group()

    before = {}
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)["per_call_us"]
    width = max(len(k) for k in results)
    print(f"{'call':<{width}}  {'before us' if before else '':>10}  {'us/call':>9}")
    for name, value in results.items():
        old = f"{before[name]:10.1f}" if name in before else " " * 10
        print(f"{name:<{width}}  {old}  {value:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repo": os.path.abspath(args.repo), "iters": args.iters, "per_call_us": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
