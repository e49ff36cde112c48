"""Every ``DEEP_EP_*`` environment variable, declared once.

This module is the only place in ``deep_ep`` that reads ``os.environ``. It imports nothing but the
standard library, so ``setup.py``, ``reference`` and ``simulator`` can use it too.

Each knob is an :class:`EnvVar` with a name, a type, a default and a one-line doc. ``docs/build.md``
lists exactly these variables (a test checks it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {text!r}")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment knob: ``get()`` parses the current value or returns the default."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {exc}") from None

    def is_set(self) -> bool:
        return os.environ.get(self.name, "") != ""


TIMEOUT_S = EnvVar(
    "DEEP_EP_TIMEOUT_S", float, 100.0,
    "Budget in seconds of every bounded wait (GPU spin loops and host polling); a timeout raises an exception.")
BACKEND = EnvVar(
    "DEEP_EP_BACKEND", str, "auto",
    "Which Buffer backend to use: 'auto' (CUDA kernels for CUDA tensors when built, else torch), 'torch' or 'cuda'.")
DISPATCH_RECEIVE = EnvVar(
    "DEEP_EP_DISPATCH_RECEIVE", str, "auto",
    "Intranode dispatch receive path: 'auto' (outputs in the buffer's pool when it has room, else rings), 'rings' "
    "or 'direct' (pool only; raises when it has no room).")
COMBINE_COPY = EnvVar(
    "DEEP_EP_COMBINE_COPY", str, "auto",
    "Intranode combine send path: 'auto' (when the dispatch's counts are known on the host and the landing zones "
    "fit: the copy engine moves the rows for SM budgets up to deep_ep.config.COMBINE_COPY_MAX_SMS, sender warps store "
    "them straight into the landing zones from COMBINE_ZONE_MIN_SMS; else ring-sender warps), 'copy' (the copy "
    "engine wherever it applies), 'rings', or 'zone' (zone senders wherever they apply).")
GPUS_PER_NODE = EnvVar(
    "DEEP_EP_GPUS_PER_NODE", int, 8,
    "Ranks per scale-up (NVLink) domain; lower it to make one host act as several virtual nodes.")
INTERNODE = EnvVar(
    "DEEP_EP_INTERNODE", str, "auto",
    "Normal dispatch/combine of N nodes x G > 1 GPUs: 'auto' (rail + node stages of CUDA kernels for CUDA tensors "
    "when each node is on one host: the rail by CUDA IPC on one host, over NVSHMEM across hosts; else torch), "
    "'composed' (the stages for every tensor: torch stages on CPU) or 'torch'.")
COMPOSED_RAIL = EnvVar(
    "DEEP_EP_COMPOSED_RAIL", str, "auto",
    "Rail stage of the composed internode path on CUDA: 'auto' (the torch backend over the rail subgroup beyond 24 "
    "nodes, else CUDA IPC when every rank is on one host, else the ring kernels over the NVSHMEM symmetric heap of "
    "num_rdma_bytes), 'ipc', 'nvshmem' (also on one host: tests) or 'torch' (any node count).")
TOPK_IDX_BITS = EnvVar(
    "DEEP_EP_TOPK_IDX_BITS", int, 64,
    "Width of deep_ep.topk_idx_t: 64 (torch.int64, DeepEP's default) or 32 (torch.int32).")
LL_PUT_ONLY = EnvVar(
    "DEEP_EP_LL_PUT_ONLY", _parse_bool, False,
    "Low-latency kernels: reach every other rank through NVSHMEM put-with-signal (the RDMA code path) even where "
    "NVLink reaches it by pointer; for testing that path on one host.")
LL_PARTIALS = EnvVar(
    "DEEP_EP_LL_PARTIALS", str, "0",
    "Low-latency combine: '0' (default: one BF16 row per expert, ascending k), 'auto' (each rank sums its experts' "
    "weighted rows of a token in fp32 and sends one fp32 "
    "partial when that carries fewer bytes: top-k >= 3 x ranks, no receive hook, no LogFMT, every peer by pointer, "
    "num_experts / num_ranks >= 3, <= 8 ranks; the sum then runs per rank, ranks ascending), '1' (whenever the "
    "structural conditions hold). Opt-in until measured at EP2 (docs/low_latency.md). Must agree on every rank.")
INTERNODE_PUT_ONLY = EnvVar(
    "DEEP_EP_INTERNODE_PUT_ONLY", _parse_bool, False,
    "CUDA internode backend (one GPU per node): reach every other rank through NVSHMEM puts and signals (the path of "
    "peers behind a NIC) even where nvshmem_ptr reaches it; for testing that path on one host. Set on any rank, it "
    "applies to the whole group.")
CPU_ONLY = EnvVar(
    "DEEP_EP_CPU_ONLY", _parse_bool, False,
    "Build-time: install the pure-Python packages only, never the CUDA extension.")
DISABLE_NVSHMEM = EnvVar(
    "DEEP_EP_DISABLE_NVSHMEM", _parse_bool, False,
    "Build-time: build the CUDA extension without NVSHMEM (intranode kernels only).")
DEBUG_BUILD = EnvVar(
    "DEEP_EP_DEBUG_BUILD", _parse_bool, False,
    "Build-time: compile kernels with -lineinfo and DEEP_EP_DEBUG (the low-latency and intranode kernels print "
    "section timestamps: tools/ll_trace.py, tools/intra_trace.py).")
TRACE_DIR = EnvVar(
    "DEEP_EP_TRACE_DIR", str, "",
    "Benchmarks: with a debug build, each worker's stdout (the kernels' printf traces) goes to <dir>/rank<r>.log.")
NVSHMEM_DIR = EnvVar(
    "NVSHMEM_DIR", str, "",
    "Build-time: NVSHMEM installation (include/ and lib/); overrides the auto-detected nvidia-nvshmem wheel.")

ALL: tuple[EnvVar, ...] = (TIMEOUT_S, BACKEND, DISPATCH_RECEIVE, COMBINE_COPY, GPUS_PER_NODE, INTERNODE,
                           COMPOSED_RAIL, TOPK_IDX_BITS, LL_PUT_ONLY, LL_PARTIALS, INTERNODE_PUT_ONLY, CPU_ONLY,
                           DISABLE_NVSHMEM, DEBUG_BUILD, TRACE_DIR, NVSHMEM_DIR)


def describe() -> str:
    """One line per knob: name, current value, doc."""
    return "\n".join(f"{v.name}={v.get()!r}  # {v.doc}" for v in ALL)
