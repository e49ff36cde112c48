"""Report rows, the fixed-width text table, the JSON object, the side-by-side comparison of two kernel families and
the optional plot.

Formatting is deterministic (fixed precision, fixed column order) so golden-file diffs mean something.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulator.rank import OpResult
    from simulator.scenario import Scenario

# What each ``kernels`` value models, for headers and JSON.
KERNEL_FAMILIES = {"deep_ep": "this library's kernels", "deepep": "DeepEP V1's kernels"}


@dataclass(frozen=True)
class OpRow:
    """One simulated op at one scale.

    Attributes:
        time_us: kernel time (µs) averaged over ranks, notify excluded (each rank of DeepEP's benchmark prints
            its own).
        max_time_us: kernel time of the slowest rank (µs): the straggler that gates the next layer.
        logical_gbps: DeepEP's test metric: normal intranode = received rows / time ("NVL"); normal internode =
            (token, node) pairs incl. the own node / time ("RDMA"); low-latency = valid selections x message / time.
        nvl_logical_gbps: received-row bytes / time (DeepEP's "NVL" figure; equals logical_gbps intranode).
        nvl_gbps / nic_gbps: physical bytes per GPU per direction on NVLink / the NIC, busiest GPU, / time.
        nvl_util / nic_util: busiest port's average utilization during the data phase (0..1).
        bottleneck: limiting resource (``NVLink``, ``RDMA``, ``SM:forward``, ``SM:send``, ``SM:recv``, ``SM``) or
            ``latency`` when fixed costs dominate.
        notify_us: notify kernel + CPU poll before a non-cached normal dispatch (reported separately, as DeepEP does).
    """

    nodes: int
    ep_size: int
    mode: str
    op: str
    dtype: str
    tokens: int
    time_us: float
    max_time_us: float
    logical_gbps: float
    nvl_logical_gbps: float
    nvl_gbps: float
    nic_gbps: float
    nvl_util: float
    nic_util: float
    bottleneck: str
    fixed_us: float
    notify_us: float = 0.0

    @classmethod
    def from_result(cls, nodes: int, ep_size: int, mode: str, op: str, dtype: str, tokens: int, res: OpResult,
                    notify_us: float = 0.0) -> OpRow:
        times = res.rank_time_us
        logical = sum(b / t for b, t in zip(res.logical_bytes, times) if t > 0) / len(times) / 1e3
        nvl_logical = sum(b / t for b, t in zip(res.nvl_logical_bytes, times) if t > 0) / len(times) / 1e3
        nvl_util = max(res.utilization.get("nvl_out", 0.0), res.utilization.get("nvl_in", 0.0))
        nic_util = max(res.utilization.get("nic_out", 0.0), res.utilization.get("nic_in", 0.0))
        per_gpu = 1.0 / ep_size
        nvl_gbps = max(res.port_bytes.get("nvl_out", 0.0), res.port_bytes.get("nvl_in", 0.0)) * per_gpu / res.time_us
        nic_gbps = max(res.port_bytes.get("nic_out", 0.0), res.port_bytes.get("nic_in", 0.0)) * per_gpu / res.time_us
        return cls(nodes, ep_size, mode, op, dtype, tokens, res.time_us, res.max_time_us, logical, nvl_logical,
                   nvl_gbps / 1e3, nic_gbps / 1e3, nvl_util, nic_util, res.bottleneck, res.fixed_us, notify_us)

    def as_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "ep_size": self.ep_size, "mode": self.mode, "op": self.op, "dtype": self.dtype,
                "tokens_per_rank": self.tokens, "time_us": round(self.time_us, 2),
                "max_time_us": round(self.max_time_us, 2),
                "logical_gbps": round(self.logical_gbps, 2), "nvl_logical_gbps": round(self.nvl_logical_gbps, 2),
                "physical_nvl_gbps": round(self.nvl_gbps, 2), "physical_nic_gbps": round(self.nic_gbps, 2),
                "nvl_utilization": round(self.nvl_util, 3), "nic_utilization": round(self.nic_util, 3),
                "bottleneck": self.bottleneck, "fixed_us": round(self.fixed_us, 2),
                "notify_us": round(self.notify_us, 2)}


@dataclass(frozen=True)
class ScaleRow:
    """Per-scale sizing: buffer bytes per GPU (``deep_ep.layout`` formulas) and recommendations.

    ``recommended_sms_time_us`` holds the normal ops' predicted time at ``recommended_num_sms`` (``op -> µs``);
    the low-latency rows are the prediction at ``recommended_num_qps_per_rank``.
    """

    nodes: int
    ep_size: int
    num_nvl_bytes: int
    num_rdma_bytes: int
    num_ll_rdma_bytes: int
    recommended_num_sms: int | None
    chunks: dict[str, int]
    recommended_num_qps_per_rank: int | None
    notes: tuple[str, ...] = ()
    recommended_sms_time_us: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "ep_size": self.ep_size, "num_nvl_bytes": self.num_nvl_bytes,
                "num_rdma_bytes": self.num_rdma_bytes, "num_ll_rdma_bytes": self.num_ll_rdma_bytes,
                "recommended_num_sms": self.recommended_num_sms,
                "recommended_num_sms_time_us": {op: round(t, 2) for op, t in self.recommended_sms_time_us.items()},
                "chunk_sizes": dict(sorted(self.chunks.items())),
                "recommended_num_qps_per_rank": self.recommended_num_qps_per_rank, "notes": list(self.notes)}


def _us(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values) + " us"


@dataclass
class Report:
    """Everything ``python -m simulator`` prints: one OpRow per (scale, mode, op) and one ScaleRow per scale."""

    scenario: Scenario
    ops: list[OpRow] = field(default_factory=list)
    scales: list[ScaleRow] = field(default_factory=list)

    @property
    def kernels(self) -> str:
        return self.scenario.kernels

    def scenario_notes(self) -> list[str]:
        """Notes on how the scenario's flags were applied."""
        sc = self.scenario
        if sc.mode == "both" and sc.tokens is not None and sc.low_latency_tokens < sc.tokens:
            return [f"low-latency rows use {sc.low_latency_tokens} tokens per rank, the low-latency kernels' limit "
                    f"(--tokens {sc.tokens} applies to normal mode; --ll-tokens sets the low-latency count)"]
        return []

    def notes(self) -> list[str]:
        notes = self.scenario_notes() + [n for s in self.scales for n in s.notes]
        if any(r.mode == "normal" for r in self.ops) and self.kernels == "deepep":
            notes.append("normal-mode time excludes the notify kernel + CPU poll "
                         f"(~{self.ops[0].notify_us:.0f} us per non-cached dispatch), as DeepEP's benchmarks do")
        return list(dict.fromkeys(notes))

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict
        scales = []
        for scale in self.scales:
            entry = scale.as_dict()
            for row in self.ops:
                if row.nodes == scale.nodes:
                    entry.setdefault(row.mode, {})[row.op] = row.as_dict()
            scales.append(entry)
        return {"kernels": self.kernels, "kernels_description": KERNEL_FAMILIES[self.kernels],
                "scenario": asdict(self.scenario), "results": scales, "notes": self.notes()}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=False)

    def header(self, kernels: str) -> str:
        sc = self.scenario
        return (f"deep_ep simulator, {kernels}: {sc.gpu.upper()} + {sc.nic.upper()}, {sc.gpus_per_node} GPUs/node, "
                f"hidden {sc.hidden}, top-{sc.topk} of {sc.experts} experts"
                + (f" (+{sc.num_redundant_experts} redundant)" if sc.num_redundant_experts else "")
                + f", routing {sc.routing}, seed {sc.seed}, num_sms {sc.num_sms}")

    def scale_lines(self) -> list[str]:
        """The sizing table and, per scale, the recommended settings with the predicted times there."""
        cols = (f"{'nodes':>5} {'EP':>4} {'NVL_buffer_MB':>13} {'RDMA_buffer_MB':>14} {'LL_buffer_MB':>12} "
                f"{'num_sms':>7} {'qps/rank':>8}  chunk sizes")
        lines = [cols, "-" * len(cols)]
        recs = []
        for s in self.scales:
            chunk_text = " ".join(f"{k}={v}" for k, v in sorted(s.chunks.items())) or "-"
            sms = "-" if s.recommended_num_sms is None else str(s.recommended_num_sms)
            qps = "-" if s.recommended_num_qps_per_rank is None else str(s.recommended_num_qps_per_rank)
            lines.append(f"{s.nodes:>5} {s.ep_size:>4} {s.num_nvl_bytes / 1e6:>13.1f} {s.num_rdma_bytes / 1e6:>14.1f} "
                         f"{s.num_ll_rdma_bytes / 1e6:>12.1f} {sms:>7} {qps:>8}  {chunk_text}")
            at = f"nodes {s.nodes}, " if len(self.scales) > 1 else ""
            rows = [r for r in self.ops if r.nodes == s.nodes]
            if s.recommended_num_sms is not None and s.recommended_sms_time_us:
                ops = list(s.recommended_sms_time_us)
                now = [r.time_us for op in ops for r in rows if r.mode == "normal" and r.op == op]
                recs.append(f"recommended: {at}num_sms {s.recommended_num_sms} -> normal {'/'.join(ops)} "
                            f"{_us(list(s.recommended_sms_time_us.values()))} "
                            f"(num_sms {self.scenario.num_sms}: {_us(now)})")
            ll = [r for r in rows if r.mode == "low-latency"]
            if s.recommended_num_qps_per_rank is not None and ll:
                recs.append(f"recommended: {at}num_qps_per_rank {s.recommended_num_qps_per_rank} -> low-latency "
                            f"{'/'.join(r.op for r in ll)} {_us([r.time_us for r in ll])} (the rows above)")
        return lines + ([""] + recs if recs else [])

    def to_text(self) -> str:
        lines = [self.header(f"kernels {self.kernels} ({KERNEL_FAMILIES[self.kernels]})"), ""]
        cols = (f"{'nodes':>5} {'EP':>4} {'mode':<11} {'op':<8} {'dtype':<5} {'tokens':>6} {'time_us':>9} "
                f"{'max_us':>9} "
                f"{'logical_GB/s':>12} {'NVL_GB/s':>9} {'NIC_GB/s':>9} {'NVL%':>5} {'NIC%':>5}  bottleneck")
        lines += [cols, "-" * len(cols)]
        for r in self.ops:
            lines.append(f"{r.nodes:>5} {r.ep_size:>4} {r.mode:<11} {r.op:<8} {r.dtype:<5} {r.tokens:>6} "
                         f"{r.time_us:>9.1f} {r.max_time_us:>9.1f} {r.logical_gbps:>12.1f} {r.nvl_gbps:>9.1f} "
                         f"{r.nic_gbps:>9.1f} "
                         f"{100 * r.nvl_util:>5.0f} {100 * r.nic_util:>5.0f}  {r.bottleneck}")
        lines += [""] + self.scale_lines()
        notes = self.notes()
        if notes:
            lines += [""] + [f"note: {n}" for n in notes]
        return "\n".join(lines) + "\n"

    def figure(self) -> Any:
        """The plot as a matplotlib Figure (needs matplotlib): one row per mode, time per op (µs) and logical
        bandwidth (GB/s) against the node count, one line per op."""
        from matplotlib.figure import Figure
        modes = [m for m in ("normal", "low-latency") if any(r.mode == m for r in self.ops)]
        nodes = sorted({r.nodes for r in self.ops})
        fig = Figure(figsize=(11, 3.6 * len(modes)))
        axes = fig.subplots(len(modes), 2, squeeze=False)
        sc = self.scenario
        for (ax_t, ax_b), mode in zip(axes, modes):
            for op in ("dispatch", "combine"):
                rows = [r for r in self.ops if r.mode == mode and r.op == op]
                if rows:
                    label = f"{op} ({rows[0].dtype})"
                    ax_t.plot([r.nodes for r in rows], [r.time_us for r in rows], marker="o", label=label)
                    ax_b.plot([r.nodes for r in rows], [r.logical_gbps for r in rows], marker="o", label=label)
            for ax, ylabel in ((ax_t, "time per op (µs)"), (ax_b, "logical bandwidth per GPU (GB/s)")):
                if nodes[-1] >= 4 * nodes[0]:
                    ax.set_xscale("log", base=2)
                ax.set_xticks(nodes, [str(n) for n in nodes])
                ax.minorticks_off()
                ax.set_xlabel(f"nodes ({sc.gpus_per_node} GPUs each)")
                ax.set_ylabel(ylabel)
                ax.set_ylim(bottom=0)
                ax.set_title(f"{mode} mode")
                ax.grid(True, alpha=0.3)
                ax.legend(fontsize=8)
        fig.suptitle(f"kernels {self.kernels}: {sc.gpu.upper()} + {sc.nic.upper()}, routing {sc.routing}")
        fig.tight_layout()
        return fig

    def plot(self, path: str) -> str:
        """Write :meth:`figure` to ``path`` (the extension picks the format) and say what it drew."""
        self.figure().savefig(path, dpi=100)
        modes = [m for m in ("normal", "low-latency") if any(r.mode == m for r in self.ops)]
        nodes = sorted({r.nodes for r in self.ops})
        return (f"time per op (µs) and logical bandwidth (GB/s) against nodes {','.join(map(str, nodes))}, "
                f"{' and '.join(modes)} mode, kernels {self.kernels}")


@dataclass
class Comparison:
    """Two kernel families on one scenario: ``base`` (the planned family) and ``other``; ratio = base / other time."""

    base: Report
    other: Report

    def pairs(self) -> list[tuple[OpRow, OpRow]]:
        theirs = {(r.nodes, r.mode, r.op): r for r in self.other.ops}
        return [(r, theirs[(r.nodes, r.mode, r.op)]) for r in self.base.ops if (r.nodes, r.mode, r.op) in theirs]

    def as_dict(self) -> dict[str, Any]:
        a, b = self.base.kernels, self.other.kernels
        rows = [{"nodes": x.nodes, "ep_size": x.ep_size, "mode": x.mode, "op": x.op, "dtype": x.dtype,
                 "tokens_per_rank": x.tokens, "time_us": {a: round(x.time_us, 2), b: round(y.time_us, 2)},
                 "ratio": round(x.time_us / y.time_us, 3), "bottleneck": {a: x.bottleneck, b: y.bottleneck}}
                for x, y in self.pairs()]
        return {"kernels": a, "compare": b, "ratio": f"{a} time / {b} time", "comparison": rows,
                "reports": {a: self.base.as_dict(), b: self.other.as_dict()}}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=False)

    def to_text(self) -> str:
        a, b = self.base.kernels, self.other.kernels
        lines = [self.base.header(f"kernels {a} ({KERNEL_FAMILIES[a]}) vs {b} ({KERNEL_FAMILIES[b]})"), ""]
        ta, tb = f"{a}_us", f"{b}_us"
        cols = (f"{'nodes':>5} {'EP':>4} {'mode':<11} {'op':<8} {'dtype':<5} {'tokens':>6} {ta:>10} {tb:>10} "
                f"{'ratio':>6}  {a + ' bottleneck':<22} {b} bottleneck")
        lines += [cols, "-" * len(cols)]
        for x, y in self.pairs():
            lines.append(f"{x.nodes:>5} {x.ep_size:>4} {x.mode:<11} {x.op:<8} {x.dtype:<5} {x.tokens:>6} "
                         f"{x.time_us:>10.1f} {y.time_us:>10.1f} {x.time_us / y.time_us:>6.2f}  "
                         f"{x.bottleneck:<22} {y.bottleneck}")
        lines += [f"ratio = {a} time / {b} time (above 1: {a} is slower)"]
        for report in (self.base, self.other):
            lines += ["", f"kernels {report.kernels}:"] + report.scale_lines()
        notes = [n if n.startswith(r.kernels + " ") else f"{r.kernels}: {n}" for r in (self.base, self.other)
                 for n in r.notes()]
        if notes:
            lines += [""] + [f"note: {n}" for n in notes]
        return "\n".join(lines) + "\n"
