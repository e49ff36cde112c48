"""``python -m simulator validate``: predict every published DeepEP row and the H200 two-GPU measurements.

Each row names its source, its measurement method and whether it was used for calibration (``calib``) or is a
hold-out prediction (``hold-out``). Errors are ``(predicted - measured) / measured``. The leave-one-group-out check
(:class:`GroupCheck`, computed by ``simulator.calibrate.leave_one_group_out``) predicts each group of rows with a
calibration that never saw it.

Measurement methods:

* ``kernel``: ``bench_kineto`` kernel time (normal internode, all low-latency rows): notify excluded.
* ``wall``: ``bench`` / CUDA-event wall time around the whole call (normal intranode rows, the H200 sweep): adds
  the cached notify kernel and the launch gap, :data:`WALL_OVERHEAD_US` in total.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from simulator.report import OpRow
from simulator.scenario import Scenario, run

# Cached notify kernel + host launch gap seen by wall-time (bench / CUDA event) measurements, µs.
# Fit: intercept of DeepEP V1's H200 SM sweep, minus the in-kernel launch cost.
WALL_OVERHEAD_US = 25.69
# Tolerances of the acceptance criteria.
TOL_BANDWIDTH = 0.10
TOL_LATENCY = 0.15
MAX_MEAN_ABS_ERROR = 0.05


@dataclass(frozen=True)
class Row:
    """One measured number to reproduce.

    Attributes:
        set_name: group of rows (``normal-h800``, ``ll-h800``, ``ll-rdma-h800``, ``h200``, ``h200-sweep``).
        label: short row label.
        scenario: what to simulate.
        mode, op: which simulated op to read.
        metric: ``gbps`` (logical bandwidth) or ``us`` (time).
        measured: the published / measured value.
        method: ``kernel`` or ``wall``.
        bound: ``bandwidth`` (±10 %) or ``latency`` (±15 %).
        calib: True when the row was used to fit a parameter.
        source: where the number comes from.
    """

    set_name: str
    label: str
    scenario: Scenario
    mode: str
    op: str
    metric: str
    measured: float
    method: str
    bound: str
    calib: bool
    source: str

    @property
    def tolerance(self) -> float:
        return TOL_BANDWIDTH if self.bound == "bandwidth" else TOL_LATENCY

    @property
    def group(self) -> str:
        """Group of the leave-one-group-out check: the row set, or the set of the row it duplicates."""
        twin = DUPLICATES.get((self.set_name, self.label))
        return twin[0] if twin else self.set_name


README = "DeepEP README (H800, CX7)"
README_RDMA = "DeepEP README, the pure-RDMA LL table (LL over RDMA only)"
H200_DOC = "DeepEP V1 (567632d) on 2 x H200"

# Calibration subset: which rows fit which parameter (``simulator.calibrate.steps``, first candidates; a test
# checks the two agree).
CALIBRATION = {
    ("normal-h800", "EP8 dispatch"): "H800.nvl_ring_efficiency",
    ("normal-h800", "EP16 dispatch"): "SM90.fwd_sm_gbps",
    ("normal-h800", "EP32 dispatch"): "CX7.normal_efficiency",
    ("ll-h800", "EP8 dispatch"): "SM90.ll_nvl_signal_us",
    ("ll-h800", "EP16 dispatch"): "SM90.ll_rdma_signal_us",
    ("ll-rdma-h800", "EP256 dispatch"): "SM90.ll_rdma_peer_us",
    ("h200-sweep", "8 SMs fp8 dispatch"): "SM90.ring_row_ns",
    ("h200-sweep", "8 SMs bf16 dispatch"): "SM90.sm_copy_gbps",
    ("h200-sweep", "16 SMs fp8 dispatch"): "WALL_OVERHEAD_US",
    ("h200-sweep", "48 SMs bf16 dispatch"): "H200.nvl_ring_efficiency",
    ("h200", "LL dispatch"): "SM90.ll_launch_us",
    ("h200", "bf16 combine"): "SM90.combine_tail_us",
}
# The README's LL EP128/EP256 rows are the pure-RDMA table's measurements: they count as calibration rows
# wherever those are, and belong to that table's group for the leave-one-group-out check.
DUPLICATES = {("ll-h800", "EP128 dispatch"): ("ll-rdma-h800", "EP128 dispatch"),
              ("ll-h800", "EP128 combine"): ("ll-rdma-h800", "EP128 combine"),
              ("ll-h800", "EP256 dispatch"): ("ll-rdma-h800", "EP256 dispatch"),
              ("ll-h800", "EP256 combine"): ("ll-rdma-h800", "EP256 combine")}


def _is_calib(key: tuple[str, str]) -> bool:
    return key in CALIBRATION or DUPLICATES.get(key) in CALIBRATION


def _normal_rows() -> list[Row]:
    rows = []
    published = {8: (153, 158), 16: (43, 43), 32: (58, 57), 64: (51, 50)}
    for ep, (disp, comb) in published.items():
        nodes = ep // 8
        sc = Scenario(nodes=nodes, mode="normal", tokens=4096, routing="uniform" if nodes == 1 else "group-limited",
                      num_sms=24, redundant_experts=0)
        method = "wall" if nodes == 1 else "kernel"
        for op, value in (("dispatch", disp), ("combine", comb)):
            label = f"EP{ep} {op}"
            rows.append(Row("normal-h800", label, sc, "normal", op, "gbps", value, method, "bandwidth",
                            _is_calib(("normal-h800", label)), README))
    return rows


def _ll_rows(set_name: str, allow_nvlink: bool, dispatch_us: tuple[int, ...], combine_us: tuple[int, ...],
             source: str) -> list[Row]:
    rows = []
    for ep, d_us, c_us in zip((8, 16, 32, 64, 128, 256), dispatch_us, combine_us):
        experts = 288 if 288 % ep == 0 else 256  # DeepEP's LL test default is 288 when the EP size divides it
        # The README's EP128/EP256 LL rows are the pure-RDMA table's numbers (not measured with LL over NVLink), so
        # they are simulated without NVLink.
        nvlink = allow_nvlink and ep <= 64
        sc = Scenario(nodes=max(ep // 8, 1), mode="low-latency", ll_tokens=128, experts=experts,
                      routing="uniform", ll_mask=True, ll_allow_nvlink=nvlink, redundant_experts=0)
        for op, value in (("dispatch", d_us), ("combine", c_us)):
            label = f"EP{ep} {op}"
            bound = "latency" if (ep <= 16 and allow_nvlink) else "bandwidth"
            rows.append(Row(set_name, label, sc, "low-latency", op, "us", value, "kernel", bound,
                            _is_calib((set_name, label)), source))
    return rows


def _h200_rows() -> list[Row]:
    rows = []
    base = Scenario(nodes=1, gpus_per_node=2, gpu="h200", mode="normal", tokens=4096, routing="uniform",
                    num_sms=24, redundant_experts=0)
    for label, dtype, op, gbps in (("fp8 dispatch", "fp8", "dispatch", 246), ("bf16 dispatch", "bf16", "dispatch", 340),
                                   ("bf16 combine", "bf16", "combine", 288)):
        sc = replace(base, dispatch_dtype=dtype)
        rows.append(Row("h200", label, sc, "normal", op, "gbps", gbps, "wall", "bandwidth",
                        _is_calib(("h200", label)), H200_DOC))
    ll = Scenario(nodes=1, gpus_per_node=2, gpu="h200", mode="low-latency", ll_tokens=128, experts=288,
                  routing="uniform", ll_mask=True, redundant_experts=0)
    for label, op, us in (("LL dispatch", "dispatch", 29.75), ("LL combine", "combine", 39.7)):
        rows.append(Row("h200", label, ll, "low-latency", op, "us", us, "kernel", "latency",
                        _is_calib(("h200", label)), H200_DOC + "; midpoint of the measured range"))
    sweep = {8: (92, 120, 116), 16: (172, 233, 218), 24: (245, 338, 300), 32: (309, 394, 367), 48: (406, 502, 451)}
    for sms, values in sweep.items():
        for (dtype, op), gbps in zip((("fp8", "dispatch"), ("bf16", "dispatch"), ("bf16", "combine")), values):
            sc = replace(base, dispatch_dtype=dtype, num_sms=sms)
            label = f"{sms} SMs {dtype} {op}"
            rows.append(Row("h200-sweep", label, sc, "normal", op, "gbps", gbps, "wall", "bandwidth",
                            _is_calib(("h200-sweep", label)), H200_DOC + ", SM sweep"))
    return rows


def all_rows() -> list[Row]:
    """Every row ``validate`` checks, in print order."""
    return (_normal_rows()
            + _ll_rows("ll-h800", True, (77, 118, 155, 173, 192, 194), (114, 195, 273, 314, 369, 360), README)
            + _ll_rows("ll-rdma-h800", False, (163, 173, 182, 186, 192, 194), (318, 329, 350, 353, 369, 360),
                       README_RDMA)
            + _h200_rows())


@dataclass(frozen=True)
class Outcome:
    row: Row
    predicted: float
    error: float
    bottleneck: str

    @property
    def ok(self) -> bool:
        return abs(self.error) <= self.row.tolerance


def predict(row: Row, cache: dict | None = None) -> tuple[float, str]:
    """Simulated value of ``row`` in its metric and method, plus the simulated bottleneck."""
    key = row.scenario
    report = cache.get(key) if cache is not None else None
    if report is None:
        report = run(row.scenario)
        if cache is not None:
            cache[key] = report
    op: OpRow = next(r for r in report.ops if r.mode == row.mode and r.op == row.op)
    time_us = op.time_us + (WALL_OVERHEAD_US if row.method == "wall" else 0.0)
    if row.metric == "us":
        return time_us, op.bottleneck
    return op.logical_gbps * op.time_us / time_us, op.bottleneck


def validate(rows: list[Row] | None = None) -> list[Outcome]:
    cache: dict = {}
    out = []
    for row in rows if rows is not None else all_rows():
        value, bottleneck = predict(row, cache)
        out.append(Outcome(row, value, (value - row.measured) / row.measured, bottleneck))
    return out


def summary(outcomes: list[Outcome]) -> dict[str, float]:
    """Mean absolute error overall, for the primary published rows, and for the hold-out rows."""
    def mae(sel: list[Outcome]) -> float:
        return sum(abs(o.error) for o in sel) / len(sel) if sel else 0.0
    primary = [o for o in outcomes if o.row.set_name in ("normal-h800", "ll-h800")]
    return {"mae_all": mae(outcomes), "mae_primary": mae(primary),
            "mae_holdout": mae([o for o in outcomes if not o.row.calib]),
            "mae_calibration": mae([o for o in outcomes if o.row.calib]),
            "max_abs_error": max((abs(o.error) for o in outcomes), default=0.0),
            "rows": len(outcomes), "rows_within_tolerance": sum(o.ok for o in outcomes)}


@dataclass(frozen=True)
class GroupCheck:
    """Leave-one-group-out result: the group's rows predicted by a calibration that never saw them.

    Attributes:
        group: the row group (``Row.group``).
        outcomes: its rows, predicted.
        priors: parameters that only this group's rows fit, so they took their priors.
    """

    group: str
    outcomes: list[Outcome]
    priors: tuple[str, ...]

    @property
    def mean_abs_error(self) -> float:
        return sum(abs(o.error) for o in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0

    @property
    def max_abs_error(self) -> float:
        return max((abs(o.error) for o in self.outcomes), default=0.0)

    @property
    def within_tolerance(self) -> int:
        return sum(o.ok for o in self.outcomes)


def logo_to_text(checks: list[GroupCheck]) -> str:
    """The leave-one-group-out table: per group, its rows' mean and worst error when fitted without them."""
    lines = ["leave-one-group-out (calibrated without the group's rows, then predicted):",
             f"{'group':<13} {'rows':>4} {'mean|err|':>9} {'worst':>7} {'in tol':>6}  parameters at their priors"]
    for c in checks:
        worst = max(c.outcomes, key=lambda o: abs(o.error))
        lines.append(f"{c.group:<13} {len(c.outcomes):>4} {100 * c.mean_abs_error:>8.1f}% {100 * worst.error:>+6.1f}% "
                     f"{c.within_tolerance:>3}/{len(c.outcomes):<2}  {', '.join(c.priors) or '-'}")
    return "\n".join(lines) + "\n"


def _logo_json(checks: list[GroupCheck]) -> list[dict]:
    return [{"group": c.group, "rows": [{"row": o.row.label, "set": o.row.set_name, "measured": o.row.measured,
                                         "predicted": round(o.predicted, 2), "error": round(o.error, 4),
                                         "ok": o.ok} for o in c.outcomes],
             "mean_abs_error": round(c.mean_abs_error, 4), "max_abs_error": round(c.max_abs_error, 4),
             "rows_within_tolerance": c.within_tolerance, "priors": list(c.priors)} for c in checks]


def to_text(outcomes: list[Outcome], logo: list[GroupCheck] | None = None) -> str:
    lines = [f"{'set':<13} {'row':<22} {'metric':<6} {'method':<6} {'measured':>9} {'predicted':>9} {'error':>7} "
             f"{'tol':>5}  {'fit':<8} {'ok':<3} bottleneck"]
    lines.append("-" * len(lines[0]))
    for o in outcomes:
        r = o.row
        lines.append(f"{r.set_name:<13} {r.label:<22} {r.metric:<6} {r.method:<6} {r.measured:>9.1f} "
                     f"{o.predicted:>9.1f} {100 * o.error:>+6.1f}% {100 * r.tolerance:>4.0f}%  "
                     f"{'calib' if r.calib else 'hold-out':<8} {'ok' if o.ok else 'NO':<3} {o.bottleneck}")
    s = summary(outcomes)
    lines += ["", f"mean |error|: all rows {100 * s['mae_all']:.1f}%, "
                  f"published H800 rows {100 * s['mae_primary']:.1f}%, hold-out rows {100 * s['mae_holdout']:.1f}%, "
                  f"calibration rows {100 * s['mae_calibration']:.1f}%",
              f"rows within tolerance: {s['rows_within_tolerance']}/{s['rows']}; worst |error| "
              f"{100 * s['max_abs_error']:.1f}%"]
    text = "\n".join(lines) + "\n"
    return text + "\n" + logo_to_text(logo) if logo is not None else text


def to_json(outcomes: list[Outcome], logo: list[GroupCheck] | None = None) -> str:
    rows = [{"set": o.row.set_name, "row": o.row.label, "metric": o.row.metric, "method": o.row.method,
             "measured": o.row.measured, "predicted": round(o.predicted, 2), "error": round(o.error, 4),
             "tolerance": o.row.tolerance, "calibration": o.row.calib, "ok": o.ok, "bottleneck": o.bottleneck,
             "source": o.row.source} for o in outcomes]
    data: dict = {"rows": rows, "summary": {k: round(v, 4) for k, v in summary(outcomes).items()}}
    if logo is not None:
        data["leave_one_group_out"] = _logo_json(logo)
    return json.dumps(data, indent=2)


def passed(outcomes: list[Outcome]) -> bool:
    """The acceptance criteria: every row within its tolerance and mean |error| <= 5 %."""
    return all(o.ok for o in outcomes) and summary(outcomes)["mae_all"] <= MAX_MEAN_ABS_ERROR
