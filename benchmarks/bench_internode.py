"""Internode normal-mode benchmark on virtual nodes: the CUDA internode backend next to the intranode kernels on the
same GPUs, with the simulator's prediction next to each measurement.

``--num-processes`` ranks (2), one per GPU: phase "intranode" (one node), then phase "internode" with
``DEEP_EP_GPUS_PER_NODE=1`` (every rank its own node, NVSHMEM buffer of ``--num-rdma-bytes``), same workload as
bench_intranode.py, same timing (its ``bench`` and ``kernel_time``), best over the chunk sweeps. Bytes as DeepEP V1's
internode test counts them: "RDMA" = (token, node) pairs sent x 2H, "NVL" = rows received x 2H (FP8: x
``(1 + 4/128) / 2``). Predictions: ``simulator.predictions`` when simpy imports, else the rows of ``--predictions``;
error = (predicted - measured) / measured against the rank-averaged wall time, at 24 SMs. ``--put`` adds phase
"internode_put" (the Buffer built under ``deep_ep.testing.overrides(internode_put_only=True)``: peers by NVSHMEM
puts, the path behind a NIC; ``--put-warps`` sweeps its copy warps). ``--composed``: the fused kernels
(``internode="fused"``, NVSHMEM buffer of ``--num-nvl-bytes`` + ``--num-rdma-bytes``) and the composed path
(``internode="composed"``) next to the torch backend (``internode="torch"``), ranks sharing GPUs as 2 virtual nodes,
wall times only; with ``--put`` also phase "fused_put" (the fused kernels with every pair of different nodes on puts,
``internode_put_only``; its buffer at least what the rings of the largest ``--sms`` need beside the put area)::

    python benchmarks/bench_internode.py --json $OUT/bench_internode.json
    python benchmarks/bench_internode.py --skip-intranode --put --json $OUT/inter_put.json
    python benchmarks/bench_internode.py --composed --num-processes 4 --num-tokens 1024 --json $OUT/composed.json
    python benchmarks/bench_internode.py --composed --put --num-processes 4 --num-tokens 1024 --json $OUT/fput.json
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_intranode import FP8_FACTOR, add_workload_args, bench, init_rank, kernel_time, spawn_ranks  # noqa: E402

# Simulator case per phase (``python -m simulator predict`` labels).
PREDICTION_CASES = {"internode": "internode 2x1 virtual", "intranode": "intranode EP2"}


def measure(buffer, rank: int, args, x, x_fp8, topk_idx, topk_weights, rdma_pairs: int, report: dict,
            phase: str) -> None:
    """Cached FP8/BF16 dispatch and BF16 combine of ``buffer`` at every ``--sms``; appends points to ``report``."""
    import deep_ep
    h, e = args.hidden, args.num_experts
    layout = buffer.get_dispatch_layout(topk_idx, e)
    internode = layout.num_tokens_per_rdma_rank is not None
    for num_sms in args.sms:
        kwargs = dict(num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                      num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=topk_idx,
                      topk_weights=topk_weights, config=deep_ep.Config(num_sms, 8, 256))
        if internode:
            kwargs["num_tokens_per_rdma_rank"] = layout.num_tokens_per_rdma_rank
        first = buffer.dispatch(x, **kwargs)
        handle = first.handle
        channels = handle[1].size(1)  # the kernels' CTAs: below num_sms where the channel cap applies
        rows = first.recv_x.size(0)
        nvl_bytes = rows * h * 2
        rdma_bytes = rdma_pairs * h * 2
        ops = [("dispatch_fp8", x_fp8, FP8_FACTOR, args.dispatch_chunks, "dispatch"),
               ("dispatch_bf16", x, 1.0, args.dispatch_chunks, "dispatch"),
               ("combine_bf16", first.recv_x, 1.0, args.combine_chunks, "combine")]
        for op, cur, factor, chunks, keyword in ops:
            best = None
            for chunk in chunks:
                cfg = deep_ep.Config(num_sms, chunk, 256)
                if keyword == "dispatch":
                    fn = functools.partial(buffer.dispatch, cur, handle=handle, config=cfg)
                else:
                    fn = functools.partial(buffer.combine, cur, handle, config=cfg)
                try:
                    t = bench(fn, args.iters, args.iters) if args.composed else bench(fn)
                except Exception:  # noqa: BLE001 - a failing point is reported, the sweep goes on
                    report["errors"].append(f"{phase} {op} sms={num_sms} chunk={chunk}: {traceback.format_exc()}")
                    continue
                if best is None or t["mean"] < best[1]["mean"]:
                    best = (chunk, t, fn)
            if best is None:
                continue
            try:
                kt = None if phase in ("composed", "torch") else kernel_time(best[2], keyword)
            except Exception:  # noqa: BLE001
                kt = None
            wall = best[1]["mean"]
            report["points"].append({
                "phase": phase, "op": op, "num_sms": num_sms, "channels": channels, "chunk": best[0], "rows": rows,
                "wall_us": wall * 1e6, "wall_us_median": best[1]["median"] * 1e6,
                "kernel_us": kt * 1e6 if kt else None,
                "nvl_GBps": nvl_bytes * factor / 1e9 / wall, "rdma_GBps": rdma_bytes * factor / 1e9 / wall,
                "nvl_GBps_kernel": nvl_bytes * factor / 1e9 / kt if kt else None})


def fused_put_rdma_bytes(args, per_node: int) -> int:
    """``--num-rdma-bytes`` for phase fused_put, raised so that the buffer (``num_nvl_bytes + num_rdma_bytes``,
    whole MiB) holds the rings of the largest ``--sms`` with put peers: the fused rings keep the Config's slots (256
    rail, 256 / 2 node per source at 2 nodes) whatever the buffer, and put peers add the rail rings' staging."""
    from deep_ep import config, layout
    record = layout.intranode_dispatch_record_bytes(args.hidden * 2, 0, args.num_topk)
    need = 0
    for num_sms in args.sms:
        used = config.fused_config_ring_bytes(config.Config(num_sms, 8, 256), 2, per_node, record, True)
        need = max(need, layout.fused_min_rdma_bytes(used, True) - args.num_nvl_bytes)
    return max(args.num_rdma_bytes, -(-need // (1 << 20)) * (1 << 20))


def run_rank(rank: int, args, port: int, result_path: str) -> None:
    group, x, x_fp8, topk_idx, topk_weights = init_rank(rank, args, port, "gloo" if args.composed else "nccl")
    import deep_ep
    import deep_ep.testing
    n, e = args.num_tokens, args.num_experts
    report: dict = {"rank": rank, "points": [], "errors": [], "backends": {}}
    # The first profiler session pays CUPTI's start-up inside the first kernel it sees: spend it on a dummy.
    kernel_time(lambda: torch.ones(1024, device="cuda").sum(), "reduce", num_tests=2)

    # (phase, ranks per node, deep_ep.testing overrides while the Buffer is built, Buffer sizes)
    phases = [("intranode", args.num_processes, {}, dict(num_nvl_bytes=args.num_nvl_bytes)),
              ("internode", 1, {}, dict(num_nvl_bytes=0, num_rdma_bytes=args.num_rdma_bytes, num_qps_per_rank=24))]
    if args.put:
        phases.append(("internode_put", 1, {"internode_put_only": True}, phases[1][3]))
    if args.composed:  # 2 virtual nodes; the same tensors through both paths
        per_node = args.num_processes // 2
        phases = [(phase, per_node, fields, dict(num_nvl_bytes=args.num_nvl_bytes))
                  for phase, fields in (("composed", {"internode": "composed"}), ("torch", {"internode": "torch"}))]
        fused_sizes = dict(num_nvl_bytes=args.num_nvl_bytes, num_rdma_bytes=args.num_rdma_bytes)
        phases.insert(0, ("fused", per_node, {"internode": "fused"}, fused_sizes))
        if args.put:
            put_sizes = dict(fused_sizes, num_rdma_bytes=fused_put_rdma_bytes(args, per_node))
            phases.insert(1, ("fused_put", per_node, {"internode": "fused", "internode_put_only": True}, put_sizes))
    for phase, per_node, fields, sizes in phases:
        if (args.skip_intranode and phase == "intranode") or (args.phases and phase not in args.phases):
            continue
        os.environ["DEEP_EP_GPUS_PER_NODE"] = str(per_node)
        try:
            with deep_ep.testing.overrides(**fields):
                buffer = deep_ep.Buffer(group, explicitly_destroy=True, **sizes)
        except Exception:  # noqa: BLE001
            report["errors"].append(f"{phase} Buffer: {traceback.format_exc()}")
            continue
        report["backends"][phase] = type(buffer.runtime).__name__
        num_nodes = args.num_processes // per_node
        layout = buffer.get_dispatch_layout(topk_idx, e)
        per_node = layout.is_token_in_rank.view(n, num_nodes, -1).any(-1)
        rdma_pairs = int(per_node.sum())
        # The put phase sweeps the copy warps per channel (0: the Buffer's choice); phase internode_put_wN is N.
        for warps in args.put_warps if phase == "internode_put" else [0]:
            label = f"{phase}_w{warps}" if warps else phase
            try:
                with deep_ep.testing.overrides(**({"dispatch_warps": warps, "combine_warps": warps} if warps else {})):
                    measure(buffer, rank, args, x, x_fp8, topk_idx, topk_weights, rdma_pairs, report, label)
            except Exception:  # noqa: BLE001
                report["errors"].append(f"{label}: {traceback.format_exc()}")
        torch.cuda.synchronize()
        buffer.destroy()
        dist.barrier()

    with open(f"{result_path}.rank{rank}", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def predictions(path: Path) -> tuple[dict, str]:
    """``(phase, op, dtype) -> predicted µs`` (the virtual 2 x 1 case for the internode phase, EP2 for the
    intranode phase), and where it came from."""
    try:
        from simulator import predictions as pred
        rows = [r.as_dict() for r in pred.predict()]
        source = "simulator.predictions (computed now)"
    except Exception as exc:  # noqa: BLE001 - simpy may be absent where the GPUs are
        if not path.exists():
            return {}, f"none (simulator unavailable: {exc}; no {path})"
        rows = json.loads(path.read_text())["rows"]
        source = f"{path.name} (stored; simulator unavailable here: {type(exc).__name__})"
    phase_of = {case: phase for phase, case in PREDICTION_CASES.items()}
    return {(phase_of[r["case"]], r["op"], r["dtype"]): r["time_us"] for r in rows if r["case"] in phase_of}, source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser, [24])
    parser.add_argument("--num-rdma-bytes", type=int, default=int(1e9) // 128 * 128)
    parser.add_argument("--skip-intranode", action="store_true", help="measure the internode phase(s) only")
    parser.add_argument("--phases", nargs="+", default=None,
                        help="measure only these phases (e.g. fused fused_put; default: every phase the flags add)")
    parser.add_argument("--put", action="store_true",
                        help="also the internode backend with every peer reached by puts (phase internode_put); with "
                             "--composed, the fused kernels with every rail pair on puts (phase fused_put)")
    parser.add_argument("--put-warps", type=int, nargs="+", default=[0],
                        help="--put: copy warps per channel to sweep in the put phase; 0: the Buffer's choice")
    parser.add_argument("--composed", action="store_true",
                        help="the fused kernels and the composed path next to the torch backend, ranks sharing GPUs")
    parser.add_argument("--iters", type=int, default=10, help="--composed: warm-ups and timed calls per point")
    parser.add_argument("--predictions", type=Path,
                        default=HERE.parent / "simulator" / "data" / "predictions_deep_ep.json")
    parser.add_argument("--json", type=str, default="bench_internode.json")
    args = parser.parse_args()
    reports = spawn_ranks(run_rank, args)
    predicted, source = ({}, "none (--composed)") if args.composed else predictions(args.predictions)
    summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": torch.cuda.get_device_name(0) + f" x{torch.cuda.device_count()}",
               "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
               "prediction_source": source,
               "predicted_us": {f"{ph} {op} {dt}": us for (ph, op, dt), us in predicted.items()},
               "ranks": reports}
    Path(args.json).write_text(json.dumps(summary, indent=1))
    print_table(summary, predicted)


def print_table(summary: dict, predicted: dict) -> None:
    rep = summary["ranks"][0]
    print(f"\n# {summary['date']}  {summary['machine']}  backends={rep['backends']}")
    print(f"# simulator: {summary['prediction_source']}; NVSHMEM over P2P (no NIC: IBGDA untested)")
    base = "torch" if any(p["phase"] == "torch" for p in rep["points"]) else "intranode"
    intra = {(p["op"], p["num_sms"]): p for p in rep["points"] if p["phase"] == base}
    print(f"{'phase':<18}{'op':<15}{'SMs':>4}{'chunk':>6}{'wall us':>9}{'kern us':>9}{'NVL GB/s':>9}{'RDMA GB/s':>10}"
          f"{'vs ' + base[:5]:>9}{'sim us':>8}{'sim err':>8}")
    for p in rep["points"]:
        ratio = sim = err = "-"
        ref = intra.get((p["op"], p["num_sms"]))
        if p["phase"].startswith("internode_put") or p["phase"] == "fused_put":  # against the pointer path
            pointer = "fused" if p["phase"] == "fused_put" else "internode"
            ref = next((q for q in rep["points"] if q["phase"] == pointer and q["op"] == p["op"]
                        and q["num_sms"] == p["num_sms"]), None)
        if (p["phase"] in ("internode", "composed", "fused", "fused_put") or p["phase"].startswith("internode_put")) \
                and ref is not None:
            ratio = f"{p['nvl_GBps'] / ref['nvl_GBps']:.2f}"
        key = (p["phase"], *p["op"].split("_"))
        if key in predicted and p["num_sms"] == 24:  # the simulator's cases run 24 SMs
            # The deep_ep simulator family is calibrated on the wall time averaged over ranks (simulator/bench_fit.py).
            same = [q["wall_us"] for r in summary["ranks"] for q in r["points"]
                    if (q["phase"], q["op"], q["num_sms"]) == (p["phase"], p["op"], p["num_sms"])]
            measured = sum(same) / len(same)
            sim = f"{predicted[key]:.1f}"
            err = f"{(predicted[key] - measured) / measured * 100:+.0f}%"
        kern = f"{p['kernel_us']:.1f}" if p["kernel_us"] else "-"
        print(f"{p['phase']:<18}{p['op']:<15}{p['num_sms']:>4}{p['chunk']:>6}{p['wall_us']:>9.1f}{kern:>9}"
              f"{p['nvl_GBps']:>9.0f}{p['rdma_GBps']:>10.0f}{ratio:>9}{sim:>8}{err:>8}")
    for r in summary["ranks"]:
        for e in r["errors"]:
            print(f"rank {r['rank']} ERROR {e.splitlines()[0]} ... {e.splitlines()[-1]}")


if __name__ == "__main__":
    main()
