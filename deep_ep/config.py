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

from dataclasses import dataclass

from deep_ep import envs, layout

# Group limits and alignment, defined in deep_ep.layout (which imports nothing from deep_ep) and importable from here.
from deep_ep.layout import BUFFER_ALIGNMENT as BUFFER_ALIGNMENT
from deep_ep.layout import NUM_MAX_FUSED_RANKS as NUM_MAX_FUSED_RANKS
from deep_ep.layout import NUM_MAX_RING_RANKS as NUM_MAX_RING_RANKS
from deep_ep.layout import NUM_MAX_RUNTIME_RANKS as NUM_MAX_RUNTIME_RANKS
from deep_ep.layout import align_up as align_up
from deep_ep.layout import ceil_div as ceil_div

# Largest scale-up (NVLink) domain a node may have; DeepEP's NUM_MAX_NVL_PEERS.
NUM_MAX_SCALEUP_RANKS = 8
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
# Bytes of an int32 / float32 word in the size-hint formulas.
_WORD_BYTES = 4
# Largest num_rdma_bytes the Buffer takes outside low-latency mode (DeepEP's int limit), rounded down to the alignment.
_MAX_NORMAL_RDMA_BYTES = (2**31 - 1) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT
# Ring sequence sentinel used by combine's rewrite of skipped send-head entries.
SEND_HEAD_SENTINEL = 1 << 25


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
        num_sms: the SM budget of a call, even (as in DeepEP). The normal kernels run one channel (a CTA) per SM,
            at most a tuned cap per rank count (``deep_ep.backends.cuda_tuning.intranode_channels``); every
            backend's handles have that many channels.
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

    def describe(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl_send={self.num_max_nvl_chunked_send_tokens}, "
                f"nvl_recv={self.num_max_nvl_chunked_recv_tokens}, rdma_send={self.num_max_rdma_chunked_send_tokens}, "
                f"rdma_recv={self.num_max_rdma_chunked_recv_tokens})")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of scale-up buffer the normal kernels need (DeepEP's formula, :func:`nvl_buffer_size_hint`)."""
        return nvl_buffer_size_hint(self, hidden_bytes, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of scale-out buffer the normal internode kernels need; 0 within one node."""
        return rdma_buffer_size_hint(self, hidden_bytes, num_ranks)


# ---------------------------------------------------------------------------------------------------------------
# Normal-mode size hints: DeepEP's formulas, so that buffers sized for DeepEP fit here too. They count a channel per
# pair of SMs, as DeepEP's kernels do; the ring kernels carve whatever buffer they get (deep_ep.layout). The fused
# internode kernels take one buffer of num_nvl_bytes + num_rdma_bytes with rings of the Config's capacities, so the
# scale-out hint is raised to cover them where they serve the group.
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
    deepep_channels = config.num_sms // 2
    num_nvl = min(num_ranks, NUM_MAX_SCALEUP_RANKS)
    num_rdma = max(num_ranks // NUM_MAX_SCALEUP_RANKS, 1)
    slots = deepep_channels * num_nvl * config.num_max_nvl_chunked_recv_tokens
    num_bytes = (deepep_channels * num_nvl * (2 * num_rdma + 3) * _WORD_BYTES
                 + slots * hidden_bytes
                 + slots * SOURCE_META_BYTES
                 + slots * NUM_HINT_MAX_TOPK * topk_idx_bytes
                 + slots * NUM_HINT_MAX_TOPK * _WORD_BYTES
                 + slots * NUM_HINT_MAX_SCALES * _WORD_BYTES)
    return align_up(num_bytes, BUFFER_ALIGNMENT)


def rdma_buffer_size_hint(config: Config, hidden_bytes: int, num_ranks: int, topk_idx_bytes: int = 8) -> int:
    """Scale-out buffer bytes for the normal internode kernels, rounded up to 128; 0 within one node.

    DeepEP's formula (:func:`deepep_rdma_buffer_size_hint`); for groups the fused internode kernels may serve (more
    than 8, at most ``NUM_MAX_FUSED_RANKS`` ranks) at least :func:`fused_buffer_bytes` less
    :func:`nvl_buffer_size_hint`, so that the two hints together hold the fused kernels' one buffer, but never past
    what the Buffer accepts as ``num_rdma_bytes`` outside low-latency mode (``2**31 - 1``, DeepEP's limit; a config
    that needs more, such as 48 SMs at 64 ranks, then needs a larger ``num_nvl_bytes``, which a refused call names).
    """
    deepep = deepep_rdma_buffer_size_hint(config, hidden_bytes, num_ranks, topk_idx_bytes)
    if num_ranks <= NUM_MAX_SCALEUP_RANKS or num_ranks > NUM_MAX_FUSED_RANKS:
        return deepep
    fused = fused_buffer_bytes(config, hidden_bytes, num_ranks)
    raised = min(fused - nvl_buffer_size_hint(config, hidden_bytes, num_ranks, topk_idx_bytes), _MAX_NORMAL_RDMA_BYTES)
    return max(deepep, raised)


def deepep_rdma_buffer_size_hint(config: Config, hidden_bytes: int, num_ranks: int, topk_idx_bytes: int = 8) -> int:
    """DeepEP's scale-out buffer bytes (what DeepEP V1's own kernels take), rounded up to 128; 0 within one node."""
    if num_ranks <= NUM_MAX_SCALEUP_RANKS:
        return 0
    _check_normal_ranks(num_ranks)
    if config.num_sms % 2 != 0:
        raise ValueError(f"num_sms must be even, got {config.num_sms}")
    deepep_channels = config.num_sms // 2
    num_rdma = num_ranks // NUM_MAX_SCALEUP_RANKS
    record = (hidden_bytes + SOURCE_META_BYTES + NUM_HINT_MAX_TOPK * topk_idx_bytes
              + NUM_HINT_MAX_TOPK * _WORD_BYTES + NUM_HINT_MAX_SCALES * _WORD_BYTES + 16)
    num_bytes = (deepep_channels * num_rdma * (NUM_MAX_SCALEUP_RANKS * 2 + 2) * 2 * _WORD_BYTES
                 + 2 * deepep_channels * num_rdma * config.num_max_rdma_chunked_recv_tokens * record)
    return align_up(num_bytes, BUFFER_ALIGNMENT)


def fused_buffer_bytes(config: Config, hidden_bytes: int, num_ranks: int) -> int:
    """Bytes of the one buffer (``num_nvl_bytes + num_rdma_bytes``) the fused internode kernels need to run both the
    dispatch and the combine under ``config`` at ``num_ranks`` ranks, 8 per node (DeepEP's assumption), with NVSHMEM
    put peers (ranks behind a NIC: rail staging and put area). Each half holds the rings of the largest record the
    kernels build for ``hidden_bytes`` (BF16-sized, as in DeepEP): BF16 rows with ``NUM_MAX_TOPK`` top-k (FP8 rows
    with a scale per 128 channels, and combine rows, take fewer bytes). Channels, ring capacities and the buffer
    are those FusedInternodeCuda.check_rings asks for (deep_ep/backends/fused_internode.py)."""
    record = layout.intranode_dispatch_record_bytes(hidden_bytes, 0, NUM_MAX_TOPK)
    rings = fused_config_ring_bytes(config, num_ranks // NUM_MAX_SCALEUP_RANKS, NUM_MAX_SCALEUP_RANKS, record,
                                    staged=True)
    return layout.fused_min_rdma_bytes(rings, put_area=True)


def fused_channels(config: Config) -> int:
    """Channels of a fused internode call: one per two SMs (a sending-and-forwarding CTA and a receiving CTA), as
    DeepEP's internode kernels."""
    return max(1, config.num_sms // 2)


def fused_config_ring_bytes(config: Config, num_nodes: int, gpus_per_node: int, record_bytes: int,
                            staged: bool) -> int:
    """Bytes of one direction's fused rings under ``config`` (:func:`deep_ep.layout.fused_ring_bytes`):
    :func:`fused_channels` channels, ``num_max_rdma_chunked_recv_tokens`` rail slots (a multiple of the send chunk,
    as Config rounds it) and the node slots of :func:`deep_ep.layout.fused_node_ring`."""
    node_slots, _ = layout.fused_node_ring(config.num_max_nvl_chunked_send_tokens,
                                           config.num_max_nvl_chunked_recv_tokens, num_nodes)
    return layout.fused_ring_bytes(num_nodes, gpus_per_node, fused_channels(config), record_bytes,
                                   config.num_max_rdma_chunked_recv_tokens, node_slots, staged)


@dataclass(frozen=True)
class Topology:
    """How ``num_ranks`` global ranks map onto scale-up domains.

    Rank ``r`` sits in node ``r // num_scaleup_ranks`` at local index ``r % num_scaleup_ranks``. With the
    default of 8 this is DeepEP's mapping. ``DEEP_EP_GPUS_PER_NODE`` lowers it so that one host acts as
    several virtual nodes.
    """

    num_ranks: int
    num_scaleup_ranks: int = NUM_MAX_SCALEUP_RANKS

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


def get_dispatch_config(num_ranks: int, num_sms: int = 20) -> Config:
    """Tuned default dispatch config for ``num_ranks`` ranks and ``num_sms`` SMs."""
    return _make(num_sms, _table_row(num_ranks)[0])


def get_combine_config(num_ranks: int, num_sms: int = 20) -> Config:
    """Tuned default combine config for ``num_ranks`` ranks and ``num_sms`` SMs."""
    return _make(num_sms, _table_row(num_ranks)[1])
