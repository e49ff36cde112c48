"""``python -m simulator predict``: predictions of deep_ep's kernels on H200, to be checked by measurement.

Cases (hidden 7168, top-8, ``--kernels deep_ep``, the profile of ``simulator/data/calibration_deep_ep.json``):
intranode EP2 / EP4 / EP8 (4096 tokens per rank, 256 experts, uniform routing, 24 SMs, FP8 and BF16 dispatch on
Buffer's default receive path, BF16 combine); low latency EP2 / EP4 / EP8 (128 tokens, 288 experts, uniform routing
without masked entries as ``benchmarks/bench_low_latency.py``; the fused kernel's time); internode on virtual nodes
(``nvlink-p2p``) 2 x 1, 2 x 2 and 2 x 4 GPUs (4096 tokens, group-limited routing; 2 x 1 runs the intranode kernels
over P2P).

A row's ``measured_us`` is the calibration file's 24-SM point of that case (EP2 or 2 x 1 virtual nodes) on the
profile's receive path, the ``--check`` run's point winning over the fitted one; for low latency EP2 the fused time
at 128 tokens of the low-latency fit. The calibration's combine points are ring-sender runs, so the intranode EP2
combine has none where the Buffer's 24-SM combine takes another send path.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from deep_ep.backends.cuda_tuning import combine_send_path
from simulator import deep_ep_kernels as dek
from simulator.bench_fit import LL_SECTION, SECTIONS
from simulator.scenario import Scenario, run


@dataclass(frozen=True)
class Prediction:
    case: str
    nodes: int
    gpus_per_node: int
    mode: str
    op: str
    dtype: str
    tokens: int
    time_us: float
    logical_gbps: float
    nvl_logical_gbps: float
    bottleneck: str
    measured_us: float | None

    def as_dict(self) -> dict:
        return {"case": self.case, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "mode": self.mode,
                "op": self.op, "dtype": self.dtype, "tokens": self.tokens, "time_us": round(self.time_us, 1),
                "logical_gbps": round(self.logical_gbps, 1), "nvl_logical_gbps": round(self.nvl_logical_gbps, 1),
                "bottleneck": self.bottleneck,
                "measured_us": None if self.measured_us is None else round(self.measured_us, 1)}


# Measured cases of the calibration file: virtual nodes of its points -> prediction case.
MEASURED_CASES = {1: "intranode EP2", 2: "internode 2x1 virtual"}
# Tokens per rank of the low-latency cases (the bar's point of benchmarks/bench_low_latency.py).
LL_TOKENS = 128


def _measured(calibration: Path, prof: dek.DeepEpProfile) -> dict[tuple[str, str, str], float]:
    """Measured 24-SM times from the calibration file's points, ``(case, op, dtype) -> µs``: dispatch on the
    profile's receive path; check points (listed after the fitted ones) win over fitted ones."""
    if not calibration.exists():
        return {}
    receive = "rings" if prof.receive_copies else "direct"
    out = {}
    data = json.loads(calibration.read_text(encoding="utf-8"))
    for p in data.get("points", []):
        case = MEASURED_CASES.get(p.get("num_nodes", 0))
        if case is None or p.get("num_sms") != 24 or (p.get("op") == "dispatch" and p.get("receive") != receive):
            continue
        if case == "intranode EP2" and p.get("op") == "combine" and combine_send_path(24) != "rings":
            continue  # a ring measurement; the Buffer's 24-SM combine runs another path
        out[(case, p["op"], p["dtype"])] = float(p["measured_us"])
    ll = data.get(LL_SECTION, {})
    for p in ll.get("points", []) if ll.get("machine", "").endswith("x2") else []:
        if p.get("phase") == "fused" and p.get("tokens") == LL_TOKENS:
            out[("low-latency EP2", p["op"], p["dtype"])] = float(p["measured_us"])
    return out


def cases() -> list[tuple[str, Scenario]]:
    """``(case label, scenario)`` per simulated configuration; each scenario yields dispatch and combine rows."""
    out = []
    normal = Scenario(nodes=1, gpu="h200", mode="normal", tokens=4096, experts=256, routing="uniform", num_sms=24,
                      redundant_experts=0, kernels="deep_ep")
    for ep in (2, 4, 8):
        for dtype in ("fp8", "bf16"):
            out.append((f"intranode EP{ep}", replace(normal, gpus_per_node=ep, dispatch_dtype=dtype)))
    ll = Scenario(nodes=1, gpu="h200", mode="low-latency", ll_tokens=LL_TOKENS, experts=288, routing="uniform",
                  ll_mask=False, redundant_experts=0, kernels="deep_ep")
    for ep in (2, 4, 8):
        out.append((f"low-latency EP{ep}", replace(ll, gpus_per_node=ep)))
    virtual = replace(normal, nodes=2, nic="nvlink-p2p", routing="group-limited")
    for per_node in (1, 2, 4):
        for dtype in ("fp8", "bf16"):
            out.append((f"internode 2x{per_node} virtual", replace(virtual, gpus_per_node=per_node,
                                                                   dispatch_dtype=dtype)))
    return out


def predict(calibration: Path | None = None) -> list[Prediction]:
    """Simulate every case with the calibration file ``calibration`` (default: the repository's)."""
    path = Path(calibration) if calibration is not None else dek.CALIBRATION_PATH
    prof = dek.load_profile(path)
    previous = dek.use_profile(prof)
    try:
        measured = _measured(path, prof)
        rows: list[Prediction] = []
        seen = set()
        for case, sc in cases():
            for r in run(sc).ops:
                key = (case, r.op, r.dtype)
                if key in seen:  # BF16 combine appears in the FP8 and the BF16 scenario: print it once
                    continue
                seen.add(key)
                ref = measured.get(key)
                rows.append(Prediction(case, sc.nodes, sc.gpus_per_node, r.mode, r.op, r.dtype, r.tokens,
                                       r.time_us, r.logical_gbps, r.nvl_logical_gbps, r.bottleneck, ref))
        order = {case: i for i, (case, _) in enumerate(cases())}
        return sorted(rows, key=lambda r: (order[r.case], r.op != "dispatch", r.dtype != "fp8"))
    finally:
        dek.use_profile(previous)


def to_markdown(rows: list[Prediction]) -> str:
    lines = ["| case | nodes x GPUs | op | dtype | tokens | predicted µs | logical GB/s | bottleneck | measured µs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = "-" if r.measured_us is None else f"{r.measured_us:.1f}"
        lines.append(f"| {r.case} | {r.nodes} x {r.gpus_per_node} | {r.op} | {r.dtype} | {r.tokens} | "
                     f"{r.time_us:.1f} | {r.logical_gbps:.0f} | {r.bottleneck} | {measured} |")
    return "\n".join(lines) + "\n"


def provenance(calibration: Path | None = None) -> dict:
    """Where the rows come from: the command, and the machine and dates of the calibration's measurements."""
    path = Path(calibration) if calibration is not None else dek.CALIBRATION_PATH
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    data = data if isinstance(data, dict) else {}
    ll, fused = data.get(LL_SECTION, {}), data.get(SECTIONS["fused"], {})
    command = "python -m simulator predict --json"
    if calibration is not None:
        command += f" --calibration {calibration}"
    return {"machine": f"computed by the simulator; calibrated on {data.get('machine', 'defaults only')}",
            "date": f"calibration fitted {data.get('fitted', '-')} (runs of {data.get('bench_date', '-')}, "
                    f"low latency {ll.get('bench_date', '-')}, fused kernels {fused.get('bench_date', '-')} on "
                    f"{fused.get('machine', '-')})",
            "command": command}


def to_json(rows: list[Prediction], calibration: Path | None = None) -> str:
    return json.dumps({"provenance": provenance(calibration), "kernels": "deep_ep",
                       "rows": [r.as_dict() for r in rows]}, indent=1)
