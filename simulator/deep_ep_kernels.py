"""The ``--kernels deep_ep`` family: how deep_ep's own kernels move bytes, and their calibrated costs.

* Intranode normal: sender warps load each row once and store it to every destination (the own ``recv_x``; a peer's
  ``recv_x`` with the direct-to-output receive, ``receive_copies = 0``, or its ring, ``1``); combine by ring senders,
  the copy engine or zone senders (:func:`normal_work`), the owner reducing in fp32.
* Low latency: one dispatch message per (token, destination rank), expanded by the receiver; one BF16 combine row
  per (token, expert) back to the owner, who reduces each token (:func:`ll_phase_times`).
* Internode: one GPU per node runs the ring kernels over NVSHMEM (over NVLink P2P for virtual nodes, ``nvlink-p2p``);
  several GPUs per node the fused kernels up to ``NUM_MAX_FUSED_RANKS`` ranks (:mod:`simulator.deep_ep_fused`), the
  composed path beyond (:mod:`simulator.deep_ep_composed`, its rail stage the torch backend); one GPU per node past
  ``NUM_MAX_RING_RANKS`` nodes the torch backend (:mod:`simulator.deep_ep_torch`).

Cost of one rank, ``C`` SMs sharing the SM-µs: ``fixed + serial_sm_us / C + max(push_bytes / (C * sm_push_gbps),
busiest port bytes / port rate)``; the DES (:func:`simulate_normal`) runs the same costs through fluid ports.
Parameters: :data:`DEFAULTS` (labelled ``assumed``) overridden by ``simulator/data/calibration_deep_ep.json``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from deep_ep.backends.cuda_tuning import COMBINE_COPY_CHUNK_ROWS, combine_send_path, intranode_channels, zone_ctas
from deep_ep.config import FP8_BLOCK, NUM_MAX_LL_TOPK, NUM_MAX_RING_RANKS, ceil_div
from deep_ep.layout import intranode_combine_record_bytes, intranode_dispatch_record_bytes
from simulator.deep_ep_composed import composed_rank_times, composed_result, composed_stages, is_composed
from simulator.deep_ep_fused import fused_rank_times, is_fused, simulate_fused
from simulator.deep_ep_torch import torch_rank_times, torch_result
from simulator.hardware import GpuProfile, NicProfile
from simulator.links import GBPS
from simulator.rank import (
    FlowSpec,
    OpResult,
    OpSpec,
    _finish,
    _nvlink_peers,
    _Ports,
    _Usage,
    ll_send_recv,
    nic_rate,
    normal_logical_bytes,
    run_rank_flows,
    token_bytes,
)
from simulator.workload import SourceTraffic, read_json

# Buffer's default RDMA queue pairs per peer.
DEFAULT_NUM_QPS_PER_RANK = 24
# Measurements and fits the simulator reads (each file names its machine, date and command).
DATA_DIR = Path(__file__).with_name("data")
CALIBRATION_PATH = DATA_DIR / "calibration_deep_ep.json"


@dataclass(frozen=True)
class DeepEpProfile:
    """Costs of deep_ep's kernels on one SM90 GPU (link rates come from the GPU / NIC profile).

    Attributes:
        sm_push_gbps: per-SM rate of remote stores (pushes over NVLink or P2P puts), GB/s per SM; overlaps the link.
        sm_local_gbps: per-SM rate of local copies (local bypass x -> recv_x, ring -> recv_x), GB/s per SM.
        row_ns: SM cost per row a sender stores (planner, metadata, send_head), ns of SM-time.
        chunk_sync_us: SM-time per published chunk (group barrier, system fence, tail store), µs.
        reduce_gbps: per-SM rate at which the combine reducer reads contributions (fp32 add, one rounding), GB/s.
        nvl_efficiency: fraction of ``GpuProfile.nvlink_gbps`` our pushes reach.
        launch_us: fixed cost of a cached normal call (launch, first chunk, last drain), µs.
        combine_extra_us: extra fixed cost of a combine call (the reducer waits for the last ring slots), µs.
        receive_copies: receive copies per row of intranode dispatch: 0 = direct-to-output (Buffer's default when
            its output pool has room), 1 = rings (receiver warps copy each ring slot into ``recv_x``). Records
            put over a NIC (one GPU per node) always take the ring copy.
        dispatch_chunk / combine_chunk: tokens per published chunk (``Sn``) used for predictions.
        ll_fixed_us: fixed part of a fused low-latency kernel (cooperative launch of the whole grid, top-k count
            pass, count signals, drain), µs.
        ll_hook_fixed_us: fixed part of each launch of a hook-mode LL combine (the send kernel, the receive
            kernel), µs.
        ll_hook_dispatch_extra_us: added to each launch of a hook-mode LL dispatch (the count pass before the sends,
            the count wait before the expansion), µs.
        ll_overlap_us: part of the fixed cost that the send phase's stores overlap (they leave before the grid's
            signals and drain are done), µs: a phase costs ``fixed + max(0, send - ll_overlap_us)``.
        ll_send_gbps: per-SM rate of the LL dispatch send phase (read the BF16 token, cast it to FP8, store the
            message to every destination rank, its own included), GB/s of message bytes per SM.
        ll_expand_gbps: per-SM rate at which the LL dispatch receiver expands messages into per-expert rows, GB/s of
            row bytes per SM.
        ll_reduce_gbps: per-SM rate of the LL combine reduction (contribution bytes read, own rows included), GB/s.
        ll_nvl_efficiency: fraction of ``GpuProfile.nvlink_gbps`` the LL stores reach (per direction, both
            directions busy).
        ll_header_bytes_per_topk: LL dispatch header bytes per top-k slot (``expert << 16 | row`` int32 per slot of
            the kernels' ``NUM_MAX_LL_TOPK`` slots, after the int32 source token).
        internode_extra_us: added to ``launch_us`` for internode calls with a network stage (NVSHMEM signal round
            trip), µs; not for one GPU per virtual node, which runs the intranode kernels over P2P.
        ce_gbps: copy-engine rate per direction of the copy-engine intranode combine while the SMs reduce, GB/s.
        ce_chunk_us: copy-engine time lost per chunk of that combine (the chunk's end drains the engine), µs.
        ce_reduce_gbps: per-SM rate at which its reducing kernel (every warp reduces) reads contributions, GB/s.
        zone_link_gbps: rate per direction at which the zone-sender intranode combine's sender warps move the rows
            to the peers while the other warps reduce, GB/s.
        zone_reduce_gbps: per-CTA rate at which the zone kernel's reducer warps (those left by the default sender
            warps and the publisher) read contributions, GB/s.
        composed_copy_gbps: rate of the composed internode path's torch copies between its stages (bytes read plus
            bytes written), GB/s (:mod:`simulator.deep_ep_composed`).
        composed_host_us: fixed cost the composed path adds to a call (its own host work and launches), µs.
        torch_call_us: host work of one torch-backend normal call (count exchange, the host syncs that size its
            outputs, Python) where the kernels do not serve the group, µs (:mod:`simulator.deep_ep_torch`).
        torch_p2p_efficiency: fraction of the link's rate the torch backend's NCCL point-to-point rows reach.
        warp_push_gbps: rate of one warp storing rows to a peer over NVLink (16-byte stores, 4 loads in flight per
            lane), GB/s per warp: the fused kernels' forwarders (dispatch) and senders (combine), teams of warps.
        warp_local_gbps: rate of one warp copying rows within its GPU, GB/s per warp: the fused kernels'
            receivers, staging senders and reducers (bytes read).
        fused_row_ns: control cost of one record in a fused kernel's ring team, paid by the warp that takes the
            record, ns.
        fused_chunk_us: turn-around of one published chunk on a fused kernel's ring (the team's progress
            handshake, the tail or credit store and fence, the consumer's poll), µs per chunk of its team.
        fused_hbm_efficiency: fraction of the GPU's HBM rate that a fused kernel's copies reach (each byte a role
            moves is read once and written once in HBM); binds where ranks share one GPU.
    """

    sm_push_gbps: float = 46.0
    sm_local_gbps: float = 75.0
    row_ns: float = 60.0
    chunk_sync_us: float = 1.0
    reduce_gbps: float = 75.0
    nvl_efficiency: float = 1.0
    launch_us: float = 10.0
    combine_extra_us: float = 10.0
    receive_copies: int = 0
    dispatch_chunk: int = 16
    combine_chunk: int = 8
    ll_fixed_us: float = 7.0
    ll_hook_fixed_us: float = 5.0
    ll_hook_dispatch_extra_us: float = 2.0
    ll_overlap_us: float = 2.0
    ll_send_gbps: float = 7.5
    ll_expand_gbps: float = 75.0
    ll_reduce_gbps: float = 75.0
    ll_nvl_efficiency: float = 1.0
    ll_header_bytes_per_topk: int = 4
    internode_extra_us: float = 5.0
    ce_gbps: float = 310.0
    ce_chunk_us: float = 6.0
    ce_reduce_gbps: float = 48.0
    zone_link_gbps: float = 284.0
    zone_reduce_gbps: float = 27.25
    composed_copy_gbps: float = 3000.0
    composed_host_us: float = 10.0
    torch_call_us: float = 200.0
    torch_p2p_efficiency: float = 0.8
    warp_push_gbps: float = 3.84
    warp_local_gbps: float = 3.59
    fused_row_ns: float = 60.0
    fused_chunk_us: float = 1.0
    fused_hbm_efficiency: float = 0.8
    sources: tuple[tuple[str, str], ...] = ()

    def source_of(self, param: str) -> str:
        return dict(self.sources).get(param, "assumed")

    def describe(self) -> list[tuple[str, object, str]]:
        return [(f.name, getattr(self, f.name), self.source_of(f.name)) for f in fields(self) if f.name != "sources"]


# Source of every parameter a calibration file does not set: an estimate (``assumed``), the kernels' design or a
# measurement the simulator's tests check.
_ASSUMED = {
    "sm_push_gbps": "assumed: one SM pushing 16-byte stores over NVLink with 4 loads in flight (~46 GB/s)",
    "sm_local_gbps": "assumed: local copies at high parallelism (60-90 GB/s per SM)",
    "row_ns": "assumed: per-row SM cost of DeepEP V1's fit (simulator/hardware.py sm_token_ns ~118 ns) halved for "
              "the load-once sender",
    "chunk_sync_us": "assumed: a system fence with remote stores outstanding (~1 µs); alternating sender groups "
                     "hide the rest",
    "reduce_gbps": "assumed: as sm_local_gbps (the reducer streams contributions from HBM)",
    "nvl_efficiency": "assumed: pushes reach the GPU profile's SM-store peak",
    "launch_us": "assumed: kernel launch + first chunk + drain",
    "combine_extra_us": "assumed",
    "receive_copies": "design: direct-to-output, Buffer's default when its output pool has room; 1 = rings",
    "dispatch_chunk": "assumed: the best Sn of the intranode chunk sweeps lies in 8..24",
    "combine_chunk": "assumed: the best Sn of the intranode chunk sweeps lies in 4..16",
    "ce_gbps": "measured: copy-engine combine chunk sweep on 2 x H200 (simulator/data/combine_copy_h200x2.json; 24 "
               "SMs, 128..1024-row chunks: time ~ 190-198 us + 6 us per chunk for 58.5 MB); its 16 points within 12 %",
    "ce_chunk_us": "measured: the same sweep's slope, 5.8-6.3 us per chunk",
    "ce_reduce_gbps": "measured: copy-engine combine at 8 SMs, 305 us of reduction for 117 MB of contributions",
    "zone_link_gbps": "measured: zone-sender combine on 2 x H200 (simulator/data/combine_zone_h200x2.json, 4 sender "
                      "warps, 16-24 CTAs: 212 us at 24 CTAs for 58.5 MB); its 9 points within 4 %",
    "zone_reduce_gbps": "measured: the same points, 20 and 16 CTAs (reduction-bound: 229-233 and 271 us)",
    "ll_fixed_us": "assumed: top-k scan ~2 µs, count signals ~2 µs, launch ~3 µs",
    "ll_hook_fixed_us": "assumed: one kernel launch + grid drain per hook-mode phase",
    "ll_hook_dispatch_extra_us": "assumed: the top-k count pass (~2 µs)",
    "ll_overlap_us": "assumed: the count signals (~2 µs) overlap the last stores",
    "ll_send_gbps": "assumed: at T = 128 one token per CTA, its cast and two 7472-byte messages in ~2 µs",
    "ll_expand_gbps": "assumed: as sm_local_gbps (local copies)",
    "ll_reduce_gbps": "assumed: as reduce_gbps",
    "ll_nvl_efficiency": "assumed: LL stores reach the GPU profile's SM-store peak",
    "ll_header_bytes_per_topk": "design: the LL message header, int32 [1 + NUM_MAX_LL_TOPK] (source token, then "
                                "expert << 16 | row per slot)",
    "internode_extra_us": "assumed: one NVSHMEM signal round trip per call (internode with a network stage)",
    "composed_copy_gbps": "assumed: torch copy kernels at ~60 % of H200 HBM (4.8 TB/s), bytes read plus written; "
                          "not measured with one rank per GPU (that needs 4 or more GPUs)",
    "composed_host_us": "assumed: the composed layer's few torch ops per cached call, mostly hidden behind the GPU",
    "torch_call_us": "assumed: a torch.distributed exchange of counts, two host syncs and Python per call (~0.1-0.3 "
                     "ms); not measured over NCCL",
    "torch_p2p_efficiency": "assumed: NCCL send/recv of MB-sized messages at ~80 % of the link's rate",
    "warp_push_gbps": "measured: lower bound, the intranode sweep's point with the fewest copy warps per SM "
                      "(simulator/data/intranode_sweep_h200x2.json, BF16 dispatch at 20 SMs x 8 sender warps: 614.9 "
                      "GB/s of rows, half of them over NVLink) / 160 warps; a lone warp may move more",
    "warp_local_gbps": "measured: lower bound, the one-GPU proxy's BF16 dispatch into the own buffer at 16 SMs x 12 "
                       "sender warps, 689.8 GB/s kernel (benchmarks/results/intranode_h200x1.json) / 192 warps; a "
                       "lone warp may move more",
    "fused_row_ns": "assumed: as row_ns's prior, one record's metadata and progress handshake",
    "fused_chunk_us": "assumed: as chunk_sync_us, a system fence with remote stores outstanding",
    "fused_hbm_efficiency": "assumed: large copies reach ~80 % of HBM's rate",
}
DEFAULTS = DeepEpProfile(sources=tuple(_ASSUMED.items()))
# Parameters a bench JSON of the intranode kernels can fit (the rest stay at their labelled assumptions).
INTRANODE_FIT_PARAMS = ("launch_us", "combine_extra_us", "sm_push_gbps", "sm_local_gbps", "row_ns", "reduce_gbps",
                        "nvl_efficiency")
# Parameters a bench JSON of the fused internode kernels on one GPU (benchmarks/bench_internode.py --composed) fits;
# only the fused kernels use them (that fit also sets warp_push_gbps to warp_local_gbps's value).
FUSED_FIT_PARAMS = ("warp_local_gbps", "fused_row_ns", "fused_chunk_us", "fused_hbm_efficiency")
# Parameters a bench JSON of the low-latency kernels (benchmarks/bench_low_latency.py) can fit; none is shared with
# the normal-mode kernels, so an LL fit leaves every normal-mode prediction as it was.
LL_FIT_PARAMS = ("ll_fixed_us", "ll_hook_fixed_us", "ll_hook_dispatch_extra_us", "ll_overlap_us", "ll_send_gbps",
                 "ll_expand_gbps", "ll_reduce_gbps", "ll_nvl_efficiency")


def load_profile(path: Path | str | None = None) -> DeepEpProfile:
    """:data:`DEFAULTS` with the values of a calibration JSON (``{"params": {name: {"value", "source"}}}``).

    A missing file gives the defaults; a malformed one raises ``ValueError`` naming the file and the entry.
    """
    path = Path(path) if path is not None else CALIBRATION_PATH
    if not path.exists():
        return DEFAULTS
    data = read_json(str(path), f"deep_ep calibration {path}")
    params = data.get("params") if isinstance(data, dict) else None
    if not isinstance(params, dict):
        raise ValueError(f"deep_ep calibration {path}: needs an object 'params' of {{name: {{value, source}}}}")
    known = {f.name: f.type for f in fields(DeepEpProfile) if f.name != "sources"}
    values, sources = {}, dict(DEFAULTS.sources)
    for name, entry in params.items():
        if name not in known:
            raise ValueError(f"deep_ep calibration {path}: unknown parameter {name!r} (known: {sorted(known)})")
        if not isinstance(entry, dict) or not isinstance(entry.get("value"), (int, float)):
            raise ValueError(f"deep_ep calibration {path}: params.{name} needs a numeric 'value', got {entry!r}")
        value = entry["value"]
        values[name] = int(value) if known[name] == "int" else float(value)
        sources[name] = str(entry.get("source", f"fit: {path.name}"))
    return replace(DEFAULTS, **values, sources=tuple(sources.items()))


_PROFILE: DeepEpProfile | None = None


def profile() -> DeepEpProfile:
    """The profile the ``deep_ep`` family uses (calibration file read once per process)."""
    global _PROFILE
    if _PROFILE is None:
        _PROFILE = load_profile()
    return _PROFILE


def use_profile(prof: DeepEpProfile | None) -> DeepEpProfile | None:
    """Make ``prof`` the profile of the ``deep_ep`` family (``None``: reload the file on next use); returns the
    previous one."""
    global _PROFILE
    previous, _PROFILE = _PROFILE, prof
    return previous


# ---------------------------------------------------------------------------------------------------------------
# Byte sizes
# ---------------------------------------------------------------------------------------------------------------

def dispatch_record_bytes(hidden: int, dtype: str, topk: int) -> int:
    """One intranode dispatch ring record (``deep_ep.layout``): hidden, scales, source index, top-k ids/weights."""
    hidden_bytes = hidden if dtype == "fp8" else 2 * hidden
    num_scales = hidden // FP8_BLOCK if dtype == "fp8" else 0
    return intranode_dispatch_record_bytes(hidden_bytes, num_scales, topk)


def ll_dispatch_message_bytes(hidden: int, dtype: str, topk: int, prof: DeepEpProfile) -> int:
    """One LL dispatch message per (token, destination rank): header (int32 source token + one word per top-k slot
    of the kernels' ``NUM_MAX_LL_TOPK`` slots, whatever ``topk`` is; 16-B padded) + row (80 + 7392 B for FP8 at
    H = 7168)."""
    del topk  # the header has room for the kernels' largest top-k
    header = ceil_div(4 + NUM_MAX_LL_TOPK * prof.ll_header_bytes_per_topk, 16) * 16
    return header + token_bytes(hidden, dtype)


# ---------------------------------------------------------------------------------------------------------------
# Normal mode (intranode and internode): per-rank work and flows
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class NormalWork:
    """What each rank of one normal op does.

    Attributes:
        serial_sm_us: ``[R]`` SM-µs that do not overlap link transfers.
        kinds / caps: port kinds and capacities (bytes/µs) of the DES; ``sm_push`` is the SM budget for remote
            stores (``C * sm_push_gbps``).
        flows: one flow per source rank (``FlowSpec``); the closed form uses their per-port loads.
        fixed_us: fixed cost of the call.
        channels: CTAs the op runs (``C``; below ``num_sms`` where deep_ep caps the intranode channels).
    """

    serial_sm_us: np.ndarray
    kinds: tuple[str, ...]
    caps: dict[str, float]
    flows: list[FlowSpec]
    fixed_us: float
    channels: int


def _chunks(rows: np.ndarray, channels: int, chunk: int) -> np.ndarray:
    """Chunks published for ``rows[..., d]`` (rows per destination ring) over ``channels`` channels of ``chunk``
    tokens, summed over the last axis."""
    per_channel = np.asarray(rows, dtype=float) / channels
    return (channels * np.ceil(per_channel / max(chunk, 1))).sum(axis=-1)


def _publishes(traffic: list[SourceTraffic], hop: np.ndarray, channels: int, chunk: int, rings: bool) -> np.ndarray:
    """Tail publications of each sender's intranode dispatch (``[R]``).

    Per-peer rings share one publisher warp per channel, one lane per peer: a publication covers every ring at
    once (its SM cost does not grow with the peers) and comes every ``chunk`` tokens of the channel, whoever they
    go to. Without rings (direct-to-output receivers) a channel publishes once, at its end.
    """
    senders = hop.sum(axis=1) > 0
    if not rings:
        return senders * float(channels)
    tokens = np.asarray([t.num_tokens for t in traffic], dtype=float)
    return senders * channels * np.ceil(tokens / channels / max(chunk, 1))


def copy_chunks(rows: float, chunk_rows: int = COMBINE_COPY_CHUNK_ROWS) -> int:
    """Chunks of a copy-engine combine moving ``rows`` rows (Runtime::combine_by_copy: the first chunk has
    ``chunk_rows / 8`` rows, each next one twice as many, up to ``chunk_rows``)."""
    full = max(chunk_rows, 8)
    done, size, count = 0, max(full // 8, 1), 0
    while done < rows:
        done, size, count = done + size, min(full, size * 2), count + 1
    return count


def copy_combine_work(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, prof: DeepEpProfile,
                      num_sms: int, chunk_rows: int = 0) -> NormalWork:
    """The copy-engine intranode combine: each source's rows to a peer cross the link by the copy engine (its
    ``copy_engine`` port, loaded with the rows plus ``ce_chunk_us`` of engine time per chunk), and the owner's
    ``num_sms`` CTAs reduce every contribution (its ``sm_reduce`` port, ``num_sms * ce_reduce_gbps``) as the rows
    land, so the reduction overlaps the copies; no SM sends. ``chunk_rows``: the chunk size (0: deep_ep's
    ``COMBINE_COPY_CHUNK_ROWS``)."""
    chunk_rows = chunk_rows or COMBINE_COPY_CHUNK_ROWS
    ce = prof.ce_gbps * GBPS
    remote = _remote_rows(traffic, spec.num_ranks)
    # Sender d's chunks cover all its owners at once (as many as its largest block needs); their engine time is
    # shared out over the owners.
    sent = remote.sum(axis=0)
    gap_bytes = ce * prof.ce_chunk_us * np.array([copy_chunks(m, chunk_rows) for m in remote.max(axis=0)])
    gap_share = np.divide(remote * gap_bytes, sent, out=np.zeros_like(remote), where=sent > 0)
    return _landing_zone_work(spec, traffic, gpu, prof, "copy_engine", ce, gap_share,
                              num_sms * prof.ce_reduce_gbps * GBPS, num_sms)


def zone_combine_work(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, prof: DeepEpProfile,
                      num_sms: int) -> NormalWork:
    """The zone-sender intranode combine (the Buffer's default from ``COMBINE_ZONE_MIN_SMS`` up): on
    deep_ep's ``zone_ctas(num_sms)`` CTAs, sender warps store each source's rows into the owners' landing
    zones (their ``zone_send`` port, ``zone_link_gbps`` per direction) while the other warps of the same CTAs reduce
    (``sm_reduce``, ``CTAs * zone_reduce_gbps``), following the landing front. Calibrated at the default sender
    warps (``COMBINE_ZONE_SEND_WARPS``) only."""
    ctas = zone_ctas(num_sms)
    no_extra = np.zeros((spec.num_ranks, spec.num_ranks))
    return _landing_zone_work(spec, traffic, gpu, prof, "zone_send", prof.zone_link_gbps * GBPS, no_extra,
                              ctas * prof.zone_reduce_gbps * GBPS, ctas)


def _remote_rows(traffic: list[SourceTraffic], num_ranks: int) -> np.ndarray:
    """``rows[s, d]`` of the dispatch with the diagonal (a rank's rows to itself) zeroed: the rows a combine moves."""
    rows = np.asarray([t.rows_to_rank for t in traffic], dtype=float)
    return rows * (1.0 - np.eye(num_ranks))


def _landing_zone_work(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, prof: DeepEpProfile,
                       mover: str, mover_cap: float, extra: np.ndarray, reduce_cap: float, ctas: int) -> NormalWork:
    """Combine into landing zones: the rows of owner s held by peer d (``rows[s, d]``) leave d through its
    ``mover`` port (capacity ``mover_cap``; ``extra[s, d]`` more bytes of its time) and NVLink, and s reduces them
    with its own rows at ``reduce_cap`` (``sm_reduce``), overlapped with the transfer."""
    num_ranks = spec.num_ranks
    record = intranode_combine_record_bytes(spec.hidden, spec.topk)
    payload = token_bytes(spec.hidden, "bf16")
    rows = np.asarray([t.rows_to_rank for t in traffic], dtype=float)  # rows[s, d]
    remote = _remote_rows(traffic, num_ranks)
    kinds = ("nvl_out", "nvl_in", mover, "sm_reduce")
    nvl = gpu.nvlink_gbps * prof.nvl_efficiency * GBPS
    caps = {"nvl_out": nvl, "nvl_in": nvl, mover: mover_cap, "sm_reduce": reduce_cap}
    ports = _Ports(kinds, caps, num_ranks)
    peers = np.arange(num_ranks)
    flows: list[FlowSpec] = []
    for s in range(num_ranks):
        back = remote[s]
        own = rows[s, s]
        u = _Usage(ports)
        u.add(mover, peers, back * record + extra[s])
        u.add("nvl_out", peers, back * record)
        u.add("nvl_in", s, back.sum() * record)
        u.add("sm_reduce", s, (back.sum() + own) * payload)
        flows.append(u.flow(float(back.sum() * record + own * payload)))
    return NormalWork(np.zeros(num_ranks), kinds, caps, flows, prof.launch_us, max(ctas, 1))


def normal_work(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                prof: DeepEpProfile, num_sms: int, chunk: int, dtype: str, channels: int = 0,
                combine_path: str | None = None, copy_chunk_rows: int = 0) -> NormalWork:
    """Per-rank SM work, fixed cost and flows of one deep_ep ring op: intranode (one node), or one GPU per node
    (virtual nodes: the intranode model over P2P; behind a NIC: network puts, ring receive). Several nodes of several
    GPUs run as the composed path, two such ops (:mod:`simulator.deep_ep_composed`); ``channels``
    (CTAs) defaults to what deep_ep runs for ``num_sms``: intranode deep_ep's ``intranode_channels``, else
    ``num_sms``; measurements taken without the cap pass their own.

    Dispatch (the formulas take nodes of ``G`` GPUs; deep_ep runs them with one node or ``G = 1``): source ``s`` puts
    one record per remote destination node ``n`` to ``f = (n, local(s))`` (no network stage on its own node, where
    ``s`` is ``f``); ``f`` stores the row into the ring of every other destination GPU of its node and into its own
    ``recv_x`` (local bypass); receivers copy ring slots to ``recv_x`` (intranode: ``prof.receive_copies`` copies, 0
    with direct-to-output, where ``f`` stores straight into the peer's ``recv_x``; behind a NIC the put records
    land in rings). Combine reverses the paths: GPUs push rows to ``f``, which reduces the node's contributions;
    across nodes the owner reduces the nodes' partials.

    One GPU per virtual node is the intranode model over all ranks (:func:`flat_p2p`).

    Intranode combine takes the send path deep_ep's Buffer would (deep_ep's ``combine_send_path(num_sms)``)
    unless ``combine_path`` ('rings', 'copy' or 'zone') says which: the copy engine (:func:`copy_combine_work`;
    ``copy_chunk_rows`` overrides its chunk size), the zone senders (:func:`zone_combine_work`) or the rings (below).
    """
    if spec.num_nodes > 1 and spec.ranks_per_node > 1:
        raise ValueError(f"{spec.num_nodes} nodes x {spec.ranks_per_node} GPUs run as deep_ep's fused kernels or "
                         f"composed path: model it with simulator.deep_ep_fused or simulator.deep_ep_composed "
                         f"(simulate_normal does), not as one ring op")
    path = combine_send_path(num_sms) if combine_path is None else combine_path
    if path not in ("rings", "copy", "zone"):
        raise ValueError(f"combine_path must be 'rings', 'copy' or 'zone', got {combine_path!r}")
    if spec.op == "combine" and spec.num_nodes == 1 and spec.num_ranks > 1 and path == "copy":
        return copy_combine_work(spec, traffic, gpu, prof, num_sms, copy_chunk_rows)
    if spec.op == "combine" and spec.num_nodes == 1 and spec.num_ranks > 1 and path == "zone":
        return zone_combine_work(spec, traffic, gpu, prof, num_sms)
    num_ranks, per_node, num_nodes = spec.num_ranks, spec.ranks_per_node, spec.num_nodes
    if flat_p2p(spec, nic):
        per_node, num_nodes = num_ranks, 1
    dispatch = spec.op == "dispatch"
    internode = num_nodes > 1
    # Intranode: deep_ep's channel cap by rank count (config.num_sms is a budget); forwarding kernels: num_sms.
    if channels <= 0:
        channels = num_sms if internode else intranode_channels(num_sms, num_ranks)
    channels = max(channels, 1)
    payload = token_bytes(spec.hidden, dtype)
    record = (dispatch_record_bytes(spec.hidden, dtype, spec.topk) if dispatch
              else intranode_combine_record_bytes(spec.hidden, spec.topk))
    local_us = 1e-3 / prof.sm_local_gbps   # SM-µs per locally copied byte
    reduce_us = 1e-3 / prof.reduce_gbps    # SM-µs per reduced contribution byte
    row_us = prof.row_ns * 1e-3
    rows = np.asarray([t.rows_to_rank for t in traffic], dtype=float)         # rows[s, d]
    records = (np.asarray([t.records_to_node for t in traffic], dtype=float) if internode  # records[s, n]
               else np.zeros((num_ranks, 1)))  # one node: no network records
    all_ranks = np.arange(num_ranks)
    local_idx = all_ranks % per_node
    block = np.arange(num_nodes)[:, None] * per_node + np.arange(per_node)[None, :]  # [N, G] ranks

    kinds = ("nvl_out", "nvl_in", "sm_push") + (("nic_out", "nic_in") if internode else ())
    nvl = gpu.nvlink_gbps * prof.nvl_efficiency * GBPS
    caps = {"nvl_out": nvl, "nvl_in": nvl, "sm_push": channels * prof.sm_push_gbps * GBPS}
    if internode:
        # Records travel in chunks of ``chunk`` records, one QP per channel to each remote node.
        rate = nic_rate(nic, chunk * record, channels * (num_nodes - 1), nic.normal_efficiency)
        caps.update(nic_out=rate, nic_in=rate)
    ports = _Ports(kinds, caps, num_ranks)  # one GPU per virtual node is flat (above): records cross a real NIC

    hop = np.zeros((num_ranks, num_ranks))   # hop[f, d]: rows forwarder f stores into d's ring (same node)
    net = np.zeros((num_ranks, num_ranks))   # net[s, f]: records s puts to forwarder f on another node
    flows: list[FlowSpec] = []
    for s in range(num_ranks):
        fwd = block[:, local_idx[s]]
        grid = rows[s].reshape(num_nodes, per_node)
        hops = grid.copy()
        hops[:, local_idx[s]] = 0.0
        remote_records = records[s].copy()
        remote_records[s // per_node] = 0.0
        hop[fwd[:, None], block] += hops
        net[s, fwd] += remote_records
        hop_bytes, net_bytes = hops * record, remote_records * record
        u = _Usage(ports)
        if dispatch:
            u.add("sm_push", fwd, hop_bytes.sum(axis=1))
            u.add("nvl_out", fwd, hop_bytes.sum(axis=1))
            u.add("nvl_in", block.reshape(-1), hop_bytes.reshape(-1))
            if internode:
                u.add("nic_out", s, net_bytes.sum())
                u.add("nic_in", fwd, net_bytes)
        else:
            u.add("sm_push", block.reshape(-1), hop_bytes.reshape(-1))
            u.add("nvl_out", block.reshape(-1), hop_bytes.reshape(-1))
            u.add("nvl_in", fwd, hop_bytes.sum(axis=1))
            if internode:
                u.add("nic_out", fwd, net_bytes)
                u.add("nic_in", s, net_bytes.sum())
        flows.append(u.flow(float(hop_bytes.sum() + net_bytes.sum())))

    # Rows each forwarder handles: its hops plus its own rows (local bypass).
    own = np.zeros(num_ranks)
    for s in range(num_ranks):
        fwd = block[:, local_idx[s]]
        own[fwd] += rows[s].reshape(num_nodes, per_node)[:, local_idx[s]]
    handled = hop.sum(axis=1) + own
    serial = np.zeros(num_ranks)
    if dispatch:
        serial += handled * row_us + own * payload * local_us
        receive_copies = 1 if internode else prof.receive_copies  # put records land in rings
        serial += receive_copies * hop.sum(axis=0) * payload * local_us
        chunks = _publishes(traffic, hop, channels, chunk, rings=bool(receive_copies))
        if internode:
            serial += records.sum(axis=1) * row_us          # the source packs one record per node
            serial += net.sum(axis=1) * record * local_us  # into the send area the NIC reads
            chunks = chunks + _chunks(net, channels, chunk)
    else:
        serial += handled * (row_us + payload * reduce_us)  # forwarder (or owner) reduces the node's rows
        chunks = _chunks(hop.T, channels, chunk)
        if internode:
            serial += records.sum(axis=1) * (row_us + payload * reduce_us)  # owner reduces the nodes' partials
            serial += net.sum(axis=0) * record * local_us
            chunks = chunks + _chunks(net.T, channels, chunk)
    serial += chunks * prof.chunk_sync_us
    fixed = prof.launch_us + (0.0 if dispatch else prof.combine_extra_us)
    fixed += prof.internode_extra_us if internode else 0.0
    return NormalWork(serial, kinds, caps, flows, fixed, channels)


def flat_p2p(spec: OpSpec, nic: NicProfile) -> bool:
    """Whether an internode op runs as the intranode kernels over P2P: one GPU per virtual node (``nvlink-p2p``),
    where deep_ep's internode backend launches the intranode kernels on the NVSHMEM symmetric heap and reaches the
    peers by ``nvshmem_ptr`` (NVLink P2P). No network stage, no per-node records, no extra signal round trip."""
    return spec.num_nodes > 1 and spec.ranks_per_node == 1 and nic.shares_nvlink


def time_components(work: NormalWork, num_sms: int, num_ranks: int) -> dict[str, np.ndarray]:
    """Per-rank terms of the closed form (µs): ``serial`` (serial SM work / C), ``push`` (SM push budget) and one
    entry per physical link kind (its busiest load / capacity)."""
    ports = _Ports(work.kinds, work.caps, num_ranks)
    loads = np.zeros(len(ports.caps))
    for size, idx, coefs in work.flows:
        np.add.at(loads, idx, coefs * size)
    per_port = loads / np.asarray(ports.caps)
    out = {"serial": work.serial_sm_us / work.channels}
    for kind in ports.physical_kinds:
        lo = ports.offset[kind]
        out["push" if kind == "sm_push" else kind] = per_port[lo:lo + num_ranks]
    return out


def closed_form_times(work: NormalWork, num_sms: int, num_ranks: int) -> np.ndarray:
    """Per-rank time: ``fixed + serial / C + max(push / (C * rate), busiest port of the rank / capacity)``."""
    comp = time_components(work, num_sms, num_ranks)
    overlapped = np.max([v for k, v in comp.items() if k != "serial"], axis=0)
    return work.fixed_us + comp["serial"] + overlapped


_BOTTLENECK_LABELS = {"serial": "SM:copy", "push": "SM:push", "nvl_out": "NVLink", "nvl_in": "NVLink",
                      "nic_out": "RDMA", "nic_in": "RDMA", "copy_engine": "copy engine", "zone_send": "SM:zone send",
                      "sm_reduce": "SM:reduce"}


def bottleneck(work: NormalWork, num_sms: int, num_ranks: int) -> str:
    """The largest term of the slowest rank: ``SM:copy`` (serial SM work), ``SM:push``, ``NVLink`` or ``RDMA``."""
    comp = time_components(work, num_sms, num_ranks)
    slowest = int(np.argmax(closed_form_times(work, num_sms, num_ranks)))
    worst = max(comp, key=lambda k: (comp[k][slowest], k))
    return _BOTTLENECK_LABELS[worst]


def torch_served(spec: OpSpec) -> bool:
    """Whether deep_ep runs this normal ring op on its torch backend: more ranks than a ring op has
    (``NUM_MAX_RING_RANKS``), i.e. one GPU per node past that many nodes (the composed path's rail stage is the
    torch backend whatever its node count, :func:`simulate_normal`)."""
    return spec.mode != "low-latency" and not is_composed(spec) and spec.num_ranks > NUM_MAX_RING_RANKS


def _torch_params(prof: DeepEpProfile) -> tuple[float, float, float]:
    return prof.torch_call_us, prof.torch_p2p_efficiency, prof.composed_copy_gbps


def simulate_normal(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                    prof: DeepEpProfile, num_sms: int, chunk: int, dtype: str) -> OpResult:
    """DES of one deep_ep normal op: per rank, the fixed cost, its serial SM work, then its push flow through the
    fluid ports (SM push budget, NVLink / network egress and ingress); a rank is done when its own flow and every
    flow into its ports have drained. Several nodes of several GPUs are the fused kernels
    (:mod:`simulator.deep_ep_fused`) or, beyond their ranks, the composed path (:mod:`simulator.deep_ep_composed`),
    each stage simulated so."""
    if is_fused(spec):
        return simulate_fused(spec, traffic, gpu, nic, prof, num_sms, dtype)
    if is_composed(spec):
        return composed_result(spec, traffic, nic, dtype, prof.composed_copy_gbps, prof.composed_host_us,
                               lambda s, t, d: torch_result(s, t, gpu, nic, *_torch_params(prof)),
                               lambda s, t, d: simulate_normal(s, t, gpu, nic, prof, num_sms, chunk, d))
    if torch_served(spec):
        return torch_result(spec, traffic, gpu, nic, *_torch_params(prof))
    work = normal_work(spec, traffic, gpu, nic, prof, num_sms, chunk, dtype)
    num_ranks = spec.num_ranks
    ports = _Ports(work.kinds, work.caps, num_ranks)
    net, finish = run_rank_flows(f"deep_ep_{spec.op}", ports, work.flows,
                                 list(work.fixed_us + work.serial_sm_us / max(num_sms, 1)))
    logical, nvl_logical = normal_logical_bytes(spec, traffic)
    data_us = max(finish) - work.fixed_us
    res = _finish(net, ports, finish, logical, nvl_logical, work.fixed_us, data_us,
                  extra={"serial_us": float(work.serial_sm_us.max()) / max(num_sms, 1)})
    res.bottleneck = bottleneck(work, num_sms, num_ranks)
    return res


def closed_form_rank_times(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                           prof: DeepEpProfile, num_sms: int, chunk: int, dtype: str,
                           stages: tuple | None = None) -> np.ndarray:
    """Per-rank closed-form time of one deep_ep normal op (the composed path from its stages' closed forms;
    ``stages``: its :func:`composed_stages`, when the caller has them)."""
    if is_fused(spec):
        return np.asarray(fused_rank_times(spec, traffic, gpu, nic, prof, num_sms, dtype))
    if is_composed(spec):
        def rail(s: OpSpec, t: list[SourceTraffic], d: str) -> SimpleNamespace:
            rank_times = torch_rank_times(s, t, gpu, nic, *_torch_params(prof))[0]
            return SimpleNamespace(rank_time_us=[float(x) for x in rank_times])

        def node(s: OpSpec, t: list[SourceTraffic], d: str) -> SimpleNamespace:
            rank_times = closed_form_rank_times(s, t, gpu, nic, prof, num_sms, chunk, d)
            return SimpleNamespace(rank_time_us=[float(x) for x in rank_times])
        return composed_rank_times(spec, traffic, nic, dtype, prof.composed_copy_gbps, prof.composed_host_us,
                                   rail, node, stages)[0]
    if torch_served(spec):
        return torch_rank_times(spec, traffic, gpu, nic, *_torch_params(prof))[0]
    work = normal_work(spec, traffic, gpu, nic, prof, num_sms, chunk, dtype)
    return closed_form_times(work, num_sms, spec.num_ranks)


def recommended_sms(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                    prof: DeepEpProfile, chunk: int, dtype: str, max_sms: int, slack: float) -> int:
    """Smallest even SM count whose closed-form time is within ``slack`` of the best one up to ``max_sms``."""
    # A composed op's stages depend on its traffic alone: derived once for every SM count.
    stages = composed_stages(traffic, spec.num_nodes, spec.ranks_per_node) if is_composed(spec) else None
    times = {}
    for sms in range(2, max_sms + 1, 2):
        times[sms] = float(closed_form_rank_times(spec, traffic, gpu, nic, prof, sms, chunk, dtype, stages).max())
    best = min(times.values())
    return min(s for s, t in times.items() if t <= best * slack)


# ---------------------------------------------------------------------------------------------------------------
# Low-latency mode
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class LowLatencyWork:
    """What each rank of one deep_ep LL op does.

    Attributes:
        sent: ``[src, dst]`` bytes the SMs of ``src`` store into ``dst`` (dispatch messages, own rank included;
            combine rows, own rank only in hook mode: a fused combine reads the own rows in place).
        send_sm_us: ``[R]`` SM-µs of the send phase (overlaps the link transfer).
        recv_sm_us: ``[R]`` SM-µs of the receive phase (expansion into rows, or the reduction), after the last
            arrival.
        nvl_rate / nic_rate: link rates, bytes/µs per direction.
        nvlink_peer: ``[src, dst]`` whether the pair talks over NVLink (the rest, but the own rank, over the NIC).
    """

    sent: np.ndarray
    send_sm_us: np.ndarray
    recv_sm_us: np.ndarray
    nvl_rate: float
    nic_rate: float
    nvlink_peer: np.ndarray
    send_cap: float


def low_latency_work(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                     prof: DeepEpProfile, dtype: str, hook: bool = False) -> LowLatencyWork:
    """Bytes and SM work of one deep_ep LL op (``hook``: the send/receive launches of ``return_recv_hook``).

    Dispatch: one message per (token, destination rank) (:func:`ll_dispatch_message_bytes`), the own rank included,
    stored by the send CTAs at ``ll_send_gbps`` per SM (the FP8 cast is part of it); the receiver expands each
    (token, expert) selection it holds into a row at ``ll_expand_gbps`` per SM. Combine: one BF16 row per selection
    back to the token's owner (a fused call skips the own rows, read in place), stored at ``sm_push_gbps`` per SM;
    after the last arrival the owner reads the contributions at ``ll_reduce_gbps`` per SM: the peers' rows in a fused
    call (its own rows are staged in shared memory while those travel), every row in the hook's receive launch.
    """
    num_ranks = spec.num_ranks
    selections = np.asarray([t.msgs_to_rank for t in traffic], dtype=float)  # [src, holder]
    if spec.op == "dispatch":
        msg = ll_dispatch_message_bytes(spec.hidden, dtype, spec.topk, prof)
        sent = np.asarray([t.rows_to_rank for t in traffic], dtype=float) * msg
        send_rate = prof.ll_send_gbps
        recv_sm_us = selections.sum(axis=0) * token_bytes(spec.hidden, dtype) * 1e-3 / prof.ll_expand_gbps
    else:
        sent = selections.T * (2 * spec.hidden)  # [holder, owner]
        if not hook:
            np.fill_diagonal(sent, 0.0)  # own rows are read in place while the peers' travel
        recv_sm_us = sent.sum(axis=0) * 1e-3 / prof.ll_reduce_gbps  # the contributions read after the last arrival
        send_rate = prof.sm_push_gbps
    nvlink_peer = _nvlink_peers(spec) | nic.shares_nvlink  # virtual nodes: the "network" rides NVLink too
    np.fill_diagonal(nvlink_peer, False)
    remote_peers = 0 if nic.shares_nvlink else num_ranks - spec.ranks_per_node
    msg_bytes = ll_dispatch_message_bytes(spec.hidden, dtype, spec.topk, prof) if spec.op == "dispatch" else (
        2 * spec.hidden)
    sms = gpu.num_device_sms
    nic_cap = nic_rate(nic, msg_bytes, DEFAULT_NUM_QPS_PER_RANK * remote_peers)
    return LowLatencyWork(sent, sent.sum(axis=1) * 1e-3 / send_rate, recv_sm_us,
                          gpu.nvlink_gbps * prof.ll_nvl_efficiency * GBPS, nic_cap, nvlink_peer, sms * send_rate * GBPS)


def ll_peer_signal_us(spec: OpSpec, gpu: GpuProfile, nic: NicProfile) -> float:
    """Per-peer signalling of a deep_ep LL call beyond the calibration's EP2 (one NVLink peer), µs.

    Every rank writes per-(destination, local expert) count words and a per-source arrival word to each peer and
    waits for all of them, so the fixed cost grows with the peers: ``gpu.ll_nvl_signal_us`` per NVLink peer past
    the first, ``gpu.ll_rdma_peer_us`` per RDMA peer (the GPU profile's per-peer costs, fitted on DeepEP V1's
    kernels, which signal the same way; the NIC round trip is ``internode_extra_us``).
    """
    nvlink = spec.num_ranks - 1 if nic.shares_nvlink else int(_nvlink_peers(spec)[0].sum())
    rdma = spec.num_ranks - 1 - nvlink
    return max(nvlink - 1, 0) * gpu.ll_nvl_signal_us + rdma * gpu.ll_rdma_peer_us


def ll_phase_times(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                   prof: DeepEpProfile, dtype: str) -> dict[str, np.ndarray]:
    """Closed form of one LL op, per rank (µs): ``fused`` (the kernel time of a call without hook), ``hook_send``
    and ``hook_recv`` (the two launches of a ``return_recv_hook`` call).

    ``send = max(send SM work / C, egress bytes / link)``: the stores overlap the transfer. A receiver's data is in
    when every sender that targets it (and its own send) is done and its ingress has drained; the receive work
    follows. With ``hidden(x) = max(0, x - ll_overlap_us)`` (the part of the fixed cost the stores overlap):
    ``fused = ll_fixed_us + hidden(arrival) + recv work / C``; ``hook_send = hook fixed + hidden(send)`` (the send
    kernel exits when its stores are done); ``hook_recv = hook fixed + recv work / C`` (the data is in). The hook
    fixed cost is ``ll_hook_fixed_us``, plus ``ll_hook_dispatch_extra_us`` for dispatch.
    """
    sms = gpu.num_device_sms
    fixed = ll_peer_signal_us(spec, gpu, nic) + (prof.internode_extra_us if spec.num_nodes > 1 else 0.0)
    hook_fixed = prof.ll_hook_fixed_us + (prof.ll_hook_dispatch_extra_us if spec.op == "dispatch" else 0.0)

    def hidden(x: np.ndarray, fixed_us: float) -> np.ndarray:
        return np.maximum(0.0, x - min(prof.ll_overlap_us, fixed_us))
    out = {}
    for hook in (False, True):
        work = low_latency_work(spec, traffic, gpu, nic, prof, dtype, hook)
        remote = work.sent.copy()
        np.fill_diagonal(remote, 0.0)
        nvl, nic_bytes = remote * work.nvlink_peer, remote * ~work.nvlink_peer
        send = np.maximum.reduce([work.send_sm_us / sms, nvl.sum(axis=1) / work.nvl_rate,
                                  nic_bytes.sum(axis=1) / work.nic_rate])
        ingress = np.maximum(nvl.sum(axis=0) / work.nvl_rate, nic_bytes.sum(axis=0) / work.nic_rate)
        targets = work.sent > 0
        np.fill_diagonal(targets, True)  # a rank's own send phase precedes its receive phase
        arrival = np.maximum(np.where(targets, send[:, None], 0.0).max(axis=0), ingress)
        recv = work.recv_sm_us / sms
        if hook:
            out["hook_send"] = hook_fixed + fixed + hidden(send, hook_fixed)
            out["hook_recv"] = hook_fixed + recv
        else:
            out["fused"] = prof.ll_fixed_us + fixed + hidden(arrival, prof.ll_fixed_us) + recv
    return out


def simulate_low_latency(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                         prof: DeepEpProfile, dtype: str) -> OpResult:
    """DES of one deep_ep LL op without hook (the costs of :func:`low_latency_work`): from ``ll_overlap_us`` before
    the end of ``ll_fixed_us`` every rank streams its stores through the fluid ports (its send SMs, NVLink or NIC
    egress, the receivers' ingress); a rank is done when the fixed cost, its own send, every sender that targets it
    and its ingress are over, plus its receive work on all SMs. ``extra`` holds the hook-mode phase times (closed
    form, mean over ranks) and the send-phase end.
    """
    num_ranks = spec.num_ranks
    sms = gpu.num_device_sms
    work = low_latency_work(spec, traffic, gpu, nic, prof, dtype)
    fixed_us = (prof.ll_fixed_us + ll_peer_signal_us(spec, gpu, nic)
                + (prof.internode_extra_us if spec.num_nodes > 1 else 0.0))
    start_us = fixed_us - min(prof.ll_overlap_us, prof.ll_fixed_us)
    net, ports, send_end, recv_end = ll_send_recv(
        spec, work.sent, nvl_rate=work.nvl_rate, nic_rate_=work.nic_rate, sm_cap=work.send_cap, fixed_us=start_us,
        nic_on_nvlink=nic.shares_nvlink)
    ends = np.asarray(send_end)
    rank_time = []
    for y in range(num_ranks):
        senders = work.sent[:, y] > 0
        last = max(float(ends[senders].max()) if senders.any() else fixed_us, recv_end[y], send_end[y], fixed_us)
        rank_time.append(last + float(work.recv_sm_us[y]) / sms)
    logical = [float(t.num_selections * spec.logical_bytes) for t in traffic]
    data_us = max(max(send_end), max(recv_end)) - start_us  # the stores stream from start_us on
    phases = ll_phase_times(spec, traffic, gpu, nic, prof, dtype)
    return _finish(net, ports, rank_time, logical, logical, fixed_us, data_us,
                   extra={"send_us": max(send_end), "recv_us": max(rank_time) - max(send_end),
                          "hook_send_us": float(phases["hook_send"].mean()),
                          "hook_recv_us": float(phases["hook_recv"].mean())})
