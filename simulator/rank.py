"""Per-rank SimPy processes for one dispatch or combine of DeepEP V1's kernels, mirroring the kernel phases.

Each op builds a :class:`~simulator.links.FluidNetwork` with, per GPU, full-duplex NVLink and NIC ports and one
port per SM role (the SM budget), then runs one process per rank:

* normal intranode: launch -> pipeline fill -> one fluid flow per source rank loading the sender SMs, NVLink and
  the receiver SMs of every destination at once (chunked rings keep all stages busy); combine is the reverse flow.
* normal internode: one flow per source rank over RDMA-sender SMs (one copy per destination node), NIC egress, the
  forwarders' NIC ingress (same local index on each remote node), forwarder SMs and NVLink, and the NVL-receiver
  SMs of every destination; combine reverses it (NVL senders -> forwarder reduction -> NIC -> origin reduction).
* low-latency: fixed costs -> one egress flow per rank (one message per (token, expert) selection; NVLink for
  same-node peers when allowed, the NIC for the rest) and one ingress flow per rank; a rank is done when every
  sender that targets it and its ingress have drained, plus the unpack / reduce on all LL blocks.

All sizes are bytes, all times µs; a role's SM capacity is ``channels * per-SM rate``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import simpy

from deep_ep.config import FP8_BLOCK, SOURCE_META_BYTES, Config, ceil_div
from simulator.hardware import GpuProfile, NicProfile
from simulator.links import GBPS, FluidNetwork
from simulator.workload import SourceTraffic

# Fixed SM cost per chunk: tail publish with a release fence plus the head poll (µs); "assumed" in docs.
CHUNK_OVERHEAD_US = 0.4
# Fraction of an internode SM given to one of its two roles (SM A hosts RDMA senders and NVL receivers).
SHARED_SM_FRACTION = 0.5
# NIC cost of one normal-mode RDMA chunk (put header, work request, tail atomic) in equivalent bytes; "assumed".
NIC_MESSAGE_OVERHEAD_BYTES = 1024
# Bytes per top-k entry carried with a normal-mode row (int64 index + float32 weight).
TOPK_ENTRY_BYTES = 12


@dataclass(frozen=True)
class OpSpec:
    """What one op moves. ``token_bytes`` is the physical payload per row/message; ``logical_bytes`` the DeepEP
    test's per-row count (FP8 rows count ``H + H/128*4``, LL dispatch messages add the 16-byte header)."""

    mode: str              # 'intranode' | 'internode' | 'low-latency'
    op: str                # 'dispatch' | 'combine'
    hidden: int
    topk: int
    token_bytes: int
    logical_bytes: int
    num_nodes: int
    ranks_per_node: int
    config: Config | None  # normal mode only
    allow_nvlink: bool = True

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.ranks_per_node


@dataclass
class OpResult:
    """Outcome of one simulated op.

    Attributes:
        time_us: kernel time averaged over ranks (µs): what each rank of DeepEP's benchmark prints.
        max_time_us: kernel time of the slowest rank (µs).
        rank_time_us: ``[num_ranks]`` kernel time per rank.
        logical_bytes: ``[num_ranks]`` bytes as DeepEP's tests count them (RDMA bytes for internode normal mode).
        nvl_logical_bytes: ``[num_ranks]`` received-row bytes (DeepEP's "NVL" figure) for normal mode.
        port_bytes: bytes carried per port class, summed over ranks (``nvl_out``, ``nic_out``, ...).
        utilization: highest average utilization per port class, each port over its own active span (0..1).
        bottleneck: the port class that needs the longest time at full rate, or ``latency`` when that time is
            under 60 % of the data phase.
        fixed_us: launch + pipeline fill/drain + fixed costs included in ``time_us``.
    """

    time_us: float
    max_time_us: float
    rank_time_us: list[float]
    logical_bytes: list[float]
    nvl_logical_bytes: list[float]
    port_bytes: dict[str, float]
    utilization: dict[str, float]
    bottleneck: str
    fixed_us: float
    num_events: int = 0
    extra: dict[str, float] = field(default_factory=dict)


PORT_LABELS = {
    "nvl_out": "NVLink", "nvl_in": "NVLink", "nic_out": "RDMA", "nic_in": "RDMA",
    "sm_send": "SM:send", "sm_recv": "SM:recv", "sm_fwd": "SM:forward", "sm_ll": "SM",
    "copy_engine": "copy engine", "sm_reduce": "SM:reduce", "hbm": "HBM",
}


def row_rate(gpu: GpuProfile, row_bytes: float, chunk_tokens: int = 0, rings: int = 0) -> float:
    """Bytes/µs one SM sustains copying rows of ``row_bytes`` through ``rings`` per-peer rings.

    Per-peer rings: the SM's warps are split over its rings (one per peer, the own rank included) and each ring's
    rows go through its warp group in order, one per ``ring_row_ns`` of latency; the groups of the other rings
    overlap it, so a row costs ``row_bytes / sm_copy_gbps + ring_row_ns / rings`` of SM-time, plus the chunk's
    tail publish (:data:`CHUNK_OVERHEAD_US`) shared by its rows. An SM-bound op therefore moves more per SM at a
    larger EP size. ``rings = 0``: rows that go through no ring (the low-latency kernels' messages).
    """
    per_row_us = row_bytes / (gpu.sm_copy_gbps * GBPS)
    if rings > 0:
        per_row_us += gpu.ring_row_ns * 1e-3 / rings
    if chunk_tokens > 0:
        per_row_us += CHUNK_OVERHEAD_US / chunk_tokens
    return row_bytes / per_row_us


def nic_rate(nic: NicProfile, msg_bytes: float, num_qps: int, efficiency: float = 1.0) -> float:
    """Effective NIC bytes/µs per direction (:meth:`NicProfile.rate`: wire, message rate and QP window)."""
    return nic.rate(msg_bytes, num_qps, efficiency) * GBPS


def rdma_ring_rate(nic: NicProfile, record_bytes: float, chunk_records: int, ring_records: int, num_rings: int,
                   forward_rate: float) -> float:
    """Bytes/µs per direction of chunked normal-mode puts into remote rings (one QP per ring): each chunk of
    ``chunk_records`` records is one message plus a tail atomic (:data:`NIC_MESSAGE_OVERHEAD_BYTES`), at the NIC's
    ``normal_efficiency``; capped by the credits: a ring of ``ring_records`` slots frees a chunk after one NIC round
    trip plus the remote forwarder's copy of it (``forward_rate`` bytes/µs; the head travels back over the NIC)."""
    chunk_bytes = chunk_records * record_bytes
    rate = nic_rate(nic, chunk_bytes, num_rings, nic.normal_efficiency) * chunk_bytes / (
        chunk_bytes + NIC_MESSAGE_OVERHEAD_BYTES)
    credit_rtt_us = 2 * nic.latency_us + chunk_bytes / forward_rate
    return min(rate, num_rings * ring_records * record_bytes / credit_rtt_us)


class _Ports:
    """Ports laid out as ``kind x rank``: port index = ``offset[kind] + rank``.

    ``alias`` maps a kind onto another kind's ports when both are the same physical port (virtual nodes: the
    "network" ports are the NVLink ports); an aliased kind has no ports of its own.
    """

    def __init__(self, kinds: tuple[str, ...], caps: dict[str, float], num_ranks: int,
                 alias: dict[str, str] | None = None) -> None:
        alias = alias or {}
        self.kinds = kinds
        self.physical_kinds = tuple(k for k in kinds if k not in alias)
        self.num_ranks = num_ranks
        self.offset = {kind: i * num_ranks for i, kind in enumerate(self.physical_kinds)}
        self.offset.update({kind: self.offset[target] for kind, target in alias.items() if kind in kinds})
        self.caps = [caps[kind] for kind in self.physical_kinds for _ in range(num_ranks)]

    @property
    def names(self) -> list[str]:
        return [f"{kind}[{r}]" for kind in self.physical_kinds for r in range(self.num_ranks)]


# One flow: (size in bytes, port indices, port bytes per byte of flow).
FlowSpec = tuple[float, np.ndarray, np.ndarray]


class _Usage:
    """Collects ``(port, bytes)`` pieces of one flow (vectors allowed) and normalises them by the flow size."""

    def __init__(self, ports: _Ports) -> None:
        self.off = ports.offset
        self.ports: list[np.ndarray] = []
        self.nbytes: list[np.ndarray] = []

    def add(self, kind: str, ranks: np.ndarray | int, nbytes: np.ndarray | float) -> None:
        r = np.atleast_1d(np.asarray(ranks, dtype=np.int64))
        b = np.broadcast_to(np.asarray(nbytes, dtype=float), r.shape)
        self.ports.append(r + self.off[kind])
        self.nbytes.append(b)

    def flow(self, size: float) -> FlowSpec:
        ports = np.concatenate(self.ports) if self.ports else np.zeros(0, dtype=np.int64)
        nbytes = np.concatenate(self.nbytes) if self.nbytes else np.zeros(0)
        keep = nbytes > 0
        ports, nbytes = ports[keep], nbytes[keep]
        uniq, inverse = np.unique(ports, return_inverse=True)
        merged = np.bincount(inverse, nbytes, minlength=len(uniq))
        return size, uniq, (merged / size if size > 0 else merged)


def _finish(net: FluidNetwork, ports: _Ports, rank_time: list[float], logical: list[float],
            nvl_logical: list[float], fixed_us: float, data_us: float,
            extra: dict[str, float] | None = None) -> OpResult:
    port_bytes: dict[str, float] = {}
    utilization: dict[str, float] = {}
    busy: dict[str, float] = {}
    util = net.utilization(max(data_us, 1e-9))
    busy_us = net.busy_us()
    for kind in ports.physical_kinds:
        lo = ports.offset[kind]
        hi = lo + ports.num_ranks
        port_bytes[kind] = float(net.port_bytes[lo:hi].sum())
        utilization[kind] = float(util[lo:hi].max())
        busy[kind] = float(busy_us[lo:hi].max())
    # The bottleneck is the port kind that needs the longest time at full rate, when that time fills most of the
    # data phase; otherwise fixed costs dominate.
    busiest = max(busy, key=lambda k: (busy[k], k)) if busy else "latency"
    bottleneck = PORT_LABELS.get(busiest, busiest) if busy.get(busiest, 0.0) >= 0.6 * data_us else "latency"
    return OpResult(sum(rank_time) / len(rank_time), max(rank_time), rank_time, logical, nvl_logical, port_bytes,
                    utilization, bottleneck, fixed_us,
                    num_events=net.num_recomputes, extra=extra or {})


def _arrival_times(flows: list[FlowSpec], num_ranks: int, flow_end: list[float]) -> list[float]:
    """Per rank: the latest end of any flow that loads one of that rank's ports."""
    finish = np.asarray(flow_end, dtype=float).copy()
    for src, (_size, ports, _coefs) in enumerate(flows):
        owners = np.unique(ports % num_ranks)
        np.maximum.at(finish, owners, flow_end[src])
    return [float(x) for x in finish]


# ---------------------------------------------------------------------------------------------------------------
# Normal mode
# ---------------------------------------------------------------------------------------------------------------

# Port kinds of each mode, in index order.
NORMAL_INTRANODE_KINDS = ("nvl_out", "nvl_in", "sm_send", "sm_recv")
NORMAL_INTERNODE_KINDS = NORMAL_INTRANODE_KINDS + ("nic_out", "nic_in", "sm_fwd")
LL_KINDS = ("nvl_out", "nvl_in", "nic_out", "nic_in", "sm_ll")


@dataclass
class NormalModel:
    """Capacities per port kind (bytes/µs), fixed costs and flows of one normal-mode op; shared by the DES and
    the closed-form roofline used for tuning."""

    kinds: tuple[str, ...]
    caps: dict[str, float]
    flows: list[FlowSpec]
    fixed_us: float
    fill_us: float
    tail_us: float
    window_cap: float


def normal_model(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                 flows: list[FlowSpec] | None = None) -> NormalModel:
    """Build the capacities (they depend on ``spec.config``) and flows (they do not) of a normal-mode op."""
    assert spec.config is not None
    cfg = spec.config
    num_ranks, per_node = spec.num_ranks, spec.ranks_per_node
    channels = max(cfg.num_sms // 2, 1)
    row = normal_row_bytes(spec)
    nvl_chunk = cfg.num_max_nvl_chunked_send_tokens
    rdma_chunk = cfg.num_max_rdma_chunked_send_tokens
    internode = spec.num_nodes > 1
    # Per-peer rings: an intranode sender SM serves one ring per destination rank and a receiver SM one per
    # source; internode, the RDMA senders stage one ring per destination node and the NVL receivers drain one
    # ring per local forwarder.
    send_rings = spec.num_nodes if internode else num_ranks
    copy_rate = row_rate(gpu, row, nvl_chunk, send_rings)
    recv_rate = row_rate(gpu, row, nvl_chunk, per_node)
    # Forwarder SMs: a byte rate plus the per-chunk tail publish.
    fwd_rate = 1.0 / (1.0 / (gpu.fwd_sm_gbps * GBPS) + CHUNK_OVERHEAD_US / (nvl_chunk * row))
    share = SHARED_SM_FRACTION if internode else 1.0
    nvl = gpu.nvlink_gbps * gpu.nvl_ring_efficiency * GBPS
    caps = {"nvl_out": nvl, "nvl_in": nvl, "sm_send": channels * copy_rate * share,
            "sm_recv": min(channels * recv_rate * share, gpu.hbm_gbps * GBPS / 2)}
    # Pipeline fill: the first chunk crosses every stage before the bottleneck stage streams.
    fill_us = gpu.nvl_latency_us * 2 + nvl_chunk * row / copy_rate
    kinds = NORMAL_INTRANODE_KINDS
    if internode:
        kinds = NORMAL_INTERNODE_KINDS
        # Each RDMA chunk is one put plus a remote atomic on the tail: a fixed per-message cost on the NIC. One
        # QP per channel to each remote node's forwarder.
        chunk_bytes = rdma_chunk * row
        rate = rdma_ring_rate(nic, row, rdma_chunk, cfg.num_max_rdma_chunked_recv_tokens,
                              channels * (spec.num_nodes - 1), fwd_rate)
        caps.update(nic_out=rate, nic_in=rate, sm_fwd=channels * fwd_rate)
        # The first RDMA chunk is staged by the sender warps, crosses the NIC, and is forwarded once.
        fill_us += chunk_bytes / (copy_rate * share) + nic.latency_us + nvl_chunk * row / fwd_rate
    # Credit window: each (channel, peer) ring of Nn rows needs one NVLink round trip to refill.
    rtt_us = 2 * gpu.nvl_latency_us + nvl_chunk * row / copy_rate
    window_cap = channels * per_node * cfg.num_max_nvl_chunked_recv_tokens * row / rtt_us
    if flows is None:
        flows = _normal_flows(spec, traffic, _Ports(kinds, caps, num_ranks), row)
    tail_us = gpu.combine_tail_us if spec.op == "combine" else 0.0
    return NormalModel(kinds, caps, flows, gpu.launch_us + fill_us + tail_us, fill_us, tail_us, window_cap)


def normal_row_bytes(spec: OpSpec) -> int:
    """Physical bytes of one normal-mode row/record: payload plus, for dispatch, source meta and top-k entries."""
    meta = SOURCE_META_BYTES + spec.topk * TOPK_ENTRY_BYTES if spec.op == "dispatch" else 0
    return spec.token_bytes + meta


def port_loads(flows: list[FlowSpec], num_ports: int) -> np.ndarray:
    """Bytes each port carries over the whole op (``[num_ports]``)."""
    loads = np.zeros(num_ports)
    for size, ports, coefs in flows:
        np.add.at(loads, ports, coefs * size)
    return loads


def max_load_per_kind(model: NormalModel, num_ranks: int) -> dict[str, float]:
    """Bytes on the most loaded port of each kind over the whole op."""
    loads = port_loads(model.flows, len(model.kinds) * num_ranks)
    return {kind: float(loads[i * num_ranks:(i + 1) * num_ranks].max()) for i, kind in enumerate(model.kinds)}


def roofline_us(model: NormalModel, max_loads: dict[str, float]) -> float:
    """Closed-form time: fixed costs + the most loaded port's bytes / capacity (exact for symmetric traffic)."""
    worst = max(load / model.caps[kind] for kind, load in max_loads.items())
    largest_flow = max((size for size, _, _ in model.flows), default=0.0)
    return model.fixed_us + max(worst, largest_flow / model.window_cap)


def simulate_normal(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                    flows: list[FlowSpec] | None = None) -> OpResult:
    """Simulate one normal-mode dispatch or combine over all ranks (intranode when one node)."""
    model = normal_model(spec, traffic, gpu, nic, flows)
    num_ranks = spec.num_ranks
    ports = _Ports(model.kinds, model.caps, num_ranks)
    # Per rank: launch (cooperative kernel start, intra-node barrier) and pipeline fill (the first chunk crosses
    # every stage), then all stages stream at the max-min fair rate, then the combine tail (last reductions, ring
    # reset).
    net, finish = run_rank_flows(spec.op, ports, model.flows, [gpu.launch_us + model.fill_us] * num_ranks,
                                 model.tail_us, model.window_cap)
    logical, nvl_logical = normal_logical_bytes(spec, traffic)
    data_us = max(finish) - model.fixed_us
    return _finish(net, ports, finish, logical, nvl_logical, model.fixed_us, data_us, extra={"fill_us": model.fill_us})


def run_rank_flows(name: str, ports: _Ports, flows: list[FlowSpec], before_us: list[float], after_us: float = 0.0,
                   cap: float = math.inf) -> tuple[FluidNetwork, list[float]]:
    """DES of one op with one flow per rank: rank ``r`` waits ``before_us[r]``, streams ``flows[r]`` through the
    fluid ports (rate capped at ``cap``), then waits ``after_us``.

    Returns:
        ``(network, finish)``: a rank finishes when its own process and every flow that loads one of its ports end.
    """
    env = simpy.Environment()
    net = FluidNetwork(env, ports.caps, ports.names)
    rank_time = [0.0] * len(flows)

    def rank_proc(rank: int, flow: FlowSpec):
        yield env.timeout(before_us[rank])
        yield net.transfer(f"{name}[{rank}]", *flow, cap=cap)
        yield env.timeout(after_us)
        rank_time[rank] = env.now

    for rank, flow in enumerate(flows):
        env.process(rank_proc(rank, flow))
    env.run()
    net.check_idle()
    return net, _arrival_times(flows, ports.num_ranks, rank_time)


def normal_logical_bytes(spec: OpSpec, traffic: list[SourceTraffic]) -> tuple[list[float], list[float]]:
    """Per rank, DeepEP's byte counts of a normal op: ``(logical, nvl_logical)``; logical is the RDMA figure
    ((token, node) records) internode and the received rows intranode."""
    if spec.op == "dispatch":
        recv_rows = [sum(t.rows_to_rank[d] for t in traffic) for d in range(spec.num_ranks)]
    else:
        recv_rows = [t.num_rows for t in traffic]
    nvl_logical = [float(n * spec.logical_bytes) for n in recv_rows]
    if spec.num_nodes > 1:
        return [float(t.num_records * spec.logical_bytes) for t in traffic], nvl_logical
    return nvl_logical, nvl_logical


def _normal_flows(spec: OpSpec, traffic: list[SourceTraffic], ports: _Ports, row: float) -> list[FlowSpec]:
    """One flow per rank: dispatch flows start at the source, combine flows end at the origin.

    Intranode: rows ``s -> d`` load ``sm_send[s]``, ``sm_recv[d]`` and, for ``d != s``, ``nvl_out[s]``/``nvl_in[d]``
    (combine: the same with the roles of ``s`` and ``d`` swapped). Internode: each record ``s -> node n`` goes to
    the forwarder ``f = (n, local(s))`` (NIC unless ``n`` is the own node), which copies it to every destination
    GPU on ``n`` over NVLink (no hop when the destination is ``f``).
    """
    num_nodes, per_node = spec.num_nodes, spec.ranks_per_node
    dispatch = spec.op == "dispatch"
    flows = []
    all_ranks = np.arange(spec.num_ranks)
    for s, t in enumerate(traffic):
        node_s, local_s = divmod(s, per_node)
        rows = np.asarray(t.rows_to_rank, dtype=float) * row  # [num_ranks] bytes of rows s -> d
        u = _Usage(ports)
        if num_nodes == 1:
            size = float(rows.sum())
            remote = rows.copy()
            remote[s] = 0.0
            if dispatch:
                u.add("sm_send", s, size)
                u.add("sm_recv", all_ranks, rows)
                u.add("nvl_out", s, remote.sum())
                u.add("nvl_in", all_ranks, remote)
            else:  # every d sends back the rows it got from s; s reduces them
                u.add("sm_send", all_ranks, rows)
                u.add("sm_recv", s, size)
                u.add("nvl_out", all_ranks, remote)
                u.add("nvl_in", s, remote.sum())
        else:
            records = np.asarray(t.records_to_node, dtype=float) * row  # [num_nodes]
            size = float(records.sum())
            fwd = np.arange(num_nodes) * per_node + local_s  # forwarder GPU per node
            grid = rows.reshape(num_nodes, per_node)
            copies = grid.sum(axis=1)
            hops = grid.copy()
            hops[:, local_s] = 0.0  # the forwarder's own rows need no NVLink hop
            remote_records = records.copy()
            remote_records[node_s] = 0.0
            u.add("sm_fwd", fwd, copies)
            if dispatch:
                u.add("sm_send", s, size)
                u.add("nic_out", s, remote_records.sum())
                u.add("nic_in", fwd, remote_records)
                u.add("nvl_out", fwd, hops.sum(axis=1))
                u.add("nvl_in", all_ranks, hops.reshape(-1))
                u.add("sm_recv", all_ranks, rows)
            else:
                u.add("sm_send", all_ranks, rows)
                u.add("nvl_out", all_ranks, hops.reshape(-1))
                u.add("nvl_in", fwd, hops.sum(axis=1))
                u.add("nic_out", fwd, remote_records)
                u.add("nic_in", s, remote_records.sum())
                u.add("sm_recv", s, size)
        flows.append(u.flow(size))
    return flows


# ---------------------------------------------------------------------------------------------------------------
# Low-latency mode
# ---------------------------------------------------------------------------------------------------------------

def ll_num_blocks(num_experts: int, num_device_sms: int) -> int:
    """Blocks of the LL kernels: ``ceil(E / G)`` with ``G = ceil(E / device SMs)`` warp groups per block."""
    groups = ceil_div(num_experts, num_device_sms)
    return ceil_div(num_experts, groups)


def _nvlink_peers(spec: OpSpec) -> np.ndarray:
    """``[R, R]`` bool: pairs that talk over NVLink in LL mode (same node, NVLink allowed, not self)."""
    node = np.arange(spec.num_ranks) // spec.ranks_per_node
    peers = (node[:, None] == node[None, :]) if spec.allow_nvlink else np.zeros((spec.num_ranks,) * 2, bool)
    np.fill_diagonal(peers, False)
    return peers


def ll_send_recv(spec: OpSpec, sent: np.ndarray, nvl_rate: float, nic_rate_: float, sm_cap: float, fixed_us: float,
                 nic_on_nvlink: bool = False) -> tuple[FluidNetwork, _Ports, list[float], list[float]]:
    """Run the LL send phase: after ``fixed_us`` every rank streams its puts (``sent[x, y]`` bytes to ``y``).

    Egress flow per sender (its SMs issue the puts, NIC / NVLink egress) and ingress flow per receiver (NIC / NVLink
    ingress): the NIC keeps one queue pair per peer, so a congested receiver slows only the traffic to itself.
    ``nic_on_nvlink`` makes the NIC ports the NVLink ports (virtual nodes on one host).

    Returns:
        ``(network, ports, send_end, recv_end)``: per rank, when its egress and its ingress drained (µs).
    """
    num_ranks = spec.num_ranks
    nvlink_peer = _nvlink_peers(spec)
    caps = {"nvl_out": nvl_rate, "nvl_in": nvl_rate, "nic_out": nic_rate_, "nic_in": nic_rate_, "sm_ll": sm_cap}
    ports = _Ports(LL_KINDS, caps, num_ranks, {"nic_out": "nvl_out", "nic_in": "nvl_in"} if nic_on_nvlink else None)
    env = simpy.Environment()
    net = FluidNetwork(env, ports.caps, ports.names)
    egress, ingress = [], []
    for x in range(num_ranks):
        out_row, in_row = sent[x], sent[:, x]
        nvl_out = float(out_row[nvlink_peer[x]].sum())
        nvl_in = float(in_row[nvlink_peer[:, x]].sum())
        u = _Usage(ports)
        u.add("sm_ll", x, out_row.sum())
        u.add("nvl_out", x, nvl_out)
        u.add("nic_out", x, out_row.sum() - out_row[x] - nvl_out)
        egress.append(u.flow(float(out_row.sum())))
        u = _Usage(ports)
        u.add("nvl_in", x, nvl_in)
        u.add("nic_in", x, in_row.sum() - in_row[x] - nvl_in)
        ingress.append(u.flow(float(in_row.sum() - in_row[x])))
    send_end = [0.0] * num_ranks
    recv_end = [0.0] * num_ranks

    def send_phase(rank: int, flow: FlowSpec):
        # launch + fixed costs (grid sync, count/flag signalling), then the puts stream out
        yield env.timeout(fixed_us)
        yield net.transfer(f"ll_{spec.op}_send[{rank}]", *flow)
        send_end[rank] = env.now

    def recv_arrivals(rank: int, flow: FlowSpec):
        # the same messages landing at this rank's ingress ports
        yield env.timeout(fixed_us)
        yield net.transfer(f"ll_{spec.op}_recv[{rank}]", *flow)
        recv_end[rank] = env.now

    for rank in range(num_ranks):
        env.process(send_phase(rank, egress[rank]))
        env.process(recv_arrivals(rank, ingress[rank]))
    env.run()
    net.check_idle()
    return net, ports, send_end, recv_end


def simulate_low_latency(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                         num_experts: int) -> OpResult:
    """Simulate one low-latency dispatch or combine (send phase, then receive phase) over all ranks.

    Dispatch: rank ``x`` sends one message per selection to the expert's rank ``y``. Combine: the expert holder
    ``x`` returns each of them to its origin. Same-node peers use NVLink when allowed, the rest the NIC.
    """
    num_ranks = spec.num_ranks
    msg = spec.token_bytes
    blocks = ll_num_blocks(num_experts, gpu.num_device_sms)
    sm_cap = blocks * row_rate(gpu, msg)
    unpack_cap = min(sm_cap, gpu.hbm_gbps * GBPS / 2)  # read + write
    reduce_cap = min(sm_cap, gpu.hbm_gbps * GBPS)      # reads dominate (K rows in, one row out)
    # msgs[x, y]: selections of source x served on rank y; sent[x, y]: bytes x puts to y in this op.
    msgs = np.asarray([t.msgs_to_rank for t in traffic], dtype=float)
    dispatch = spec.op == "dispatch"
    sent = (msgs if dispatch else msgs.T) * msg
    nvlink_peers = int(_nvlink_peers(spec)[0].sum())
    remote_peers = num_ranks - 1 - nvlink_peers
    # One QP per local expert to every remote peer (DeepEP's LL QP count), one message per selection.
    qps = max(num_experts // num_ranks, 1) * remote_peers
    tokens = max(t.num_tokens for t in traffic)
    fixed_us = gpu.ll_fixed_us(nvlink_peers, remote_peers, tokens, spec.topk)
    net, ports, send_end, recv_end = ll_send_recv(spec, sent, gpu.nvlink_gbps * GBPS,
                                                  nic_rate(nic, msg, qps), sm_cap, fixed_us,
                                                  nic_on_nvlink=nic.shares_nvlink)
    # Receive phase: the last message from each sender lands after that sender's egress has drained (puts leave
    # round-robin over peers) and after this rank's ingress has drained; then unpack / reduce on all blocks.
    ends = np.asarray(send_end)
    rank_time = []
    for y in range(num_ranks):
        senders = sent[:, y] > 0
        last = max(float(ends[senders].max()) if senders.any() else fixed_us, recv_end[y], send_end[y])
        if dispatch:
            # Unpacking overlaps the arrivals (each (expert, source) block starts when its count lands); only the
            # last source's share remains after the last arrival.
            rank_time.append(last + float(sent[:, y].sum()) / max(int(senders.sum()), 1) / unpack_cap)
        else:
            # Combine waits for every flag, then streams all K rows of each token from HBM and reduces them.
            rank_time.append(last + float(sent[:, y].sum()) / reduce_cap)
    logical = [float(t.num_selections * spec.logical_bytes) for t in traffic]
    data_us = max(max(send_end), max(recv_end)) - fixed_us
    return _finish(net, ports, rank_time, logical, logical, fixed_us, data_us,
                   extra={"send_us": max(send_end), "recv_us": max(rank_time) - max(send_end)})


def token_bytes(hidden: int, dtype: str) -> int:
    """Payload per normal-mode row: FP8 ``H + H/128*4`` (data + float32 scales) or BF16 ``2H``."""
    return hidden + hidden // FP8_BLOCK * 4 if dtype == "fp8" else 2 * hidden
