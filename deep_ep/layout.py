"""Byte layout of the communication buffers.

Standard library only, and imports nothing from ``deep_ep``: ``deep_ep.config`` takes the group limits, the
alignment and the fused ring sizes from here. ``Buffer`` sizes its allocations from these functions, the CUDA
kernels carve the same regions (``csrc/kernels/layout.cuh`` mirrors this file), and the simulator takes ring
capacities and buffer bytes from here. The normal-mode size hints (``nvl_buffer_size_hint``,
``rdma_buffer_size_hint``) are defined with ``Config`` in ``deep_ep.config``.

A layout is an ordered tuple of :class:`Region` s, each starting where the previous one ends (every region
is padded to ``BUFFER_ALIGNMENT`` bytes unless stated otherwise).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

# Largest group of this library's ring kernels (csrc/kernels/constants.cuh kMaxRanks): the intranode Buffer's NVLink
# domain (at most 8 ranks) and the nodes of the one-GPU-per-node CUDA internode backend. Larger groups fall back to
# the torch backend.
NUM_MAX_RING_RANKS = 24
# Largest group of one CUDA runtime (csrc/kernels/constants.cuh kMaxRuntimeRanks: its peer table and barrier).
NUM_MAX_RUNTIME_RANKS = 64
# Largest group of the fused internode kernels (csrc/kernels/fused_internode.cuh kFusedMaxRanks): N nodes x G > 1
# GPUs with N * G <= 64 (so N <= 32). Larger groups take the composed path.
NUM_MAX_FUSED_RANKS = 64
# Every buffer byte count and region is a multiple of this.
BUFFER_ALIGNMENT = 128

INT32_BYTES = 4
FLOAT32_BYTES = 4
BF16_BYTES = 2


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


@dataclass(frozen=True)
class Region:
    """One named, contiguous byte range ``[offset, offset + num_bytes)`` of a buffer."""

    name: str
    offset: int
    num_bytes: int

    @property
    def end(self) -> int:
        return self.offset + self.num_bytes


@dataclass(frozen=True)
class Layout:
    """Ordered, disjoint regions; ``total_bytes`` is the end of the last one."""

    regions: tuple[Region, ...]

    @property
    def total_bytes(self) -> int:
        return self.regions[-1].end if self.regions else 0

    def __getitem__(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(name)

    def describe(self) -> str:
        rows = [f"{r.name:<28} {r.offset:>14} {r.num_bytes:>14}" for r in self.regions]
        header = f"{'region':<28} {'offset':>14} {'bytes':>14}"
        return "\n".join([header, *rows, f"{'total':<28} {self.total_bytes:>14}"])


def chain(*sizes: tuple[str, int], alignment: int = BUFFER_ALIGNMENT) -> Layout:
    """Place named sizes back to back, each region starting at a multiple of ``alignment``."""
    regions, offset = [], 0
    for name, num_bytes in sizes:
        if num_bytes < 0:
            raise ValueError(f"region {name} has negative size {num_bytes}")
        regions.append(Region(name, offset, num_bytes))
        offset = align_up(offset + num_bytes, alignment)
    return Layout(tuple(regions))


# ---------------------------------------------------------------------------------------------------------------
# Low-latency buffer (one symmetric buffer, two halves used alternately).
# ---------------------------------------------------------------------------------------------------------------

def low_latency_message_bytes(hidden: int) -> tuple[int, int]:
    """(dispatch message bytes, combine slot bytes) per token for ``hidden`` channels.

    A dispatch message is a 16-byte header (source token index first) plus the larger of the BF16 payload and
    the FP8 payload with its per-128-channel float32 scales. A combine slot holds the per-128-channel
    LogFMT (amax, amin) pairs plus the BF16 payload.
    """
    num_scales = hidden // 128
    dispatch_msg = 16 + max(hidden * BF16_BYTES, hidden + num_scales * FLOAT32_BYTES)
    combine_msg = num_scales * FLOAT32_BYTES + hidden * BF16_BYTES
    return dispatch_msg, combine_msg


@functools.lru_cache(maxsize=64)  # every low-latency call checks it; the result is immutable
def low_latency_layout(num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Layout:
    """Regions ``signal_0, signal_1, send_0, send_1, recv_0, recv_1`` of the low-latency buffer.

    ``signal_i`` holds ``num_experts`` int32 (dispatch: ``count[local_expert * R + src]`` stored as ``-(n+1)``;
    combine: ``flag[global_expert]``). ``send_i`` stages outgoing messages, ``recv_i`` receives them:
    dispatch ``[local_expert][src_rank][slot < T]`` messages, combine ``[global_expert][src_token < T]`` slots.
    """
    tokens, experts = num_max_dispatch_tokens_per_rank, num_experts
    dispatch_msg, combine_msg = low_latency_message_bytes(hidden)
    send = max(tokens * dispatch_msg, experts * tokens * combine_msg)
    recv = max(experts * tokens * dispatch_msg, experts * tokens * combine_msg)
    signal = align_up(experts * INT32_BYTES, BUFFER_ALIGNMENT)
    return chain(("signal_0", signal), ("signal_1", signal), ("send_0", send), ("send_1", send),
                 ("recv_0", recv), ("recv_1", recv), alignment=1)


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                               num_experts: int) -> int:
    """DeepEP's ``get_low_latency_rdma_size_hint``: layout total, plus one extra 128-byte unit.

    ``num_ranks`` is accepted for API compatibility and unused, as in DeepEP.
    """
    del num_ranks
    total = low_latency_layout(num_max_dispatch_tokens_per_rank, hidden, num_experts).total_bytes
    return (total // BUFFER_ALIGNMENT + 1) * BUFFER_ALIGNMENT


# ---------------------------------------------------------------------------------------------------------------
# Normal intranode buffer (csrc/kernels/layout.cuh mirrors every number of this section).
#
# The receiver owns the rings; senders write into them over NVLink. Ring positions are monotonic 32-bit sequence
# numbers that never reset: the sender keeps its tail in a private workspace and publishes it into the receiver's
# control region, the receiver keeps its head in its workspace and publishes it into the sender's control region.
# ---------------------------------------------------------------------------------------------------------------

INTRANODE_MAX_RANKS = NUM_MAX_RING_RANKS
INTRANODE_MAX_CHANNELS = 160
INTRANODE_MAX_TOPK = 16
INTRANODE_MAX_LOCAL_EXPERTS = 1024
# int64 words of a call signature (deep_ep.backends.agreement.SIGNATURE_WORDS) in each notify slot.
INTRANODE_SIGNATURE_WORDS = 32
# int32 per (parity, source) notify slot: [R totals][L expert counts][C channel counts][the source's call signature,
# INTRANODE_SIGNATURE_WORDS int64], at fixed positions.
INTRANODE_NOTIFY_INTS = (INTRANODE_MAX_RANKS + INTRANODE_MAX_LOCAL_EXPERTS + INTRANODE_MAX_CHANNELS
                         + 2 * INTRANODE_SIGNATURE_WORDS)
# Bytes of the private device workspace the kernels keep their ring shadows and epochs in.
INTRANODE_WORKSPACE_BYTES = 1 << 20
_COUNTER_BYTES = INTRANODE_MAX_CHANNELS * INTRANODE_MAX_RANKS * INT32_BYTES


def intranode_control_layout() -> Layout:
    """Fixed control region at the start of every rank's scale-up buffer (independent of the call).

    * ``abort``: int32, 0 or ``code << 8 | (aborting rank + 1)``; any rank's failure raises it on every rank.
    * ``barrier``: int32 ``[NUM_MAX_RUNTIME_RANKS]``, slot ``s`` counts barrier arrivals of rank ``s`` (monotonic; a
      runtime's whole group, fused internode groups included).
    * ``notify_flags``: uint32 ``[2][16]``, per (parity, source) the epoch of the notify data that source wrote here.
    * ``notify_data``: int32 ``[2][16][INTRANODE_NOTIFY_INTS]``.
    * ``dispatch_tail`` / ``combine_tail``: uint32 ``[160][16]``, index ``channel * 16 + source``, written by the
      source.
    * ``dispatch_head`` / ``combine_head``: uint32 ``[160][16]``, index ``channel * 16 + destination``, written by
      the destination (the receiver) and polled here by this rank as a sender.
    * ``dispatch_output``: 24-byte words ``[160][16]`` ``(epoch, data_units, meta_units, rows, hash[2])`` uint32,
      index ``channel * 16 + destination``, written by the destination at the start of every dispatch: where its
      outputs of the call lie in its output pool (offsets in units of ``BUFFER_ALIGNMENT``; ``0xffffffff`` = rings /
      none) and, at ``hash[epoch % 2]``, the hash of its call signature (a cached dispatch compares them).
    * ``combine_landed``: uint32 ``[16]``, index source: ``epoch << 20 | rows`` of that source's copy-engine combine
      landed here. ``combine_freed``: uint32 ``[16]``, index owner: the last copy-engine combine epoch whose
      landing zone of this rank's rows the owner has finished reading. ``combine_zone_landed``: uint32 ``[160][16]``,
      index ``cta * 16 + source``: ``epoch << 20 | stripes`` that source's CTA has stored into the landing zone here.
    * ``combine_agreement``: uint64 ``[INTRANODE_MAX_RANKS][2]``, index ``source * 2 + parity``: ``call << 32 |
      hash`` written by the source at the start of each checked combine (its combine call number and the hash of
      its call signature; parity = call number % 2).
    """
    notify_data = 2 * INTRANODE_MAX_RANKS * INTRANODE_NOTIFY_INTS * INT32_BYTES
    return chain(("abort", INT32_BYTES),
                 ("barrier", NUM_MAX_RUNTIME_RANKS * INT32_BYTES),
                 ("notify_flags", 2 * INTRANODE_MAX_RANKS * INT32_BYTES),
                 ("notify_data", notify_data),
                 ("dispatch_tail", _COUNTER_BYTES),
                 ("dispatch_head", _COUNTER_BYTES),
                 ("combine_tail", _COUNTER_BYTES),
                 ("combine_head", _COUNTER_BYTES),
                 ("dispatch_output", INTRANODE_MAX_CHANNELS * INTRANODE_MAX_RANKS * 24),
                 ("combine_landed", INTRANODE_MAX_RANKS * INT32_BYTES),
                 ("combine_freed", INTRANODE_MAX_RANKS * INT32_BYTES),
                 ("combine_zone_landed", _COUNTER_BYTES),
                 ("combine_agreement", INTRANODE_MAX_RANKS * 2 * 8))


def intranode_control_bytes() -> int:
    """Bytes of the control region, rounded up to ``BUFFER_ALIGNMENT``."""
    return align_up(intranode_control_layout().total_bytes, BUFFER_ALIGNMENT)


def intranode_workspace_layout() -> Layout:
    """Private (never shared) device workspace of one rank, zeroed at creation and by ``reset``.

    ``notify_epoch`` and ``barrier_epoch`` are uint32 call counters; ``dispatch_max_channels`` /
    ``combine_max_channels`` the largest channel count any call of that direction used (the rings a sender checks
    for leftovers before writing); ``error_claim`` is 0 until the first failing thread of this rank claims the
    host-mapped error record; the four shadows are uint32 ``[160][16]``: the sender's last published tail per
    (channel, destination) and the receiver's consumed head per (channel, source), for dispatch and combine;
    ``dispatch_epoch`` uint32 ``[160]`` counts the dispatch calls each channel took part in (the epoch of the
    ``dispatch_output`` words); ``combine_done`` counts the CTAs of a copy-engine combine that finished;
    ``notify_mismatch`` is 1 when the call signatures of the last notify disagreed (its dispatch moves no row);
    ``agreement_arrivals`` counts the CTAs of a cached dispatch or checked combine that compared the peers'
    signature hashes; ``checked_calls`` counts the checked calls (combines, and the fused kernels' cached
    dispatches) whose CTAs all compared them: the next one's number is one more, on the device, so that a call
    captured in a CUDA graph takes a new number at each replay.
    """
    return chain(("notify_epoch", INT32_BYTES),
                 ("barrier_epoch", INT32_BYTES),
                 ("dispatch_max_channels", INT32_BYTES),
                 ("combine_max_channels", INT32_BYTES),
                 ("error_claim", INT32_BYTES),
                 ("dispatch_tail_shadow", _COUNTER_BYTES),
                 ("dispatch_head_shadow", _COUNTER_BYTES),
                 ("combine_tail_shadow", _COUNTER_BYTES),
                 ("combine_head_shadow", _COUNTER_BYTES),
                 ("dispatch_epoch", INTRANODE_MAX_CHANNELS * INT32_BYTES),
                 ("combine_done", INT32_BYTES),
                 ("notify_mismatch", INT32_BYTES),
                 ("agreement_arrivals", INT32_BYTES),
                 ("checked_calls", INT32_BYTES))


def intranode_dispatch_record_bytes(hidden_bytes: int, num_scales: int, num_topk: int) -> int:
    """Bytes of one dispatch ring slot: ``[hidden bytes][num_scales x 4-byte scales][src_idx int32, K int32 global
    top-k ids, K float32 weights]``, each part padded to 16 bytes."""
    return align_up(hidden_bytes, 16) + align_up(num_scales * FLOAT32_BYTES, 16) + align_up((1 + 2 * num_topk) * 4, 16)


def intranode_combine_record_bytes(hidden: int, num_topk: int) -> int:
    """Bytes of one combine ring slot: ``[hidden BF16][K float32 weights]``, each part padded to 16 bytes."""
    return align_up(hidden * BF16_BYTES, 16) + align_up(num_topk * FLOAT32_BYTES, 16)


@dataclass(frozen=True)
class RingGeometry:
    """Where the rings of one direction (dispatch or combine) lie for one call.

    The bytes after the control region are split into a dispatch half and a combine half; each half into one
    sub-region per source rank (``source_bytes``); ring (channel c, source s) holds ``capacity`` records at
    ``half_offset + s * source_bytes + c * capacity * record_bytes``.
    """

    half_offset: int
    source_bytes: int
    record_bytes: int
    capacity: int

    def slot_offset(self, channel: int, source: int, slot: int) -> int:
        return self.half_offset + source * self.source_bytes + (channel * self.capacity + slot) * self.record_bytes


# Largest ring half (dispatch or combine): 256 slots of 7168-BF16-hidden records per (channel, source) at 2 ranks
# and 24 channels fit. Whatever a larger buffer has beyond the two halves is the output pool.
INTRANODE_MAX_RING_HALF_BYTES = 256 << 20


def intranode_ring_half_bytes(num_nvl_bytes: int) -> int:
    left = num_nvl_bytes - intranode_control_bytes()
    half = (left // 2) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT if left > 0 else 0
    return min(half, INTRANODE_MAX_RING_HALF_BYTES)


def intranode_pool_region(num_nvl_bytes: int) -> Region:
    """The output pool of direct-to-output dispatch: the bytes after the control region and both ring halves
    (empty when ``num_nvl_bytes`` only covers those)."""
    offset = intranode_control_bytes() + 2 * intranode_ring_half_bytes(num_nvl_bytes)
    return Region("output_pool", offset, max(num_nvl_bytes - offset, 0))


@functools.lru_cache(maxsize=64)  # every direct-to-output dispatch sizes its block; the result is immutable
def intranode_dispatch_output_layout(rows: int, hidden_bytes: int, num_scales: int, num_topk: int,
                                     topk_idx_bytes: int) -> Layout:
    """Sections of a direct-to-output data block (offsets from the block start): ``recv_x [rows, hidden_bytes]``,
    ``recv_x_scales [rows, num_scales]`` 4-byte, ``recv_topk_idx [rows, num_topk]`` of ``topk_idx_bytes``,
    ``recv_topk_weights [rows, num_topk]`` float32. ``recv_src_idx [rows]`` int32 is a separate block (the handle
    keeps it alive after ``recv_x`` is gone)."""
    return chain(("recv_x", rows * hidden_bytes), ("recv_x_scales", rows * num_scales * FLOAT32_BYTES),
                 ("recv_topk_idx", rows * num_topk * topk_idx_bytes),
                 ("recv_topk_weights", rows * num_topk * FLOAT32_BYTES))


def intranode_ring_geometry(num_nvl_bytes: int, num_ranks: int, num_channels: int, record_bytes: int,
                            max_capacity: int, is_combine: bool) -> RingGeometry:
    """Ring geometry of a call: ``capacity = min(max_capacity, source_bytes // (num_channels * record_bytes))``.

    ``max_capacity`` is ``Config.num_max_nvl_chunked_recv_tokens``; the kernels need ``capacity >= 2 * Sn``
    (``Config.num_max_nvl_chunked_send_tokens``) when ``num_ranks > 1``.
    """
    half = intranode_ring_half_bytes(num_nvl_bytes)
    source_bytes = (half // num_ranks) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT if num_ranks > 0 else 0
    fit = source_bytes // (num_channels * record_bytes) if num_channels > 0 and record_bytes > 0 else 0
    return RingGeometry(intranode_control_bytes() + (half if is_combine else 0), source_bytes, record_bytes,
                        min(fit, max_capacity))


def intranode_dispatch_ring_layout(num_nvl_bytes: int, num_ranks: int, num_channels: int, hidden_bytes: int,
                              num_topk: int, num_scales: int, max_capacity: int) -> Layout:
    """Regions of one rank's scale-up buffer during one of our intranode dispatches: the control regions, then one
    ``dispatch_rings_src{s}`` region per source rank (``num_channels`` rings of ``capacity`` records each)."""
    geometry = intranode_ring_geometry(num_nvl_bytes, num_ranks, num_channels,
                                       intranode_dispatch_record_bytes(hidden_bytes, num_scales, num_topk),
                                       max_capacity, is_combine=False)
    return _with_rings(geometry, num_ranks, num_channels, "dispatch")


def intranode_combine_ring_layout(num_nvl_bytes: int, num_ranks: int, num_channels: int, hidden: int, num_topk: int,
                             max_capacity: int) -> Layout:
    """Regions of one rank's scale-up buffer during one of our intranode combines: the control regions, then one
    ``combine_rings_src{s}`` region per source rank, in the second half of the ring bytes."""
    geometry = intranode_ring_geometry(num_nvl_bytes, num_ranks, num_channels,
                                       intranode_combine_record_bytes(hidden, num_topk), max_capacity,
                                       is_combine=True)
    return _with_rings(geometry, num_ranks, num_channels, "combine")


def _with_rings(geometry: RingGeometry, num_ranks: int, num_channels: int, name: str) -> Layout:
    rings = tuple(Region(f"{name}_rings_src{s}", geometry.half_offset + s * geometry.source_bytes,
                         num_channels * geometry.capacity * geometry.record_bytes) for s in range(num_ranks))
    return Layout(intranode_control_layout().regions + rings)


# ---------------------------------------------------------------------------------------------------------------
# Put area (csrc/kernels/layout.cuh put_layout): worlds with NVSHMEM put peers end every buffer with the signal
# twins of the control region, one notify staging slot per destination rank and two staging halves that mirror the
# two ring halves, so the kernels' region (``ring_bytes``) is what is left before it.
# ---------------------------------------------------------------------------------------------------------------


def put_header_bytes() -> int:
    """Bytes of the put area before its staging halves: uint64 signal twins of the control region's uint32 words,
    then an int32 ``[NUM_MAX_RING_RANKS][INTRANODE_NOTIFY_INTS]`` notify staging block."""
    staging = align_up(INTRANODE_MAX_RANKS * INTRANODE_NOTIFY_INTS * INT32_BYTES, BUFFER_ALIGNMENT)
    return 2 * intranode_control_bytes() + staging


# Which put area a world with put pairs carves (csrc/kernels/layout.cuh PutArea): the ring kernels' (header and
# staging halves that mirror the ring halves), or the fused kernels' (the header alone: they stage inside their
# region).
PUT_AREA_NONE, PUT_AREA_MIRROR, PUT_AREA_IN_REGION = 0, 1, 2


def put_region_bytes(num_bytes: int, put_area: int) -> int:
    """The kernels' region of a buffer of ``num_bytes`` with put area ``put_area`` (``PUT_AREA_*``)."""
    if put_area == PUT_AREA_MIRROR:
        return put_ring_bytes(num_bytes)
    if put_area == PUT_AREA_IN_REGION:
        return num_bytes - put_header_bytes()
    return num_bytes


def put_ring_bytes(num_bytes: int) -> int:
    """The kernels' region of a buffer of ``num_bytes`` that ends with a put area: each staging half equals a ring
    half, so the rings get a quarter of what the fixed regions leave (at most ``INTRANODE_MAX_RING_HALF_BYTES``
    each) and what a larger buffer has beyond that stays in the kernels' region (the output pool)."""
    control = intranode_control_bytes()
    left = num_bytes - control - put_header_bytes()
    half = min((left // 4) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT if left > 0 else 0, INTRANODE_MAX_RING_HALF_BYTES)
    if half < INTRANODE_MAX_RING_HALF_BYTES:
        return control + 2 * half
    return num_bytes - put_header_bytes() - 2 * half


# ---------------------------------------------------------------------------------------------------------------
# Fused internode kernels (csrc/kernels/fused_internode.cuh): after the shared control region, their own notify
# slots, counters and signals for up to NUM_MAX_FUSED_RANKS ranks and the staging twins of those words, then a
# dispatch half and a combine half of rings. In each half, rail rings [channel][source node] of ``rail_capacity``
# records (at a forwarder), then node rings [channel][source rank] of ``node_capacity`` records (at a receiver), and
# with put peers in the world a rail staging of the rail rings' shape; the capacities are the Config's, not fitted
# to the buffer, so a buffer too small for a call's rings refuses the call.
# ---------------------------------------------------------------------------------------------------------------

FUSED_MAX_NODES = NUM_MAX_FUSED_RANKS // 2
# int32 per (parity, source) fused notify slot: [R counts][L expert counts][C channel counts][signature as int32].
FUSED_NOTIFY_INTS = (NUM_MAX_FUSED_RANKS + INTRANODE_MAX_LOCAL_EXPERTS + INTRANODE_MAX_CHANNELS
                     + 2 * INTRANODE_SIGNATURE_WORDS)


def fused_control_layout() -> Layout:
    """The fused kernels' words, offsets from the end of the shared control region: notify flags uint32 [2][64] and
    data int32 [2][64][FUSED_NOTIFY_INTS]; uint32 counters [160][64] (dispatch rail tails and heads, node tails and
    heads), node counts int32 [2][64][160], the combine counters; then the uint64 signals NVSHMEM put peers raise
    (notify flags [2][64], the four rail counters [160][32]); then the agreement words uint64 [2][64], index
    ``parity * 64 + source``: ``call << 32 | hash`` written by the source (a release store, or a signal from a put
    peer) at the start of each checked call, a cached dispatch or a combine (parity = call number % 2)."""
    counters = INTRANODE_MAX_CHANNELS * NUM_MAX_FUSED_RANKS * INT32_BYTES
    signals = INTRANODE_MAX_CHANNELS * FUSED_MAX_NODES * 8
    return chain(("notify_flags", 2 * NUM_MAX_FUSED_RANKS * INT32_BYTES),
                 ("notify_data", 2 * NUM_MAX_FUSED_RANKS * FUSED_NOTIFY_INTS * INT32_BYTES),
                 *((name, counters) for name in ("rail_tail", "rail_head", "node_tail", "node_head")),
                 ("node_count", 2 * NUM_MAX_FUSED_RANKS * INTRANODE_MAX_CHANNELS * INT32_BYTES),
                 *((name, counters) for name in ("combine_node_tail", "combine_node_head", "combine_rail_tail",
                                                 "combine_rail_head")),
                 ("notify_flag_signals", 2 * NUM_MAX_FUSED_RANKS * 8),
                 *((name, signals) for name in ("rail_tail_signals", "rail_head_signals",
                                                "combine_rail_tail_signals", "combine_rail_head_signals")),
                 ("agreement", 2 * NUM_MAX_FUSED_RANKS * 8))


def fused_control_end() -> int:
    """Byte offset of the end of the fused kernels' control words (where their staging twins start)."""
    return intranode_control_bytes() + align_up(fused_control_layout().total_bytes, BUFFER_ALIGNMENT)


def fused_rings_offset() -> int:
    """Byte offset of the fused kernels' dispatch half: after their control words and the words' staging twins."""
    return 2 * fused_control_end() - intranode_control_bytes()


def fused_half_bytes(ring_bytes: int) -> int:
    """Bytes of each fused half in a kernels' region of ``ring_bytes``."""
    left = ring_bytes - fused_rings_offset()
    return (left // 2) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT if left > 0 else 0


def fused_node_ring(nvl_send: int, nvl_recv: int, num_nodes: int) -> tuple[int, int]:
    """``(slots, publish chunk)`` of a fused node ring for a Config's ``num_max_nvl_chunked_send_tokens``
    (``nvl_send``) and ``num_max_nvl_chunked_recv_tokens`` (``nvl_recv``). A receiver keeps one node ring per
    (channel, source rank) where DeepEP keeps one per (channel, NVLink peer): the ``num_nodes`` source nodes a
    forwarder serves share its ``nvl_recv`` slots, so the node rings take what DeepEP's NVLink buffer takes. A
    forwarder publishes at most ``nvl_send`` records at a time, and at most half a ring."""
    slots = nvl_recv // num_nodes
    return slots, max(1, min(nvl_send, slots // 2))


def fused_ring_bytes(num_nodes: int, gpus_per_node: int, num_channels: int, record_bytes: int, rail_capacity: int,
                     node_capacity: int, staged: bool) -> int:
    """Bytes of one direction's fused rings: ``[C][N][rail_capacity]`` records, aligned, then
    ``[C][N * G][node_capacity]`` records, and with put peers in the world (``staged``), aligned, the rail staging
    (``[C][N][rail_capacity]`` records again: only the rail hops cross to put peers)."""
    rail = num_channels * num_nodes * rail_capacity * record_bytes
    used = align_up(rail, BUFFER_ALIGNMENT) + num_channels * num_nodes * gpus_per_node * node_capacity * record_bytes
    return align_up(used, BUFFER_ALIGNMENT) + rail if staged else used


def fused_min_rdma_bytes(ring_bytes: int, put_area: bool) -> int:
    """The smallest buffer (a multiple of ``BUFFER_ALIGNMENT``) whose fused halves hold ``ring_bytes`` of rings
    each (:func:`fused_ring_bytes`); with put peers in the world (``put_area``) the put area's header follows the
    kernels' region."""
    region = fused_rings_offset() + 2 * align_up(ring_bytes, BUFFER_ALIGNMENT)
    return region + (put_header_bytes() if put_area else 0)


def intranode_dispatch_layout(num_ranks: int, num_channels: int, num_recv_tokens: int, hidden_bytes: int,
                              num_topk: int, num_scales: int, topk_idx_bytes: int = 8) -> Layout:
    """DeepEP V1's regions of one rank's scale-up buffer during an intranode dispatch.

    Our kernels carve the buffer differently (:func:`intranode_dispatch_ring_layout`); this function documents
    the shape DeepEP's size hints were derived from.

    ``num_recv_tokens`` is the ring capacity per (channel, source rank); ring index = ``channel * R + src``.
    """
    rings = num_channels * num_ranks
    slots = rings * num_recv_tokens
    return chain(("rank_prefix_matrix", num_ranks * num_ranks * INT32_BYTES),
                 ("channel_start_offset", rings * INT32_BYTES),
                 ("channel_end_offset", rings * INT32_BYTES),
                 ("channel_head", rings * INT32_BYTES),
                 ("channel_tail", rings * INT32_BYTES),
                 ("token_data", slots * hidden_bytes),
                 ("src_idx", slots * INT32_BYTES),
                 ("topk_idx", slots * num_topk * topk_idx_bytes),
                 ("topk_weights", slots * num_topk * FLOAT32_BYTES),
                 ("scales", slots * num_scales * FLOAT32_BYTES))


def intranode_combine_layout(num_ranks: int, num_channels: int, num_recv_tokens: int, hidden: int,
                             num_topk: int) -> Layout:
    """DeepEP V1's regions of one rank's scale-up buffer during an intranode combine.

    Our kernels use :func:`intranode_combine_ring_layout`."""
    rings = num_channels * num_ranks
    slots = rings * num_recv_tokens
    return chain(("channel_head", rings * INT32_BYTES),
                 ("channel_tail", rings * INT32_BYTES),
                 ("token_data", slots * hidden * BF16_BYTES),
                 ("src_idx", slots * INT32_BYTES),
                 ("topk_weights", slots * num_topk * FLOAT32_BYTES))


def channel_token_range(num_tokens: int, num_channels: int, channel: int) -> tuple[int, int]:
    """Tokens ``[begin, end)`` of ``channel``: the token range split into ``num_channels`` chunks of
    ``ceil(num_tokens / num_channels)`` tokens, in order (the last ones may be short or empty)."""
    per_channel = ceil_div(num_tokens, num_channels) if num_channels > 0 else 0
    begin = min(per_channel * channel, num_tokens)
    return begin, min(begin + per_channel, num_tokens)
