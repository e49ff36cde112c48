"""Byte layout of the communication buffers: every buffer-size formula lives here.

Standard library only. ``Buffer`` sizes its allocations from these functions, the CUDA kernels carve the
same regions (``csrc/kernels/layout.cuh`` mirrors this file), and the simulator takes ring capacities and
buffer bytes from here.

A layout is an ordered tuple of :class:`Region` s, each starting where the previous one ends (every region
is padded to ``BUFFER_ALIGNMENT`` bytes unless stated otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass

from deep_ep.config import (BUFFER_ALIGNMENT, NUM_HINT_MAX_SCALES, NUM_HINT_MAX_TOPK, NUM_MAX_SCALEUP_RANKS,
                            SOURCE_META_BYTES, Config, align_up, ceil_div)

INT32_BYTES = 4
FLOAT32_BYTES = 4
BF16_BYTES = 2


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
        return "\n".join([f"{'region':<28} {'offset':>14} {'bytes':>14}", *rows, f"{'total':<28} {self.total_bytes:>14}"])


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
# Normal-mode size hints (DeepEP's formulas, so that buffers sized for DeepEP fit here too).
# ---------------------------------------------------------------------------------------------------------------

def _check_normal_ranks(num_ranks: int) -> None:
    if num_ranks > NUM_MAX_SCALEUP_RANKS and num_ranks % NUM_MAX_SCALEUP_RANKS != 0:
        raise ValueError(f"num_ranks must be < {NUM_MAX_SCALEUP_RANKS} or a multiple of {NUM_MAX_SCALEUP_RANKS}, "
                         f"got {num_ranks}")


def nvl_buffer_size_hint(config: Config, hidden_bytes: int, num_ranks: int, topk_idx_bytes: int = 8) -> int:
    """Scale-up buffer bytes for the normal kernels, rounded up to 128.

    ``hidden_bytes`` should be ``hidden * max(element_size, 2)`` (BF16-sized even for FP8), as in DeepEP.
    """
    _check_normal_ranks(num_ranks)
    if num_ranks > NUM_MAX_SCALEUP_RANKS and config.num_sms % 2 != 0:
        raise ValueError(f"num_sms must be even, got {config.num_sms}")
    num_channels = config.num_sms // 2
    num_nvl = min(num_ranks, NUM_MAX_SCALEUP_RANKS)
    num_rdma = max(num_ranks // NUM_MAX_SCALEUP_RANKS, 1)
    slots = num_channels * num_nvl * config.num_max_nvl_chunked_recv_tokens
    num_bytes = (num_channels * num_nvl * (2 * num_rdma + 3) * INT32_BYTES
                 + slots * hidden_bytes
                 + slots * SOURCE_META_BYTES
                 + slots * NUM_HINT_MAX_TOPK * topk_idx_bytes
                 + slots * NUM_HINT_MAX_TOPK * FLOAT32_BYTES
                 + slots * NUM_HINT_MAX_SCALES * FLOAT32_BYTES)
    return align_up(num_bytes, BUFFER_ALIGNMENT)


def rdma_buffer_size_hint(config: Config, hidden_bytes: int, num_ranks: int, topk_idx_bytes: int = 8) -> int:
    """Scale-out buffer bytes for the normal internode kernels, rounded up to 128; 0 within one node."""
    if num_ranks <= NUM_MAX_SCALEUP_RANKS:
        return 0
    _check_normal_ranks(num_ranks)
    if config.num_sms % 2 != 0:
        raise ValueError(f"num_sms must be even, got {config.num_sms}")
    num_channels = config.num_sms // 2
    num_rdma = num_ranks // NUM_MAX_SCALEUP_RANKS
    record = (hidden_bytes + SOURCE_META_BYTES + NUM_HINT_MAX_TOPK * topk_idx_bytes
              + NUM_HINT_MAX_TOPK * FLOAT32_BYTES + NUM_HINT_MAX_SCALES * FLOAT32_BYTES + 16)
    num_bytes = (num_channels * num_rdma * (NUM_MAX_SCALEUP_RANKS * 2 + 2) * 2 * INT32_BYTES
                 + 2 * num_channels * num_rdma * config.num_max_rdma_chunked_recv_tokens * record)
    return align_up(num_bytes, BUFFER_ALIGNMENT)


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
# Normal intranode buffer (the receiver owns the rings; senders write into them over NVLink).
# ---------------------------------------------------------------------------------------------------------------

def intranode_dispatch_layout(num_ranks: int, num_channels: int, num_recv_tokens: int, hidden_bytes: int,
                              num_topk: int, num_scales: int, topk_idx_bytes: int = 8) -> Layout:
    """Regions of one rank's scale-up buffer during an intranode dispatch (DeepEP §13.1 shape).

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
    """Regions of one rank's scale-up buffer during an intranode combine (DeepEP §13.2 shape)."""
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
