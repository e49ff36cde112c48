"""Fit the ``deep_ep`` kernel family (``simulator.deep_ep_kernels``) to our own benchmark JSON files.

:func:`read_bench` turns a bench file into a :class:`BenchRun` (workload and one :class:`BenchPoint` per measured
op); :func:`fit` least-squares the family's parameters on the points whose sweep value (SM count; tokens per rank
for the low-latency bench) is not held out (residual log(predicted / measured), Levenberg-Marquardt in log-parameter
space, so every parameter stays positive) and predicts the points of ``check`` runs (never fitted);
:func:`to_text` prints measured vs predicted per point; :func:`write_calibration` stores the values with their
sources in ``simulator/data/calibration_deep_ep.json``, which ``deep_ep_kernels.profile()`` loads.

Readers: ``benchmarks/bench_intranode.py``, ``benchmarks/bench_internode.py`` (its intranode phase and one GPU per
virtual node) and ``benchmarks/bench_low_latency.py`` (fused kernels and the two launches of hook mode, per ``T``).
A new bench kind needs a reader in :data:`BENCH_READERS`, its parameters in :data:`FIT_PARAMS` and a branch in
:func:`predict_point`; unknown files raise ``ValueError`` naming the keys found.
"""
from __future__ import annotations

import datetime
import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from deep_ep.backends.cuda_tuning import intranode_channels, send_warp_range
from deep_ep.config import Config
from simulator import deep_ep_fused as fused
from simulator import deep_ep_kernels as dek
from simulator import hardware, rank, workload
from simulator.deep_ep_kernels import CALIBRATION_PATH, DeepEpProfile

__all__ = ["BenchPoint", "BenchRun", "FitResult", "read_bench", "fit", "to_text", "write_calibration",
           "CALIBRATION_PATH"]


@dataclass(frozen=True)
class BenchPoint:
    """One measured op: ``time_us`` is the mean over ranks of the bench's acceptance time (normal mode: wall time of
    the call; low latency: the kernel time of the profiler).

    ``receive`` is the dispatch receive path (``rings`` or ``direct``, see ``DeepEpProfile.receive_copies``; combine
    points say ``rings``); ``num_nodes`` > 1 marks a point measured on that many virtual nodes of one host
    (``nvlink-p2p``), the bench's ranks split evenly between them. Low-latency points carry ``tokens`` (per rank; 0
    for normal-mode points, whose token count is the run's) and ``phase``: ``fused`` (one kernel, no hook), ``send``
    or ``recv`` (the two launches of ``return_recv_hook``).
    """

    op: str         # 'dispatch' | 'combine'
    dtype: str      # 'fp8' | 'bf16'
    num_sms: int
    chunk: int
    time_us: float
    receive: str = "rings"
    num_nodes: int = 1
    tokens: int = 0
    phase: str = "fused"
    channels: int = 0  # CTAs the kernels ran; 0: what deep_ep runs for num_sms (capped intranode channels)

    @property
    def sweep_value(self) -> int:
        """What ``--hold-out`` selects on: tokens per rank for low-latency points, the SM count otherwise."""
        return self.tokens or self.num_sms

    @property
    def label(self) -> str:
        if self.tokens:
            hook = f" {self.phase} (hook)" if self.phase != "fused" else ""
            return f"T={self.tokens} {self.dtype} {self.op}{hook}"
        direct = " direct" if self.receive == "direct" else ""
        nodes = f" ({self.num_nodes} virtual nodes)" if self.num_nodes > 1 else ""
        return f"{self.num_sms} SMs {self.dtype} {self.op}{direct}{nodes}"

    def as_dict(self) -> dict:
        """The point's identity for the calibration file (``predictions`` looks measured values up by it)."""
        if self.tokens:
            return {"point": self.label, "op": self.op, "dtype": self.dtype, "num_sms": self.num_sms,
                    "tokens": self.tokens, "phase": self.phase}
        return {"point": self.label, "op": self.op, "dtype": self.dtype, "num_sms": self.num_sms,
                "receive": self.receive, "num_nodes": self.num_nodes, "chunk": self.chunk}


@dataclass(frozen=True)
class BenchRun:
    """A bench file: its kind, workload and points."""

    kind: str       # 'intranode' | 'internode' | 'low-latency'
    path: str
    date: str
    machine: str
    num_ranks: int
    num_tokens: int
    hidden: int
    topk: int
    num_experts: int
    points: tuple[BenchPoint, ...]
    # Low latency: DeepEP's byte counts per (tokens, op), summed over ranks (valid selections x bytes per message).
    deepep_bytes: tuple[tuple[int, str, int], ...] = ()

    @property
    def gpu(self) -> str:
        for name in sorted(hardware.GPUS):
            if name in self.machine.lower():
                return name
        return "h200"


# ---------------------------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------------------------

# Copy warps per channel of the points the stored calibration is fit on (every channel count and dtype). The
# Buffer's tuned warp table (deep_ep's ``intranode_send_warps``) differs; a fit on a sweep measured at the tuned
# warps would take them from there instead.
CALIBRATION_SEND_WARPS = {"dispatch": 16, "combine": 8}


def calibration_send_warps(kernel: str, num_ranks: int) -> int:
    """The calibration's warp count for ``kernel``, clamped to deep_ep's ``send_warp_range`` as Buffer clamps."""
    lowest, highest = send_warp_range(kernel, num_ranks)
    return min(max(CALIBRATION_SEND_WARPS[kernel], lowest), highest)


# bench_intranode.py op -> (op, dtype, dispatch receive path); other ops (the NCCL baseline, the combine entries
# that name their send path) are not read.
_INTRANODE_OPS = {"dispatch_fp8": ("dispatch", "fp8", "rings"), "dispatch_bf16": ("dispatch", "bf16", "rings"),
                  "dispatch_fp8_direct": ("dispatch", "fp8", "direct"),
                  "dispatch_bf16_direct": ("dispatch", "bf16", "direct"),
                  "combine_bf16": ("combine", "bf16", "rings")}
WARPS_CHOICES = ("default", "best")


def _first_rank(data: dict) -> dict:
    ranks = data.get("ranks")
    return ranks[0] if isinstance(ranks, list) and ranks and isinstance(ranks[0], dict) else {}


def _is_intranode(data: dict) -> bool:
    points = [p for p in _first_rank(data).get("points", []) if isinstance(p, dict)]
    return any(p.get("op") in _INTRANODE_OPS for p in points) and not any("phase" in p for p in points)


def _is_internode(data: dict) -> bool:
    points = [p for p in _first_rank(data).get("points", []) if isinstance(p, dict)]
    return any(p.get("phase") in ("intranode", "internode") for p in points)


def _positive(path: str, what: str, t: object) -> float:
    if not isinstance(t, (int, float)) or not t > 0:
        raise ValueError(f"bench {path}: {what} has no positive wall time, got {t!r}")
    return float(t)


def _read_intranode(data: dict, path: str, warps: str = "default") -> BenchRun:
    """``benchmarks/bench_intranode.py`` output: per rank a list of points ``{op, num_sms, chunk, wall_us_mean}``
    (the best chunk and warp count of that rank) and, where recorded, the whole ``sweep`` of ``[op, num_sms, chunk,
    send_warps, wall_us_mean]``; ops outside :data:`_INTRANODE_OPS` are skipped.

    ``warps='default'``: where the sweep has the calibration's warp count (:data:`CALIBRATION_SEND_WARPS`), a
    point's time is the best chunk at that warp count, averaged over ranks; otherwise (and with ``warps='best'``)
    it is the mean of the ranks' best ``wall_us_mean``.
    """
    if warps not in WARPS_CHOICES:
        raise ValueError(f"warps must be one of {WARPS_CHOICES}, got {warps!r}")
    args = data.get("args", {})
    num_ranks = int(args.get("num_processes", len(data["ranks"])))
    # A file without the 'uncapped' argument ran num_sms channels; one with it ran the capped count unless uncapped.
    uncapped = bool(args.get("uncapped", True))
    samples: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in data["ranks"]:
        for p in r.get("points", []):
            if p.get("op") in _INTRANODE_OPS:
                t = _positive(path, f"point {p.get('op')} at {p.get('num_sms')} SMs", p.get("wall_us_mean"))
                samples.setdefault((p["op"], int(p["num_sms"])), []).append((int(p.get("chunk", 0)), t))
    if warps == "default":
        swept: dict[tuple[str, int, int], list[float]] = {}
        for r in data["ranks"]:
            for entry in r.get("sweep", []):
                if len(entry) != 5 or entry[0] not in _INTRANODE_OPS:
                    continue  # a 4-field sweep entry carries no single warp count
                op_name, sms, chunk, send_warps, t = entry
                if send_warps == calibration_send_warps(_INTRANODE_OPS[op_name][0], num_ranks):
                    t = _positive(path, f"sweep {op_name} at {sms} SMs chunk {chunk}", t)
                    swept.setdefault((op_name, int(sms), int(chunk)), []).append(t)
        at_default: dict[tuple[str, int], tuple[int, float]] = {}  # (op, SMs) -> best (chunk, mean over ranks)
        for (op_name, sms, chunk), values in swept.items():
            mean = sum(values) / len(values)
            if len(values) == len(data["ranks"]) and mean < at_default.get((op_name, sms), (0, float("inf")))[1]:
                at_default[(op_name, sms)] = (chunk, mean)
        samples.update({key: [value] for key, value in at_default.items()})
    points = []
    order = list(_INTRANODE_OPS)
    for (op_name, sms), values in sorted(samples.items(), key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
        op, dtype, receive = _INTRANODE_OPS[op_name]
        chunks = [c for c, _ in values]
        chunk = max(set(chunks), key=chunks.count)  # ranks pick their best chunk; take the most common
        points.append(BenchPoint(op, dtype, sms, chunk, sum(t for _, t in values) / len(values), receive,
                                 channels=sms if uncapped else intranode_channels(sms, num_ranks)))
    if not points:
        raise ValueError(f"bench {path}: no dispatch/combine points")
    return BenchRun("intranode", path, str(data.get("date", "unknown")), str(data.get("machine", "unknown")),
                    num_ranks, int(args.get("num_tokens", 4096)), int(args.get("hidden", 7168)),
                    int(args.get("num_topk", 8)), int(args.get("num_experts", 256)), tuple(points))


def _read_internode(data: dict, path: str, warps: str = "default") -> BenchRun:
    """``benchmarks/bench_internode.py`` output: per rank points ``{phase, op, num_sms, chunk, wall_us}``. Phase
    ``intranode`` is one node of all ranks on Buffer's default receive path (direct-to-output); phase ``internode``
    is one GPU per virtual node (``DEEP_EP_GPUS_PER_NODE=1``). A point's time is the mean over ranks of ``wall_us``
    (what the bench's "sim err" compares with). The bench runs Buffer's default warps, so ``warps`` is unused."""
    del warps
    args = data.get("args", {})
    num_ranks = int(args.get("num_processes", len(data["ranks"])))
    samples: dict[tuple[int, str, int], list[tuple[int, float]]] = {}
    channels: dict[tuple[int, str, int], int] = {}  # points without 'channels' ran num_sms channels
    for r in data["ranks"]:
        for p in r.get("points", []):
            if p.get("op") not in _INTRANODE_OPS or p.get("phase") not in ("intranode", "internode"):
                continue
            nodes = 1 if p["phase"] == "intranode" else num_ranks
            channels[(nodes, p["op"], int(p["num_sms"]))] = int(p.get("channels", p["num_sms"]))
            t = _positive(path, f"{p['phase']} point {p['op']} at {p.get('num_sms')} SMs", p.get("wall_us"))
            samples.setdefault((nodes, p["op"], int(p["num_sms"])), []).append((int(p.get("chunk", 0)), t))
    points = []
    order = list(_INTRANODE_OPS)
    for (nodes, op_name, sms), values in sorted(samples.items(),
                                                key=lambda kv: (kv[0][0], kv[0][2], order.index(kv[0][1]))):
        op, dtype, _ = _INTRANODE_OPS[op_name]
        chunks = [c for c, _ in values]
        chunk = max(set(chunks), key=chunks.count)
        points.append(BenchPoint(op, dtype, sms, chunk, sum(t for _, t in values) / len(values),
                                 "direct" if op == "dispatch" else "rings", nodes,
                                 channels=channels[(nodes, op_name, sms)]))
    if not points:
        raise ValueError(f"bench {path}: no intranode/internode dispatch or combine points")
    return BenchRun("internode", path, str(data.get("date", "unknown")), str(data.get("machine", "unknown")),
                    num_ranks, int(args.get("num_tokens", 4096)), int(args.get("hidden", 7168)),
                    int(args.get("num_topk", 8)), int(args.get("num_experts", 256)), tuple(points))


def _is_fused(data: dict) -> bool:
    points = [p for p in _first_rank(data).get("points", []) if isinstance(p, dict)]
    return any(p.get("phase") == "fused" for p in points)


def _read_fused(data: dict, path: str, warps: str = "default") -> BenchRun:
    """``benchmarks/bench_internode.py --composed`` output: phase ``fused`` is the fused kernels on 2 virtual nodes
    of ``num_processes / 2`` ranks, all ranks on one GPU under MPS (:func:`simulator.deep_ep_fused.shared_gpu`).
    A point's time is the mean over ranks of ``wall_us`` at the best chunk (the chunk most ranks chose); the other
    phases (composed path, torch backend) are not read. ``warps`` is unused (the kernels' warps are fixed)."""
    del warps
    args = data.get("args", {})
    num_ranks = int(args.get("num_processes", len(data["ranks"])))
    samples: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in data["ranks"]:
        for p in r.get("points", []):
            if p.get("phase") != "fused" or p.get("op") not in _INTRANODE_OPS:
                continue
            t = _positive(path, f"fused point {p['op']} at {p.get('num_sms')} SMs", p.get("wall_us"))
            samples.setdefault((p["op"], int(p["num_sms"])), []).append((int(p.get("chunk", 0)), t))
    order = list(_INTRANODE_OPS)
    points = []
    for (op_name, sms), values in sorted(samples.items(), key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
        op, dtype, _ = _INTRANODE_OPS[op_name]
        chunks = [c for c, _ in values]
        points.append(BenchPoint(op, dtype, sms, max(set(chunks), key=chunks.count),
                                 sum(t for _, t in values) / len(values), "fused", 2))
    if not points or num_ranks % 2 or num_ranks < 4:
        raise ValueError(f"bench {path}: needs fused dispatch/combine points of 2 virtual nodes of >= 2 ranks, got "
                         f"{len(points)} points, {num_ranks} ranks")
    return BenchRun("fused", path, str(data.get("date", "unknown")), str(data.get("machine", "unknown")),
                    num_ranks, int(args.get("num_tokens", 4096)), int(args.get("hidden", 7168)),
                    int(args.get("num_topk", 8)), int(args.get("num_experts", 256)), tuple(points))


# bench_low_latency.py kernel names -> (op, dtype, phase); dispatch is FP8 (the bench's only dispatch format).
_LL_KERNELS = {("kernel_s", "dispatch"): ("dispatch", "fp8", "fused"),
               ("kernel_s", "combine"): ("combine", "bf16", "fused"),
               ("phases_s", "dispatch_send"): ("dispatch", "fp8", "send"),
               ("phases_s", "dispatch_recv"): ("dispatch", "fp8", "recv"),
               ("phases_s", "combine_send"): ("combine", "bf16", "send"),
               ("phases_s", "combine_recv"): ("combine", "bf16", "recv")}


def _is_low_latency(data: dict) -> bool:
    per_rank = data.get("per_rank")
    return (isinstance(per_rank, list) and bool(per_rank) and isinstance(per_rank[0], list) and bool(per_rank[0])
            and isinstance(per_rank[0][0], dict) and "kernel_s" in per_rank[0][0])


def _read_low_latency(data: dict, path: str, warps: str = "default") -> BenchRun:
    """``benchmarks/bench_low_latency.py`` output: ``per_rank[rank][i]`` is the point of the ``i``-th token count
    ``{tokens, kernel_s: {dispatch, combine}, phases_s: {dispatch_send, dispatch_recv, combine_send, combine_recv},
    wall_s, wall_back_to_back_s, dispatch_bytes, combine_bytes}`` (seconds). A point's time is the kernel time
    (profiler mean, the bench's acceptance metric) averaged over ranks, in µs, as the bench's ``summary`` prints it;
    the hook-mode send and receive launches are points of their own (``phase``). Wall times include the launch gap
    and are not read. Every rank must report the same token sweep; ``warps`` is unused (LL uses every SM)."""
    del warps
    per_rank = data["per_rank"]
    args = data.get("args", {})
    sweeps = [[p.get("tokens") for p in rank_points] for rank_points in per_rank]
    if any(s != sweeps[0] for s in sweeps):
        raise ValueError(f"bench {path}: ranks report different token sweeps {sweeps}")
    points, deepep_bytes = [], []
    for i, tokens in enumerate(sweeps[0]):
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"bench {path}: point {i} has no positive 'tokens', got {tokens!r}")
        for (group, key), (op, dtype, phase) in _LL_KERNELS.items():
            values = [_positive(path, f"T={tokens} {group}.{key}", r[i].get(group, {}).get(key)) for r in per_rank]
            points.append(BenchPoint(op, dtype, 0, 0, 1e6 * sum(values) / len(values), tokens=tokens, phase=phase))
        for op in ("dispatch", "combine"):
            deepep_bytes.append((tokens, op, int(sum(r[i].get(f"{op}_bytes", 0) for r in per_rank))))
    if not points:
        raise ValueError(f"bench {path}: no low-latency points")
    machine = f"{data.get('gpu', 'unknown')} x{len(per_rank)}"
    num_ranks = int(args.get("num_processes", len(per_rank)))
    return BenchRun("low-latency", path, str(data.get("date", "unknown")), machine, num_ranks,
                    max(sweeps[0]), int(args.get("hidden", 7168)), int(args.get("num_topk", 8)),
                    int(args.get("num_experts", 288)), tuple(points), tuple(deepep_bytes))


# (name, detector, reader): the first detector that accepts the JSON object reads it.
BENCH_READERS: list[tuple[str, Callable[[dict], bool], Callable[..., BenchRun]]] = [
    ("fused kernels on one GPU (benchmarks/bench_internode.py --composed)", _is_fused, _read_fused),
    ("intranode (benchmarks/bench_intranode.py)", _is_intranode, _read_intranode),
    ("internode on virtual nodes (benchmarks/bench_internode.py)", _is_internode, _read_internode),
    ("low latency (benchmarks/bench_low_latency.py)", _is_low_latency, _read_low_latency),
]
# Weight of the log-space prior toward the assumed defaults (dek.DEFAULTS), per parameter (a factor 2 away costs
# as much as a point 3.5 % off).
PRIOR_WEIGHT = 0.05
# Kinds without that prior: the fused file has as many points as parameters, each rate binding a different point,
# so the fit solves them exactly.
NO_PRIOR_KINDS = ("fused",)
SPAN = math.log(1e4)
DEFAULTS_FOR_PRIOR = dek.DEFAULTS
# Parameters each bench kind fits; the others keep their values (and sources) from the current profile.
FIT_PARAMS: dict[str, tuple[str, ...]] = {"intranode": dek.INTRANODE_FIT_PARAMS,
                                          "internode": dek.INTRANODE_FIT_PARAMS,
                                          "low-latency": dek.LL_FIT_PARAMS, "fused": dek.FUSED_FIT_PARAMS}
# Sweep values held out when the caller names none: SM counts (normal mode), tokens per rank (low latency).
DEFAULT_HOLD_OUT: dict[str, tuple[int, ...]] = {"intranode": (16, 32), "internode": (16, 32), "fused": (),
                                                "low-latency": (2, 4, 16, 32, 128)}
# Bench kinds whose fit restarts Levenberg-Marquardt from several points (see :func:`fit`).
MULTI_START_KINDS = ("low-latency", "fused")
SWEEP_NAMES = {"intranode": "SM counts", "internode": "SM counts", "low-latency": "token counts",
               "fused": "SM counts"}


def read_bench(path: str | Path, warps: str = "default") -> BenchRun:
    """Read a bench JSON with the first matching reader of :data:`BENCH_READERS` (``warps``: see
    :func:`_read_intranode`)."""
    path = str(path)
    data = workload.read_json(path, f"--from-bench {path}")
    if isinstance(data, dict):
        for _name, detect, read in BENCH_READERS:
            if detect(data):
                return read(data, path, warps)
    keys = sorted(data) if isinstance(data, dict) else type(data).__name__
    known = "; ".join(name for name, _, _ in BENCH_READERS)
    raise ValueError(f"--from-bench {path}: unknown bench schema (top-level keys {keys}); known kinds: {known}")


# ---------------------------------------------------------------------------------------------------------------
# Model of one point
# ---------------------------------------------------------------------------------------------------------------

def bench_traffic(run: BenchRun, seed: int = 0) -> dict[int, list[workload.SourceTraffic]]:
    """The bench's workload per token count: uniform top-k routing (``topk(|randn| + 1)``, no masked entries) over
    ``num_ranks`` GPUs (as one node; the rows per destination rank are the same when the ranks are split into
    virtual nodes). Normal-mode runs have one token count (``run.num_tokens``), the LL run one per sweep point."""
    counts = sorted({p.tokens for p in run.points if p.tokens}) or [run.num_tokens]
    out = {}
    for tokens in counts:
        router = workload.Router("uniform", None, run.num_experts, run.topk, 1, seed)
        out[tokens] = workload.build_traffic(router, run.num_ranks, run.num_ranks, tokens, 0, mask_ll=False)
    return out


def _nodes_traffic(run: BenchRun, num_nodes: int, traffic: list[workload.SourceTraffic],
                   seed: int) -> list[workload.SourceTraffic]:
    if num_nodes == 1:
        return traffic
    return _split_traffic(run.num_experts, run.topk, run.num_ranks, num_nodes, run.num_tokens, seed)


@functools.lru_cache(maxsize=32)
def _split_traffic(num_experts: int, topk: int, num_ranks: int, num_nodes: int, num_tokens: int,
                   seed: int) -> list[workload.SourceTraffic]:
    """The bench's workload over ``num_nodes`` virtual nodes, built once per workload (a fit predicts each point
    many times; callers do not modify it)."""
    router = workload.Router("uniform", None, num_experts, topk, num_nodes, seed)
    return workload.build_traffic(router, num_ranks, num_ranks // num_nodes, num_tokens, 0, mask_ll=False)


def predict_points(run: BenchRun, points: list[BenchPoint] | tuple[BenchPoint, ...], prof: DeepEpProfile,
                   traffic: dict[int, list[workload.SourceTraffic]], seed: int = 0) -> list[float]:
    """:func:`predict_point` of every point; the LL phases of one (tokens, op) share one closed-form evaluation."""
    memo: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    out = []
    for point in points:
        if not point.tokens:
            out.append(predict_point(run, point, prof, traffic, seed))
            continue
        key = (point.tokens, point.op)
        if key not in memo:
            memo[key] = _ll_times(run, point, prof, traffic)
        out.append(float(memo[key][_LL_PHASE_KEYS[point.phase]].mean()))
    return out


_LL_PHASE_KEYS = {"fused": "fused", "send": "hook_send", "recv": "hook_recv"}


def _ll_times(run: BenchRun, point: BenchPoint, prof: DeepEpProfile,
              traffic: dict[int, list[workload.SourceTraffic]]) -> dict[str, np.ndarray]:
    payload = rank.token_bytes(run.hidden, point.dtype)
    spec = rank.OpSpec("low-latency", point.op, run.hidden, run.topk, payload, payload, 1, run.num_ranks, None)
    return dek.ll_phase_times(spec, traffic[point.tokens], hardware.get_gpu(run.gpu), hardware.CX7, prof,
                              point.dtype)


def predict_point(run: BenchRun, point: BenchPoint, prof: DeepEpProfile,
                  traffic: dict[int, list[workload.SourceTraffic]], seed: int = 0) -> float:
    """Predicted time of ``point`` (µs, mean over ranks) by the closed form of the deep_ep family, on the point's
    receive path and, for ``num_nodes`` > 1, on virtual nodes (``nvlink-p2p``); LL points by
    ``deep_ep_kernels.ll_phase_times`` (all ranks on one NVLink node, the phase of the point). ``traffic`` is
    :func:`bench_traffic` of the run."""
    gpu = hardware.get_gpu(run.gpu)
    payload = rank.token_bytes(run.hidden, point.dtype)
    if run.kind == "fused":
        return _fused_time(run, point, prof, traffic, seed)
    if point.tokens:
        return float(_ll_times(run, point, prof, traffic)[_LL_PHASE_KEYS[point.phase]].mean())
    traffic_ = traffic[run.num_tokens]
    per_node = run.num_ranks // point.num_nodes
    mode = "internode" if point.num_nodes > 1 else "intranode"
    nic = hardware.get_nic("nvlink-p2p") if point.num_nodes > 1 else hardware.CX7
    spec = rank.OpSpec(mode, point.op, run.hidden, run.topk, payload, payload, point.num_nodes, per_node, None)
    prof = replace(prof, receive_copies=1 if point.receive == "rings" else 0)
    # Combine points are ring-sender runs (op combine_bf16) unless receive is 'copy' (the copy-engine path, whose
    # chunk is its rows per copy chunk) or 'zone' (the zone senders).
    path = point.receive if point.receive in ("copy", "zone") else "rings"
    work = dek.normal_work(spec, _nodes_traffic(run, point.num_nodes, traffic_, seed), gpu, nic, prof,
                           point.num_sms, point.chunk, point.dtype, point.channels, combine_path=path,
                           copy_chunk_rows=point.chunk if path == "copy" else 0)
    return float(dek.closed_form_times(work, point.num_sms, run.num_ranks).mean())


def _fused_time(run: BenchRun, point: BenchPoint, prof: DeepEpProfile,
                traffic: dict[int, list[workload.SourceTraffic]], seed: int) -> float:
    """A fused-kernel point of :func:`_read_fused`: 2 virtual nodes of all ranks on one GPU, the bench's config
    (``deep_ep.Config(num_sms, chunk, 256)``), mean over ranks."""
    per_node = run.num_ranks // point.num_nodes
    payload = rank.token_bytes(run.hidden, point.dtype)
    spec = rank.OpSpec("internode", point.op, run.hidden, run.topk, payload, payload, point.num_nodes, per_node,
                       None)
    res = fused.simulate_fused(spec, _nodes_traffic(run, point.num_nodes, traffic[run.num_tokens], seed),
                               fused.shared_gpu(hardware.get_gpu(run.gpu), run.num_ranks),
                               hardware.get_nic("nvlink-p2p"), fused.on_one_gpu(prof), point.num_sms, point.dtype,
                               Config(point.num_sms, point.chunk, 256))
    return res.time_us


# ---------------------------------------------------------------------------------------------------------------
# Least squares
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class CheckResult:
    """A bench file that was not fitted: its points predicted with the fitted profile."""

    run: BenchRun
    predicted: list[float]

    def errors(self) -> list[float]:
        return [(p - pt.time_us) / pt.time_us for p, pt in zip(self.predicted, self.run.points)]

    def mape(self) -> float:
        return sum(abs(e) for e in self.errors()) / len(self.run.points)


@dataclass
class FitResult:
    run: BenchRun
    profile: DeepEpProfile
    params: tuple[str, ...]
    hold_out: tuple[int, ...]
    predicted: list[float]
    iterations: int
    checks: tuple[CheckResult, ...] = ()

    def errors(self) -> list[float]:
        return [(p - pt.time_us) / pt.time_us for p, pt in zip(self.predicted, self.run.points)]

    def mape(self, held: bool) -> float:
        """MAPE of the fitted (``held=False``) or held-out points of the fitted file; NaN when there are none."""
        sel = [abs(e) for e, pt in zip(self.errors(), self.run.points) if (pt.sweep_value in self.hold_out) == held]
        return sum(sel) / len(sel) if sel else float("nan")

    def mape_check(self) -> float:
        """MAPE over every point of the check files; NaN without check files."""
        errors = [abs(e) for c in self.checks for e in c.errors()]
        return sum(errors) / len(errors) if errors else float("nan")


def levenberg_marquardt(residual: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, max_iter: int = 200,
                        tol: float = 1e-10) -> tuple[np.ndarray, int]:
    """Minimise ``|residual(x)|^2`` (forward-difference Jacobian); returns ``(x, iterations)``."""
    x = np.asarray(x0, dtype=float).copy()
    r = residual(x)
    cost = float(r @ r)
    lam = 1e-3
    for it in range(1, max_iter + 1):
        step = 1e-6 * np.maximum(np.abs(x), 1.0)
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            xp = x.copy()
            xp[j] += step[j]
            jac[:, j] = (residual(xp) - r) / step[j]
        jtj, jtr = jac.T @ jac, jac.T @ r
        improved = False
        while lam < 1e12:
            dx = np.linalg.solve(jtj + lam * np.diag(np.diag(jtj) + 1e-12), -jtr)
            r_new = residual(x + dx)
            cost_new = float(r_new @ r_new)
            if cost_new < cost:
                improved = True
                x, r, lam = x + dx, r_new, max(lam / 3, 1e-12)
                break
            lam *= 4
        if not improved or cost - cost_new <= tol * max(cost, 1e-30):
            if improved:
                cost = cost_new
            return x, it
        cost = cost_new
    return x, max_iter


def fit(run: BenchRun, hold_out: list[int] | tuple[int, ...] | None = None, start: DeepEpProfile | None = None,
        seed: int = 0, fixed: dict[str, float] | None = None, check: list[BenchRun] | tuple[BenchRun, ...] = ()
        ) -> FitResult:
    """Fit :data:`FIT_PARAMS` of ``run.kind`` on the points whose sweep value (SM count; tokens per rank for the LL
    bench) is not in ``hold_out`` (default :data:`DEFAULT_HOLD_OUT` of the kind), then predict every point of the
    ``check`` runs (other bench files, held out as a whole).

    ``fixed`` pins parameters to given values (they are not fitted and keep the source ``fixed by --fix``).
    """
    if run.kind not in FIT_PARAMS:
        raise ValueError(f"no fit for bench kind {run.kind!r} (known: {sorted(FIT_PARAMS)})")
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(FIT_PARAMS[run.kind]))
    if unknown:
        raise ValueError(f"--fix names parameters that this bench does not fit: {unknown} "
                         f"(fitted: {list(FIT_PARAMS[run.kind])})")
    names = tuple(n for n in FIT_PARAMS[run.kind] if n not in fixed)
    hold_out = tuple(DEFAULT_HOLD_OUT[run.kind] if hold_out is None else hold_out)
    sweep = SWEEP_NAMES[run.kind]
    # The fused kernels also use the intranode fit's SM rates and fixed costs: their fit keeps the profile in use.
    base = start or (dek.profile() if run.kind == "fused" else dek.DEFAULTS)
    if fixed:
        sources = dict(base.sources)
        sources.update({n: f"fixed by --fix at {v}" for n, v in fixed.items()})
        base = replace(base, **fixed, sources=tuple(sources.items()))
    fit_points = [p for p in run.points if p.sweep_value not in hold_out]
    sweep_all = sorted({p.sweep_value for p in run.points})
    if len(fit_points) < len(names):
        raise ValueError(f"--hold-out {list(hold_out)} leaves {len(fit_points)} points to fit {len(names)} "
                         f"parameters ({sweep} in the file: {sweep_all})")
    traffic = bench_traffic(run, seed)

    x0 = np.log([max(float(getattr(DEFAULTS_FOR_PRIOR, n)), 1e-3) for n in names])

    def make(x: np.ndarray) -> DeepEpProfile:
        # Within 10^4 of the assumed values either way: a step into a flat direction stays finite.
        x = np.clip(x, x0 - SPAN, x0 + SPAN)
        return replace(base, **{n: float(v) for n, v in zip(names, np.exp(x))})

    def residual(x: np.ndarray) -> np.ndarray:
        prof = make(x)
        data = [math.log(t / p.time_us) for t, p in zip(predict_points(run, fit_points, prof, traffic, seed),
                                                         fit_points)]
        # Weak prior toward the assumed values: parameters the points cannot separate (at EP2 the local and
        # remote byte counts are equal) stay near their estimate instead of drifting to 0 or infinity.
        weight = 0.0 if run.kind in NO_PRIOR_KINDS else PRIOR_WEIGHT
        return np.concatenate([data, weight * (x - x0)])

    x, iterations = levenberg_marquardt(residual, x0)
    if run.kind in MULTI_START_KINDS:
        # The max() terms of the LL phases have flat directions (a rate that binds nowhere has no gradient): start
        # again from every parameter 4x below and above its assumed value and keep the lowest cost. The fused
        # teams bind only far from their assumed rates, so those starts reach 64x either way.
        cost = float(residual(x) @ residual(x))
        shifts = (-math.log(4), math.log(4)) if run.kind == "low-latency" else \
            tuple(k * math.log(4) for k in (-3, -2, -1, 1, 2, 3))
        for j in range(len(names)):
            for shift in shifts:
                start_x = x0.copy()
                start_x[j] += shift
                x_j, it_j = levenberg_marquardt(residual, start_x)
                iterations += it_j
                cost_j = float(residual(x_j) @ residual(x_j))
                if cost_j < cost * (1 - 1e-9):
                    x, cost = x_j, cost_j
    stamp = datetime.date.today().isoformat()
    source = f"fit: {Path(run.path).name} ({run.date}, {run.machine}), least squares on {len(fit_points)} points, " \
             f"{sweep} {[s for s in sweep_all if s not in hold_out]} (held out {list(hold_out)}), fitted {stamp}"
    if run.kind == "fused":
        source = f"fit: {run.path} ({run.date}, {run.machine}; {run.num_ranks} ranks as 2 virtual nodes under MPS), " \
                 f"least squares on its {len(fit_points)} fused-phase points at SM counts " \
                 f"{sorted({p.num_sms for p in fit_points})} (held out {list(hold_out)}; wall µs, mean over ranks, " \
                 f"e.g. {', '.join(f'{p.dtype} {p.op} {p.time_us:.1f}' for p in fit_points[-3:])} at " \
                 f"{fit_points[-1].num_sms} SMs), fitted {stamp}"
    sources = dict(base.sources)
    sources.update(dict.fromkeys(names, source))
    prof = replace(make(x), sources=tuple(sources.items()))
    if run.kind == "fused":
        # On one GPU a push is a local copy through a P2P mapping: the fit gives the pushing warps the same rate.
        prof = replace(prof, warp_push_gbps=prof.warp_local_gbps, sources=tuple({
            **sources, "warp_push_gbps": f"{source}; one GPU: pushes are local copies, so warp_local_gbps's "
                                         f"value (NVLink pushes not measured)"}.items()))
    predicted = predict_points(run, run.points, prof, traffic, seed)
    checks = []
    for other in check:
        other_traffic = bench_traffic(other, seed)
        checks.append(CheckResult(other, predict_points(other, other.points, prof, other_traffic, seed)))
    return FitResult(run, prof, names, tuple(hold_out), predicted, iterations, tuple(checks))


def _role(result: FitResult, pt: BenchPoint) -> str:
    return "hold-out" if pt.sweep_value in result.hold_out else "fit"


def to_text(result: FitResult) -> str:
    run = result.run
    ll = run.kind == "low-latency"
    tokens = f"T = {', '.join(str(t) for t in sorted({p.tokens for p in run.points}))} tokens per rank" if ll \
        else f"{run.num_tokens} tokens"
    name_width = max(18, *(len(n) for n in result.params))
    lines = [f"deep_ep kernel fit: {run.path} ({run.kind}, {run.machine}, {run.date}), EP{run.num_ranks}, "
             f"{tokens}, hidden {run.hidden}, top-{run.topk} of {run.num_experts} experts",
             "", f"{'parameter':<{name_width}} {'value':>10}  source", "-" * 60]
    for name in result.params:
        lines.append(f"{name:<{name_width}} {getattr(result.profile, name):>10.3f}  fit")
    width = max(24, *(len(pt.label) for r in (run, *(c.run for c in result.checks)) for pt in r.points))
    column = "T" if ll else "chunk"
    head = [f"{'point':<{width}} {column:>5} {'measured_us':>11} {'predicted_us':>12} {'error':>7}  role",
            "-" * (width + 48)]
    lines += ["", *head]

    def row(pt: BenchPoint, pred: float, err: float, role: str) -> str:
        return (f"{pt.label:<{width}} {pt.tokens if pt.tokens else pt.chunk:>5} {pt.time_us:>11.1f} {pred:>12.1f} "
                f"{100 * err:>+6.1f}%  {role}")

    for pt, pred, err in zip(run.points, result.predicted, result.errors()):
        lines.append(row(pt, pred, err, _role(result, pt)))
    for c in result.checks:
        lines += ["", f"check (not fitted): {c.run.path} ({c.run.kind}, {c.run.machine}, {c.run.date})", *head]
        for pt, pred, err in zip(c.run.points, c.predicted, c.errors()):
            lines.append(row(pt, pred, err, "check"))
    held = (f"{100 * result.mape(True):.1f}%" if not math.isnan(result.mape(True))
            else "none in the file")
    summary = f"MAPE: fitted points {100 * result.mape(False):.1f}%, held-out points {held} " \
              f"({SWEEP_NAMES[run.kind]} {list(result.hold_out)})"
    if ll:
        for phase in ("fused", "send", "recv"):
            errs = [abs(e) for e, pt in zip(result.errors(), run.points) if pt.phase == phase]
            held_errs = [abs(e) for e, pt in zip(result.errors(), run.points)
                         if pt.phase == phase and pt.sweep_value in result.hold_out]
            name = "fused kernels" if phase == "fused" else f"hook {phase}"
            summary += f"; {name} {100 * sum(errs) / len(errs):.1f}%" + \
                (f" (held out {100 * sum(held_errs) / len(held_errs):.1f}%)" if held_errs else "")
    if result.checks:
        summary += f", check points {100 * result.mape_check():.1f}%"
    lines += ["", f"{summary}; {result.iterations} Levenberg-Marquardt iterations"]
    return "\n".join(lines) + "\n"


# Section of the calibration file that holds the low-latency fit's summary and points (the top level holds the
# normal-mode fit's, which ``simulator.predictions`` reads the measured column from).
LL_SECTION = "low_latency"
# Section of each bench kind that does not write the top level.
SECTIONS = {"low-latency": LL_SECTION, "fused": "fused"}


def write_calibration(result: FitResult, path: str | Path = CALIBRATION_PATH, command: str | None = None) -> None:
    """Write the fitted (and ``--fix``-ed) parameters with their sources, plus the fit summary (bench file, its date
    and machine, the fit's date and ``command``, the command line that ran the fit) and its points.

    Parameters an existing file holds that this fit does not touch (e.g. those of another bench kind) are kept. An
    intranode or internode fit writes its summary and points at the top level and keeps the file's
    :data:`SECTIONS`; a low-latency or fused fit writes them into its section and keeps the rest.
    """
    path = Path(path)
    params, old = {}, {}
    written = FIT_PARAMS[result.run.kind] + (("warp_push_gbps",) if result.run.kind == "fused" else ())
    if path.exists():
        old = workload.read_json(str(path), f"deep_ep calibration {path}")
        old = old if isinstance(old, dict) else {}
        params = {k: v for k, v in old.get("params", {}).items() if k not in written}
    for name, value, source in result.profile.describe():
        if name in written:
            params[name] = {"value": round(float(value), 4), "source": source}

    def rounded(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 4)

    def entry(pt: BenchPoint, pred: float, role: str) -> dict:
        return {**pt.as_dict(), "measured_us": round(pt.time_us, 2), "predicted_us": round(pred, 2), "role": role}

    points = [entry(pt, pred, _role(result, pt)) for pt, pred in zip(result.run.points, result.predicted)]
    for c in result.checks:
        points += [entry(pt, pred, "check") for pt, pred in zip(c.run.points, c.predicted)]
    summary = {"bench": result.run.path, "bench_date": result.run.date, "machine": result.run.machine,
               "fitted": datetime.date.today().isoformat()}
    if command:
        summary["command"] = command
    section_name = SECTIONS.get(result.run.kind)
    if section_name is not None:
        section = {**summary, f"hold_out_{SWEEP_NAMES[result.run.kind].split()[0].lower()}s": list(result.hold_out),
                   "mape_fit": rounded(result.mape(False)),
                   "mape_hold_out": rounded(result.mape(True)), "points": points}
        # The file's other entries keep their places.
        data = {"family": "deep_ep", **{k: v for k, v in old.items() if k != "family"}}
        data.update(params=params, **{section_name: section})
    else:
        data = {"family": "deep_ep", **summary, "hold_out_sms": list(result.hold_out),
                "mape_fit": rounded(result.mape(False)), "mape_hold_out": rounded(result.mape(True)),
                "check": [c.run.path for c in result.checks], "mape_check": rounded(result.mape_check()),
                "params": params, "points": points}
        data.update({k: old[k] for k in SECTIONS.values() if k in old})
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
