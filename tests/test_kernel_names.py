"""Kernel names as DeepEP V1's own profiling step reads them, and the LL benchmark's parsing of them.

DeepEP's ``tests/utils.py::bench_kineto`` asks, of a low-latency profile with or without receive hooks, for exactly
one kernel row whose name contains ``dispatch`` and one with ``combine``, and with hooks for launches named
``...::dispatch...`` / ``...::combine...`` in pairs (send, receive). So the LL kernels are ``ll::dispatch_kernel`` and
``ll::combine_kernel``, templated on whether the launch is fused only: a hooked call's two launches are one kernel.
"""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_low_latency  # noqa: E402

GLOBAL = re.compile(r"template\s*<([^>]*)>\s*__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(", re.S)


def ll_kernels() -> dict[str, str]:
    """``{kernel name: template parameters}`` of the templated kernels of the low-latency sources."""
    found = {}
    for path in (ROOT / "csrc" / "kernels").glob("low_latency*.cu"):
        for params, name in GLOBAL.findall(path.read_text()):
            found[name] = params.strip()
    return found


def test_one_ll_kernel_per_operation_named_as_deepep_profiles_expect():
    kernels = ll_kernels()
    for op in ("dispatch", "combine"):
        named = [name for name in kernels if op in name]
        assert named == [f"{op}_kernel"], kernels
        assert kernels[f"{op}_kernel"] == "bool kFused", kernels


def test_split_launches_share_one_instantiation():
    for op in ("dispatch", "combine"):
        source = (ROOT / "csrc" / "kernels" / f"low_latency_{op}.cu").read_text()
        launches = re.findall(rf"case (kPhase\w+(?: \| kPhase\w+)?):\s*(?:case (kPhase\w+):\s*)?"
                              rf"return launch_cooperative\({op}_kernel<(\w+)>", source)
        assert launches == [("kPhaseSend", "kPhaseRecv", "false"), ("kPhaseSend | kPhaseRecv", "", "true")], launches


def test_spellings_match_the_mangled_names_nvcc_gives():
    mangled = {
        "ll::dispatch_kernel<true>": "_ZN7deep_ep7kernels2ll15dispatch_kernelILb1EEEvNS1_7ContextENS1_12DispatchArgsE",
        "ll::combine_kernel<false>": "_ZN7deep_ep7kernels2ll14combine_kernelILb0EEEvNS1_7ContextENS1_11CombineArgsE"}
    spellings = bench_low_latency.spellings
    for pattern, symbol in mangled.items():
        assert any(s in symbol for s in spellings(pattern)), (pattern, spellings(pattern))
    assert not any(s in mangled["ll::combine_kernel<false>"] for s in spellings("ll::combine_kernel<true>"))


def fake_kernel(name: str, start: float, duration_us: float):
    span = types.SimpleNamespace(start=start, elapsed_us=lambda: duration_us)
    return types.SimpleNamespace(name=name, device_type=types.SimpleNamespace(name="CUDA"), time_range=span)


def test_split_phase_times_alternate_send_and_receive():
    dispatch = "void deep_ep::kernels::ll::dispatch_kernel<false>(deep_ep::kernels::ll::Context, DispatchArgs)"
    combine = "void deep_ep::kernels::ll::combine_kernel<false>(deep_ep::kernels::ll::Context, CombineArgs)"
    events = [fake_kernel(dispatch, 10, 4.0), fake_kernel("void gemm()", 12, 100.0), fake_kernel(dispatch, 20, 8.0),
              fake_kernel(combine, 30, 2.0), fake_kernel(combine, 40, 6.0),
              fake_kernel(dispatch, 50, 6.0), fake_kernel(dispatch, 60, 10.0)]
    trace = types.SimpleNamespace(events=lambda: list(reversed(events)))
    times = bench_low_latency.split_phase_times(trace)
    assert times == {"dispatch_send": 5e-6, "dispatch_recv": 9e-6, "combine_send": 2e-6, "combine_recv": 6e-6}
