"""Low-latency benchmark of deep_ep's CUDA LL kernels (NVSHMEM), measured the way DeepEP V1's test_low_latency.py does.

Workload: ``T`` tokens per rank (``--tokens``; 128 is the bar), hidden 7168, top-8 of 288 experts
(``topk(|randn| + 1)``), ``x = randn * 0.1`` BF16, FP8 dispatch, BF16 combine, one process per GPU. Before each
profiled iteration the ranks meet in a bounded LL barrier kernel, the GPUs sleep ~300 us and the L2 is flushed.
Reported: kernel time (mean duration of ``dispatch_kernel`` / ``combine_kernel`` in a profiler trace; with
``return_recv_hook`` the send and receive launches apart, told by their order); the same by DeepEP's own method (an
8192^2 matmul and a barrier, then 30 dispatch + combine pairs back to back, no flush); wall time (median of CUDA-event
intervals, with barrier and flush, and back to back); bytes as DeepEP counts them (FP8 dispatch
``(#valid k) * (H + H/128*4 + 16)``, BF16 combine ``(#valid k) * 2H``). ``--put`` builds the Buffer under
``deep_ep.testing.overrides(ll_put_only=True)``: every other rank reached by NVSHMEM put-with-signal (the path of
peers behind a NIC)::

    python benchmarks/bench_low_latency.py --num-processes 2 --json out/ll.json
"""
from __future__ import annotations

import argparse
import datetime
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


# The LL kernels' instantiations: the fused launch, and the split launches (send, receive) of a hooked call.
FUSED = {"dispatch": "ll::dispatch_kernel<true>", "combine": "ll::combine_kernel<true>"}
SPLIT = {"dispatch": "ll::dispatch_kernel<false>", "combine": "ll::combine_kernel<false>"}


def spellings(pattern: str) -> list[str]:
    """``pattern`` demangled ("ll::dispatch_kernel<true>") and as the profiler may show it mangled
    ("2ll15dispatch_kernelILb1EE")."""
    out = [pattern]
    if "<" in pattern:
        name, arg = pattern.rstrip(">").split("<")
        space, _, function = name.rpartition("::")
        mangled_arg = {"true": "Lb1E", "false": "Lb0E"}.get(arg, f"Li{arg}E")
        out.append(f"{len(space)}{space}{len(function)}{function}I{mangled_arg}")
    return out


def kernel_times(trace, names: dict) -> dict:
    """Mean device time (s) per kernel of a finished torch.profiler session, keyed like ``names`` (a substring or a
    tuple of them, any of which matches)."""
    events = trace.key_averages()
    out = {}
    for key, patterns in names.items():
        patterns = (patterns,) if isinstance(patterns, str) else patterns
        matches = [s for pattern in patterns for s in spellings(pattern)]
        hits = [e for e in events if any(p in e.key for p in matches)]
        count = sum(e.count for e in hits)
        out[key] = sum(e.device_time_total for e in hits) / count / 1e6 if count else float("nan")
    return out


def split_phase_times(trace) -> dict:
    """Mean device time (s) of the send and receive launches of hooked dispatches and combines: each hooked call
    launches its kernel twice, send then receive, so in launch order the launches alternate."""
    out = {}
    kernels = [e for e in trace.events() if e.device_type.name == "CUDA"]
    for op, pattern in SPLIT.items():
        matches = spellings(pattern)
        launches = sorted((e for e in kernels if any(p in e.name for p in matches)), key=lambda e: e.time_range.start)
        for phase, chosen in (("send", launches[0::2]), ("recv", launches[1::2])):
            total = sum(e.time_range.elapsed_us() for e in chosen)
            out[f"{op}_{phase}"] = total / len(chosen) / 1e6 if chosen else float("nan")
    return out


def measure_point(rank: int, world: int, args, buf, tokens: int, flush: torch.Tensor) -> dict:
    """Kernel, phase, DeepEP-method and wall times of ``tokens`` tokens per rank on the LL Buffer ``buf``."""
    import deep_ep
    ll = buf._cuda_ll
    hidden, experts, topk = args.hidden, args.num_experts, args.num_topk
    host_lead_cycles = 600_000  # ~300 us at 2 GHz
    # The buffer's token capacity: R * capacity must be a multiple of 4 (DeepEP's rule); x has `tokens` rows.
    capacity = tokens
    while (world * capacity) % 4:
        capacity += 1
    buf.clean_low_latency_buffer(capacity, hidden, experts)
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    x = (torch.randn(tokens, hidden, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    scores = torch.randn(tokens, experts, device="cuda", generator=gen).abs() + 1
    idx = scores.topk(topk, dim=1).indices.to(deep_ep.topk_idx_t)
    weights = torch.rand(tokens, topk, device="cuda", generator=gen)
    valid = int((idx >= 0).sum())
    dispatch_bytes = valid * (hidden + hidden // 128 * 4 + 16)
    combine_bytes = valid * hidden * 2
    state = {}

    def dispatch(hook=False):
        state["d"] = buf.low_latency_dispatch(x, idx, capacity, experts, use_fp8=True,
                                              return_recv_hook=hook)
        return state["d"]

    def combine(hook=False):
        d = state["d"]
        y = state.get("y")
        if y is None or y.shape[1] != d.recv_x[0].shape[1]:
            y = state["y"] = torch.randn(d.recv_x[0].shape, device="cuda").to(torch.bfloat16) * 0.1
        return buf.low_latency_combine(y, idx, weights, d.handle, return_recv_hook=hook)

    def sync_ranks():
        # The barrier aligns the GPUs; the sleep keeps them busy until both hosts have enqueued the next
        # calls (otherwise a kernel starts when its host gets there and waits for the later peer).
        ll.runtime.barrier(torch.cuda.current_stream().cuda_stream)
        torch.cuda._sleep(host_lead_cycles)
        flush.zero_()

    for _ in range(args.warmups):
        dispatch()
        combine()
    torch.cuda.synchronize()
    # Wall time: events around each call.
    wall = {"dispatch": [], "combine": []}
    for _ in range(args.iters):
        sync_ranks()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        dispatch()
        ev[1].record()
        combine()
        ev[2].record()
        torch.cuda.synchronize()
        wall["dispatch"].append(ev[0].elapsed_time(ev[1]) / 1e3)
        wall["combine"].append(ev[1].elapsed_time(ev[2]) / 1e3)
    # Back-to-back wall time: calls enqueued one after another (no barrier, no flush), as a training step
    # issues them; events around each call.
    piped = {"dispatch": [], "combine": []}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3 * args.iters)]
    sync_ranks()
    for i in range(args.iters):
        ev[3 * i].record()
        dispatch()
        ev[3 * i + 1].record()
        combine()
        ev[3 * i + 2].record()
    torch.cuda.synchronize()
    for i in range(1, args.iters):
        piped["dispatch"].append(ev[3 * i].elapsed_time(ev[3 * i + 1]) / 1e3)
        piped["combine"].append(ev[3 * i + 1].elapsed_time(ev[3 * i + 2]) / 1e3)
    # Kernel time: profiler, no hook.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
        for _ in range(args.iters):
            sync_ranks()
            dispatch()
            combine()
        torch.cuda.synchronize()
    fused = kernel_times(trace, FUSED)
    # Send / receive phases with hooks (a matmul between send and hook, as DeepEP imitates overlap).
    big = torch.randn(4096, 4096, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
        for _ in range(args.iters):
            sync_ranks()
            d = dispatch(hook=True)
            big @ big
            d.hook()
            c = combine(hook=True)
            big @ big
            c.hook()
        torch.cuda.synchronize()
    phases = split_phase_times(trace)
    # DeepEP's own method (bench_kineto with barrier_comm_profiling): per profiled
    # step an 8192^2 fp32 matmul and a GPU barrier line the ranks up, then 30 dispatch + combine pairs run
    # back to back with no flush; the kernels' mean duration. Once more with hooks (a matmul before each
    # hook) for the send / receive phases.
    lhs = torch.randn(8192, 8192, device="cuda")

    def deepep_step(hook: bool) -> None:
        lhs @ lhs
        ll.runtime.barrier(torch.cuda.current_stream().cuda_stream)
        for _ in range(30):
            d = dispatch(hook=hook)
            if hook:
                big @ big
                d.hook()
            c = combine(hook=hook)
            if hook:
                big @ big
                c.hook()
        torch.cuda.synchronize()

    deepep = {}
    for hook in (False, True):
        deepep_step(hook)  # DeepEP's profiler schedule records the second of two steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
            deepep_step(hook)
        deepep.update(split_phase_times(trace) if hook else kernel_times(trace, FUSED))
    return {"tokens": tokens, "dispatch_bytes": dispatch_bytes, "combine_bytes": combine_bytes,
            "kernel_s": fused, "phases_s": phases, "deepep_method_s": deepep,
            "wall_s": {k: statistics.median(v) for k, v in wall.items()},
            "wall_back_to_back_s": {k: statistics.median(v) for k, v in piped.items()},
            "dispatch_GBps": dispatch_bytes / fused["dispatch"] / 1e9,
            "combine_GBps": combine_bytes / fused["combine"] / 1e9}


def run_rank(rank: int, world: int, port: int, args, results) -> None:
    try:
        torch.cuda.set_device(rank % torch.cuda.device_count())  # ranks may share a GPU (MPS)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        import deep_ep
        import deep_ep.testing
        hidden, experts = args.hidden, args.num_experts
        sweep = [int(t) for t in args.tokens.split(",")]
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(max(sweep), hidden, world, experts)
        with deep_ep.testing.overrides(ll_put_only=args.put):
            buf = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=rdma, low_latency_mode=True,
                                 num_qps_per_rank=experts // world, explicitly_destroy=True)
        assert buf._cuda_ll is not None, "the CUDA low-latency backend is not in use"
        flush = torch.empty(int(256e6 // 4), dtype=torch.int32, device="cuda")
        points = []
        for tokens in sweep:
            points.append(measure_point(rank, world, args, buf, tokens, flush))
            buf._cuda_ll.check_errors()
        buf.destroy()
        dist.destroy_process_group()
        results.put((rank, "ok", points))
    except Exception:  # noqa: BLE001 - reported to the driver
        results.put((rank, "error", traceback.format_exc()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", type=int, default=2)
    # DeepEP requires num_ranks * tokens % 4 == 0, so the EP2 sweep starts at 2.
    parser.add_argument("--tokens", default="2,4,8,16,32,64,128,256")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=288)
    parser.add_argument("--warmups", type=int, default=20)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--put", action="store_true",
                        help="every other rank reached by NVSHMEM puts (the RDMA path) even where NVLink reaches it")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=run_rank, args=(r, args.num_processes, port, args, results))
             for r in range(args.num_processes)]
    for p in procs:
        p.start()
    replies = []
    for _ in procs:  # an error is printed when it arrives: a peer left waiting may never answer
        replies.append(results.get(timeout=900))
        if replies[-1][1] != "ok":
            print(f"rank {replies[-1][0]}: {replies[-1][2]}", file=sys.stderr, flush=True)
    replies.sort()
    for p in procs:
        p.join(timeout=60)
    if any(status != "ok" for _, status, _ in replies):
        sys.exit(1)
    per_rank = [msg for _, _, msg in replies]
    print(f"{'T':>5} {'disp us':>8} {'comb us':>8} {'disp GB/s':>9} {'comb GB/s':>9} {'wall d':>7} {'wall c':>7} "
          f"{'d send':>7} {'d recv':>7} {'c send':>7} {'c recv':>7}   (rank-averaged)")
    summary = []
    for i, point in enumerate(per_rank[0]):
        ranks = [pr[i] for pr in per_rank]

        def avg(get, ranks=ranks):
            return statistics.fmean(get(r) for r in ranks)

        row = {"tokens": point["tokens"],
               "dispatch_us": avg(lambda r: r["kernel_s"]["dispatch"]) * 1e6,
               "combine_us": avg(lambda r: r["kernel_s"]["combine"]) * 1e6,
               "dispatch_GBps": avg(lambda r: r["dispatch_GBps"]), "combine_GBps": avg(lambda r: r["combine_GBps"]),
               "wall_dispatch_us": avg(lambda r: r["wall_s"]["dispatch"]) * 1e6,
               "wall_combine_us": avg(lambda r: r["wall_s"]["combine"]) * 1e6,
               "wall_b2b_dispatch_us": avg(lambda r: r["wall_back_to_back_s"]["dispatch"]) * 1e6,
               "wall_b2b_combine_us": avg(lambda r: r["wall_back_to_back_s"]["combine"]) * 1e6,
               **{f"{k}_us": avg(lambda r, k=k: r["phases_s"][k]) * 1e6 for k in point["phases_s"]},
               **{f"deepep_{k}_us": avg(lambda r, k=k: r["deepep_method_s"][k]) * 1e6
                  for k in point["deepep_method_s"]}}
        summary.append(row)
        print(f"{row['tokens']:>5} {row['dispatch_us']:>8.1f} {row['combine_us']:>8.1f} {row['dispatch_GBps']:>9.1f} "
              f"{row['combine_GBps']:>9.1f} {row['wall_dispatch_us']:>7.1f} {row['wall_combine_us']:>7.1f} "
              f"{row['dispatch_send_us']:>7.1f} {row['dispatch_recv_us']:>7.1f} {row['combine_send_us']:>7.1f} "
              f"{row['combine_recv_us']:>7.1f}")
    print("DeepEP's method (matmul + barrier, then 30 pairs back to back, no flush), rank-averaged kernel us:")
    print(f"{'T':>5} {'disp us':>8} {'comb us':>8} {'d send':>7} {'d recv':>7} {'c send':>7} {'c recv':>7}")
    for row in summary:
        print(f"{row['tokens']:>5} {row['deepep_dispatch_us']:>8.1f} {row['deepep_combine_us']:>8.1f} "
              f"{row['deepep_dispatch_send_us']:>7.1f} {row['deepep_dispatch_recv_us']:>7.1f} "
              f"{row['deepep_combine_send_us']:>7.1f} {row['deepep_combine_recv_us']:>7.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": socket.gethostname(),
            "gpu": torch.cuda.get_device_name(0), "args": vars(args), "summary": summary, "per_rank": per_rank,
        }, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("DEEP_EP_TIMEOUT_S", "30")
    main()
