"""Soak: two ranks time-sliced on one GPU run a long mixed sequence of calls, every result checked against
``reference``, and neither device nor host memory grows.

Opt-in (skipped unless ``TEST_SOAK_ITERS`` is a positive count, and without CUDA)::

    TEST_SOAK_ITERS=2000 python -m pytest -s tests/gpu/test_soak.py -k gpu

Iteration ``i`` runs step ``STEPS[i % len(STEPS)]`` (normal dispatch/combine in BF16 and in FP8, a cached dispatch,
low-latency dispatch/combine without a hook, with hooks in FP8, and with a zero-copy combine) on small inputs drawn
from ``(seed, i)``, compared bit for bit with the reference; after each iteration the ranks agree on whether all
passed, so a mismatch stops every rank at once with the iteration, step and tensor named. After ``warmup``
iterations ``torch.cuda.memory_allocated()`` and the resident set size are sampled, and again at the end: growth
beyond ``MAX_DEVICE_GROWTH`` / ``MAX_HOST_GROWTH`` fails. Each rank prints a summary line. The CPU tests below run
the same loop on the torch backend and show that an injected mismatch and an injected leak both fail it.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import asdict, dataclass
from typing import Optional

import dist
import pytest

torch = pytest.importorskip("torch")

STEPS = ("normal_bf16", "normal_fp8", "cached", "ll", "ll_hook_fp8", "ll_zero_copy")
NORMAL_MAX_TOKENS, NORMAL_HIDDEN = 48, 256
LL_TOKENS, LL_HIDDEN = 32, 1024  # LL: T (max tokens per rank) and H (the CUDA LL kernels take H >= 1024)
NUM_LOCAL_EXPERTS, NUM_TOPK = 4, 3
NUM_NVL_BYTES = 128 << 20
# Allowed growth between the post-warm-up sample and the end.
MAX_DEVICE_GROWTH = 1 << 20
MAX_HOST_GROWTH = 64 << 20
SOAK_ITERS = int(os.environ.get("TEST_SOAK_ITERS", "0") or 0)
# How the pool's workers (``tests/`` on their path) import this file.
WORKER_MODULE = "gpu.test_soak"


@dataclass(frozen=True)
class SoakCase:
    iters: int
    seed: int
    warmup: int
    device: str  # "cuda" (all ranks on GPU 0) or "cpu" (the torch backend)
    corrupt_at: int = -1  # iteration whose first non-empty comparison gets one flipped bit (-1: none)
    leak_bytes: int = 0  # bytes kept alive per iteration (a deliberate leak)

    def fields(self) -> dict:
        return asdict(self)


class _Checker:
    """Bitwise comparisons; ``corrupt`` flips one bit of the next non-empty result (the self-test of the check)."""

    def __init__(self) -> None:
        self.corrupt = False

    def eq(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        got, want = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
        if self.corrupt and got.numel() > 0:
            got = got.clone()
            got.view(-1).view(torch.uint8)[0] ^= 1
            self.corrupt = False
        if got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(f"{name}: shape/dtype {tuple(got.shape)} {got.dtype} != "
                                 f"{tuple(want.shape)} {want.dtype}")
        if got.numel() == 0:
            return
        rows_got = got.reshape(got.size(0) if got.dim() else 1, -1).view(torch.uint8)
        rows_want = want.reshape(rows_got.size(0), -1).view(torch.uint8)
        if not torch.equal(rows_got, rows_want):
            bad = (rows_got != rows_want).any(dim=1)
            raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} rows differ from the reference, "
                                 f"first rows {bad.nonzero().view(-1)[:5].tolist()}")

    def same(self, name: str, got, want) -> None:
        if list(got) != list(want):
            raise AssertionError(f"{name}: {list(got)} != reference {list(want)}")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS missing from /proc/self/status")


def _inputs(case: SoakCase, i: int, world: int, num_tokens_max: int, hidden: int) -> list[dict]:
    """Every rank's inputs of iteration ``i``: integer-valued BF16 x, distinct top-k experts with -1 holes, weights."""
    import deep_ep
    gen = torch.Generator().manual_seed(case.seed * 1_000_003 + i)
    num_experts = NUM_LOCAL_EXPERTS * world
    out = []
    for _ in range(world):
        n = int(torch.randint(0, num_tokens_max + 1, (1,), generator=gen))
        x = torch.randint(-8, 9, (n, hidden), generator=gen).to(torch.bfloat16)
        idx = torch.rand(n, num_experts, generator=gen).argsort(dim=1)[:, :NUM_TOPK]
        idx[torch.rand(n, NUM_TOPK, generator=gen) < 0.1] = -1
        w = torch.rand(n, NUM_TOPK, generator=gen, dtype=torch.float32)
        out.append({"x": x, "topk_idx": idx.to(deep_ep.topk_idx_t).contiguous(), "topk_weights": w})
    return out


def _to(obj, device: str):
    return tuple(o.to(device) for o in obj) if isinstance(obj, tuple) else obj.to(device)


def _normal_step(buffer, rank: int, world: int, case: SoakCase, i: int, use_fp8: bool, cached: bool,
                 check: _Checker) -> None:
    """Layout + dispatch (+ cached dispatch) + combine, all compared with the reference."""
    import deep_ep
    import reference
    from deep_ep.config import Topology
    dev, num_experts = case.device, NUM_LOCAL_EXPERTS * world
    topo = Topology(world, world)
    inputs = _inputs(case, i, world, NORMAL_MAX_TOKENS, NORMAL_HIDDEN)
    xs = [deep_ep.per_token_cast_to_fp8(inp["x"]) if use_fp8 else inp["x"] for inp in inputs]
    with_topk = not cached
    mine = inputs[rank]
    idx = mine["topk_idx"].to(dev)
    layout = buffer.get_dispatch_layout(idx, num_experts)
    kwargs = dict(num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                  num_tokens_per_expert=layout.num_tokens_per_expert)
    if with_topk:
        kwargs.update(topk_idx=idx, topk_weights=mine["topk_weights"].to(dev))
    x = _to(xs[rank], dev)
    out = buffer.dispatch(x, **kwargs)
    layouts = [reference.get_dispatch_layout(inp["topk_idx"], num_experts, topo) for inp in inputs]
    ref_kwargs = dict(topk_idx=[inp["topk_idx"] for inp in inputs],
                      topk_weights=[inp["topk_weights"] for inp in inputs]) if with_topk else {}
    refs = reference.dispatch(xs, [lay.is_token_in_rank for lay in layouts], topo, num_experts=num_experts,
                              num_channels=out.handle.channel_prefix_matrix.size(1), **ref_kwargs)
    ref = refs[rank]
    check.eq("is_token_in_rank", layout.is_token_in_rank, layouts[rank].is_token_in_rank)
    if use_fp8:
        check.eq("recv_x fp8", out.recv_x[0], ref.recv_x[0])
        check.eq("recv_x scales", out.recv_x[1].contiguous(), ref.recv_x[1].contiguous())
    else:
        check.eq("recv_x", out.recv_x, ref.recv_x)
    if with_topk:
        check.eq("recv_topk_idx", out.recv_topk_idx, ref.recv_topk_idx)
        check.eq("recv_topk_weights", out.recv_topk_weights, ref.recv_topk_weights)
        check.same("num_recv_tokens_per_expert_list", out.num_recv_tokens_per_expert_list,
                   ref.num_recv_tokens_per_expert_list)
    if cached:
        again = buffer.dispatch(x, handle=out.handle)
        check.eq("cached recv_x", again.recv_x, ref.recv_x)
    gen = torch.Generator().manual_seed(case.seed * 7 + i)
    ys = [torch.randint(-8, 9, (r.handle.recv_src_idx.size(0), NORMAL_HIDDEN), generator=gen).to(torch.bfloat16)
          for r in refs]
    comb_kwargs = dict(topk_weights=out.recv_topk_weights) if with_topk else {}
    comb = buffer.combine(ys[rank].to(dev), out.handle, **comb_kwargs)
    ref_comb = reference.combine(ys, [r.handle for r in refs], topo,
                                 **(dict(topk_weights=[r.recv_topk_weights for r in refs]) if with_topk else {}))
    check.eq("combined_x", comb.combined_x, ref_comb[rank][0])
    if with_topk:
        check.eq("combined_topk_weights", comb.combined_topk_weights, ref_comb[rank][1])


def _ll_step(buffer, rank: int, world: int, case: SoakCase, i: int, use_fp8: bool, hook: bool, zero_copy: bool,
             check: _Checker) -> None:
    """Low-latency dispatch + combine (hooks or events; copy or zero-copy combine), compared with the reference."""
    from gpu.test_low_latency import expert_output  # the toy expert of the LL tests: dequantised input x 1.5

    import reference
    dev, num_experts = case.device, NUM_LOCAL_EXPERTS * world
    inputs = _inputs(case, i, world, LL_TOKENS, LL_HIDDEN)
    mine = {k: v.to(dev) for k, v in inputs[rank].items()}
    res = buffer.low_latency_dispatch(mine["x"], mine["topk_idx"], LL_TOKENS, num_experts, use_fp8=use_fp8,
                                      async_finish=not hook, return_recv_hook=hook)
    res.hook() if hook else res.event.current_stream_wait()
    refs = reference.low_latency_dispatch([inp["x"] for inp in inputs], [inp["topk_idx"] for inp in inputs],
                                          LL_TOKENS, num_experts, use_fp8=use_fp8)
    ref = refs[rank]
    check.eq("packed_recv_count", res.packed_recv_count, ref.packed_recv_count)
    for j in range(NUM_LOCAL_EXPERTS):
        n = int(ref.packed_recv_count[j])
        check.eq(f"src_info[{j}]", res.handle.packed_recv_src_info[j, :n], ref.handle.packed_recv_src_info[j, :n])
        if use_fp8:
            check.eq(f"recv_x fp8[{j}]", res.recv_x[0][j, :n], ref.recv_x[0][j, :n])
            check.eq(f"recv_x scales[{j}]", res.recv_x[1][j, :n], ref.recv_x[1][j, :n])
        else:
            check.eq(f"recv_x[{j}]", res.recv_x[j, :n], ref.recv_x[j, :n])
    y = expert_output(res.recv_x, use_fp8)
    if zero_copy:
        buffer.get_next_low_latency_combine_buffer(res.handle)[:, :, :] = y
    comb = buffer.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], res.handle, zero_copy=zero_copy,
                                      async_finish=not hook, return_recv_hook=hook)
    comb.hook() if hook else comb.event.current_stream_wait()
    ys = [expert_output(r.recv_x, use_fp8) for r in refs]
    want = reference.low_latency_combine(ys, [inp["topk_idx"] for inp in inputs],
                                         [inp["topk_weights"] for inp in inputs], [r.handle for r in refs])[rank]
    check.eq("ll combined_x", comb.combined_x, want)


def _step(name: str, buffer, rank: int, world: int, case: SoakCase, i: int, check: _Checker) -> None:
    if name.startswith("ll"):
        _ll_step(buffer, rank, world, case, i, use_fp8=name == "ll_hook_fp8", hook=name == "ll_hook_fp8",
                 zero_copy=name == "ll_zero_copy", check=check)
    else:
        _normal_step(buffer, rank, world, case, i, use_fp8=name == "normal_fp8", cached=name == "cached",
                     check=check)


def _sample(device: str) -> tuple[int, int]:
    """(device bytes allocated, host resident bytes) with nothing of the loop alive."""
    gc.collect()
    allocated = 0
    if device == "cuda":
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
    return allocated, _rss_bytes()


def run_soak(ctx: dist.WorkerContext, fields: dict) -> Optional[str]:
    """Worker side: the iterations of ``SoakCase(**fields)`` on one Buffer; None when every check passed. (The case
    travels as a dict: the workers import this file under another module name.)"""
    import torch.distributed as tdist

    import deep_ep
    case = SoakCase(**fields)
    rank, world = ctx.rank, ctx.world_size
    if case.device == "cuda":
        torch.cuda.set_device(0)  # every rank on GPU 0: the ranks time-slice it
    num_experts = NUM_LOCAL_EXPERTS * world
    buffer = ctx.cache.get(("soak", case.device))
    if buffer is None:
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, LL_HIDDEN, world, num_experts)
        buffer = deep_ep.Buffer(ctx.group, num_nvl_bytes=NUM_NVL_BYTES, num_rdma_bytes=rdma, low_latency_mode=True,
                                num_qps_per_rank=NUM_LOCAL_EXPERTS)
        if case.device == "cuda":
            served = (type(buffer.runtime).__name__, type(buffer._cuda_ll).__name__)
            if served != ("CudaBackend", "LowLatencyCuda"):
                return f"rank {rank}: the Buffer is not served by the CUDA kernels: {served}"
        ctx.cache[("soak", case.device)] = buffer
    check, leaked, counts = _Checker(), [], dict.fromkeys(STEPS, 0)
    baseline: Optional[tuple[int, int]] = None
    needs_clean = True  # the LL signal areas must be cleaned after normal-mode use
    start = time.monotonic()
    for i in range(case.iters):
        name = STEPS[i % len(STEPS)]
        error = None
        try:
            if name.startswith("ll") and needs_clean:
                buffer.clean_low_latency_buffer(LL_TOKENS, LL_HIDDEN, num_experts)
            needs_clean = not name.startswith("ll")
            check.corrupt = check.corrupt or i == case.corrupt_at
            _step(name, buffer, rank, world, case, i, check)
            counts[name] += 1
            if case.leak_bytes and i >= case.warmup:
                leaked.append(torch.ones(case.leak_bytes, dtype=torch.uint8, device=case.device))
        except Exception as exc:  # noqa: BLE001 - a mismatch or a failed call: reported with the iteration
            error = f"soak iteration {i} ({name}, seed {case.seed}) on rank {rank}: {type(exc).__name__}: {exc}"
        # Every rank learns whether any rank failed, so all stop at the same iteration (no peer waits it out).
        failed = torch.tensor([int(error is not None)])
        tdist.all_reduce(failed, group=ctx.group)
        if error is not None:
            return error
        if int(failed) != 0:
            return f"soak iteration {i} ({name}) on rank {rank}: passed here, failed on another rank"
        if i + 1 == case.warmup:
            baseline = _sample(case.device)
    elapsed = time.monotonic() - start
    if baseline is None:
        return f"rank {rank}: warmup {case.warmup} must be in [1, iters={case.iters}]"
    end = _sample(case.device)
    device_growth, host_growth = end[0] - baseline[0], end[1] - baseline[1]
    print(f"soak rank {rank}: {case.iters} iterations {counts} in {elapsed:.1f} s "
          f"({1e3 * elapsed / case.iters:.1f} ms each); device allocated {baseline[0]} -> {end[0]} B "
          f"({device_growth:+d}); host RSS {baseline[1] >> 20} -> {end[1] >> 20} MiB ({host_growth / 2**20:+.1f})",
          flush=True)
    problems = []
    if device_growth > MAX_DEVICE_GROWTH:
        problems.append(f"device memory grew by {device_growth} B (bound {MAX_DEVICE_GROWTH} B)")
    if host_growth > MAX_HOST_GROWTH:
        problems.append(f"host memory grew by {host_growth / 2**20:.1f} MiB (bound {MAX_HOST_GROWTH >> 20} MiB)")
    if problems:
        return (f"rank {rank}: after {case.iters - case.warmup} iterations past the warm-up: " + "; ".join(problems))
    return None


# ----------------------------------------------------------------------------------------------------------------
# The soak (GPU, opt-in)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.skipif(SOAK_ITERS <= 0, reason="opt-in: set TEST_SOAK_ITERS (e.g. 2000)")
def test_soak_two_ranks_one_gpu(pools):
    case = SoakCase(iters=SOAK_ITERS, seed=int(os.environ.get("TEST_SOAK_SEED", "1")),
                    warmup=max(1, min(SOAK_ITERS // 10, 100)), device="cuda")
    pools.get(2, {"DEEP_EP_BACKEND": "cuda"}).check(WORKER_MODULE, "run_soak", case.fields(), timeout_s=840)


# ----------------------------------------------------------------------------------------------------------------
# The same loop on the CPU (torch backend): it passes, and it fails on a mismatch and on a leak
# ----------------------------------------------------------------------------------------------------------------
CPU_ITERS, CPU_WARMUP = 2 * len(STEPS), len(STEPS)


def test_soak_loop_passes_on_cpu(pools):
    case = SoakCase(iters=CPU_ITERS, seed=3, warmup=CPU_WARMUP, device="cpu")
    pools.get(2).check(WORKER_MODULE, "run_soak", case.fields())


def test_soak_loop_reports_a_mismatch(pools):
    corrupt_at = len(STEPS) + 2  # a cached-dispatch iteration past the warm-up
    reports = pools.get(2).run(WORKER_MODULE, "run_soak",
                               SoakCase(iters=CPU_ITERS, seed=3, warmup=CPU_WARMUP, device="cpu",
                                        corrupt_at=corrupt_at).fields())
    for rank, message in reports.items():
        assert message is not None and f"soak iteration {corrupt_at} (cached" in message, (rank, message)
        assert "differ from the reference" in message, (rank, message)


def test_soak_loop_reports_a_leak(pools):
    reports = pools.get(2).run(WORKER_MODULE, "run_soak",
                               SoakCase(iters=CPU_ITERS, seed=4, warmup=CPU_WARMUP, device="cpu",
                                        leak_bytes=(MAX_HOST_GROWTH // CPU_WARMUP) * 2).fields())
    for rank, message in reports.items():
        assert message is not None and "host memory grew" in message, (rank, message)
