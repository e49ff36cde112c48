"""Every ``DEEP_EP_*`` environment variable, declared once.

This module is the only place in ``deep_ep`` that reads ``os.environ``. It imports nothing but the
standard library, so ``setup.py``, ``reference`` and ``simulator`` can use it too.

Each knob is an :class:`EnvVar` with a name, a type, a default and a one-line doc. ``docs/build.md``
lists exactly these variables (a test checks it). Tests and benchmarks choose kernel variants through
``deep_ep.testing``, not through the environment.
"""
from __future__ import annotations

import math
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


def _parse_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


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
    "DEEP_EP_TIMEOUT_S", _parse_seconds, 100.0,
    "Budget in seconds of every bounded wait (GPU spin loops and host polling), finite and > 0; a timeout raises an "
    "exception.")
BACKEND = EnvVar(
    "DEEP_EP_BACKEND", str, "auto",
    "Which Buffer backend to use: 'auto' (CUDA kernels for CUDA tensors when built, else torch), 'torch' or 'cuda'.")
GPUS_PER_NODE = EnvVar(
    "DEEP_EP_GPUS_PER_NODE", int, 8,
    "Ranks per scale-up (NVLink) domain; lower it to make one host act as several virtual nodes.")
TOPK_IDX_BITS = EnvVar(
    "DEEP_EP_TOPK_IDX_BITS", int, 64,
    "Width of deep_ep.topk_idx_t: 64 (torch.int64, DeepEP's default) or 32 (torch.int32).")
CPU_ONLY = EnvVar(
    "DEEP_EP_CPU_ONLY", _parse_bool, False,
    "Build-time: install the pure-Python packages only, never the CUDA extension.")
DISABLE_NVSHMEM = EnvVar(
    "DEEP_EP_DISABLE_NVSHMEM", _parse_bool, False,
    "Build-time: build the CUDA extension without NVSHMEM (intranode kernels only).")
DEBUG_BUILD = EnvVar(
    "DEEP_EP_DEBUG_BUILD", _parse_bool, False,
    "Build-time: compile the kernels with -lineinfo (source lines in profilers and compute-sanitizer reports).")
NVSHMEM_DIR = EnvVar(
    "NVSHMEM_DIR", str, "",
    "Build-time: NVSHMEM installation (include/ and lib/); overrides the auto-detected nvidia-nvshmem wheel.")

ALL: tuple[EnvVar, ...] = (TIMEOUT_S, BACKEND, GPUS_PER_NODE, TOPK_IDX_BITS, CPU_ONLY, DISABLE_NVSHMEM, DEBUG_BUILD,
                           NVSHMEM_DIR)


def describe() -> str:
    """One line per knob: name, current value, doc."""
    return "\n".join(f"{v.name}={v.get()!r}  # {v.doc}" for v in ALL)
