"""Intranode normal-mode benchmark: deep_ep's CUDA kernels against the NCCL all-to-all baseline.

Workload of DeepEP V1's intranode test: ``--num-tokens`` tokens per rank (4096), hidden 7168, top-8 of 256 experts,
uniform routing (``topk(|randn| + 1)``), one process per GPU. Timing as DeepEP's ``bench``: warm-ups, one L2 flush,
then calls between CUDA events on the calling stream, first sample dropped (*wall time*); *kernel time* is the mean
kernel duration in a torch-profiler trace. Dispatch is the cached dispatch (``handle=``), as a training step repeats.
Bytes (DeepEP's "logical" count): rows received (own included) x hidden x 2 for BF16, x ``(1 + 4/128) / 2`` for
FP8; "remote" GB/s counts only rows crossing NVLink, with their wire bytes.

Variants through ``deep_ep.testing.overrides`` (see ``--help``): receive path (``--receive rings direct``; ops
``dispatch_*``, ``dispatch_*_direct``), combine send path (``--combine-copy auto copy zone rings``; each op names the
path that ran: ``combine_bf16``, ``_copy``, ``_zone``, ``_rings``), copy warps, copy chunk rows, ``--uncapped``.
Output: a table on stdout (rank 0) and ``--json`` with every point of the sweeps and the NCCL baseline::

    python benchmarks/bench_intranode.py --num-processes 2 --json out/bench.json
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import socket
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FP8_FACTOR = (1 + 4 / 128) / 2
OPS = ("dispatch_fp8", "dispatch_bf16", "combine_bf16", "nccl")


# ----------------------------------------------------------------------------------------------------------------
# Timing helpers
# ----------------------------------------------------------------------------------------------------------------
def bench(fn, num_warmups: int = 50, num_tests: int = 50) -> dict:
    """DeepEP's timing: warm-ups, one L2 flush, CUDA events around each call; first sample dropped (seconds)."""
    torch.cuda.synchronize()
    cache = torch.empty(int(256e6 // 4), dtype=torch.int32, device="cuda")
    for _ in range(num_warmups):
        fn()
    cache.zero_()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
    for i in range(num_tests):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)][1:]
    return {"mean": statistics.fmean(times), "median": statistics.median(times), "min": min(times), "max": max(times)}


def kernel_time(fn, keyword: str, num_tests: int = 20) -> float | None:
    """Mean duration (s) of the one CUDA kernel whose name contains ``keyword`` (None if not exactly one)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_tests):
            fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if keyword in e.key and e.device_type.name == "CUDA"]
    names = {e.key for e in rows}
    if len(names) != 1:
        return None
    row = rows[0]
    total_us = getattr(row, "device_time_total", None)
    if total_us is None:
        total_us = row.cuda_time_total
    return total_us / max(row.count, 1) / 1e6


def per_token_cast_to_fp8(x: torch.Tensor):
    """FP8 e4m3 with one float32 scale per 128 channels (DeepEP's test helper, column-major scales)."""
    m, n = x.shape
    view = x.float().view(m, n // 128, 128)
    amax = view.abs().amax(dim=2).clamp(min=1e-4)
    fp8 = (view * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n)
    scales = (amax / 448.0).t().contiguous().t()  # column-major, as DeepEP's test passes them
    return fp8, scales


# ----------------------------------------------------------------------------------------------------------------
# One rank
# ----------------------------------------------------------------------------------------------------------------
def init_rank(rank: int, args, port: int, backend: str = "nccl"):
    """Join the group (``backend``; gloo whenever ranks share GPUs) on GPU ``rank % GPUs`` and draw the
    workload: ``(group, x, x_fp8, topk_idx, topk_weights)`` (uniform routing: top-k of ``|randn| + 1``, unit
    weights)."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    if backend == "nccl" and torch.cuda.device_count() < args.num_processes:
        backend = "gloo"  # NCCL refuses two ranks of one communicator on one GPU
    device = dict(device_id=torch.device("cuda", torch.cuda.current_device())) if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.num_processes, **device)
    import deep_ep
    torch.manual_seed(rank)
    n, h, k, e = args.num_tokens, args.hidden, args.num_topk, args.num_experts
    x = torch.randn(n, h, dtype=torch.bfloat16, device="cuda")
    scores = torch.randn(n, e, dtype=torch.float32, device="cuda").abs() + 1
    topk_idx = torch.topk(scores, k, dim=-1, sorted=False).indices.to(deep_ep.topk_idx_t)
    topk_weights = torch.ones(n, k, dtype=torch.float32, device="cuda")
    return dist.group.WORLD, x, per_token_cast_to_fp8(x), topk_idx, topk_weights


def run_rank(rank: int, args, port: int, result_path: str) -> None:
    group, x, x_fp8, topk_idx, topk_weights = init_rank(rank, args, port)
    import deep_ep
    import deep_ep.testing
    buffer = deep_ep.Buffer(group, num_nvl_bytes=args.num_nvl_bytes, explicitly_destroy=True)
    report: dict = {"rank": rank, "backend": type(getattr(buffer, "runtime", None)).__name__, "points": [],
                    "sweep": [], "errors": []}
    # --uncapped: num_sms channels even where the channel cap of this rank count is lower (every call).
    with deep_ep.testing.overrides(uncapped_channels=args.uncapped):
        measure(buffer, rank, args, report, x, x_fp8, topk_idx, topk_weights)
    with open(f"{result_path}.rank{rank}", "w") as f:
        json.dump(report, f)
    buffer.destroy()
    dist.barrier()
    dist.destroy_process_group()


def measure(buffer, rank: int, args, report: dict, x, x_fp8, topk_idx, topk_weights) -> None:
    """Layout, then at every ``--sms``: the dispatch and combine sweeps of ``buffer``; then the NCCL baseline."""
    import deep_ep
    from deep_ep.backends import cuda_tuning
    num_ranks = args.num_processes
    n, h, e = args.num_tokens, args.hidden, args.num_experts
    layout = buffer.get_dispatch_layout(topk_idx, e)
    torch.cuda.synchronize()
    # The first profiler session pays CUPTI's start-up inside the first kernel it sees: spend it on a dummy.
    kernel_time(lambda: torch.ones(1024, device="cuda").sum(), "reduce", num_tests=2)
    iters, profiled = args.iters, min(args.iters, 20)
    layout_t = bench(lambda: buffer.get_dispatch_layout(topk_idx, e), iters, iters)
    report["layout_us"] = layout_t["mean"] * 1e6
    layout_kernel = kernel_time(lambda: buffer.get_dispatch_layout(topk_idx, e), "layout", profiled)
    report["layout_kernel_us"] = layout_kernel * 1e6 if layout_kernel else None

    def safe(label, fn):
        try:
            return fn()
        except Exception:  # noqa: BLE001 - a failing point is reported, the sweep goes on
            report["errors"].append(f"{label}: {traceback.format_exc()}")
            return None

    for num_sms in args.sms:
        base = deep_ep.Config(num_sms, 8, 256)
        # The handle's dispatch receives through the rings: the output pool stays free for the measured calls.
        with deep_ep.testing.overrides(dispatch_receive="rings"):
            first = buffer.dispatch(x, num_tokens_per_rank=layout.num_tokens_per_rank,
                                    is_token_in_rank=layout.is_token_in_rank,
                                    num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=topk_idx,
                                    topk_weights=topk_weights, config=base)
        handle = first.handle
        channels = handle.channel_prefix_matrix.size(1)  # below num_sms where the channel cap applies
        recv_rows = first.recv_x.size(0)
        prefix = handle.rank_prefix_matrix[:, rank].tolist()
        local_rows = prefix[rank] - (prefix[rank - 1] if rank > 0 else 0)
        remote_rows = recv_rows - local_rows
        bf16_bytes = recv_rows * h * 2
        fp8_wire_row = h + 4 * (h // 128)
        variants = tuple(v for v in (("dispatch_fp8", x_fp8, bf16_bytes * FP8_FACTOR, remote_rows * fp8_wire_row),
                                     ("dispatch_bf16", x, bf16_bytes, remote_rows * h * 2)) if v[0] in args.ops)
        for receive, (base_label, cur_x, logical_bytes, remote_bytes) in (
                (r, v) for r in args.receive for v in variants):
            label = base_label + ("" if receive == "rings" else f"_{receive}")
            best = None
            for chunk, warps in ((c, w) for c in args.dispatch_chunks for w in args.dispatch_warps):
                cfg = deep_ep.Config(num_sms, chunk, 256)
                fn = functools.partial(buffer.dispatch, cur_x, handle=handle, config=cfg)
                fields = dict(dispatch_receive=receive, dispatch_warps=warps or None)  # 0: the tuned warps
                t = safe(f"{label} sms={num_sms} chunk={chunk} warps={warps}",
                         functools.partial(under, fields, bench, fn, iters, iters))
                if t is not None:
                    report["sweep"].append([label, num_sms, chunk, warps, t["mean"] * 1e6])
                if t is not None and (best is None or t["mean"] < best[1]["mean"]):
                    best = (chunk, t, fn, warps, fields)
            if best is None:
                continue
            kt = safe(f"{label} kernel time", functools.partial(under, best[4], kernel_time, best[2], "dispatch",
                                                                profiled))
            warps = best[3] or cuda_tuning.intranode_send_warps("dispatch", num_ranks, channels,
                                                                base_label == "dispatch_fp8")
            report["points"].append(_point(label, num_sms, best[0], best[1], kt, logical_bytes, remote_bytes,
                                           warps, channels))
        combine_x = first.recv_x
        runtime = getattr(getattr(buffer, "runtime", None), "runtime", None)
        for mode in args.combine_copy if "combine_bf16" in args.ops else ():
            send = None if mode == "auto" else mode  # None: the library's choice for num_sms
            # The copy-engine path has no sender warps: sweep them only for rings. Labels name the path that ran:
            # combine_bf16 (rings, the Buffer's default), combine_bf16_copy, combine_bf16_rings (asked for rings).
            epoch = runtime.get_copy_epoch() if runtime is not None else 0
            safe(f"combine {mode} probe",
                 functools.partial(under, dict(combine_send=send), buffer.combine, combine_x, handle, config=base))
            by_copy = runtime is not None and runtime.get_copy_epoch() > epoch
            zone = by_copy and (send or cuda_tuning.combine_send_path(num_sms)) == "zone"
            label = ("combine_bf16_zone" if zone else "combine_bf16_copy") if by_copy else \
                "combine_bf16" + ("_rings" if mode == "rings" else "")
            best = None
            # Copy path: the "chunk" swept is the copy-engine chunk in rows (--copy-chunk-rows).
            copy_engine = by_copy and not zone  # zone senders are warps: sweep them like the rings'
            for chunk, warps in ((c, w) for c in (args.copy_chunk_rows if copy_engine else args.combine_chunks)
                                 for w in ([0] if copy_engine else args.combine_warps)):
                cfg = deep_ep.Config(num_sms, 8 if copy_engine else chunk, 256)
                fn = functools.partial(buffer.combine, combine_x, handle, config=cfg)
                fields = dict(combine_send=send, combine_warps=warps or None)  # 0: the tuned warps
                if copy_engine:
                    fields["combine_copy_chunk_rows"] = chunk
                t = safe(f"{label} sms={num_sms} chunk={chunk} warps={warps}",
                         functools.partial(under, fields, bench, fn, iters, iters))
                if t is not None:
                    report["sweep"].append([label, num_sms, chunk, warps, t["mean"] * 1e6])
                if t is not None and (best is None or t["mean"] < best[1]["mean"]):
                    best = (chunk, t, fn, warps, fields)
            if best is not None:
                keyword = "combine_landed" if by_copy else "combine"  # the reducing kernel spans the copies
                kt = safe(f"{label} kernel time", functools.partial(under, best[4], kernel_time, best[2], keyword,
                                                                    profiled))
                if copy_engine:
                    warps, ctas = 0, num_sms
                elif zone:
                    warps, ctas = best[3] or cuda_tuning.zone_send_warps(), cuda_tuning.zone_ctas(num_sms)
                else:
                    warps = best[3] or cuda_tuning.intranode_send_warps("combine", num_ranks, channels)
                    ctas = channels
                report["points"].append(_point(label, num_sms, best[0], best[1], kt, bf16_bytes,
                                               remote_rows * h * 2, warps, ctas))

    # NCCL baseline: index_select by destination + all_to_all_single; back with all_to_all_single + index_add_.
    if "nccl" in args.ops:
        in_rank = layout.is_token_in_rank
        send_counts = in_rank.sum(0).tolist()
        order = torch.cat([in_rank[:, d].nonzero().squeeze(1) for d in range(num_ranks)])
        counts = torch.tensor(send_counts, dtype=torch.int64, device="cuda")
        recv_counts_t = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts_t, counts)
        recv_counts = recv_counts_t.tolist()
        recv_buf = torch.empty(sum(recv_counts), h, dtype=torch.bfloat16, device="cuda")
        back_buf = torch.empty(order.numel(), h, dtype=torch.bfloat16, device="cuda")
        acc = torch.empty(n, h, dtype=torch.float32, device="cuda")

        def nccl_dispatch():
            send = x.index_select(0, order)
            dist.all_to_all_single(recv_buf, send, recv_counts, send_counts)

        def nccl_combine():
            dist.all_to_all_single(back_buf, recv_buf, send_counts, recv_counts)
            acc.zero_()
            acc.index_add_(0, order, back_buf.float())
            return acc.to(torch.bfloat16)

        rows = sum(recv_counts)
        nccl_local = recv_counts[rank]
        for label, fn in (("nccl_dispatch_bf16", nccl_dispatch), ("nccl_combine_bf16", nccl_combine)):
            t = safe(label, functools.partial(bench, fn, iters, iters))
            if t is not None:
                report["points"].append(_point(label, 0, 0, t, None, rows * h * 2, (rows - nccl_local) * h * 2))


def under(fields: dict, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` within ``deep_ep.testing.overrides(**fields)``."""
    import deep_ep.testing
    with deep_ep.testing.overrides(**fields):
        return fn(*args, **kwargs)


def _point(op: str, num_sms: int, chunk: int, t: dict, kernel_s, logical_bytes: float, remote_bytes: float,
           send_warps: int | None = None, channels: int | None = None) -> dict:
    return {"op": op, "num_sms": num_sms, "channels": channels, "chunk": chunk, "send_warps": send_warps,
            "wall_us_mean": t["mean"] * 1e6,
            "wall_us_median": t["median"] * 1e6, "wall_us_min": t["min"] * 1e6,
            "kernel_us": kernel_s * 1e6 if kernel_s else None,
            "logical_GBps": logical_bytes / 1e9 / t["mean"], "remote_GBps": remote_bytes / 1e9 / t["mean"],
            "logical_GBps_kernel": logical_bytes / 1e9 / kernel_s if kernel_s else None}


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------
DEEPEP_V1 = {  # DeepEP V1's intranode test on 2 x H200 (EP2): (op, SMs) -> logical GB/s
    ("dispatch_fp8", 8): 92, ("dispatch_bf16", 8): 120, ("combine_bf16", 8): 116,
    ("dispatch_fp8", 16): 172, ("dispatch_bf16", 16): 233, ("combine_bf16", 16): 218,
    ("dispatch_fp8", 24): 245, ("dispatch_bf16", 24): 338, ("combine_bf16", 24): 300,
    ("dispatch_fp8", 32): 309, ("dispatch_bf16", 32): 394, ("combine_bf16", 32): 367,
    ("dispatch_fp8", 48): 406, ("dispatch_bf16", 48): 502, ("combine_bf16", 48): 451,
}


def spawn_ranks(run_rank, args) -> list[dict]:
    """Run ``run_rank(rank, args, port, args.json)`` in ``args.num_processes`` processes; each writes its report to
    ``<args.json>.rank<r>``, which is read back (rank order) and removed."""
    os.environ.setdefault("DEEP_EP_TIMEOUT_S", "30")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_rank, args=(args, port, args.json), nprocs=args.num_processes)
    reports = []
    for r in range(args.num_processes):
        path = Path(f"{args.json}.rank{r}")
        reports.append(json.loads(path.read_text()))
        path.unlink()
    return reports


def add_workload_args(parser: argparse.ArgumentParser, sms: list[int]) -> None:
    """The workload, buffer and sweep flags shared with bench_internode.py (DeepEP's test defaults)."""
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=256)
    parser.add_argument("--num-nvl-bytes", type=int, default=int(2e9) // 128 * 128)
    parser.add_argument("--sms", type=int, nargs="+", default=sms)
    parser.add_argument("--dispatch-chunks", type=int, nargs="+", default=[8, 16, 24])
    parser.add_argument("--combine-chunks", type=int, nargs="+", default=[4, 8, 16])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser, [8, 16, 24, 32, 48])
    parser.add_argument("--dispatch-warps", type=int, nargs="+", default=[0],
                        help="copy warps per channel to sweep in dispatch; 0: the tuned choice (Buffer's default)")
    parser.add_argument("--combine-warps", type=int, nargs="+", default=[0],
                        help="ring-sender warps per channel (zone: per CTA) to sweep in combine; 0: the tuned "
                             "choice")
    parser.add_argument("--uncapped", action="store_true",
                        help="run num_sms channels even where the channel cap of the rank count is lower")
    parser.add_argument("--combine-copy", nargs="+", default=["auto"], choices=["auto", "copy", "rings", "zone"],
                        help="combine send paths to measure: auto (the Buffer's default; the op names the path "
                             "taken), copy (the copy engine; op combine_bf16_copy), zone (zone senders; op "
                             "combine_bf16_zone), rings (ring-sender warps; op combine_bf16_rings)")
    parser.add_argument("--copy-chunk-rows", nargs="+", type=int, default=[512],
                        help="rows per copy-engine chunk of the copy combine path to sweep")
    parser.add_argument("--receive", nargs="+", default=["rings"], choices=["rings", "direct"],
                        help="dispatch receive paths to measure")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS,
                        help="what to measure (default: all); nccl is the NCCL baseline")
    parser.add_argument("--iters", type=int, default=50,
                        help="warm-up and timed calls per point (DeepEP: 50); profiled calls: min(20, this)")
    parser.add_argument("--json", type=str, default="bench_intranode.json")
    args = parser.parse_args()
    reports = spawn_ranks(run_rank, args)
    summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": torch.cuda.get_device_name(0) + f" x{torch.cuda.device_count()}",
               "torch": torch.__version__, "args": vars(args), "ranks": reports}
    Path(args.json).write_text(json.dumps(summary, indent=1))
    print_table(summary)


def print_table(summary: dict) -> None:
    rep = summary["ranks"][0]
    print(f"\n# {summary['date']}  {summary['machine']}  backend={rep['backend']}  layout {rep['layout_us']:.1f} us"
          f" (kernel {rep.get('layout_kernel_us') or 0:.1f} us)")
    print(f"{'op':<20}{'SMs':>5}{'ch':>4}{'chunk':>6}{'warps':>6}{'wall us':>10}{'kern us':>10}{'GB/s':>9}"
          f"{'GB/s kern':>10}{'remote':>8}{'DeepEP':>8}{'ratio':>7}")
    for p in rep["points"]:
        ref = DEEPEP_V1.get((p["op"].replace("_direct", "").replace("_rings", "")
                             .replace("_copy", "").replace("_zone", ""), p["num_sms"]))
        kern = f"{p['kernel_us']:.1f}" if p["kernel_us"] else "-"
        kern_bw = f"{p['logical_GBps_kernel']:.0f}" if p["logical_GBps_kernel"] else "-"
        print(f"{p['op']:<20}{p['num_sms']:>5}{p.get('channels') or '-':>4}{p['chunk']:>6}"
              f"{p.get('send_warps') or '-':>6}{p['wall_us_mean']:>10.1f}{kern:>10}"
              f"{p['logical_GBps']:>9.0f}{kern_bw:>10}{p['remote_GBps']:>8.0f}{ref or '-':>8}"
              f"{(p['logical_GBps'] / ref if ref else 0):>7.2f}")
    for op, sms, chunk, warps, us in rep.get("sweep", []):
        print(f"  sweep {op:<16} sms={sms:<3} chunk={chunk:<3} warps={warps:<3} {us:8.1f} us")
    for r in summary["ranks"]:
        for err in r["errors"]:
            print(f"rank {r['rank']} ERROR {err.splitlines()[0]} ... {err.splitlines()[-1]}")


if __name__ == "__main__":
    main()
