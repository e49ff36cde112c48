"""A stand-in ``deep_ep._C`` and CUDA stream API, so that the CUDA backends' host path runs on a CPU machine.

The fake kernels do nothing but allocate the outputs the real ones allocate (``torch.empty`` on CPU); streams and
events are free; with ``patched(torch, cuda_tensors=True)`` every tensor claims ``is_cuda``. The call signatures
the kernels exchange (notify slots, cached-dispatch output words, combine agreement words, low-latency count
words) travel through ``torch.distributed.all_gather_object`` over the default group, and a disagreement the
kernels would record fills the fake error record. Install it before ``deep_ep`` is imported
(``sys.modules["deep_ep._C"] = make_fake_extension(torch)``), in a process of its own: the patches are global.
``tests/test_cuda_host_path.py`` records, through subclasses of these fakes, which stream waits and output blocks
each call asks the extension for.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import types
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The head of a probe script run in a subprocess as `python -c SCRIPT ROOT`: ROOT and ROOT/tests on sys.path, this
# fake installed as ``deep_ep._C`` (``ext``) before anything imports deep_ep.
PROBE_HEAD = r"""
import gc, json, os, sys, warnings
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
sys.path.insert(0, sys.argv[1])
import fake_cuda as fake
import torch
import torch.distributed as dist
ext = fake.make_fake_extension(torch)
sys.modules["deep_ep._C"] = ext
"""


def probe_env(**env: str) -> dict:
    """The environment of a probe: the caller's without its DEEP_EP_* variables (the probes check the library's
    defaults), with ``env`` added."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("DEEP_EP_")}, "PYTHONPATH": ROOT, **env}


def run_probe(script: str, **env: str) -> dict:
    """Run ``script`` (it starts with :data:`PROBE_HEAD`) as ``python -c SCRIPT ROOT`` in :func:`probe_env`;
    returns the JSON object it printed last."""
    done = subprocess.run([sys.executable, "-c", script, ROOT], cwd=ROOT, env=probe_env(**env), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

class FakeStream:
    """Stands in for ``torch.cuda.Stream``: every operation is free."""

    def __init__(self, *args, **kwargs) -> None:
        self.cuda_stream = 0x1000 + id(self) % 4096
        self.stream_id, self.device_index, self.device_type = self.cuda_stream, 0, 1
        self.priority = kwargs.get("priority", 0)
        self.device = "cpu"  # the fake's "CUDA" tensors live on the CPU

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


def make_fake_extension(torch) -> types.ModuleType:
    """A ``deep_ep._C`` whose kernels do nothing; entry points that allocate their outputs do so on CPU."""
    ext = types.ModuleType("deep_ep._C")
    ext.MAX_RANKS, ext.MAX_CHANNELS, ext.MAX_TOPK, ext.MAX_LOCAL_EXPERTS = 8, 128, 32, 1024
    ext.MAX_RUNTIME_RANKS = 64  # the extension's (tests/gpu/test_fused_internode.py checks it)
    ext.CONTROL_BYTES, ext.WORKSPACE_BYTES = 1 << 16, 1 << 20

    class HostTimeout(TimeoutError):
        pass

    class DeviceError(RuntimeError):
        pass

    def num_channels_for_sms(num_sms):
        if num_sms < 1 or num_sms > ext.MAX_CHANNELS:
            raise ValueError(f"config.num_sms must be in [1, {ext.MAX_CHANNELS}], got {num_sms}")
        return num_sms

    def gather(value):
        """Every rank's ``value`` (the exchange a kernel makes through the peers' buffers)."""
        import torch.distributed as dist
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out

    class _ErrorRecord:
        """What both runtimes do with their error record (``record``: ``None`` or the pending error)."""

        record = None

        def read_error(self):
            return self.record

        def clear_argument_error(self, stream):
            assert self.record is not None and self.record["code"] == "argument_mismatch", self.record
            self.record = None

        def destroy(self):
            pass

    class Runtime(_ErrorRecord):
        """The normal-mode runtime. ``num_recv`` / ``per_expert``: what the fake notify reports as received;
        ``launches``: the kernels launched (``notify``, ``refuse``, ``dispatch``), in order."""

        def __init__(self, rank, num_ranks, num_nvl_bytes, timeout_s, **kwargs):
            if not 1 <= num_ranks <= ext.MAX_RUNTIME_RANKS:
                raise ValueError(f"num_ranks must be in [1, {ext.MAX_RUNTIME_RANKS}] for the CUDA runtime, got "
                                 f"{num_ranks}")
            self.rank, self.num_ranks, self.num_nvl_bytes = rank, num_ranks, num_nvl_bytes
            self.num_recv = 0
            self.per_expert = []
            self.pool_blocks = {}  # offset -> weak references to the tensors viewing the block
            self.record = None  # the error record
            self.signatures = [0] * (32 * num_ranks)  # every rank's signature of the last notify
            self.launches = []

        def get_local_device_id(self):
            return 0

        # The symmetric runtime (SymmetricCuda and its subclasses) with the checks of csrc/buffer.cpp:
        # sync_symmetric reports the ranks in ``unreachable`` (a probe sets it); set_put_peers takes put peers in
        # any group of the runtime (a bit of the mask per rank) and refuses what the extension refuses.
        unreachable = ()
        put_mask = 0

        def sync_symmetric(self, unique_id):
            return [r for r in self.unreachable if r != self.rank]

        def set_put_peers(self, ranks, put_area):
            mask = 0
            for r in ranks:
                if not 0 <= r < self.num_ranks or r == self.rank:
                    raise ValueError(f"put peers must be other ranks in [0, {self.num_ranks}), got {r} (this rank "
                                     f"is {self.rank})")
                mask |= 1 << r
            for r in self.unreachable:
                if r != self.rank and not (mask >> r) & 1:
                    raise ValueError(f"rank {r} is not reachable by nvshmem_ptr from rank {self.rank}: it must be a "
                                     "put peer")
            if mask and not put_area:
                raise ValueError(f"put peers (rank {self.rank}: mask {mask:#x}) need the put area")
            self.put_mask = mask
            if put_area:
                from deep_ep.layout import put_region_bytes
                self.ring_bytes = put_region_bytes(self.num_nvl_bytes, put_area)

        ring_bytes = None  # the kernels' region when a put area follows it

        def get_ring_bytes(self):
            return self.num_nvl_bytes if self.ring_bytes is None else self.ring_bytes

        def get_put_mask(self):
            return self.put_mask

        def get_local_ipc_handle(self):
            return b"\0" * 64

        def sync(self, device_ids, handles):
            pass


        # The output pool of direct-to-output dispatch. A block comes back once every tensor made on it is gone (the
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

        def get_dispatch_layout(self, topk_idx, num_experts, *streams):
            return (torch.empty(self.num_ranks, dtype=torch.int32), torch.empty(num_experts, dtype=torch.int32),
                    torch.empty(topk_idx.size(0), self.num_ranks, dtype=torch.bool))

        def notify_dispatch(self, *args):
            worst, words, check = args[6], args[12], args[13]
            self.launches.append("notify")
            self._exchange(words, check, worst)

        def refuse_notify(self, words, stream):
            self.launches.append("refuse")
            self._exchange(words, False, True)

        def _exchange(self, words, check, worst):
            """The notify slots' signatures: gathered, compared when ``check``; in worst-token mode a difference
            fills the record (the dispatch kernel then moves nothing)."""
            if not words:
                return
            rows = gather(list(words))
            self.signatures = [w for row in rows for w in row]
            differ = [s for s, row in enumerate(rows) if row != list(words)]
            if check and worst and differ and self.record is None:
                self.record = dict(code="argument_mismatch", phase="notify agreement", rank=self.rank,
                                   peer=differ[0],
                                   message=f"notify agreement: rank {self.rank} peer {differ[0]} (fake)")

        def await_agreement(self):
            self.pending_verdict = False
            self.launches.append("await")

        def gathered_signatures(self):
            return list(self.signatures)

        def wait_recv_counts(self, num_local_experts):
            return self.num_recv, self.per_expert

        def pair_counts(self):
            return [self.num_recv] * (self.num_ranks * self.num_ranks)

        def _compare_hashes(self, signature_hash, op):
            """Every rank's kernel compares every peer's hash with its own; the first difference is recorded and the
            verdict awaits the host's next call."""
            hashes = gather(signature_hash)
            differ = [s for s, h in enumerate(hashes) if h != signature_hash]
            if differ and self.record is None:
                self.record = dict(code="argument_mismatch", phase=f"{op} agreement", rank=self.rank, peer=differ[0],
                                   message=f"{op} agreement: rank {self.rank} peer {differ[0]} expected "
                                           f"{signature_hash} observed {hashes[differ[0]]} (fake)")
            self.pending_verdict = True

        def dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, is_token_in_rank, rank_prefix_matrix,
                     channel_prefix_matrix, recv_channel_prefix_matrix, send_head, rows, recv_src_idx, data_offset,
                     meta_offset, *rest):
            self.launches.append("dispatch")
            signature_hash = rest[-1]
            if signature_hash:  # a cached call: every rank's kernel compares the hashes in the output words
                assert recv_src_idx is not None, "signature_hash is for cached calls"
                self._compare_hashes(signature_hash, "dispatch")
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
            self.launches.append("combine")
            signature_hash = rest[12]
            if signature_hash:  # every rank's kernel compares the hashes in the agreement words
                self._compare_hashes(signature_hash, "combine")
            weights = None if topk_weights is None else torch.empty(send_head.size(0), topk_weights.size(1))
            return torch.empty(send_head.size(0), x.size(1), dtype=x.dtype), weights

        # The fused internode kernels (csrc/fused_internode.cpp): the notify exchanges the signatures as the ring
        # notify does (it never runs in worst-token mode), the dispatch allocates its outputs, a cached dispatch and
        # the combine compare the hashes in their agreement words. ``num_forward``: the rows the fake notify reports
        # as forwarded.
        num_forward = 0

        def fused_notify(self, *args):
            words, check = args[-2], args[-1]
            self.launches.append("notify")
            self._exchange(words, check, args[8])

        def fused_refuse_notify(self, words, gpus_per_node, stream):
            self.launches.append("refuse")
            self._exchange(words, False, True)

        def forward_count(self):
            return self.num_forward

        def fused_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, is_token_in_rank, gpus_per_node,
                           *rest):
            self.launches.append("dispatch")
            rows, signature_hash = rest[7], rest[-1]
            if signature_hash:  # a cached call: every rank's kernel compares the hashes in the agreement words
                assert rest[4] is None, "signature_hash is for cached calls"
                self._compare_hashes(signature_hash, "dispatch")
            scales = None if x_scales is None else torch.empty(rows, x_scales.size(1), dtype=x_scales.dtype)
            recv_topk_idx = recv_topk_weights = None
            if topk_idx is not None:
                recv_topk_idx = torch.empty(rows, topk_idx.size(1), dtype=topk_idx.dtype)
                recv_topk_weights = torch.empty(rows, topk_idx.size(1))
            return torch.empty(rows, x.size(1), dtype=x.dtype), scales, recv_topk_idx, recv_topk_weights

        def fused_combine(self, x, topk_weights, bias_0, bias_1, gpus_per_node, recv_rdma_cpm, recv_rdma_rps,
                          recv_gbl_cpm, recv_gbl_rps, send_rdma_head, *rest):
            self.launches.append("combine")
            signature_hash = rest[-1]
            if signature_hash:  # every rank's kernel compares the hashes in the agreement words
                self._compare_hashes(signature_hash, "combine")
            rows = send_rdma_head.size(0)
            weights = None if topk_weights is None else torch.empty(rows, topk_weights.size(1))
            return torch.empty(rows, x.size(1), dtype=x.dtype), weights

    world = {}  # "pe": (rank, num_ranks) once a runtime joined, as the real once-per-process bootstrap keeps it

    class LowLatencyRuntime(_ErrorRecord):
        """The low-latency runtime: ``dispatch`` / ``combine`` return the outputs they are given (the receive launch
        of a hook) or allocate them. Construction joins the process's NVSHMEM world (``ll_world``); a runtime of
        another world raises ValueError, as the real bootstrap does. A send launch exchanges its hash and buffer
        half: ranks on different halves get a timeout record (each waits for count words on its own half). In a
        combine only the ranks with tokens receive rows and see another rank's hash; a rank without tokens is
        told (``told``): its next launch does nothing but record that, and returns its outputs."""

        def __init__(self, rank, num_ranks, num_rdma_bytes, timeout_s, enable_shrink, unique_id, put_only=False):
            if world.setdefault("pe", (rank, num_ranks)) != (rank, num_ranks):
                raise ValueError(f"NVSHMEM is already initialised in this process as PE {world['pe'][0]} of "
                                 f"{world['pe'][1]}; a low-latency Buffer for rank {rank} of {num_ranks} cannot "
                                 "join another world")
            self.rank, self.num_ranks = rank, num_ranks
            self.record = None
            self.told = None  # the record a rank without rows gets at its next launch (a peer told it)
            self.launches = []  # "dispatch (N tokens)" / "combine (N tokens)" / "refuse combine" per launch
            self.shrink_mask = [0] * num_ranks  # 1: masked (shrink mode)
            self.cleans = 0  # clean launches

        def required_bytes(self, num_max_tokens, hidden, num_experts):
            return 0

        def all_p2p(self):
            return True

        def num_blocks(self):
            return 132


        def clean(self, num_max_tokens, hidden, num_experts, stream):
            self.told = None  # the disagreement word is zeroed
            self.cleans += 1

        def update_mask(self, rank, mask, stream):
            self.shrink_mask[rank] = 1 if mask else 0

        def query_mask(self, out, stream):
            out.copy_(torch.tensor(self.shrink_mask, dtype=torch.int32))

        def clean_mask(self, stream):
            self.shrink_mask = [0] * self.num_ranks

        def combine_buffer(self, num_max_tokens, hidden, num_experts, half):
            return torch.empty(num_experts // self.num_ranks, self.num_ranks * num_max_tokens, hidden,
                               dtype=torch.bfloat16)

        def _launch(self, what):
            """A launch: raises while an error is pending; False when a peer's tell stops the kernel at its start
            (it records the tell and does nothing else)."""
            if self.record is not None:
                raise DeviceError("a low-latency kernel error is pending (read_error() has it)")
            self.launches.append(what)
            if self.told is None:
                return True
            self.record, self.told = self.told, None
            return False

        def dispatch(self, x, topk_idx, tokens, num_experts, recv_stats, wait_stats, use_fp8, round_scale, use_ue8m0,
                     half, phases, stream, current_after, outputs, signature_hash=0):
            if self._launch(f"dispatch ({x.size(0)} tokens)") and phases & 1 and self.num_ranks > 1:
                self._compare("low_latency_dispatch agreement", signature_hash, half)  # the count words' hash
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

        def _compare(self, phase, signature_hash, half, receives=True):
            """Every rank's (hash, half, whether it receives rows): the kernels' count or arrival words, and a
            combine's disagreement word (``half`` None: a refusal, which uses no half). Ranks on different halves
            time out; a rank that receives rows of another hash records it and tells the others, and a rank that
            receives none is told (its next launch records it)."""
            words = gather((signature_hash, half, receives))
            halves = {h for _, h, _ in words if h is not None}
            if len(halves) > 1 and self.record is None:
                peer = next(s for s, (_, h, _) in enumerate(words) if h not in (None, half))
                self.record = dict(code="timeout", phase="low_latency_dispatch wait counts", rank=self.rank,
                                   peer=peer, message=f"low_latency_dispatch wait counts: rank {self.rank} peer "
                                                      f"{peer} (buffer half {half} here, {1 - half} there; fake)")
                return
            seers = [s for s, (h, _, sees) in enumerate(words) if sees and any(o != h for o, _, _ in words)]
            differ = [s for s, (h, _, _) in enumerate(words) if h != signature_hash]
            if differ and receives and self.record is None:
                self.record = dict(code="argument_mismatch", phase=phase, rank=self.rank, peer=differ[0],
                                   message=f"{phase}: rank {self.rank} peer {differ[0]} expected {signature_hash} "
                                           f"observed {words[differ[0]][0]} (fake)")
            elif seers and not receives and self.record is None:
                phase = "low_latency_combine agreement (told by a peer)"
                self.told = dict(code="argument_mismatch", phase=phase, rank=self.rank, peer=seers[0],
                                 message=f"{phase}: rank {self.rank} peer {seers[0]} (fake)")

        def combine(self, x, topk_idx, topk_weights, src_info, layout_range, tokens, num_experts, use_logfmt,
                    zero_copy, out, wait_stats, half, phases, stream, current_after, signature_hash):
            num_tokens = topk_idx.size(0)
            if self._launch(f"combine ({num_tokens} tokens)") and phases & 1 and self.num_ranks > 1:
                # The arrival words carry the hash; a receiver of another hash tells every rank.
                self._compare("low_latency_combine agreement", signature_hash, half, num_tokens > 0)
            return out if out is not None else torch.empty(num_tokens, x.size(2), dtype=x.dtype)

        def refuse_combine(self, tokens, hidden, num_experts, signature_hash):
            if self._launch("refuse combine"):
                self._compare("low_latency_combine refused", signature_hash, None)

    ext.Runtime = Runtime
    ext.HAS_LOW_LATENCY, ext.LL_MAX_TOPK, ext.LL_MAX_TOKENS = True, 16, 1024
    ext.LowLatencyRuntime = LowLatencyRuntime
    ext.ll_unique_id = lambda: b"\0" * 128
    ext.ll_world = lambda: world.get("pe")
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


def scenario(torch, deep_ep, num_tokens: int, hidden: int, num_topk: int, num_experts: int):
    """Inputs of one rank: BF16 and FP8 x (all-one scales), top-k routing and weights."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    x_fp8 = (x.to(torch.float8_e4m3fn), torch.ones(num_tokens, hidden // 128, dtype=torch.float32))
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk_idx = scores.topk(num_topk, dim=1).indices.to(deep_ep.topk_idx_t)
    topk_weights = torch.rand(num_tokens, num_topk, generator=gen)
    return x, x_fp8, topk_idx, topk_weights
