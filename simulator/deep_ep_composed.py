"""deep_ep's composed internode path in the ``--kernels deep_ep`` family: ``N`` nodes x ``G > 1`` GPUs beyond the
fused kernels' ranks (:mod:`simulator.deep_ep_fused`).

deep_ep runs that topology as two stage calls: a **rail stage** (the ``N`` ranks of one local index: each token goes
once to each node it needs, to the rail peer there), a torch-backend op, and a **node stage** (the ``G`` ranks of one
node: the forwarder sends each row to the local ranks that need it), a ring op over its subgroup; the caller passes
the model of each. A stage starts when the last rank of its group is ready; around the stages the composed layer's
torch copies move the rows (``composed_copy_gbps``, bytes read plus written) and it adds
``composed_host_us`` per call. The model is a **cached** call (stage records carry the payload only): dispatch packs
``x`` into records (not BF16), rail stage, node stage, gather into the contract's order; combine gathers the expert
rows into node-stage order, node-stage combine (a BF16 partial per node), rail-stage combine at the owner.

The rail stage is the torch backend (:mod:`simulator.deep_ep_torch`) over NVLink for virtual nodes on one host
(``nvlink-p2p``), else over the NIC. The node stage is intranode over NVLink.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from simulator.deep_ep_fused import is_fused
from simulator.hardware import NicProfile
from simulator.links import GBPS
from simulator.rank import OpResult, OpSpec, normal_logical_bytes, token_bytes
from simulator.workload import SourceTraffic

# (stage spec, stage traffic, stage dtype) -> OpResult of that stage's ranks
StageModel = Callable[[OpSpec, list[SourceTraffic], str], OpResult]


def is_composed(spec: OpSpec) -> bool:
    """Whether deep_ep runs this normal op as the composed path: several nodes of several GPUs beyond the fused
    kernels' ranks (:func:`simulator.deep_ep_fused.is_fused`; one GPU per node, virtual or behind a NIC, is the
    one-GPU-per-node backend)."""
    return spec.mode != "low-latency" and spec.num_nodes > 1 and spec.ranks_per_node > 1 and not is_fused(spec)


def stage_traffic(traffic: list[SourceTraffic], num_nodes: int, per_node: int
                  ) -> tuple[list[list[SourceTraffic]], list[list[SourceTraffic]]]:
    """``(rail, node)``: ``rail[l][n]`` is what rail rank ``n`` of local index ``l`` (global rank ``n * G + l``)
    sends in its rail stage (one record per node its tokens need, its own node included); ``node[n][l]`` what the
    forwarder ``(n, l)`` sends in node ``n``'s stage (for every local rank ``l'``, the rows of the sources
    ``(m, l)`` for ``(n, l')``)."""
    rows = np.asarray([t.rows_to_rank for t in traffic], dtype=np.int64)       # [R, R]
    records = np.asarray([t.records_to_node for t in traffic], dtype=np.int64)  # [R, N]
    tokens = [t.num_tokens for t in traffic]
    rail = [[_traffic(tokens[n * per_node + local], records[n * per_node + local].tolist(), True)
             for n in range(num_nodes)] for local in range(per_node)]
    # Sum over the source node m of the sources (m, l): [l, n, l'] rows into (n, l'), [l, n] records into node n.
    to_local = rows.reshape(num_nodes, per_node, num_nodes, per_node).sum(axis=0).tolist()
    into_node = records.reshape(num_nodes, per_node, num_nodes).sum(axis=0).tolist()
    node = [[_traffic(into_node[local][n], to_local[local][n], False) for local in range(per_node)]
            for n in range(num_nodes)]
    return rail, node


def _traffic(num_tokens: int, rows_to_rank: list[int], rank_is_node: bool) -> SourceTraffic:
    """A stage source's traffic; ``rank_is_node``: each stage rank is a node of its own (the rail stage)."""
    rows = tuple(rows_to_rank)
    return SourceTraffic(num_tokens, 0, rows, rows, rows if rank_is_node else (sum(rows),))


def _stage_spec(spec: OpSpec, row_bytes: int, topk: int, num_nodes: int, per_node: int) -> OpSpec:
    """A stage op whose rows are ``row_bytes`` (a multiple of 2): BF16 rows of ``row_bytes / 2`` channels."""
    mode = "internode" if num_nodes > 1 else "intranode"
    return OpSpec(mode, spec.op, row_bytes // 2, topk, row_bytes, row_bytes, num_nodes, per_node, None)


def composed_stages(traffic: list[SourceTraffic], num_nodes: int, per_node: int) -> tuple:
    """What a composed op derives from its traffic alone, whatever the SM count: ``(rail, node, tokens,
    received)``, :func:`stage_traffic` and ``[N, G]`` float arrays of each rank's tokens and received rows."""
    rail, node = stage_traffic(traffic, num_nodes, per_node)
    tokens = np.array([t.num_tokens for t in traffic], dtype=float).reshape(num_nodes, per_node)
    received = np.asarray([t.rows_to_rank for t in traffic], dtype=float).sum(axis=0).reshape(num_nodes, per_node)
    return rail, node, tokens, received


def composed_rank_times(spec: OpSpec, traffic: list[SourceTraffic], nic: NicProfile, dtype: str,
                        copy_gbps: float, host_us: float, rail_stage: StageModel,
                        node_stage: StageModel, stages: tuple | None = None) -> tuple[np.ndarray, dict]:
    """Per-rank time of one composed op and its parts (``rail``, ``node``: the stages' OpResults per group;
    ``copy_us``: per-rank copy time), with ``rail_stage`` / ``node_stage`` costing each stage op; ``stages``:
    :func:`composed_stages` of ``traffic``, when the caller costs it more than once."""
    num_nodes, per_node = spec.num_nodes, spec.ranks_per_node
    rail_traffic, node_traffic, tokens, received = stages or composed_stages(traffic, num_nodes, per_node)
    dispatch = spec.op == "dispatch"
    payload = token_bytes(spec.hidden, dtype)
    row = -(-payload // 16) * 16 if dispatch else 2 * spec.hidden  # cached dispatch records: the payload, padded
    topk = 0 if dispatch else spec.topk                              # combine carries the top-k weights
    one_host = nic.shares_nvlink  # virtual nodes: the rail group is one host's N ranks
    rail_spec = (_stage_spec(spec, row, topk, 1, num_nodes) if one_host
                 else _stage_spec(spec, row, topk, num_nodes, 1))
    node_spec = _stage_spec(spec, row, topk, 1, per_node)
    rail = [rail_stage(rail_spec, rail_traffic[local], "bf16") for local in range(per_node)]
    node = [node_stage(node_spec, node_traffic[n], "bf16") for n in range(num_nodes)]
    rail_t = np.array([[rail[local].rank_time_us[n] for local in range(per_node)] for n in range(num_nodes)])
    node_t = np.array([node[n].rank_time_us for n in range(num_nodes)])       # both [N, G]

    rate = copy_gbps * GBPS
    if dispatch:
        packed = dtype == "fp8" or payload % 16 != 0                          # BF16 rows are their own records
        before = 2 * tokens * payload / rate if packed else np.zeros_like(tokens)
        after = 2 * received * payload / rate                                 # gather, one per payload field
        rail_end = before.max(axis=0, keepdims=True) + rail_t   # each rail group starts together
        end = rail_end.max(axis=1, keepdims=True) + node_t + after
    else:
        before = 2 * received * 2 * spec.hidden / rate                        # expert rows into node-stage order
        after = np.zeros_like(before)
        node_end = before.max(axis=1, keepdims=True) + node_t
        end = node_end.max(axis=0, keepdims=True) + rail_t
    return (end + host_us).reshape(-1), {"rail": rail, "node": node, "copy_us": (before + after).reshape(-1)}


def composed_result(spec: OpSpec, traffic: list[SourceTraffic], nic: NicProfile, dtype: str, copy_gbps: float,
                    host_us: float, rail_stage: StageModel, node_stage: StageModel) -> OpResult:
    """The composed op as one OpResult: rank times from :func:`composed_rank_times`, DeepEP's byte counts of the
    whole op, port bytes summed over the stages, each port's utilization as its busiest stage's share of the op,
    and the bottleneck of the part that takes longest on the slowest rank (``rail:<stage bottleneck>``,
    ``node:<...>`` or ``copies``)."""
    times, parts = composed_rank_times(spec, traffic, nic, dtype, copy_gbps, host_us, rail_stage, node_stage)
    logical, nvl_logical = normal_logical_bytes(spec, traffic)
    stages = parts["rail"] + parts["node"]
    port_bytes: dict[str, float] = {}
    utilization: dict[str, float] = {}
    total = max(float(times.max()), 1e-9)
    for res in stages:
        for kind, value in res.port_bytes.items():
            port_bytes[kind] = port_bytes.get(kind, 0.0) + value
        for kind, value in res.utilization.items():
            utilization[kind] = max(utilization.get(kind, 0.0), value * res.max_time_us / total)
    slowest = int(np.argmax(times))
    per_node = spec.ranks_per_node
    node_of, local_of = divmod(slowest, per_node)
    rail_res, node_res = parts["rail"][local_of], parts["node"][node_of]
    shares = {f"rail:{rail_res.bottleneck}": rail_res.rank_time_us[node_of],
              f"node:{node_res.bottleneck}": node_res.rank_time_us[local_of],
              "copies": float(parts["copy_us"][slowest])}
    fixed = max(r.fixed_us for r in parts["rail"]) + max(r.fixed_us for r in parts["node"]) + host_us
    extra = {"rail_us": float(np.mean([r.time_us for r in parts["rail"]])),
             "node_us": float(np.mean([r.time_us for r in parts["node"]])),
             "copy_us": float(parts["copy_us"].mean())}
    return OpResult(float(times.mean()), float(times.max()), [float(t) for t in times], logical, nvl_logical,
                    port_bytes, utilization, max(shares, key=lambda k: (shares[k], k)), fixed, extra=extra)
