"""Report rows, the fixed-width text table, the JSON object and the optional PNG plot.

Formatting is deterministic (fixed precision, fixed column order) so golden-file diffs mean something.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulator.rank import OpResult
    from simulator.scenario import Scenario


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
    """Per-scale sizing: buffer bytes per GPU (``deep_ep.layout`` formulas) and recommendations."""

    nodes: int
    ep_size: int
    num_nvl_bytes: int
    num_rdma_bytes: int
    num_ll_rdma_bytes: int
    recommended_num_sms: int | None
    chunks: dict[str, int]
    recommended_num_qps_per_rank: int | None
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "ep_size": self.ep_size, "num_nvl_bytes": self.num_nvl_bytes,
                "num_rdma_bytes": self.num_rdma_bytes, "num_ll_rdma_bytes": self.num_ll_rdma_bytes,
                "recommended_num_sms": self.recommended_num_sms, "chunk_sizes": dict(sorted(self.chunks.items())),
                "recommended_num_qps_per_rank": self.recommended_num_qps_per_rank, "notes": list(self.notes)}


@dataclass
class Report:
    """Everything ``python -m simulator`` prints: one OpRow per (scale, mode, op) and one ScaleRow per scale."""

    scenario: Scenario
    ops: list[OpRow] = field(default_factory=list)
    scales: list[ScaleRow] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict
        scales = []
        for scale in self.scales:
            entry = scale.as_dict()
            for row in self.ops:
                if row.nodes == scale.nodes:
                    entry.setdefault(row.mode, {})[row.op] = row.as_dict()
            scales.append(entry)
        return {"scenario": asdict(self.scenario), "results": scales}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=False)

    def to_text(self) -> str:
        sc = self.scenario
        head = (f"deep_ep simulator: {sc.gpu.upper()} + {sc.nic.upper()}, {sc.gpus_per_node} GPUs/node, "
                f"hidden {sc.hidden}, top-{sc.topk} of {sc.experts} experts"
                + (f" (+{sc.num_redundant_experts} redundant)" if sc.num_redundant_experts else "")
                + f", routing {sc.routing}, seed {sc.seed}, num_sms {sc.num_sms}"
                + (f", kernels {sc.kernels}" if sc.kernels != "deepep" else ""))
        lines = [head, ""]
        cols = (f"{'nodes':>5} {'EP':>4} {'mode':<11} {'op':<8} {'dtype':<5} {'tokens':>6} {'time_us':>9} "
                f"{'max_us':>9} "
                f"{'logical_GB/s':>12} {'NVL_GB/s':>9} {'NIC_GB/s':>9} {'NVL%':>5} {'NIC%':>5}  bottleneck")
        lines += [cols, "-" * len(cols)]
        for r in self.ops:
            lines.append(f"{r.nodes:>5} {r.ep_size:>4} {r.mode:<11} {r.op:<8} {r.dtype:<5} {r.tokens:>6} "
                         f"{r.time_us:>9.1f} {r.max_time_us:>9.1f} {r.logical_gbps:>12.1f} {r.nvl_gbps:>9.1f} "
                         f"{r.nic_gbps:>9.1f} "
                         f"{100 * r.nvl_util:>5.0f} {100 * r.nic_util:>5.0f}  {r.bottleneck}")
        lines.append("")
        cols2 = (f"{'nodes':>5} {'EP':>4} {'NVL_buffer_MB':>13} {'RDMA_buffer_MB':>14} {'LL_buffer_MB':>12} "
                 f"{'num_sms':>7} {'qps/rank':>8}  chunk sizes")
        lines += [cols2, "-" * len(cols2)]
        for s in self.scales:
            chunk_text = " ".join(f"{k}={v}" for k, v in sorted(s.chunks.items())) or "-"
            sms = "-" if s.recommended_num_sms is None else str(s.recommended_num_sms)
            qps = "-" if s.recommended_num_qps_per_rank is None else str(s.recommended_num_qps_per_rank)
            lines.append(f"{s.nodes:>5} {s.ep_size:>4} {s.num_nvl_bytes / 1e6:>13.1f} {s.num_rdma_bytes / 1e6:>14.1f} "
                         f"{s.num_ll_rdma_bytes / 1e6:>12.1f} {sms:>7} {qps:>8}  {chunk_text}")
        notes = [n for s in self.scales for n in s.notes]
        if any(r.mode == "normal" for r in self.ops) and sc.kernels == "deepep":
            notes.append("normal-mode time excludes the notify kernel + CPU poll "
                         f"(~{self.ops[0].notify_us:.0f} us per non-cached dispatch), as DeepEP's benchmarks do")
        if notes:
            lines += [""] + [f"note: {n}" for n in dict.fromkeys(notes)]
        return "\n".join(lines) + "\n"

    def plot(self, path: str) -> None:
        """Write a PNG: time and logical bandwidth against node count, per mode and op (needs matplotlib)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise RuntimeError(f"--plot needs matplotlib ({exc})") from None
        fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
        series: dict[tuple[str, str], list[OpRow]] = {}
        for r in self.ops:
            series.setdefault((r.mode, r.op), []).append(r)
        for (mode, op), rows in sorted(series.items()):
            xs = [r.nodes for r in rows]
            ax_t.plot(xs, [r.time_us for r in rows], marker="o", label=f"{mode} {op}")
            ax_b.plot(xs, [r.logical_gbps for r in rows], marker="o", label=f"{mode} {op}")
        for ax, ylabel in ((ax_t, "time (us)"), (ax_b, "logical bandwidth (GB/s)")):
            ax.set_xlabel("nodes")
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        sc = self.scenario
        fig.suptitle(f"{sc.gpu.upper()} + {sc.nic.upper()}, {sc.gpus_per_node} GPUs/node, routing {sc.routing}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
