"""deep_ep's fused internode kernels in the ``--kernels deep_ep`` family: ``N`` nodes x ``G > 1`` GPUs, at most
``NUM_MAX_FUSED_RANKS`` ranks (csrc/kernels/fused_internode.cu).

Paths and network are DeepEP V1's internode model: one fluid flow per source (:func:`simulator.rank._normal_flows`:
a record per (token, node) over the NIC to the forwarder ``(n, local(s))``, which copies it over NVLink to every GPU
of node ``n`` that needs it; combine the reverse, one BF16 partial per (token, node)), its NIC rate, per-chunk
message cost, QPs and credits (:func:`simulator.rank.rdma_ring_rate`) and its two-role SM share. Ours are the record
layout, the rings, the CTA roles (``C / 2`` channels of two CTAs of 32 warps, each ring served by a team of warps,
:func:`role_warps`) and the rates (:func:`team_rate`): the warps of a team take whole records in turn, each
record's bytes and control cost ``fused_row_ns`` on one warp. A role moves ``min(sum of its teams, its SM share x
the SM rate)`` per channel, and each rank's HBM carries every byte its roles move twice (read and written) at
``fused_hbm_efficiency`` of its rate. Times are the pipelined steady state in closed form (:func:`simulate_fused`),
monotone in every capacity.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from deep_ep.config import (
    NUM_MAX_FUSED_RANKS,
    NUM_MAX_SCALEUP_RANKS,
    SUPPORTED_NORMAL_RANKS,
    Config,
    get_combine_config,
    get_dispatch_config,
)
from simulator.hardware import GpuProfile, NicProfile
from simulator.links import GBPS
from simulator.rank import (
    PORT_LABELS,
    SHARED_SM_FRACTION,
    NormalModel,
    OpResult,
    OpSpec,
    _arrival_times,
    _normal_flows,
    _Ports,
    normal_logical_bytes,
    port_loads,
    rdma_ring_rate,
)
from simulator.workload import SourceTraffic

# Share of an even CTA that each of its two roles (senders and forwarders, or forwarders and the owner) gets: DeepEP
# V1's value for its SMs of two roles.
ROLE_SHARE = SHARED_SM_FRACTION
# Warps of one CTA (kChannelThreads / 32).
CTA_WARPS = 32
# The fewest warps of a combine channel's owner team (the kernels' kFusedCombineOwnerWarps).
COMBINE_OWNER_WARPS = 8


def team_sizes(num_warps: int, num_teams: int) -> list[int]:
    """Warps of each of ``num_teams`` teams of consecutive warps out of ``num_warps``, as the kernels split a CTA:
    sizes differ by at most one, the larger teams first."""
    if not 1 <= num_teams <= num_warps:
        raise ValueError(f"num_teams must be in [1, {num_warps}], got {num_teams}")
    base, extra = divmod(num_warps, num_teams)
    return [base + 1] * extra + [base] * (num_teams - extra)


def role_warps(op: str, num_nodes: int, num_ranks: int) -> dict[str, tuple[int, int]]:
    """(warps, rings) per channel of each role of the fused ``op``: dispatch, the even CTA's warps in ``2N`` teams
    (senders of each node, then forwarders; past 16 nodes half the warps each), the odd CTA's in one receiver team
    per source rank; combine, the odd CTA's warps in one sender team per source rank, the even CTA's last
    ``max(32 // (N + 1), COMBINE_OWNER_WARPS)`` in the owner team and the others in ``N`` forwarder teams. Where a role
    has more rings than warps each warp serves several in turn, so a ring gets the role's rate over its ring count
    either way."""
    if op == "dispatch":
        if 2 * num_nodes > CTA_WARPS:
            half = CTA_WARPS // 2
            return {"send": (half, num_nodes), "forward": (half, num_nodes), "receive": (CTA_WARPS, num_ranks)}
        even = team_sizes(CTA_WARPS, 2 * num_nodes)
        return {"send": (sum(even[:num_nodes]), num_nodes), "forward": (sum(even[num_nodes:]), num_nodes),
                "receive": (CTA_WARPS, num_ranks)}
    owner = max(CTA_WARPS // (num_nodes + 1), COMBINE_OWNER_WARPS)
    return {"send": (CTA_WARPS, num_ranks), "forward": (CTA_WARPS - owner, num_nodes), "receive": (owner, 1)}


def is_fused(spec: OpSpec) -> bool:
    """Whether deep_ep runs this normal op on the fused kernels: several nodes of 2..``NUM_MAX_SCALEUP_RANKS`` GPUs,
    at most ``NUM_MAX_FUSED_RANKS`` ranks (the kernels' limit)."""
    return (spec.mode != "low-latency" and spec.num_nodes > 1 and 2 <= spec.ranks_per_node <= NUM_MAX_SCALEUP_RANKS
            and spec.num_ranks <= NUM_MAX_FUSED_RANKS)


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def fused_record_bytes(op: str, hidden: int, dtype: str, topk: int) -> int:
    """One ring record of the fused kernels (rail and node rings alike). Dispatch: [payload][float32 scales][int32
    local-rank mask, ``topk`` int32 ids, ``topk`` float32 weights], each part padded to 16 bytes; combine: [BF16 row]
    [``topk`` float32 weights], each padded to 16."""
    if op == "combine":
        return _pad16(2 * hidden) + _pad16(4 * topk)
    payload = hidden if dtype == "fp8" else 2 * hidden
    scales = 4 * (hidden // 128) if dtype == "fp8" else 0
    return _pad16(payload) + _pad16(scales) + _pad16(4 + 8 * topk)


def fused_config(op: str, num_ranks: int, num_sms: int) -> Config:
    """The Buffer's default config of ``op`` for ``num_ranks`` ranks (DeepEP's table row, the next larger one for
    counts it does not list) at ``num_sms`` SMs."""
    table = [r for r in SUPPORTED_NORMAL_RANKS if r >= num_ranks] or [max(SUPPORTED_NORMAL_RANKS)]
    make = get_dispatch_config if op == "dispatch" else get_combine_config
    return make(min(table), num_sms)


def sm_rate(gbps: float, row_ns: float, record: float, chunk_sync_us: float, chunk: int) -> float:
    """Bytes/µs one SM moves through a ring at ``gbps`` per byte, ``row_ns`` per record and ``chunk_sync_us`` per
    published chunk of ``chunk`` records."""
    per_record_us = record / (gbps * GBPS) + row_ns * 1e-3 + chunk_sync_us / max(chunk, 1)
    return record / per_record_us


def team_rate(warps: float, warp_gbps: float, row_ns: float, record: float, chunk_us: float, chunk: int) -> float:
    """Bytes/µs of records one ring's team of ``warps`` warps moves (fewer than one: a warp serving ``1 / warps``
    rings in turn). Each warp takes whole records in turn (dispatch: record k of a window of up to 32 on warp
    k % size; combine: row i on warp i % size), a record's bytes and control cost ``row_ns`` on one warp, ``warps``
    records at once; one warp publishes the team's progress, ``chunk_us`` per chunk of ``chunk`` records."""
    turn, team = min(warps, 1.0), max(warps, 1.0)
    per_record_us = (record / (warp_gbps * GBPS) + row_ns * 1e-3) / team
    return turn * record / (per_record_us + chunk_us / max(chunk, 1))


def shared_gpu(gpu: GpuProfile, ranks: int) -> GpuProfile:
    """``gpu`` as each of ``ranks`` ranks sharing one device under MPS sees it (virtual nodes on one GPU): a
    peer's buffer is the same HBM through a P2P mapping, so a byte sent is read and written there, and the ranks
    split its bandwidth: "NVLink" ``hbm_gbps / (2 ranks)`` per direction, local copies ``hbm_gbps / ranks``. The
    SMs are the kernel's own (MPS gives each rank its share; ``num_sms`` must fit in it)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return replace(gpu, name=f"{gpu.name}/{ranks}", nvlink_gbps=gpu.hbm_gbps / (2 * ranks),
                   hbm_gbps=gpu.hbm_gbps / ranks)


def on_one_gpu(prof: Any) -> Any:
    """The deep_ep profile ``prof`` as ranks sharing one GPU run it: every push is a local copy through a P2P
    mapping, at the local rates (per warp and per SM)."""
    return replace(prof, warp_push_gbps=prof.warp_local_gbps, sm_push_gbps=prof.sm_local_gbps)


def fused_model(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile, prof: Any,
                num_sms: int, dtype: str, cfg: Config | None = None) -> tuple[NormalModel, dict[str, str]]:
    """Capacities, flows and fixed cost of one fused op (``prof``: the deep_ep profile; ``cfg``: the ring config,
    default :func:`fused_config`), and the port aliases (virtual nodes: the network ports are the NVLink ports)."""
    if not is_fused(spec):
        raise ValueError(f"{spec.num_nodes} nodes x {spec.ranks_per_node} GPUs is not a fused-kernel group (needs "
                         f">= 2 nodes of 2..{NUM_MAX_SCALEUP_RANKS} GPUs, <= {NUM_MAX_FUSED_RANKS} ranks)")
    dispatch = spec.op == "dispatch"
    cfg = cfg or fused_config(spec.op, spec.num_ranks, num_sms)
    channels = max(num_sms // 2, 1)
    record = fused_record_bytes(spec.op, spec.hidden, dtype, spec.topk)
    nvl_chunk, rdma_chunk = cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_rdma_chunked_send_tokens
    rail_slots = -(-cfg.num_max_rdma_chunked_recv_tokens // rdma_chunk) * rdma_chunk
    warps_of = role_warps(spec.op, spec.num_nodes, spec.num_ranks)

    def role(name: str, warp_gbps: float, sm_gbps: float, share: float, chunk: int,
             fan_out: float = 1.0) -> tuple[float, float]:
        """(capacity of the role over all channels, rate of one of its teams, i.e. of one ring): its teams at
        :func:`team_rate` (times ``fan_out`` stores per load), at most ``share`` of an SM at ``sm_gbps``."""
        warps, teams = warps_of[name]
        one = fan_out * team_rate(warps / teams, warp_gbps, prof.fused_row_ns, record, prof.fused_chunk_us, chunk)
        per_channel = min(teams * one, share * sm_rate(sm_gbps, prof.row_ns, record, prof.chunk_sync_us, chunk))
        return channels * per_channel, per_channel / teams
    # Senders stage into the rail ring: a peer's by pointer over NVLink (virtual nodes), else the own buffer that
    # the NIC reads.
    if nic.shares_nvlink:
        stage = (prof.warp_push_gbps, prof.sm_push_gbps)
    else:
        stage = (prof.warp_local_gbps, prof.sm_local_gbps)
    if dispatch:
        send, one_send = role("send", *stage, ROLE_SHARE, rdma_chunk)
        # A forwarder loads a record once and stores it to each local rank in its mask: its warps are bound by
        # the loads, so they store ``fan_out`` (rows per record) times their rate.
        rows = sum(sum(t.rows_to_rank) for t in traffic)
        fan_out = rows / max(sum(sum(t.records_to_node) for t in traffic), 1)
        fwd, one_fwd = role("forward", prof.warp_push_gbps, prof.sm_push_gbps, ROLE_SHARE, nvl_chunk, fan_out)
        recv, _ = role("receive", prof.warp_local_gbps, prof.sm_local_gbps, 1.0, nvl_chunk)
    else:
        # Forwarders and the owner reduce whole records per warp, two sources' loads in flight (warp_local_gbps
        # counts the bytes read).
        send, one_send = role("send", prof.warp_push_gbps, prof.sm_push_gbps, 1.0, nvl_chunk)
        fwd, one_fwd = role("forward", prof.warp_local_gbps, prof.reduce_gbps, ROLE_SHARE, rdma_chunk)
        recv, _ = role("receive", prof.warp_local_gbps, prof.reduce_gbps, ROLE_SHARE, rdma_chunk)
    nvl = gpu.nvlink_gbps * prof.nvl_efficiency * GBPS
    caps = {"nvl_out": nvl, "nvl_in": nvl, "sm_send": send, "sm_recv": min(recv, gpu.hbm_gbps * GBPS / 2),
            "sm_fwd": fwd, "hbm": gpu.hbm_gbps * prof.fused_hbm_efficiency * GBPS}
    alias: dict[str, str] = {}
    if nic.shares_nvlink:
        alias = {"nic_out": "nvl_out", "nic_in": "nvl_in"}
        caps.update(nic_out=nvl, nic_in=nvl)
    else:
        net = rdma_ring_rate(nic, record, rdma_chunk, rail_slots, channels * (spec.num_nodes - 1), one_fwd)
        caps.update(nic_out=net, nic_in=net)
    kinds = ("nvl_out", "nvl_in", "nic_out", "nic_in", "sm_send", "sm_fwd", "sm_recv", "hbm")
    ports = _Ports(kinds, caps, spec.num_ranks, alias)
    flows = _with_hbm(_normal_flows(spec, traffic, ports, record), ports)
    # Pipeline fill as DeepEP's: the first chunk crosses every stage, each ring served by one team. Dispatch: a rail
    # chunk staged, the NIC, a node chunk forwarded; combine: a node chunk sent, a rail chunk reduced, the NIC.
    first, second = (rdma_chunk, nvl_chunk) if dispatch else (nvl_chunk, rdma_chunk)
    fill_us = (2 * gpu.nvl_latency_us + nic.latency_us + first * record / one_send + second * record / one_fwd)
    # NVLink credits: the N x G node rings of a channel, of Nn / N records each (the source nodes behind a forwarder
    # share its Nn), refill after one round trip.
    window = channels * spec.ranks_per_node * cfg.num_max_nvl_chunked_recv_tokens * record / (
        2 * gpu.nvl_latency_us + nvl_chunk * record / (one_fwd if dispatch else one_send))
    tail_us = 0.0 if dispatch else prof.combine_extra_us
    fixed = prof.launch_us + prof.internode_extra_us + fill_us + tail_us
    physical = tuple(k for k in kinds if k not in alias)
    return NormalModel(physical, {k: caps[k] for k in physical}, flows, fixed, fill_us, tail_us, window), alias


def _with_hbm(flows: list, ports: _Ports) -> list:
    """``flows`` with each rank's HBM port loaded by twice the bytes its roles move (sender, forwarder, receiver:
    each byte read once and written once)."""
    n = ports.num_ranks
    roles = [ports.offset[k] for k in ("sm_send", "sm_fwd", "sm_recv")]
    hbm = ports.offset["hbm"]
    out = []
    for size, idx, weight in flows:
        load = np.zeros(n)
        for first in roles:
            inside = (idx >= first) & (idx < first + n)
            np.add.at(load, idx[inside] - first, 2.0 * weight[inside])
        ranks = np.nonzero(load)[0]
        out.append((size, np.concatenate([idx, hbm + ranks]), np.concatenate([weight, load[ranks]])))
    return out


def _flow_times(model: NormalModel, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """(time each port needs at full rate for its bytes, ``[kinds x ranks]``; data time of each flow): a flow
    streams at the pace of the slowest port on its path, every port shared in proportion to the bytes crossing it
    (the pipelined steady state), and at most at the credit window's rate."""
    caps = np.repeat([model.caps[k] for k in model.kinds], num_ranks)
    busy = port_loads(model.flows, caps.size) / caps
    flow_us = np.array([max(float(busy[ports].max(initial=0.0)), size / model.window_cap)
                        for size, ports, _ in model.flows])
    return busy, flow_us


def fused_rank_times(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile, prof: Any,
                     num_sms: int, dtype: str, cfg: Config | None = None) -> list[float]:
    """Time of one fused op per rank (µs): :func:`simulate_fused`'s."""
    return simulate_fused(spec, traffic, gpu, nic, prof, num_sms, dtype, cfg).rank_time_us


def simulate_fused(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile, prof: Any,
                   num_sms: int, dtype: str, cfg: Config | None = None) -> OpResult:
    """One fused op in closed form: a rank ends at the fixed cost (launch, fill, combine tail) plus the data time
    of the latest flow that loads one of its ports (:func:`_flow_times`). Each time is a maximum of bytes over
    capacities, so more SMs, NVLink or NIC bandwidth never make it slower."""
    model, _ = fused_model(spec, traffic, gpu, nic, prof, num_sms, dtype, cfg)
    busy, flow_us = _flow_times(model, spec.num_ranks)
    finish = _arrival_times(model.flows, spec.num_ranks, [model.fixed_us + t for t in flow_us])
    data_us = max(finish) - model.fixed_us
    loads = busy * np.repeat([model.caps[k] for k in model.kinds], spec.num_ranks)
    port_bytes, utilization, busiest = {}, {}, {}
    for i, kind in enumerate(model.kinds):
        part = slice(i * spec.num_ranks, (i + 1) * spec.num_ranks)
        port_bytes[kind] = float(loads[part].sum())
        busiest[kind] = float(busy[part].max())
        utilization[kind] = min(busiest[kind] / max(data_us, 1e-9), 1.0)
    top = max(busiest, key=lambda k: (busiest[k], k))
    bottleneck = PORT_LABELS.get(top, top) if busiest[top] >= 0.6 * data_us else "latency"
    logical, nvl_logical = normal_logical_bytes(spec, traffic)
    return OpResult(sum(finish) / len(finish), max(finish), finish, logical, nvl_logical, port_bytes, utilization,
                    bottleneck, model.fixed_us, extra={"fill_us": model.fill_us})
