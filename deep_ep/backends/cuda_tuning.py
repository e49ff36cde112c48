"""Selection rules and tuned tables of the CUDA ring kernels, in one place (standard library only).

``num_sms`` of a ``Config`` is the SM budget of a call; from it come the channels (:func:`intranode_channels`: one
CTA per channel, ``num_sms`` of them up to a cap per rank count, the channel count of every backend's handles), the
copy warps per channel (:func:`intranode_send_warps`, :func:`zone_send_warps`) and the intranode combine send path
(:func:`combine_send_path`: copy engine up to ``COMBINE_COPY_MAX_SMS`` SMs, ring senders below
``COMBINE_ZONE_MIN_SMS``, zone senders from there, each the fastest measured in its regime, docs/performance.md).
Dispatch receives straight into its outputs when the buffer's output pool has room, else through the rings
(:func:`dispatch_receive_mode`). Also here: the NVSHMEM put peers (:func:`put_peers`). ``deep_ep.testing.overrides``
overrides each choice for tests and benchmarks.
"""
from __future__ import annotations

import types
from typing import Mapping, Sequence

from deep_ep import testing
from deep_ep.layout import INTRANODE_MAX_CHANNELS

# Channels of the ring kernels by rank count. Above the cap more channels measured slower (EP2, 4096 tokens, hidden
# 7168: BF16 dispatch 217 us at 24 channels vs 191-195 us at 16; FP8 dispatch 120 vs 116 us; combine 231 vs 241 us),
# so the kernels run the cap's count and leave the other SMs free. Rank counts without a cap use num_sms channels.
INTRANODE_CHANNEL_CAP: Mapping[int, int] = types.MappingProxyType({2: 16})

# Copy warps per channel by (kernel, dtype): rows (largest channel count, warps); the first row whose bound is >= the
# call's channel count applies, the last one above it. The best measured on 2 x H200, EP2, 4096 tokens, hidden 7168
# (wall us by warps):
#   dispatch BF16   8 ch: 24 -> 321, 16 -> 325 | 12 ch: 24 -> 223 | 16 ch: 12 -> 195, 16 -> 209
#   dispatch FP8    8 ch: 24 -> 196, 20 -> 198 | 12 ch: 24 -> 144 | 16 ch: 24 -> 116, 16 -> 129
#   combine         8 ch: 8 -> 420, 10 -> 436  | 12 ch: 8 -> 302  | 16 ch: 8 -> 241, 10 -> 264 | 24 ch: 6 -> 231
INTRANODE_SEND_WARP_TABLE: Mapping[tuple[str, str], tuple[tuple[int, int], ...]] = types.MappingProxyType({
    ("dispatch", "bf16"): ((12, 24), (16, 12), (24, 16)),
    ("dispatch", "fp8"): ((16, 24), (24, 12)),
    ("combine", "bf16"): ((16, 8), (24, 6)),
})

# Intranode combine send paths by SM budget (EP2, 4096 tokens, hidden 7168, wall us): copy engine vs ring senders
# 8 SMs 315 vs 436, 12 SMs 259 vs 306, 16 SMs 254 vs 241; zone senders (4 per CTA) vs ring senders 20 SMs 229 vs
# 240, 24 SMs 214-235 vs 238-239, 48 SMs 223 vs 240.
COMBINE_COPY_MAX_SMS = 12
COMBINE_ZONE_MIN_SMS = 20
# Rows per copy-engine chunk: each chunk ends with a flag the reducers wait for (the first chunks are smaller, so
# that the reducers start early).
COMBINE_COPY_CHUNK_ROWS = 512
# Warps per CTA of the zone-sender kernel (csrc kZoneWarps; a stripe is that many rows), its sender warps per CTA,
# and its largest CTA count.
COMBINE_ZONE_WARPS = 20
COMBINE_ZONE_SEND_WARPS = 4
COMBINE_ZONE_MAX_CTAS = 24


def intranode_channels(num_sms: int, num_ranks: int) -> int:
    """Channels of the normal kernels for a budget of ``num_sms`` SMs in a group of ``num_ranks`` ranks: one CTA
    per channel, ``num_sms`` channels, at most ``INTRANODE_CHANNEL_CAP[num_ranks]`` (unless ``uncapped_channels``).
    Every backend gives its handles this many channels. Raises ``ValueError`` outside ``[1, 160]``."""
    if not 1 <= num_sms <= INTRANODE_MAX_CHANNELS:
        raise ValueError(f"config.num_sms must be in [1, {INTRANODE_MAX_CHANNELS}] (one channel per SM), got "
                         f"{num_sms}")
    if testing.current().uncapped_channels:
        return num_sms
    return min(num_sms, INTRANODE_CHANNEL_CAP.get(num_ranks, num_sms))


# Copy warps per channel when the rank has NVSHMEM put peers. Each copy warp then also puts its own staged records
# (csrc/kernels/put.cuh); over NVSHMEM's P2P transport a put is a copy loop of the calling warp with one 16-byte load
# per lane in flight (about 1.1 GB/s per warp over NVLink on H200), so staging and putting a record costs a sender
# warp about three times what the receiver's copy out of the ring (dispatch) or a reduction (combine) costs. The
# split balances the two at 2 ranks: 24 senders and 7 receivers, 22 senders and 9 reducers.
PUT_SEND_WARPS: Mapping[str, int] = types.MappingProxyType({"dispatch": 24, "combine": 22})


def send_warp_range(kernel: str, num_ranks: int) -> tuple[int, int]:
    """Copy warps per channel the ring ``kernel`` accepts with ``num_ranks`` ranks: dispatch [2, 32 - R] (the
    publisher and a receiver warp per source remain), combine [R - 1, 30] (a ring sender per destination; the
    publisher and a reducer remain)."""
    return (2, 32 - num_ranks) if kernel == "dispatch" else (num_ranks - 1, 30)


def intranode_send_warps(kernel: str, num_ranks: int, num_channels: int = 24, fp8: bool = False,
                         puts: bool = False) -> int:
    """Copy warps per channel of the ring ``kernel`` ('dispatch' or 'combine') for ``num_ranks`` ranks and
    ``num_channels`` channels (``fp8``: an FP8 dispatch; ``puts``: this rank has NVSHMEM put peers): the override,
    else :data:`PUT_SEND_WARPS` with put peers or the tuned table's row, clamped to :func:`send_warp_range`."""
    lowest, highest = send_warp_range(kernel, num_ranks)
    chosen = testing.current()
    warps = chosen.dispatch_warps if kernel == "dispatch" else chosen.combine_warps
    if warps is None and puts:
        warps = PUT_SEND_WARPS[kernel]
    if warps is None:
        rows = INTRANODE_SEND_WARP_TABLE[(kernel, "fp8" if fp8 and kernel == "dispatch" else "bf16")]
        warps = next((w for bound, w in rows if num_channels <= bound), rows[-1][1])
    return min(max(warps, lowest), highest)


def combine_send_path(num_sms: int) -> str:
    """The send path an intranode combine with a budget of ``num_sms`` SMs asks for: 'copy' (the copy engine moves
    the rows), 'zone' (sender warps store them straight into the owners' landing zones, every CTA reduces) or
    'rings'. The landing-zone paths also need the dispatch's counts on the host and zones that fit, else the call
    takes the rings."""
    forced = testing.current().combine_send
    if forced is not None:
        return forced
    if num_sms <= COMBINE_COPY_MAX_SMS:
        return "copy"
    return "zone" if num_sms >= COMBINE_ZONE_MIN_SMS else "rings"


def combine_copy_chunk_rows() -> int:
    """Rows per chunk of the copy-engine combine."""
    rows = testing.current().combine_copy_chunk_rows
    return COMBINE_COPY_CHUNK_ROWS if rows is None else rows


def zone_send_warps() -> int:
    """Sender warps per CTA of the zone-sender combine (the ``combine_warps`` override or
    ``COMBINE_ZONE_SEND_WARPS``), clamped to [1, COMBINE_ZONE_WARPS - 2] (a publisher and a reducer remain)."""
    warps = testing.current().combine_warps
    return min(max(COMBINE_ZONE_SEND_WARPS if warps is None else warps, 1), COMBINE_ZONE_WARPS - 2)


def zone_ctas(num_sms: int) -> int:
    """CTAs of the zone-sender combine for a budget of ``num_sms`` SMs: at most ``COMBINE_ZONE_MAX_CTAS``."""
    return max(1, min(num_sms, COMBINE_ZONE_MAX_CTAS))


def dispatch_receive_mode() -> str:
    """'auto' (straight into the outputs when the buffer's output pool has room, else through the rings), 'rings' or
    'direct' (the pool only: a dispatch raises when it has no room)."""
    return testing.current().dispatch_receive or "auto"


def put_peers(rank: int, unreachable: Sequence[Sequence[int]], put_only: bool, gpus_per_node: int = 0) -> list[int]:
    """The ranks that ``rank`` reaches by NVSHMEM puts: those it cannot reach by ``nvshmem_ptr`` and those that
    cannot reach it (both sides of a pair must agree), or with ``put_only`` every other rank (every rank of another
    node when ``gpus_per_node`` > 0: the fused kernels' NVLink hops stay pointer).
    ``unreachable[r]``: the ranks that rank ``r`` cannot reach."""
    num_ranks = len(unreachable)
    if put_only:
        return [r for r in range(num_ranks)
                if r != rank and (gpus_per_node <= 0 or r // gpus_per_node != rank // gpus_per_node)]
    return [r for r in range(num_ranks) if r != rank and (r in unreachable[rank] or rank in unreachable[r])]

