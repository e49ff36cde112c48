"""deep_ep's torch backend where its ring kernels do not serve the group, in the ``--kernels deep_ep`` family.

Past ``NUM_MAX_RING_RANKS`` nodes (a ring op has at most that many ranks) deep_ep runs the whole normal op on its
torch backend (NCCL point-to-point of the rows) with one GPU per node, and the composed path's rail stage on it
with several (the node stage stays on the kernels; :mod:`simulator.deep_ep_composed` sends the rail op here).
Closed form per rank, with assumed parameters of ``DeepEpProfile``:

    time = torch_call_us + latency + max(bytes sent, bytes received) / (link rate * torch_p2p_efficiency)
           + (bytes sent + bytes received) * 2 / composed_copy_gbps

``torch_call_us`` is the host work per call (count exchange, the host syncs that size the outputs, Python); one
call's ``isend`` / ``irecv`` run as one NCCL group, so the slower direction counts. Link rate: the NIC's line rate,
or NVLink for virtual nodes on one host. The copies gather rows into per-peer send buffers and scatter the
received ones (read plus write of every byte). NCCL brings its own CTAs: the recommended SMs do not change.
"""
from __future__ import annotations

import numpy as np

from simulator.hardware import GpuProfile, NicProfile
from simulator.links import GBPS
from simulator.rank import OpResult, OpSpec, normal_logical_bytes
from simulator.workload import SourceTraffic


def torch_rank_times(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile,
                     call_us: float, p2p_efficiency: float, copy_gbps: float) -> tuple[np.ndarray, dict]:
    """Per-rank time of one torch-backend normal op over ``spec.num_ranks`` ranks whose rows are
    ``spec.token_bytes`` (every other rank a peer over the link), and its parts (``sent``, ``received`` bytes per
    rank; ``link_us``, ``copy_us`` per rank; ``fixed_us``; ``link``: the link's label)."""
    rows = np.asarray([t.rows_to_rank for t in traffic], dtype=float)  # [R, R]: source -> destination
    if spec.op == "combine":
        rows = rows.T                                                   # the rows travel back
    np.fill_diagonal(rows, 0.0)
    sent = rows.sum(axis=1) * spec.token_bytes
    received = rows.sum(axis=0) * spec.token_bytes
    link_gbps, link = (gpu.nvlink_gbps, "NVLink") if nic.shares_nvlink else (nic.line_gbps, "RDMA")
    link_us = np.maximum(sent, received) / (link_gbps * p2p_efficiency * GBPS)
    copy_us = 2 * (sent + received) / (copy_gbps * GBPS)
    fixed_us = call_us + nic.latency_us
    return fixed_us + link_us + copy_us, {"sent": sent, "received": received, "link_us": link_us,
                                          "copy_us": copy_us, "fixed_us": fixed_us, "link": link}


def torch_result(spec: OpSpec, traffic: list[SourceTraffic], gpu: GpuProfile, nic: NicProfile, call_us: float,
                 p2p_efficiency: float, copy_gbps: float) -> OpResult:
    """:func:`torch_rank_times` as an OpResult: DeepEP's byte counts, the link's bytes and busiest share of the op,
    bottleneck the largest part of the slowest rank's time: ``torch:<link>``, ``torch:host`` or ``torch:copies``."""
    times, parts = torch_rank_times(spec, traffic, gpu, nic, call_us, p2p_efficiency, copy_gbps)
    logical, nvl_logical = normal_logical_bytes(spec, traffic)
    out, into = ("nvl_out", "nvl_in") if parts["link"] == "NVLink" else ("nic_out", "nic_in")
    total = max(float(times.max()), 1e-9)
    busy = float(parts["link_us"].max()) / total
    slowest = int(np.argmax(times))
    shares = {f"torch:{parts['link']}": float(parts["link_us"][slowest]), "torch:host": parts["fixed_us"],
              "torch:copies": float(parts["copy_us"][slowest])}
    return OpResult(float(times.mean()), float(times.max()), [float(t) for t in times], logical, nvl_logical,
                    {out: float(parts["sent"].sum()), into: float(parts["received"].sum())}, {out: busy, into: busy},
                    max(shares, key=lambda k: (shares[k], k)), parts["fixed_us"],
                    extra={"link_us": float(parts["link_us"].mean()), "copy_us": float(parts["copy_us"].mean())})
