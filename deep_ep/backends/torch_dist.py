"""Torch backend of ``deep_ep.Buffer``: real communication over any ``torch.distributed`` process group.

Works with gloo (CPU tensors) and NCCL (CUDA tensors, also GPUs without NVLink or NVSHMEM); the results are
bit-identical to ``reference``. Counts (tokens per destination, per-channel prefixes, per-expert counts) travel in
one ``all_gather`` of a small int64 vector per call, with the call's signature (:meth:`TorchBackend.agree`); token
rows travel point-to-point as byte records, each rank sending a peer exactly the rows it needs. Low-latency calls
use a real symmetric buffer of ``num_rdma_bytes`` laid out by :func:`deep_ep.layout.low_latency_layout`: each call
stages its messages in ``send_i``, receives into ``recv_i`` and flips the parity ``i``, so the zero-copy combine
buffer is a view of the next ``send_i``.

Every wait is bounded by ``DEEP_EP_TIMEOUT_S``; a timeout raises :class:`CommTimeoutError` naming this rank, the
peer, the phase and what was awaited. A timed-out gloo group is unusable afterwards (gloo closes the pair).
"""
from __future__ import annotations

import datetime
import functools
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from deep_ep import envs, numerics
from deep_ep import handle as hd
from deep_ep.backends.agreement import SIGNATURE_WORDS, Signature, check_agreement
from deep_ep.backends.base import (
    Backend,
    CombineRequest,
    DispatchRequest,
    LayoutRequest,
    LowLatencyCombineRequest,
    LowLatencyDispatchRequest,
)
from deep_ep.backends.common import ReceiveHook, StreamScope, as_bytes, check_worst_tokens, from_bytes, pad_rows
from deep_ep.backends.torch_kernels import copy_rows
from deep_ep.config import FP8_BLOCK, NUM_MAX_LOCAL_EXPERTS, Topology, align_up
from deep_ep.errors import CommError, CommTimeoutError, rank_name
from deep_ep.event import EventOverlap
from deep_ep.layout import low_latency_layout, low_latency_message_bytes
from deep_ep.results import (
    CombineResult,
    DispatchLayout,
    DispatchResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
)

# Point-to-point tags, one per kind of message, so that messages of different phases never match each other
# (gloo honours tags; NCCL matches in issue order, which the collective call sequence keeps consistent).
_TAG_DISPATCH = 11
_TAG_FORWARD_META = 12
_TAG_COMBINE = 13
_TAG_LL_COUNT = 21
_TAG_LL_DISPATCH = 22
_TAG_LL_COMBINE = 23
_TAG_SIGNATURE = 24
# Count words of a normal dispatch that ride in the agreement all-gather (the rest follows in a second one).
_AGREEMENT_PAYLOAD_WORDS = 224
# Tags are ``kind + _NUM_TAG_KINDS * (batch number mod _NUM_TAG_SEQUENCES)``.
_NUM_TAG_KINDS = 32
_NUM_TAG_SEQUENCES = 1 << 20


def _profiled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside a profiler range ``deep_ep::<name>``: the torch backend launches no kernel of its own, so
    this range is how a profile with CPU activity (and its trace) shows the operation; a hooked call shows two
    ranges, its send and its receive."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"deep_ep::{name}"):
            return fn(*args, **kwargs)

    return run


class _Pending:
    """Posted point-to-point operations of one phase; :meth:`wait` bounds every wait."""

    def __init__(self, comm: "_Comm", works: list, peers: list, phase: str, what: str) -> None:
        self.comm, self.works, self.peers, self.phase, self.what = comm, works, peers, phase, what
        self.wait_ns = [0] * comm.num_ranks  # time spent waiting on each peer's operations

    def wait(self) -> None:
        for work, (peer, direction) in zip(self.works, self.peers):
            start = time.perf_counter_ns()
            self.comm.wait_work(work, self.phase, f"{direction} of {self.what}", peer)
            self.wait_ns[peer] += time.perf_counter_ns() - start
        self.works = []


class _Comm:
    """Bounded collective and point-to-point helpers over one process group (ranks are group ranks)."""

    # Shrink mode (Buffer(enable_shrink=True)): errors name the rank to mask.
    shrink = False

    def __init__(self, group: Any, rank: int, num_ranks: int) -> None:
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(num_ranks)]
        self.is_nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.is_nccl else torch.device("cpu")
        # Every rank posts the same sequence of batches; numbering them in the tag keeps a message of one call from
        # ever matching a receive of another call (e.g. while a receive hook is still outstanding).
        self.num_posts = 0
        # Errors name group rank r as rank_names[r] (the Buffer's rank, when this group is a stage of the composed
        # path), with rank_scope naming the group (TorchBackend.set_rank_names).
        self.rank_names: Optional[list[int]] = None
        self.rank_scope = ""

    def _ranks_text(self, peer: Optional[int]) -> tuple[str, str]:
        """``(this rank, the peer or 'all ranks')`` as errors name them, with the group's own numbers in brackets
        after the peer when the group is a subgroup."""
        names = self.rank_names
        if peer is None:
            scope = f" ({self.rank_scope} rank {self.rank})" if names else ""
            return f"{rank_name(names, self.rank)}{scope}", "all ranks"
        scope = f" ({self.rank_scope} ranks {self.rank} / {peer})" if names else ""
        return rank_name(names, self.rank), f"peer {rank_name(names, peer)}{scope}"

    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=envs.TIMEOUT_S.get())

    def _buffer_rank(self, rank: int) -> int:
        """Group rank ``rank`` in the Buffer's numbers (``rank_names`` for a stage's subgroup)."""
        return self.rank_names[rank] if self.rank_names else rank

    def failure(self, exc: BaseException, phase: str, what: str, peer: Optional[int]) -> CommError:
        """The ``CommError`` (``CommTimeoutError`` for a timeout) for ``exc`` raised by ``torch.distributed`` while
        this rank posted or awaited ``what`` of ``peer`` (``None``: a collective) in ``phase``. In shrink mode the
        message names the rank to mask."""
        text = str(exc)
        me, who = self._ranks_text(peer)
        peer_rank = None if peer is None else self._buffer_rank(peer)
        hint = ""
        if self.shrink and peer_rank is not None and peer != self.rank:
            hint = f"; to go on without it, mask rank {peer_rank} (low_latency_update_mask_buffer({peer_rank}, True))"
        if "timed out" in text.lower() or "timeout" in text.lower():
            error: CommError = CommTimeoutError(
                f"deep_ep torch backend: rank {me} timed out after {envs.TIMEOUT_S.get()} s (DEEP_EP_TIMEOUT_S) in "
                f"phase '{phase}' waiting for {what} from {who}{hint}: {text}")
        else:
            error = CommError(f"deep_ep torch backend: rank {me} failed in phase '{phase}' on {what} with {who}"
                              f"{hint}: {text}")
        return error.with_origin(self._buffer_rank(self.rank), peer_rank, phase)

    def wait_work(self, work: Any, phase: str, what: str, peer: Optional[int]) -> None:
        """Wait for one ``torch.distributed`` work handle within ``DEEP_EP_TIMEOUT_S``."""
        try:
            work.wait(timeout=self.timeout())
        except RuntimeError as exc:
            raise self.failure(exc, phase, f"{what}", peer) from exc

    def all_gather(self, tensor: torch.Tensor, phase: str, what: str) -> torch.Tensor:
        """``[*]`` -> ``[R, *]``: every rank's ``tensor`` (same shape and dtype on all ranks)."""
        local = tensor.to(self.device).contiguous()
        out = [torch.empty_like(local) for _ in range(self.num_ranks)]
        try:
            work = dist.all_gather(out, local, group=self.group, async_op=True)
        except RuntimeError as exc:
            raise self.failure(exc, phase, f"posting the all-gather of {what}", None) from exc
        self.wait_work(work, phase, what, None)
        return torch.stack(out).to(tensor.device)

    def barrier(self, phase: str) -> None:
        token = torch.zeros(1, dtype=torch.int32, device=self.device)
        try:
            work = dist.all_reduce(token, group=self.group, async_op=True)
        except RuntimeError as exc:
            raise self.failure(exc, phase, "posting a barrier", None) from exc
        self.wait_work(work, phase, "a barrier", None)

    def post(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
             tag: int, phase: str, what: str) -> _Pending:
        """Post ``isend``/``irecv`` of contiguous comm-device tensors as one batch (peers are group ranks). NCCL
        posts them as one group; gloo one by one, so that a failure names its peer."""
        tag += _NUM_TAG_KINDS * (self.num_posts % _NUM_TAG_SEQUENCES)
        self.num_posts += 1
        items = [(dist.isend, peer, tensor, "send") for peer, tensor in sends]
        items += [(dist.irecv, peer, tensor, "receive") for peer, tensor in recvs]
        peers = [(peer, direction) for _, peer, _, direction in items]
        if not self.is_nccl:
            works = []
            for function, peer, tensor, direction in items:
                try:
                    works.append(function(tensor, self.global_ranks[peer], self.group, tag))
                except RuntimeError as exc:
                    raise self.failure(exc, phase, f"posting the {direction} of {what}", peer) from exc
            return _Pending(self, works, peers, phase, what)
        ops = [dist.P2POp(function, tensor, self.global_ranks[peer], self.group, tag)
               for function, peer, tensor, _ in items]
        if not ops:
            return _Pending(self, [], [], phase, what)
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            first = peers[0][0] if len({p for p, _ in peers}) == 1 else None
            raise self.failure(exc, phase, f"posting the sends and receives of {what}", first) from exc
        if len(works) != len(ops):  # some torch versions return one coalesced work for the whole batch
            peers = [(self.rank if not peers else peers[0][0], "batch")] * len(works)
        return _Pending(self, list(works), peers, phase, what)


class TorchBackend(Backend):
    """One rank's torch.distributed implementation of every ``Buffer`` communication method.

    Args:
        group: the process group (gloo for CPU tensors, NCCL for CUDA tensors).
        rank / num_ranks: this rank and the group size.
        topology: node structure (decides intranode vs internode handles).
        num_nvl_bytes / num_rdma_bytes: sizes of the local buffers (``get_local_buffer_tensor``; the RDMA buffer
            is the low-latency symmetric buffer).
        enable_shrink: keep a per-rank mask; low-latency calls skip masked ranks.
    """

    needs_host_checks = True

    def __init__(self, group: Any, rank: int, num_ranks: int, topology: Topology, num_nvl_bytes: int,
                 num_rdma_bytes: int, enable_shrink: bool) -> None:
        self.comm = _Comm(group, rank, num_ranks)
        self.rank, self.num_ranks, self.topology = rank, num_ranks, topology
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.device = self.comm.device
        self.comm_stream = torch.cuda.Stream(priority=-1) if self.device.type == "cuda" else None
        self._nvl_buffer: Optional[torch.Tensor] = None
        self._rdma_buffer: Optional[torch.Tensor] = None
        self.ll_parity = 0
        self.mask = torch.zeros(num_ranks, dtype=torch.int32, device="cpu") if enable_shrink else None
        self.comm.shrink = enable_shrink

    def agree(self, signature: Signature, phase: str, low_latency: bool = False, payload: Any = None,
              ranks: Optional[Sequence[int]] = None) -> Any:
        """Exchange ``signature`` with every rank of the call and check that they agree (``check_agreement``),
        before any row moves; ``payload`` rides in the same exchange and every rank's comes back.

        Normal mode: one all-gather of ``SIGNATURE_WORDS + _AGREEMENT_PAYLOAD_WORDS`` int64 words, whatever the
        call (so that ranks making different calls exchange equal sizes); ``payload`` is an ``[n]`` int64 vector
        (``n`` follows from the agreed arguments) and comes back as ``[R, n]``, its words beyond the fixed part in
        a second all-gather. Low-latency mode: point-to-point with the active ranks (shrink mode skips masked
        ranks; a timeout names the peer), or with ``ranks`` (those another backend's mask leaves active, this
        rank included), receives sized for the largest message; ``payload`` maps each other active rank to its
        ``[n]`` int64 vector and ``{source: [n] int64}`` comes back."""
        words = signature.words()
        if not low_latency:
            count = 0 if payload is None else payload.numel()
            head = torch.zeros(SIGNATURE_WORDS + _AGREEMENT_PAYLOAD_WORDS, dtype=torch.int64, device="cpu")
            head[:SIGNATURE_WORDS] = words
            riding = min(count, _AGREEMENT_PAYLOAD_WORDS)
            if riding:
                head[SIGNATURE_WORDS:SIGNATURE_WORDS + riding] = payload[:riding]
            gathered = self.comm.all_gather(head, phase, "the call signatures and counts")
            check_agreement(signature, gathered[:, :SIGNATURE_WORDS], list(range(self.num_ranks)), self.rank)
            if payload is None:
                return None
            rows = gathered[:, SIGNATURE_WORDS:SIGNATURE_WORDS + riding]
            if count > riding:
                rest = self.comm.all_gather(payload[riding:].contiguous(), phase, "per-rank token counts")
                rows = torch.cat([rows, rest.to(torch.int64)], dim=1)
            return rows
        return self._agree_peers(signature, phase, payload, ranks)[0]

    def _agree_peers(self, signature: Signature, phase: str, payload: Any,
                     ranks: Optional[Sequence[int]] = None) -> tuple[Any, _Pending]:
        """:meth:`agree` of low-latency mode; also returns the exchange's ``_Pending`` (its wait times)."""
        words = signature.words()
        ranks = list(ranks) if ranks is not None else self._active_peers()
        capacity = SIGNATURE_WORDS + NUM_MAX_LOCAL_EXPERTS
        bufs = {s: torch.empty(capacity, dtype=torch.int64, device=self.device) for s in ranks if s != self.rank}
        sends = [(d, torch.cat([words, payload[d]]).to(self.device) if payload is not None else words.to(self.device))
                 for d in bufs]
        pending = self.comm.post(sends, list(bufs.items()), _TAG_SIGNATURE, phase, "the call signatures")
        pending.wait()
        received = {s: buf.cpu() for s, buf in bufs.items()}
        gathered = torch.stack([words if s == self.rank else received[s][:SIGNATURE_WORDS] for s in ranks])
        check_agreement(signature, gathered, ranks, self.rank)
        if payload is None:
            return None, pending
        count = max((p.numel() for p in payload.values()), default=0)  # the same for every peer once agreed
        return {s: row[SIGNATURE_WORDS:SIGNATURE_WORDS + count] for s, row in received.items()}, pending

    def set_rank_names(self, names: Sequence[int], scope: str) -> None:
        """Report ranks in errors as ``names[r]`` instead of this group's ``r``; ``scope`` names the group (the
        composed path's stages: the Buffer's ranks)."""
        self.comm.rank_names, self.comm.rank_scope = [int(r) for r in names], scope

    # ------------------------------------------------------------------------------------------------------------
    # Buffers
    # ------------------------------------------------------------------------------------------------------------
    def nvl_buffer(self) -> torch.Tensor:
        """``[num_nvl_bytes]`` uint8, allocated on first use (uninitialised, as DeepEP's)."""
        if self._nvl_buffer is None:
            self._nvl_buffer = torch.empty(self.num_nvl_bytes, dtype=torch.uint8, device=self.device)
        return self._nvl_buffer

    def rdma_buffer(self) -> torch.Tensor:
        """``[num_rdma_bytes]`` uint8 symmetric low-latency buffer, zeroed, allocated on first use."""
        if self._rdma_buffer is None:
            self._rdma_buffer = torch.zeros(self.num_rdma_bytes, dtype=torch.uint8, device=self.device)
        return self._rdma_buffer

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        return self.comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        raw = self.rdma_buffer() if use_rdma_buffer else self.nvl_buffer()
        itemsize = torch.empty(0, dtype=dtype, device="cpu").element_size()
        # DeepEP's length ignores the offset (it could read past the end); a real view must stay inside.
        count = (raw.numel() - offset) // itemsize
        view = raw[offset:offset + count * itemsize].view(dtype)
        if size is None:
            return view
        return view[:size.numel()].view(size)

    def destroy(self) -> None:
        self._nvl_buffer = None
        self._rdma_buffer = None

    # ------------------------------------------------------------------------------------------------------------
    # Normal mode
    # ------------------------------------------------------------------------------------------------------------
    def get_dispatch_layout(self, request: LayoutRequest) -> DispatchLayout:
        """Local computation from ``topk_idx [N, K]``; see ``Buffer.get_dispatch_layout``."""
        with StreamScope(self.comm_stream, request.previous_event, request.async_finish,
                         request.allocate_on_comm_stream) as scope:
            layout = hd.layout_from_topk(request.topk_idx, request.num_experts, self.topology)
        return DispatchLayout(*layout, scope.finish([request.topk_idx, *layout]))

    def _recv_counts_from_handle(self, handle: Any) -> torch.Tensor:
        """``[R]`` int64 rows this rank received from each source in the dispatch that made ``handle``."""
        if isinstance(handle, hd.IntranodeHandle):
            prefix = handle.rank_prefix_matrix[:, self.rank].to(torch.int64).cpu()
        else:
            prefix = handle.recv_gbl_rank_prefix_sum.to(torch.int64).cpu()
        return torch.diff(prefix, prepend=torch.zeros(1, dtype=torch.int64, device="cpu"))

    def _exchange_rows(self, send_rows: list[torch.Tensor], recv_counts: Sequence[int], row_bytes: int, tag: int,
                       phase: str, what: str, device: torch.device) -> list[torch.Tensor]:
        """Send ``send_rows[d]`` (``[n_d, row_bytes]`` uint8 on ``device``) to every ``d`` and receive
        ``[recv_counts[s], row_bytes]`` from every ``s``. Returns the blocks by source, on ``device``: the own block
        never leaves it. When the group's device is the host and ``device`` a GPU (gloo), rows cross through
        page-locked staging, so that both copies run at the bus's speed."""
        staged = device.type == "cuda" and self.device.type == "cpu"

        def to_comm(rows: torch.Tensor) -> torch.Tensor:
            if not staged:
                return rows.to(self.device).contiguous()
            return torch.empty(rows.shape, dtype=rows.dtype, device="cpu", pin_memory=True).copy_(rows)

        recv = [torch.empty(int(n), row_bytes, dtype=torch.uint8, device=self.device, pin_memory=staged)
                if s != self.rank else send_rows[s] for s, n in enumerate(recv_counts)]
        sends = [(d, to_comm(rows)) for d, rows in enumerate(send_rows) if d != self.rank and rows.size(0) > 0]
        recvs = [(s, buf) for s, buf in enumerate(recv) if s != self.rank and buf.size(0) > 0]
        pending = self.comm.post(sends, recvs, tag, phase, what)
        pending.wait()
        return [buf.to(device, non_blocking=staged) for buf in recv]

    @functools.partial(_profiled, "dispatch")
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """Normal dispatch; see ``Buffer.dispatch`` for shapes. Routing comes only from ``is_token_in_rank``."""
        with StreamScope(self.comm_stream, request.previous_event, request.async_finish,
                         request.allocate_on_comm_stream) as scope:
            if request.handle is not None:
                result = self._cached_dispatch(request)
            else:
                result = self._dispatch(request)
        recv_x = result[0]
        flat = [*recv_x] if isinstance(recv_x, tuple) else [recv_x]
        event = scope.finish([*flat, *result[1:3], *request.payload()])
        return DispatchResult(*result, event)

    def _cached_dispatch(self, request: DispatchRequest) -> tuple:
        data, scales = request.payload()
        handle = request.handle
        mask = handle.is_token_in_rank
        parts = [as_bytes(data)]
        if scales is not None:
            parts.append(as_bytes(scales.contiguous()))
        record = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        send_rows = [record[mask[:, d]] for d in range(self.num_ranks)]
        recv_counts = self._recv_counts_from_handle(handle).tolist()
        blocks = self._exchange_rows(send_rows, recv_counts, record.size(1), _TAG_DISPATCH, "cached dispatch",
                                     "token rows", data.device)
        rows = torch.cat(blocks, dim=0)
        hidden_bytes = data.size(1) * data.element_size()
        recv_data = from_bytes(rows[:, :hidden_bytes], data.dtype, data.size(1))
        if scales is None:
            return recv_data, None, None, None, None
        recv_scales = from_bytes(rows[:, hidden_bytes:], scales.dtype, scales.size(1))
        return (recv_data, recv_scales), None, None, None, None

    def _dispatch(self, request: DispatchRequest) -> tuple:
        data, scales = request.payload()
        is_token_in_rank, num_tokens_per_expert = request.is_token_in_rank, request.num_tokens_per_expert
        topk_idx, topk_weights = request.topk_idx, request.topk_weights
        expert_alignment, num_worst_tokens = request.expert_alignment, request.num_worst_tokens
        num_ranks, rank, topo = self.num_ranks, self.rank, self.topology
        num_tokens, hidden = data.shape
        num_channels = self.num_channels(request.config)
        num_experts = num_tokens_per_expert.numel()
        num_local_experts = num_experts // num_ranks
        internode = topo.is_internode
        mask = is_token_in_rank.to(torch.bool)

        # Sender-side handle fields and the counts every receiver needs.
        if internode:
            sender = hd.internode_sender(mask, num_channels, topo)
            chan_prefix = sender.gbl_channel_prefix_matrix
            extra = sender.rdma_channel_prefix_matrix.flatten()
        else:
            sender = hd.intranode_sender(mask, num_channels)
            chan_prefix = sender.channel_prefix_matrix
            extra = torch.zeros(0, dtype=torch.int32, device=mask.device)
        send_counts = mask.sum(0)
        info = torch.cat([send_counts.to(torch.int64), chan_prefix.flatten().to(torch.int64),
                          num_tokens_per_expert.to(torch.int64), extra.to(torch.int64),
                          torch.tensor([num_tokens], dtype=torch.int64, device=mask.device)])
        if request.signature is not None:
            gathered = self.agree(request.signature, "dispatch notify", payload=info.cpu())
        else:
            gathered = self.comm.all_gather(info.cpu(), "dispatch notify", "per-rank token counts").to(torch.int64)
        offsets = [0, num_ranks, num_ranks * num_channels, num_experts, extra.numel(), 1]
        begin = [sum(offsets[:i + 1]) for i in range(len(offsets))]
        count_matrix = gathered[:, begin[0]:begin[1]]                                     # [src, dst]
        src_chan_prefix = gathered[:, begin[1]:begin[2]].view(num_ranks, num_ranks, num_channels)[:, rank]
        expert_counts = gathered[:, begin[2]:begin[3]]                                    # [src, E]
        recv_counts = count_matrix[:, rank]
        num_recv = int(recv_counts.sum())
        per_expert = expert_counts[:, rank * num_local_experts:(rank + 1) * num_local_experts].sum(0)
        if num_worst_tokens > 0:
            num_recv_list: list = []
        else:
            num_recv_list = [align_up(int(c), expert_alignment) for c in per_expert.tolist()]

        # Per-row records: payload | scales | top-k ids | top-k weights | source token index | local-rank mask.
        parts = [as_bytes(data)]
        if scales is not None:
            parts.append(as_bytes(scales.contiguous()))
        if topk_idx is not None:
            parts += [as_bytes(topk_idx), as_bytes(topk_weights)]
        parts.append(as_bytes(torch.arange(num_tokens, dtype=torch.int32, device=data.device)))
        if internode:
            parts.append(as_bytes(mask.to(torch.uint8)))
        widths = [p.size(1) for p in parts]
        record = torch.cat(parts, dim=1)
        send_rows = [record.index_select(0, mask[:, d].nonzero().squeeze(1)) for d in range(num_ranks)]
        blocks = self._exchange_rows(send_rows, recv_counts.tolist(), record.size(1), _TAG_DISPATCH, "dispatch",
                                     "token rows", data.device)
        rows = torch.cat(blocks, dim=0)
        cols = iter(torch.split(rows, widths, dim=1))  # the record's parts, in the order above
        recv_data = from_bytes(next(cols), data.dtype, hidden)
        recv_scales = from_bytes(next(cols), scales.dtype, scales.size(1)) if scales is not None else None
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            num_topk = topk_idx.size(1)
            global_idx = from_bytes(next(cols), topk_idx.dtype, num_topk)
            weights = from_bytes(next(cols), torch.float32, num_topk)
            recv_topk_idx, recv_topk_weights = hd.local_topk(global_idx, weights, rank, num_local_experts)
        recv_src_idx = from_bytes(next(cols), torch.int32, 1).view(-1)

        if num_worst_tokens > 0:
            check_worst_tokens(num_worst_tokens, num_recv, rank)
            recv_data, recv_scales = pad_rows(recv_data, num_worst_tokens), pad_rows(recv_scales, num_worst_tokens)
            recv_topk_idx = pad_rows(recv_topk_idx, num_worst_tokens, -1)
            recv_topk_weights = pad_rows(recv_topk_weights, num_worst_tokens)
            recv_src_idx = pad_rows(recv_src_idx, num_worst_tokens)

        dev = data.device
        if internode:
            new_handle = self._internode_handle(mask, sender, gathered, begin, recv_counts, src_chan_prefix,
                                                next(cols), num_channels, recv_src_idx, num_recv)
        else:
            new_handle = hd.IntranodeHandle(
                hd.rank_prefix_matrix(count_matrix).to(dev), sender.channel_prefix_matrix,
                hd.recv_channel_prefix_matrix(src_chan_prefix).to(dev), recv_src_idx, is_token_in_rank,
                sender.send_head)
        recv_x = (recv_data, recv_scales) if scales is not None else recv_data
        return recv_x, recv_topk_idx, recv_topk_weights, num_recv_list, new_handle

    def _internode_handle(self, mask: torch.Tensor, sender: hd.InternodeSender, gathered: torch.Tensor,
                          begin: list[int], recv_counts: torch.Tensor, src_chan_prefix: torch.Tensor,
                          recv_mask_bytes: torch.Tensor, num_channels: int,
                          recv_src_idx: torch.Tensor, num_recv: int) -> hd.InternodeHandle:
        """Receiver-side internode fields; the forwarder fields need one extra metadata exchange.

        As forwarder, this rank ``(my_node, my_local)`` is responsible for every token of a rank
        ``(n, my_local)`` that needs ``my_node``; that rank sends the token's index and its local-rank mask for
        ``my_node`` (the data itself travels directly to the final receivers). ``recv_mask_bytes`` is the
        ``[num_recv, R]`` uint8 part of the received records: each row's ``is_token_in_rank`` on its source.
        """
        topo, rank, dev = self.topology, self.rank, mask.device
        num_nodes, per_node = topo.num_scaleout_ranks, topo.num_scaleup_ranks
        my_node, my_local = topo.node_of(rank), topo.local_of(rank)
        num_tokens = mask.size(0)
        rdma_prefix = gathered[:, begin[3]:begin[4]].view(self.num_ranks, num_nodes, num_channels)
        peers = [n * per_node + my_local for n in range(num_nodes)]
        src_rdma_prefix = torch.stack([rdma_prefix[p, my_node] for p in peers])            # [R_so, C]
        recv_rdma_prefix = hd.recv_rdma_channel_prefix_matrix(src_rdma_prefix)
        recv_rdma_rank_prefix = hd.recv_rdma_rank_prefix_sum(src_rdma_prefix)
        recv_gbl_rank_prefix = hd.recv_gbl_rank_prefix_sum(recv_counts)
        recv_gbl_chan_prefix = hd.recv_gbl_channel_prefix_matrix(src_chan_prefix, recv_gbl_rank_prefix)

        # recv_src_meta: source node and this node's local-rank mask of every received row.
        source_of_row = torch.repeat_interleave(torch.arange(self.num_ranks, device=recv_counts.device), recv_counts)
        local_masks = from_bytes(recv_mask_bytes, torch.uint8, num_nodes * per_node)
        local_masks = local_masks.view(num_recv, num_nodes, per_node)[:, my_node].to(torch.bool)
        src_meta = hd.encode_src_meta((source_of_row // per_node).to(dev), local_masks[:num_recv])
        if recv_src_idx.size(0) > num_recv:  # worst-token padding rows carry no meta
            src_meta = torch.cat([src_meta, torch.zeros(recv_src_idx.size(0) - num_recv, 8, dtype=torch.uint8,
                                                        device=src_meta.device)])

        # Forwarder bookkeeping: tokens of (n, my_local) that need my node, with their local masks.
        nodes_needed = hd.node_mask(mask, topo)
        token_ids = torch.arange(num_tokens, dtype=torch.int32, device=dev)
        meta_record = torch.cat([token_ids.view(-1, 1),
                                 hd.pack_rank_bits(mask.view(num_tokens, num_nodes, per_node))], dim=1)
        # meta_record[t] = [t, bits of node 0, bits of node 1, ...]; send column (1 + n) rows to (n, my_local).
        forward_counts = [int(v) for v in src_rdma_prefix[:, -1].tolist()] if num_channels else [0] * num_nodes
        send = [torch.empty(0, 8, dtype=torch.uint8, device=dev) for _ in range(self.num_ranks)]
        for n in range(num_nodes):
            sel = nodes_needed[:, n]
            send[n * per_node + my_local] = as_bytes(meta_record[sel][:, [0, 1 + n]].contiguous())
        recv_counts_meta = [0] * self.num_ranks
        for n, p in enumerate(peers):
            recv_counts_meta[p] = forward_counts[n]
        blocks = self._exchange_rows(send, recv_counts_meta, 8, _TAG_FORWARD_META, "dispatch forward meta",
                                     "forwarded-token metadata", dev)
        src_node, channel, fwd_mask = [], [], []
        gathered_num_tokens = gathered[:, begin[4]]
        for n, p in enumerate(peers):
            meta = from_bytes(blocks[p], torch.int32, 2)
            src_node.append(torch.full((meta.size(0),), n, dtype=torch.int64, device=dev))
            channels_of_source = hd.token_channels(int(gathered_num_tokens[p]), num_channels, dev)
            channel.append(channels_of_source[meta[:, 0].to(torch.int64)])
            fwd_mask.append(hd.unpack_rank_bits(meta[:, 1], per_node))
        send_nvl_head = hd.forwarder_send_nvl_head(torch.cat(src_node), torch.cat(channel), torch.cat(fwd_mask))
        return hd.InternodeHandle(mask, sender.rdma_channel_prefix_matrix, sender.gbl_channel_prefix_matrix,
                                  recv_rdma_prefix.to(dev), recv_rdma_rank_prefix.to(dev),
                                  recv_gbl_chan_prefix.to(dev), recv_gbl_rank_prefix.to(dev), src_meta,
                                  sender.send_rdma_head, send_nvl_head)

    @functools.partial(_profiled, "combine")
    def combine(self, request: CombineRequest) -> CombineResult:
        """Normal combine: per original token, the float32 sum of its holders' rows (plus biases), in BF16."""
        with StreamScope(self.comm_stream, request.previous_event, request.async_finish,
                         request.allocate_on_comm_stream) as scope:
            combined_x, combined_w = self._combine(request.x, request.handle, request.topk_weights, request.bias)
        event = scope.finish([request.x, request.topk_weights, combined_x, combined_w])
        return CombineResult(combined_x, combined_w, event)

    def _combine(self, x: torch.Tensor, handle: Any, topk_weights: Optional[torch.Tensor],
                 biases: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        mask = handle.is_token_in_rank.to(torch.bool)
        num_tokens, hidden = mask.size(0), x.size(1)
        recv_counts = self._recv_counts_from_handle(handle)
        starts = torch.cumsum(recv_counts, 0) - recv_counts
        parts = [as_bytes(x)]
        if topk_weights is not None:
            parts.append(as_bytes(topk_weights))
        record = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        send_rows = [record[int(starts[s]):int(starts[s] + recv_counts[s])] for s in range(self.num_ranks)]
        back_counts = mask.sum(0).tolist()
        blocks = self._exchange_rows(send_rows, back_counts, record.size(1), _TAG_COMBINE, "combine",
                                     "expert output rows", x.device)
        hidden_bytes = hidden * x.element_size()
        ys = [from_bytes(b[:, :hidden_bytes], x.dtype, hidden) for b in blocks]
        ws = None
        if topk_weights is not None:
            ws = [from_bytes(b[:, hidden_bytes:], torch.float32, topk_weights.size(1)) for b in blocks]
        return reduce_combine(mask, ys, ws, biases, self.topology, num_tokens, hidden, x.device)

    # ------------------------------------------------------------------------------------------------------------
    # Low-latency mode
    # ------------------------------------------------------------------------------------------------------------
    def _ll_regions(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Any:
        """The low-latency layout; ``Buffer._check_low_latency`` has already checked that it fits the buffer."""
        layout = low_latency_layout(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        assert layout.total_bytes <= self.num_rdma_bytes, "the Buffer front checks the low-latency buffer size"
        return layout

    def _region(self, layout: Any, name: str) -> torch.Tensor:
        region = layout[name]
        return self.rdma_buffer()[region.offset:region.end]

    def _active_peers(self) -> list[int]:
        if self.mask is None:
            return list(range(self.num_ranks))
        return [r for r in range(self.num_ranks) if int(self.mask[r]) == 0]

    def _combine_send_view(self, layout: Any, half: int, num_local_experts: int, tokens: int,
                           hidden: int) -> torch.Tensor:
        """BF16 ``[L, R*T, H]`` view of ``send_{half}`` with row stride ``H + H/64`` elements (a combine slot's
        LogFMT scale pairs come first)."""
        region = layout[f"send_{half}"]
        _, combine_msg = low_latency_message_bytes(hidden)
        slot = combine_msg // 2
        rows = self.num_ranks * tokens
        as_bf16 = self.rdma_buffer().view(torch.bfloat16)
        return as_bf16.as_strided((num_local_experts, rows, hidden), (rows * slot, slot, 1), region.offset // 2)

    def _combine_recv_view(self, layout: Any, half: int, num_experts: int, tokens: int,
                           hidden: int) -> torch.Tensor:
        """BF16 ``[E, T, H]`` view of the payloads in ``recv_{half}`` (row stride ``H + H/64`` elements, after
        each slot's LogFMT scale pairs)."""
        region = layout[f"recv_{half}"]
        _, combine_msg = low_latency_message_bytes(hidden)
        slot, header = combine_msg // 2, (combine_msg - 2 * hidden) // 2
        as_bf16 = self.rdma_buffer().view(torch.bfloat16)
        return as_bf16.as_strided((num_experts, tokens, hidden), (tokens * slot, slot, 1),
                                  region.offset // 2 + header)

    def get_next_low_latency_combine_buffer(self, handle: hd.LowLatencyHandle) -> torch.Tensor:
        tokens, hidden, num_experts = handle[2], handle[3], handle[4]
        layout = self._ll_regions(tokens, hidden, num_experts)
        return self._combine_send_view(layout, self.ll_parity, num_experts // self.num_ranks, tokens, hidden)

    def _flip(self, layout: Any) -> int:
        """Take the current half, clear the other half's signals for the next call, flip the parity."""
        half = self.ll_parity
        self._region(layout, f"signal_{1 - half}").zero_()
        self.ll_parity = 1 - half
        return half

    @functools.partial(_profiled, "dispatch")
    def low_latency_dispatch(self, request: LowLatencyDispatchRequest) -> LowLatencyDispatchResult:
        """Send every token once per valid top-k entry to the expert's owner; pack per local expert.

        Packed order (one valid order of the contract): per local expert, source ranks ascending, and within one
        source, tokens ascending then top-k slot ascending.
        """
        (x, topk_idx, tokens, num_experts, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
         use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook, signature) = request
        num_ranks, rank = self.num_ranks, self.rank
        num_tokens, hidden = x.shape
        num_local = num_experts // num_ranks
        layout = self._ll_regions(tokens, hidden, num_experts)
        dispatch_msg, _ = low_latency_message_bytes(hidden)
        num_scales = hidden // FP8_BLOCK
        scale_cols = num_scales // numerics.UE8M0_PER_INT32 if use_ue8m0 else num_scales
        scale_dtype = torch.int32 if use_ue8m0 else torch.float32
        # With a receive hook the send phase runs on the caller's stream.
        scope = StreamScope(None if return_recv_hook else self.comm_stream, None, async_finish)
        active = self._active_peers()
        device = x.device

        with scope:
            # Rows per (destination, local expert), ordered by (token, k).
            idx = topk_idx.to(torch.int64).cpu()
            flat = idx.flatten()
            token_of = torch.arange(num_tokens, device="cpu").repeat_interleave(idx.size(1))
            valid = flat >= 0
            flat, token_of = flat[valid], token_of[valid]
            send_counts = torch.bincount(flat, minlength=num_experts).view(num_ranks, num_local).to(torch.int32)

            # Counts first (so that every receiver can post its receives), then the rows; with a signature the
            # counts ride in the agreement exchange.
            recv_counts = torch.zeros(num_ranks, num_local, dtype=torch.int32, device="cpu")
            recv_counts[rank] = send_counts[rank]
            if signature is not None:
                counts = {d: send_counts[d].to(torch.int64) for d in active if d != rank}
                received, count_wait = self._agree_peers(signature, "low-latency dispatch", counts)
                count_bufs = {s: row.to(torch.int32) for s, row in received.items()}
            else:
                count_bufs = {s: torch.empty(num_local, dtype=torch.int32, device=self.device) for s in active
                              if s != rank}
                sends = [(d, send_counts[d].to(self.device)) for d in active if d != rank]
                count_wait = self.comm.post(sends, list(count_bufs.items()), _TAG_LL_COUNT, "low-latency dispatch",
                                            "per-expert token counts")
                count_wait.wait()

            half = self._flip(layout)
            # Stage one message per token in send_{half}: [int32 source token index | 12 B pad | payload].
            staging = self._region(layout, f"send_{half}")[:num_tokens * dispatch_msg].view(num_tokens, dispatch_msg)
            staging[:, :4] = as_bytes(torch.arange(num_tokens, dtype=torch.int32, device=self.device))
            if use_fp8:
                q, scales = numerics.per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
                staging[:, 16:16 + hidden] = as_bytes(q).to(self.device)
                staging[:, 16 + hidden:16 + hidden + scale_cols * 4] = as_bytes(scales).to(self.device)
            else:
                staging[:, 16:16 + 2 * hidden] = as_bytes(x).to(self.device)
            signal = self._region(layout, f"signal_{half}").view(torch.int32)[:num_experts].view(num_local, num_ranks)
            for s, buf in count_bufs.items():
                recv_counts[s] = buf.cpu()
            for s in active:
                signal[:, s] = -(recv_counts[s].to(self.device) + 1)

            # One message per destination: its rows are contiguous in expert order (local expert, then token
            # and top-k slot), which is also the order the receiver unpacks them in.
            order = torch.argsort(flat, stable=True)
            sorted_tokens = token_of[order]
            dest_totals = send_counts.sum(1).to(torch.int64)
            dest_start = torch.cumsum(dest_totals, 0) - dest_totals
            data_sends, own_rows = [], None
            for d in active:
                n = int(dest_totals[d])
                if n == 0:
                    continue
                start = int(dest_start[d])
                rows = staging[sorted_tokens[start:start + n].to(self.device)]
                if d == rank:
                    own_rows = rows
                else:
                    data_sends.append((d, rows))
            landing = {s: torch.empty(int(recv_counts[s].sum()), dispatch_msg, dtype=torch.uint8, device=self.device)
                       for s in active if s != rank and int(recv_counts[s].sum()) > 0}
            data_recvs = list(landing.items())
            data_wait = self.comm.post(data_sends, data_recvs, _TAG_LL_DISPATCH, "low-latency dispatch",
                                       "token messages")

            # Outputs (filled by the receive phase).
            rows_per_expert = num_ranks * tokens
            if use_fp8:
                recv_data = torch.empty(num_local, rows_per_expert, hidden, dtype=torch.float8_e4m3fn, device=device)
                recv_scales = torch.empty(num_local, scale_cols, rows_per_expert, dtype=scale_dtype,
                                          device=device).transpose(1, 2)
                recv_x: Any = (recv_data, recv_scales)
            else:
                recv_data = torch.empty(num_local, rows_per_expert, hidden, dtype=torch.bfloat16, device=device)
                recv_x = recv_data
            packed_recv_count = torch.zeros(num_local, dtype=torch.int32, device=device)
            src_info = torch.zeros(num_local, rows_per_expert, dtype=torch.int32, device=device)
            layout_range = torch.zeros(num_local, num_ranks, dtype=torch.int64, device=device)

        def receive() -> None:
            data_wait.wait()
            # Packed order per local expert: sources ascending, each source's rows in arrival order.
            counts = recv_counts.to(torch.int64)  # [R, L]
            begins = torch.cumsum(counts, 0) - counts
            pieces, dst_j, dst_row = [], [], []
            for s in active:
                rows = own_rows if s == rank else landing.get(s)
                if rows is None:
                    continue
                j = torch.repeat_interleave(torch.arange(num_local, device="cpu"), counts[s])
                within = torch.arange(j.numel(), device="cpu") - (torch.cumsum(counts[s], 0) - counts[s])[j]
                pieces.append(rows)
                dst_j.append(j)
                dst_row.append(begins[s, j] + within)
            if pieces:
                msgs = torch.cat(pieces).to(device)
                jj, rr = torch.cat(dst_j).to(device), torch.cat(dst_row).to(device)
                src_info[jj, rr] = from_bytes(msgs[:, :4], torch.int32, 1).view(-1)
                if use_fp8:
                    recv_scales[jj, rr] = from_bytes(msgs[:, 16 + hidden:16 + hidden + scale_cols * 4], scale_dtype,
                                                     scale_cols)
                copy_rows("dispatch", msgs, 16, recv_data.view(-1, hidden).view(torch.uint8), jj * rows_per_expert + rr)
            ranges = (begins << 32) | counts
            inactive = [s for s in range(num_ranks) if s not in active]
            ranges[inactive] = 0
            layout_range.copy_(ranges.t().to(device))
            packed_recv_count.copy_(counts.sum(0).to(torch.int32).to(device))
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(packed_recv_count.to(cumulative_local_expert_recv_stats.device))
            if dispatch_wait_recv_cost_stats is not None:
                waited = torch.tensor([a + b for a, b in zip(count_wait.wait_ns, data_wait.wait_ns)],
                                      dtype=torch.int64, device="cpu")
                dispatch_wait_recv_cost_stats.add_(waited.to(dispatch_wait_recv_cost_stats.device))

        new_handle = hd.LowLatencyHandle(src_info, layout_range, tokens, hidden, num_experts)
        outputs = [*(recv_x if use_fp8 else (recv_x,)), packed_recv_count, src_info, layout_range]
        if return_recv_hook:
            return LowLatencyDispatchResult(recv_x, packed_recv_count, new_handle, EventOverlap(None),
                                            ReceiveHook(_profiled("dispatch", receive)))
        with scope:
            receive()
        event = scope.finish([x, topk_idx, *outputs])
        if async_finish:
            event.extra_tensors = (x, topk_idx, *outputs)
        return LowLatencyDispatchResult(recv_x, packed_recv_count, new_handle, event, None)

    @functools.partial(_profiled, "combine")
    def low_latency_combine(self, request: LowLatencyCombineRequest) -> LowLatencyCombineResult:
        """Return expert outputs to the token owners and reduce ``sum_k w[t, k] * y(e_k, t)`` in float32."""
        (x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
         combine_wait_recv_cost_stats, _) = request
        src_info, layout_range, tokens, hidden, num_experts = handle
        num_ranks, rank = self.num_ranks, self.rank
        num_local = num_experts // num_ranks
        num_tokens = topk_idx.size(0)
        layout = self._ll_regions(tokens, hidden, num_experts)
        _, combine_msg = low_latency_message_bytes(hidden)
        header = combine_msg - 2 * hidden
        scope = StreamScope(None if return_recv_hook else self.comm_stream, None, async_finish)
        active = self._active_peers()
        device = x.device

        with scope:
            half = self._flip(layout)
            send_view = self._combine_send_view(layout, half, num_local, tokens, hidden)
            begins, counts = hd.unpack_layout_range(layout_range.cpu())
            # One message per source rank: its rows of every local expert (ascending), each row headed by the
            # source token index.
            sends, own_message = [], None
            for s in active:
                c = counts[:, s]
                n = int(c.sum())
                if n == 0:
                    continue
                j = torch.repeat_interleave(torch.arange(num_local, device="cpu"), c)
                r = begins[j, s] + torch.arange(n, device="cpu") - (torch.cumsum(c, 0) - c)[j]
                jd, rd = j.to(self.device), r.to(self.device)
                if not zero_copy:
                    send_view[jd, rd] = x[j.to(device), r.to(device)].to(self.device)
                rows = send_view[jd, rd]
                if use_logfmt:
                    rows = numerics.logfmt_roundtrip(rows)
                message = torch.cat([as_bytes(src_info[j.to(src_info.device), r.to(src_info.device)].to(self.device)),
                                     as_bytes(rows)], dim=1)
                if s == rank:
                    own_message = message
                else:
                    sends.append((s, message))

            # Receive: one message per owner rank, its experts' rows in expert order, sized from this rank's own
            # routing (the owner returns every row this rank dispatched to it).
            idx = topk_idx.to(torch.int64).cpu()
            owner_ok = torch.zeros(num_ranks, dtype=torch.bool, device="cpu")
            owner_ok[active] = True
            flat = idx[idx >= 0]
            flat = flat[owner_ok[flat // num_local]]
            expected = torch.bincount(flat, minlength=num_experts)
            per_owner = expected.view(num_ranks, num_local).sum(1)
            recvs = [(o, torch.empty(int(per_owner[o]), 4 + 2 * hidden, dtype=torch.uint8, device=self.device))
                     for o in active if o != rank and int(per_owner[o]) > 0]
            pending = self.comm.post(sends, recvs, _TAG_LL_COMBINE, "low-latency combine", "expert output rows")
            recv_area = self._region(layout, f"recv_{half}")[:num_experts * tokens * combine_msg]
            recv_area = recv_area.view(num_experts * tokens, combine_msg)
            signal = self._region(layout, f"signal_{half}").view(torch.int32)[:num_experts]
            combined = out if out is not None else torch.empty(num_tokens, hidden, dtype=torch.bfloat16,
                                                               device=device)

        def receive() -> None:
            pending.wait()
            messages, experts = [], []
            if own_message is not None:
                messages.append(own_message)
                own_experts = torch.arange(rank * num_local, (rank + 1) * num_local, device="cpu")
                experts.append(torch.repeat_interleave(own_experts, counts[:, rank]))
            for o, buf in recvs:
                messages.append(buf)
                owner_experts = torch.arange(o * num_local, (o + 1) * num_local, device="cpu")
                experts.append(torch.repeat_interleave(owner_experts, expected[o * num_local:(o + 1) * num_local]))
            if messages:
                message = torch.cat(messages)
                token_idx = from_bytes(message[:, :4], torch.int32, 1).view(-1).to(torch.int64)
                key = torch.cat(experts).to(self.device) * tokens + token_idx
                first = _first_occurrence(key)  # a token that chose an expert twice: its first row counts
                recv_area[key[first], header:] = message[first, 4:]
                signal[torch.unique(key[first] // tokens)] = 1
            slots = self._combine_recv_view(layout, half, num_experts, tokens, hidden)
            masked_owner = ~owner_ok
            reduced = reduce_low_latency_combine(slots, topk_idx.to(self.device), topk_weights.to(self.device),
                                                 num_local, masked_owner.to(self.device))
            copy_rows("combine", as_bytes(reduced.to(device)), 0, combined.view(torch.uint8))
            if combine_wait_recv_cost_stats is not None:
                combine_wait_recv_cost_stats.add_(torch.tensor(pending.wait_ns, dtype=torch.int64, device="cpu").to(
                    combine_wait_recv_cost_stats.device))

        if return_recv_hook:
            return LowLatencyCombineResult(combined, EventOverlap(None), ReceiveHook(_profiled("combine", receive)))
        with scope:
            receive()
        event = scope.finish([x, topk_idx, topk_weights, combined])
        if async_finish:
            event.extra_tensors = (x, topk_idx, topk_weights, combined)
        return LowLatencyCombineResult(combined, event, None)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        layout = self._ll_regions(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.comm.barrier("clean_low_latency_buffer (before)")
        self._region(layout, "signal_0").zero_()
        self._region(layout, "signal_1").zero_()
        self.ll_parity = 0  # the next call uses half 0 on every rank, as the CUDA kernels' clean does
        self.comm.barrier("clean_low_latency_buffer (after)")

    # Shrink masks (enable_shrink=True).
    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool) -> None:
        self.mask[rank_to_mask] = 1 if mask else 0

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        mask_status.copy_(self.mask.to(mask_status.device))

    def low_latency_clean_mask_buffer(self) -> None:
        self.mask.zero_()


def _first_occurrence(values: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64 -> positions of the first occurrence of each distinct value."""
    if values.numel() == 0:
        return values
    _, inverse = torch.unique(values, return_inverse=True)
    positions = torch.arange(values.numel(), device=values.device)
    first = torch.full((int(inverse.max()) + 1,), values.numel(), dtype=torch.int64, device=values.device)
    return first.scatter_reduce(0, inverse, positions, reduce="amin")


def reduce_combine(mask: torch.Tensor, ys: list[torch.Tensor], ws: Optional[list[torch.Tensor]],
                   biases: Sequence[torch.Tensor], topology: Topology, num_tokens: int, hidden: int,
                   device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Normal-combine reduction on the token owner.

    Args:
        mask: ``[N, R]`` bool, the dispatch's ``is_token_in_rank``.
        ys: per holder rank ``d``, ``[count_d, H]`` rows for the tokens with ``mask[:, d]`` (token order).
        ws: per holder rank, ``[count_d, K]`` float32 weights, or ``None``.
        biases: up to two ``[N, H]`` tensors.
    Returns:
        ``combined_x [N, H]`` BF16 and ``combined_topk_weights [N, K]`` float32 (or ``None``). Intranode: one
        float32 sum over holders in ascending rank order starting from the biases, one BF16 rounding. Internode:
        a float32 sum per node rounded to BF16, then the biases plus the node partials in ascending node order.
    """
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    for b in biases:
        acc = acc + b.to(torch.float32)
    weights = None
    if ws is not None:
        weights = torch.zeros(num_tokens, ws[0].size(1), dtype=torch.float32, device=device)
    mask = mask.to(device)
    # Each token row receives one addition per holder, in holder order (index_add_ with the holder's token indices,
    # which are unique: the same sums as masked in-place adds, without materialising the masked rows).
    if not topology.is_internode:
        for d, y in enumerate(ys):
            rows = mask[:, d].nonzero().squeeze(1)
            acc.index_add_(0, rows, y.to(torch.float32))
            if ws is not None:
                weights.index_add_(0, rows, ws[d])
        return acc.to(torch.bfloat16), weights
    per_node = topology.num_scaleup_ranks
    for n in range(topology.num_scaleout_ranks):
        partial = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
        partial_w = torch.zeros_like(weights) if ws is not None else None
        for d in range(n * per_node, (n + 1) * per_node):
            rows = mask[:, d].nonzero().squeeze(1)
            partial.index_add_(0, rows, ys[d].to(torch.float32))
            if ws is not None:
                partial_w.index_add_(0, rows, ws[d])
        # Only nodes that hold the token contribute a (BF16-rounded) partial.
        touched = mask[:, n * per_node:(n + 1) * per_node].any(1).nonzero().squeeze(1)
        acc.index_add_(0, touched, partial.index_select(0, touched).to(torch.bfloat16).to(torch.float32))
        if ws is not None:
            weights.index_add_(0, touched, partial_w.index_select(0, touched))
    return acc.to(torch.bfloat16), weights


def reduce_low_latency_combine(slots: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                               num_local_experts: int, masked_owner: torch.Tensor) -> torch.Tensor:
    """Low-latency combine reduction.

    Args:
        slots: ``[E, T, H]`` BF16: ``slots[e, t]`` = expert ``e``'s output for this rank's token ``t``.
        topk_idx: ``[N, K]`` global expert ids or -1; topk_weights: ``[N, K]`` float32.
        masked_owner: ``[R]`` bool, owners whose experts are dropped.
    Returns:
        ``[N, H]`` BF16: ``bf16(sum_k w[t, k] * f32(slots[e_k, t]))`` over valid, unmasked ``k`` ascending.
    """
    num_tokens, hidden = topk_idx.size(0), slots.size(2)
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=slots.device)
    tokens = torch.arange(num_tokens, device=slots.device)
    for k in range(topk_idx.size(1)):
        e = topk_idx[:, k].to(torch.int64)
        use = e >= 0
        use &= ~masked_owner[torch.where(use, e, torch.zeros_like(e)) // num_local_experts]
        rows = slots[torch.where(use, e, torch.zeros_like(e)), tokens].to(torch.float32)
        w = torch.where(use, topk_weights[:, k], torch.zeros_like(topk_weights[:, k]))
        acc = torch.where(use.unsqueeze(1), acc + w.unsqueeze(1) * rows, acc)
    return acc.to(torch.bfloat16)
