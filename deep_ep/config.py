"""Topology and tuning configuration shared by ``deep_ep``, ``reference`` and ``simulator``.

Standard library only: importing this module loads neither torch nor the CUDA extension.

* :class:`Config` is DeepEP V1's tuning config for the normal (high-throughput) kernels, with the same
  constructor (positional or keyword) and the same validation rules, as a frozen dataclass whose
  fields can be read back.
* :class:`Topology` says how global ranks map onto scale-up (NVLink) domains ("nodes").
* :func:`get_dispatch_config` / :func:`get_combine_config` hold the tuned default tables, keyed by rank
  count and built with keyword arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from deep_ep import envs

# Largest scale-up (NVLink) domain a node may have; DeepEP's NUM_MAX_NVL_PEERS.
NUM_MAX_SCALEUP_RANKS = 8
# Largest group of this library's ring kernels (csrc/kernels/constants.cuh kMaxRanks): the intranode Buffer's NVLink
# domain (at most NUM_MAX_SCALEUP_RANKS), the nodes of the one-GPU-per-node CUDA internode backend and of the composed
# path's rail stage. Larger groups fall back to the torch backend.
NUM_MAX_RING_RANKS = 24
# Most local experts per rank that the host layer accepts (DeepEP's host limit).
NUM_MAX_LOCAL_EXPERTS = 1024
# Largest top-k the normal kernels carry per token (DeepEP's device limit).
NUM_MAX_TOPK = 32
# Largest top-k of the low-latency path.
NUM_MAX_LL_TOPK = 16
# Normal-mode buffer-size hints assume at most this many top-k entries and scales per token.
NUM_HINT_MAX_TOPK = 128
NUM_HINT_MAX_SCALES = 128
# Bytes of the internode per-token source-meta record (source node index + local-GPU mask).
SOURCE_META_BYTES = 8
# Channels per block width of the per-token FP8 scale (one float32 scale per 128 channels).
FP8_BLOCK = 128
# Largest finite float8_e4m3fn value.
FP8_E4M3_MAX = 448.0
# Every buffer byte count and region is a multiple of this.
BUFFER_ALIGNMENT = 128
# Ring sequence sentinel used by combine's rewrite of skipped send-head entries.
SEND_HEAD_SENTINEL = 1 << 25


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` must be a Python int (not bool) within ``[minimum, maximum]``; ``deep_ep.validate`` re-exports it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


@dataclass(frozen=True)
class Config:
    """Tuning of the normal dispatch/combine kernels (DeepEP V1 ``Config``).

    Args (DeepEP's positional order):
        num_sms: SMs (thread blocks) per kernel; even, because a channel is a pair of SMs. The CUDA intranode
            kernels treat it as a budget: one CTA per channel, at most ``INTRANODE_MAX_CHANNELS[R]`` channels.
        num_max_nvl_chunked_send_tokens: tokens moved per step over the scale-up link before a tail publish (``Sn``).
        num_max_nvl_chunked_recv_tokens: scale-up ring capacity per (channel, peer), in tokens (``Nn``).
        num_max_rdma_chunked_send_tokens: tokens per scale-out put (``Sr``).
        num_max_rdma_chunked_recv_tokens: scale-out ring capacity per (channel, node) (``Nr``); rounded up to a
            multiple of ``Sr``, as DeepEP does.

    Raises:
        TypeError / ValueError naming the field, the rule and the value.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        check_int("num_sms", self.num_sms, 0)
        check_int("num_max_nvl_chunked_send_tokens", self.num_max_nvl_chunked_send_tokens, 1)
        check_int("num_max_nvl_chunked_recv_tokens", self.num_max_nvl_chunked_recv_tokens, 1)
        check_int("num_max_rdma_chunked_send_tokens", self.num_max_rdma_chunked_send_tokens, 1)
        check_int("num_max_rdma_chunked_recv_tokens", self.num_max_rdma_chunked_recv_tokens, 1)
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "num_max_nvl_chunked_send_tokens must be < num_max_nvl_chunked_recv_tokens, got "
                f"{self.num_max_nvl_chunked_send_tokens} >= {self.num_max_nvl_chunked_recv_tokens}")
        send_r = self.num_max_rdma_chunked_send_tokens
        recv_r = align_up(self.num_max_rdma_chunked_recv_tokens, send_r)
        object.__setattr__(self, "num_max_rdma_chunked_recv_tokens", recv_r)
        if send_r > recv_r // 2:
            raise ValueError(
                "num_max_rdma_chunked_send_tokens must be <= num_max_rdma_chunked_recv_tokens // 2 (after rounding "
                f"the latter up to a multiple of the former), got {send_r} > {recv_r} // 2")

    @property
    def num_channels(self) -> int:
        """Channels (pairs of SMs) of the normal kernels: ``num_sms // 2``."""
        return self.num_sms // 2

    def describe(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl_send={self.num_max_nvl_chunked_send_tokens}, "
                f"nvl_recv={self.num_max_nvl_chunked_recv_tokens}, rdma_send={self.num_max_rdma_chunked_send_tokens}, "
                f"rdma_recv={self.num_max_rdma_chunked_recv_tokens})")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of scale-up buffer the normal kernels need (DeepEP's formula; see ``deep_ep.layout``)."""
        from deep_ep import layout
        return layout.nvl_buffer_size_hint(self, hidden_bytes, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of scale-out buffer the normal internode kernels need; 0 within one node."""
        from deep_ep import layout
        return layout.rdma_buffer_size_hint(self, hidden_bytes, num_ranks)


@dataclass(frozen=True)
class Topology:
    """How ``num_ranks`` global ranks map onto scale-up domains.

    Rank ``r`` sits in node ``r // num_scaleup_ranks`` at local index ``r % num_scaleup_ranks``. With the
    default of 8 this is DeepEP's mapping. ``DEEP_EP_GPUS_PER_NODE`` lowers it so that one host acts as
    several virtual nodes.
    """

    num_ranks: int
    num_scaleup_ranks: int = field(default=NUM_MAX_SCALEUP_RANKS)

    def __post_init__(self) -> None:
        check_int("num_ranks", self.num_ranks, 1)
        check_int("num_scaleup_ranks", self.num_scaleup_ranks, 1)
        if self.num_scaleup_ranks > NUM_MAX_SCALEUP_RANKS:
            raise ValueError(f"num_scaleup_ranks must be <= {NUM_MAX_SCALEUP_RANKS}, got {self.num_scaleup_ranks}")
        # A group smaller than one node is one (partial) node.
        object.__setattr__(self, "num_scaleup_ranks", min(self.num_scaleup_ranks, self.num_ranks))
        if self.num_ranks % self.num_scaleup_ranks != 0:
            raise ValueError(f"num_ranks ({self.num_ranks}) must be a multiple of the ranks per node "
                             f"({self.num_scaleup_ranks}) when the group spans several nodes")

    @classmethod
    def one_domain(cls, num_ranks: int) -> "Topology":
        """One scale-up domain of ``num_ranks`` ranks, whatever their count: the topology of a composed-path stage
        (its rail stage has a rank per node, possibly more than a node's GPUs), never a Buffer's."""
        topology = cls(num_ranks, 1)
        object.__setattr__(topology, "num_scaleup_ranks", num_ranks)
        return topology

    @classmethod
    def from_env(cls, num_ranks: int) -> "Topology":
        return cls(num_ranks, envs.GPUS_PER_NODE.get())

    @property
    def num_scaleout_ranks(self) -> int:
        """Number of nodes (DeepEP's ``num_rdma_ranks``)."""
        return self.num_ranks // self.num_scaleup_ranks

    @property
    def is_internode(self) -> bool:
        return self.num_scaleout_ranks > 1

    def node_of(self, rank: int) -> int:
        return rank // self.num_scaleup_ranks

    def local_of(self, rank: int) -> int:
        return rank % self.num_scaleup_ranks


def put_peers(rank: int, unreachable: list, put_only: bool) -> list[int]:
    """The ranks that ``rank`` reaches by NVSHMEM puts in the CUDA internode backend (``deep_ep/cuda_internode.py``):
    those it cannot reach by ``nvshmem_ptr`` and those that cannot reach it (the relation is symmetric: both sides of
    a pair must agree on it), or every other rank with ``put_only`` (``DEEP_EP_INTERNODE_PUT_ONLY``).
    ``unreachable[r]``: the ranks that rank ``r`` cannot reach."""
    num_ranks = len(unreachable)
    if put_only:
        return [r for r in range(num_ranks) if r != rank]
    return [r for r in range(num_ranks) if r != rank and (r in unreachable[rank] or rank in unreachable[r])]


def composed_rail(mode: str, hosts: Sequence[str], topology: Topology, num_rdma_bytes: int,
                  has_nvshmem: bool) -> tuple[Optional[str], Optional[str]]:
    """How the composed internode path's rail stage reaches its peers next to the CUDA node stage
    (``DEEP_EP_COMPOSED_RAIL`` = ``mode``): ``('ipc', None)`` (the ring kernels in CUDA IPC buffers), ``('nvshmem',
    None)`` (the ring kernels on the NVSHMEM symmetric heap, ``deep_ep.cuda_internode.SymmetricCuda``), ``('torch',
    None)`` (``TorchBackend`` over the rail subgroup: any node count), or ``(None, why the CUDA node stage cannot
    serve the group)``. ``hosts[r]``: the host name of rank ``r``. The node stage always runs on CUDA IPC, so each
    node's ranks must share a host; ``auto`` takes torch beyond ``NUM_MAX_RING_RANKS`` nodes, else IPC when every
    rank shares one host, else NVSHMEM."""
    if mode not in ("auto", "ipc", "nvshmem", "torch"):
        raise ValueError(f"DEEP_EP_COMPOSED_RAIL must be 'auto', 'ipc', 'nvshmem' or 'torch', got {mode!r}")
    per_node = topology.num_scaleup_ranks
    for node in range(topology.num_scaleout_ranks):
        names = sorted(set(hosts[node * per_node:(node + 1) * per_node]))
        if len(names) > 1:
            return None, (f"the ranks of node {node} span hosts {names} (the node stage needs CUDA IPC; set "
                          f"DEEP_EP_GPUS_PER_NODE to the GPUs per host)")
    if mode == "torch" or (mode == "auto" and topology.num_scaleout_ranks > NUM_MAX_RING_RANKS):
        return "torch", None
    if topology.num_scaleout_ranks > NUM_MAX_RING_RANKS:
        return None, (f"DEEP_EP_COMPOSED_RAIL={mode}: {topology.num_scaleout_ranks} nodes exceed the rail stage's "
                      f"{NUM_MAX_RING_RANKS} ranks (a torch rail serves them)")
    one_host = len(set(hosts)) == 1
    if mode == "ipc" and not one_host:
        return None, f"DEEP_EP_COMPOSED_RAIL=ipc but the ranks span {len(set(hosts))} hosts"
    if mode == "ipc" or (mode == "auto" and one_host):
        return "ipc", None
    if not has_nvshmem:
        return None, "the rail stage across hosts needs NVSHMEM, and the extension was built without it"
    if num_rdma_bytes <= 0:
        return None, "num_rdma_bytes is 0 (the rail stage across hosts runs on the NVSHMEM symmetric heap)"
    return "nvshmem", None


def num_local_experts(num_experts: int, num_ranks: int) -> int:
    """Experts per rank; raises ``ValueError`` unless ``num_experts`` divides by ``num_ranks``."""
    check_int("num_experts", num_experts, 1)
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks ({num_ranks})")
    return num_experts // num_ranks


# Tuned defaults per rank count: (dispatch, combine) chunk settings, keyed by DeepEP's rank counts. Rank counts
# below 8 that DeepEP does not list take the row of the next listed count.
_DEFAULT_CHUNKS: dict[int, tuple[dict[str, int], dict[str, int]]] = {
    2: (dict(nvl_send=24, nvl_recv=256, rdma_send=6, rdma_recv=128),
        dict(nvl_send=10, nvl_recv=256, rdma_send=6, rdma_recv=128)),
    4: (dict(nvl_send=6, nvl_recv=256, rdma_send=6, rdma_recv=128),
        dict(nvl_send=9, nvl_recv=256, rdma_send=6, rdma_recv=128)),
    8: (dict(nvl_send=6, nvl_recv=256, rdma_send=6, rdma_recv=128),
        dict(nvl_send=4, nvl_recv=256, rdma_send=6, rdma_recv=128)),
    16: (dict(nvl_send=36, nvl_recv=288, rdma_send=20, rdma_recv=128),
         dict(nvl_send=4, nvl_recv=288, rdma_send=12, rdma_recv=128)),
    24: (dict(nvl_send=32, nvl_recv=288, rdma_send=8, rdma_recv=128),
         dict(nvl_send=1, nvl_recv=288, rdma_send=8, rdma_recv=128)),
    32: (dict(nvl_send=32, nvl_recv=288, rdma_send=8, rdma_recv=128),
         dict(nvl_send=1, nvl_recv=288, rdma_send=8, rdma_recv=128)),
    48: (dict(nvl_send=32, nvl_recv=288, rdma_send=8, rdma_recv=128),
         dict(nvl_send=1, nvl_recv=288, rdma_send=8, rdma_recv=128)),
    64: (dict(nvl_send=32, nvl_recv=288, rdma_send=8, rdma_recv=128),
         dict(nvl_send=1, nvl_recv=288, rdma_send=8, rdma_recv=128)),
    96: (dict(nvl_send=20, nvl_recv=480, rdma_send=12, rdma_recv=128),
         dict(nvl_send=1, nvl_recv=480, rdma_send=8, rdma_recv=128)),
    128: (dict(nvl_send=20, nvl_recv=560, rdma_send=12, rdma_recv=128),
          dict(nvl_send=1, nvl_recv=560, rdma_send=8, rdma_recv=128)),
    144: (dict(nvl_send=32, nvl_recv=720, rdma_send=12, rdma_recv=128),
          dict(nvl_send=2, nvl_recv=720, rdma_send=8, rdma_recv=128)),
    160: (dict(nvl_send=28, nvl_recv=720, rdma_send=12, rdma_recv=128),
          dict(nvl_send=2, nvl_recv=720, rdma_send=8, rdma_recv=128)),
}
SUPPORTED_NORMAL_RANKS: tuple[int, ...] = tuple(range(1, 9)) + tuple(r for r in _DEFAULT_CHUNKS if r > 8)


def _table_row(num_ranks: int) -> tuple[dict[str, int], dict[str, int]]:
    check_int("num_ranks", num_ranks, 1)
    if num_ranks <= 8:
        return _DEFAULT_CHUNKS[next(r for r in (2, 4, 8) if r >= num_ranks)]
    if num_ranks not in _DEFAULT_CHUNKS:
        raise ValueError(f"Unsupported number of EP ranks: {num_ranks} (supported: {SUPPORTED_NORMAL_RANKS})")
    return _DEFAULT_CHUNKS[num_ranks]


def _make(num_sms: int, row: dict[str, int]) -> Config:
    return Config(num_sms=num_sms,
                  num_max_nvl_chunked_send_tokens=row["nvl_send"],
                  num_max_nvl_chunked_recv_tokens=row["nvl_recv"],
                  num_max_rdma_chunked_send_tokens=row["rdma_send"],
                  num_max_rdma_chunked_recv_tokens=row["rdma_recv"])


# Warps of the 32 in an intranode channel CTA that push rows when R > 1: the others receive (dispatch) or reduce
# (combine), and one publishes the ring counters. An int entry overrides the tuned table below for every call (the
# benchmark and the GPU tests set them between calls); None (the default) takes the table's row.
# intranode_send_warps() clamps either to what each kernel accepts.
INTRANODE_SEND_WARPS: dict[str, Optional[int]] = {"dispatch": None, "combine": None}

# Tuned copy warps by (kernel, dtype): rows (largest channel count, warps), the first row whose bound is >= the
# call's channel count applies, the last row above it. Best split of the 2026-11-30 10:56 sweep on 2 x H200, EP2,
# 4096 tokens, hidden 7168 (docs/performance.md, "Channel and warp sweep"), wall us by warps:
#   dispatch BF16   8 ch: 24 -> 321, 16 -> 325 | 12 ch: 24 -> 223 | 16 ch: 12 -> 195 (191 at 10:46), 16 -> 209
#   dispatch FP8    8 ch: 24 -> 196, 20 -> 198 | 12 ch: 24 -> 144 | 16 ch: 24 -> 116 (116 at 10:46), 16 -> 129
#   combine         8 ch: 8 -> 420, 10 -> 436  | 12 ch: 8 -> 302  | 16 ch: 8 -> 241, 10 -> 264
#                   24 ch: 6 -> 231, 5 -> 237
INTRANODE_SEND_WARP_TABLE: dict[tuple[str, str], tuple[tuple[int, int], ...]] = {
    ("dispatch", "bf16"): ((12, 24), (16, 12), (24, 16)),
    ("dispatch", "fp8"): ((16, 24), (24, 12)),
    ("combine", "bf16"): ((16, 8), (24, 6)),
}

# Channels the intranode kernels use, by rank count: config.num_sms is a budget, and above this cap more channels
# measured slower, so the kernels run the cap's count and leave the other SMs free. EP2 (10:46 and 10:56 sweeps):
# BF16 dispatch 217 us at 24 channels, 191-195 us at 16; FP8 dispatch 120 vs 116 us; combine 231 vs 241 us. Rank
# counts without a measured cap use config.num_sms channels.
INTRANODE_MAX_CHANNELS: dict[int, int] = {2: 16}


def intranode_channels(num_sms: int, num_ranks: int) -> int:
    """Channels (one CTA each) of the intranode kernels for a budget of ``num_sms`` SMs and ``num_ranks`` ranks."""
    return min(num_sms, INTRANODE_MAX_CHANNELS.get(num_ranks, num_sms))


def send_warp_range(kernel: str, num_ranks: int) -> tuple[int, int]:
    """Copy warps per channel the ring ``kernel`` accepts with ``num_ranks`` ranks: dispatch [2, 32 - R] (the
    publisher and a receiver warp per source remain), combine [R - 1, 30] (a ring sender per destination; the
    publisher and a reducer remain)."""
    return (2, 32 - num_ranks) if kernel == "dispatch" else (num_ranks - 1, 30)


def intranode_send_warps(kernel: str, num_ranks: int, num_channels: int = 24, fp8: bool = False) -> int:
    """Copy warps per channel of the intranode ``kernel`` ('dispatch' or 'combine') for ``num_ranks`` ranks and
    ``num_channels`` channels (``fp8``: an FP8 dispatch): the override of ``INTRANODE_SEND_WARPS`` or the tuned
    table's row, clamped to ``send_warp_range``."""
    lowest, highest = send_warp_range(kernel, num_ranks)
    warps = INTRANODE_SEND_WARPS[kernel]
    if warps is None:
        rows = INTRANODE_SEND_WARP_TABLE[(kernel, "fp8" if fp8 and kernel == "dispatch" else "bf16")]
        warps = next((w for bound, w in rows if num_channels <= bound), rows[-1][1])
    return min(max(warps, lowest), highest)


# Receive path of intranode dispatch (design guide §2.8): None follows DEEP_EP_DISPATCH_RECEIVE; tests and the
# benchmark set 'auto', 'rings' or 'direct' here to compare the paths within one process.
INTRANODE_DISPATCH_RECEIVE: Optional[str] = None
DISPATCH_RECEIVE_MODES = ("auto", "rings", "direct")


# Send path of intranode combine: None follows DEEP_EP_COMBINE_COPY ('auto', 'copy', 'rings' or 'zone'); tests and
# the benchmark set it here. 'auto' takes the copy engine for SM budgets up to COMBINE_COPY_MAX_SMS and the zone
# senders from COMBINE_ZONE_MIN_SMS up: 2 x H200, EP2, 4096 tokens, hidden 7168 (docs/performance.md, "Copy-engine
# combine" and "Zone-sender combine"), wall us copy engine vs rings: 8 SMs 315 vs 436, 12 SMs 259 vs 306, 16 SMs 254
# vs 241, 24 SMs 240 vs 241; zone senders (4 per CTA) vs rings: 20 SMs 229 vs 240, 24 SMs 214-235 vs 238-239, 32
# SMs (32 CTAs) 246 vs 239, 48 SMs 223 vs 240. COMBINE_COPY_CHUNK_ROWS: rows per copy-engine chunk (each chunk ends
# with a flag the reducers wait for; the first chunks are smaller so that the reducers start early).
# COMBINE_ZONE_SEND_WARPS: sender warps per CTA of the zone kernel (20 warps; a stripe is that many rows), unless
# INTRANODE_SEND_WARPS['combine'] overrides it; the zone kernel runs min(budget, COMBINE_ZONE_MAX_CTAS) CTAs.
INTRANODE_COMBINE_COPY: Optional[str] = None
COMBINE_COPY_MODES = ("auto", "copy", "rings", "zone")
COMBINE_COPY_MAX_SMS = 12
COMBINE_COPY_CHUNK_ROWS = 512
COMBINE_ZONE_MIN_SMS = 20
COMBINE_ZONE_WARPS = 20  # the kernel's warps per CTA (csrc/kernels/intranode.cu, kZoneWarps)
COMBINE_ZONE_SEND_WARPS = 4
COMBINE_ZONE_MAX_CTAS = 24


def combine_send_path(num_sms: int) -> str:
    """The send path an intranode combine with a budget of ``num_sms`` SMs asks for: 'copy' (copy engine), 'zone'
    (sender warps storing straight into the owners' landing zones, all CTAs reducing) or 'rings'. The landing-zone
    paths still need the dispatch's counts on the host and zones that fit, else the call takes the rings."""
    mode = combine_copy_mode()
    if mode == "auto":
        return "copy" if num_sms <= COMBINE_COPY_MAX_SMS else "zone" if num_sms >= COMBINE_ZONE_MIN_SMS else "rings"
    return mode


def zone_send_warps() -> int:
    """Sender warps per CTA of the zone-sender combine: INTRANODE_SEND_WARPS['combine'] or COMBINE_ZONE_SEND_WARPS,
    clamped to [1, COMBINE_ZONE_WARPS - 2] (the kernel also needs its publisher warp and a reducer)."""
    warps = INTRANODE_SEND_WARPS["combine"]
    return min(max(COMBINE_ZONE_SEND_WARPS if warps is None else warps, 1), COMBINE_ZONE_WARPS - 2)


def zone_ctas(num_sms: int) -> int:
    """CTAs of the zone-sender combine for a budget of ``num_sms`` SMs: at most COMBINE_ZONE_MAX_CTAS."""
    return max(1, min(num_sms, COMBINE_ZONE_MAX_CTAS))


def combine_by_copy_engine(num_sms: int) -> bool:
    """Whether an intranode combine with a budget of ``num_sms`` SMs asks for the copy-engine path."""
    return combine_send_path(num_sms) == "copy"


def combine_copy_mode() -> str:
    """'auto' (copy engine for budgets up to COMBINE_COPY_MAX_SMS SMs, zone senders from COMBINE_ZONE_MIN_SMS, where
    they apply, else rings), 'copy' (copy engine wherever it applies), 'rings', or 'zone' (sender warps storing into
    the landing zones wherever they apply)."""
    mode = INTRANODE_COMBINE_COPY if INTRANODE_COMBINE_COPY is not None else envs.COMBINE_COPY.get()
    if mode not in COMBINE_COPY_MODES:
        raise ValueError(f"combine copy mode (DEEP_EP_COMBINE_COPY or deep_ep.config.INTRANODE_COMBINE_COPY) must "
                         f"be one of {COMBINE_COPY_MODES}, got {mode!r}")
    return mode


def dispatch_receive_mode() -> str:
    """'auto' (direct-to-output when the output pool has room, else rings), 'rings' or 'direct'."""
    mode = INTRANODE_DISPATCH_RECEIVE if INTRANODE_DISPATCH_RECEIVE is not None else envs.DISPATCH_RECEIVE.get()
    if mode not in DISPATCH_RECEIVE_MODES:
        raise ValueError(f"dispatch receive mode (DEEP_EP_DISPATCH_RECEIVE or "
                         f"deep_ep.config.INTRANODE_DISPATCH_RECEIVE) must be one of {DISPATCH_RECEIVE_MODES}, "
                         f"got {mode!r}")
    return mode


def ll_combine_by_partials(mode: str, num_ranks: int, num_topk: int, num_experts: int, hidden: int, all_p2p: bool,
                           use_logfmt: bool, zero_copy: bool, return_recv_hook: bool) -> bool:
    """Whether the LL combine runs by per-rank fp32 partial sums (``DEEP_EP_LL_PARTIALS`` = ``mode``).

    Structural conditions (the kernel's): a fused launch (no receive hook), no LogFMT, every peer reached by pointer
    on every rank, 2 to 8 ranks, ``num_experts / num_ranks >= 3`` (the partial and routing areas fit the receive
    area), and with ``zero_copy`` ``hidden % 512 == 0`` (16-byte aligned send slots). ``auto`` also asks for
    ``num_topk >= 3 * num_ranks``: ~3 or more of a token's rows per rank, so one fp32 partial (4H bytes) replaces at
    least 6H bytes of BF16 rows and pays for the owner's routing message. Same answer on every rank."""
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"DEEP_EP_LL_PARTIALS must be 'auto', '0' or '1', got {mode!r}")
    if mode == "0":
        return False
    structural = (not return_recv_hook and not use_logfmt and all_p2p and 2 <= num_ranks <= 8
                  and num_experts // num_ranks >= 3 and (not zero_copy or hidden % 512 == 0))
    return structural and (mode == "1" or num_topk >= 3 * num_ranks)


def get_dispatch_config(num_ranks: int, num_sms: int = 20) -> Config:
    """Tuned default dispatch config for ``num_ranks`` ranks and ``num_sms`` SMs."""
    return _make(num_sms, _table_row(num_ranks)[0])


def get_combine_config(num_ranks: int, num_sms: int = 20) -> Config:
    """Tuned default combine config for ``num_ranks`` ranks and ``num_sms`` SMs."""
    return _make(num_sms, _table_row(num_ranks)[1])
