"""Buffer-half reuse of the CUDA low-latency kernels under real concurrency: two ranks issue rounds of LL calls back
to back (no host synchronisation) and every result is compared bit for bit with ``reference`` at the end.

Call ``k`` of a rank writes into the half its peer's call ``k - 2`` used. Rank 1 lags (a GPU sleep after each
dispatch's send), in one of four ways (``lag``): ``hook`` (the hook after the sleep), ``fused`` (no hooks: the next
launch, which releases the half, starts late), ``mixed`` (an asynchronous dispatch, then a hooked one issued while
the fused launch before it may still run) and ``overlap`` (every call hooked; where the next call of the round does
not read the outputs, the hook runs after that call's send and releases its half itself).
In every other round rank 0's combine needs nothing from rank 1, so only the kernels' ordering (a send waits for the
peers' release of the half) keeps it from overwriting what rank 1 has still to read. Rounds mix dispatch-combine,
dispatch-dispatch-combine and dispatch-combine-combine, with 0 to ``T`` tokens; ``second_buffer`` alternates the
rounds between two LL Buffers of the same ranks in each process (the second joins the process's NVSHMEM world).

Two ranks on one GPU, time-sliced (under a minute; ``TEST_LL_REUSE_ROUNDS`` rounds, 24 by default; with two GPUs the
ranks get one each; the low-latency kernels do not complete under MPS, see docs/build.md)::

    python -m pytest -q tests/gpu/test_ll_reuse.py
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Optional

import pytest

torch = pytest.importorskip("torch")

WORKER_MODULE = "gpu.test_ll_reuse"
ROUNDS = int(os.environ.get("TEST_LL_REUSE_ROUNDS", "24") or 24)
T, H, NUM_LOCAL, NUM_TOPK = 32, 2048, 4, 3
# GPU cycles rank 1 sleeps after a dispatch's send (about 10 ms at H200 clocks): long next to a call, short next to
# the kernels' wait budget.
LAG_CYCLES = 20_000_000
PATTERNS = ("DC", "DDC", "DCC")


@dataclass(frozen=True)
class ReuseCase:
    rounds: int
    seed: int
    device: str = "cuda"  # "cuda": the CUDA kernels; "cpu": the torch backend (the check of the loop itself)
    corrupt_round: int = -1  # round whose first combine result gets one value changed before the check (-1: none)
    lag: str = "hook"  # how rank 1 lags (module docstring)
    second_buffer: bool = False

    def describe(self) -> str:
        return f"ReuseCase({asdict(self)})"


def round_inputs(seed: int, r: int, world: int) -> list[dict]:
    """CPU inputs of every rank for round ``r``: BF16 rows, distinct top-k experts with -1 holes, weights. In odd
    rounds rank 0 routes only to its own experts (its combine then waits for no peer); token counts 0..T."""
    import deep_ep
    experts = NUM_LOCAL * world
    out = []
    for rank in range(world):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + r * 101 + rank)
        n = int(torch.randint(0, T + 1, (1,), generator=gen))
        if r % 4 == 1 and rank == 0:
            n = 0
        x = (torch.randn(n, H, generator=gen) * 3).to(torch.bfloat16)
        pool = NUM_LOCAL if (r % 2 == 1 and rank == 0) else experts
        topk = torch.rand(n, pool, generator=gen).argsort(1)[:, :NUM_TOPK] if n else torch.empty(0, NUM_TOPK)
        topk = topk.to(torch.int64).contiguous()
        topk[torch.rand(n, NUM_TOPK, generator=gen) < 0.2] = -1
        weights = torch.rand(n, NUM_TOPK, generator=gen, dtype=torch.float32)
        out.append({"x": x, "topk_idx": topk.to(deep_ep.topk_idx_t), "topk_weights": weights})
    return out


def _expert(recv_x: "torch.Tensor") -> "torch.Tensor":
    """A toy expert, exact in BF16: the received rows times 1.5."""
    return (recv_x.float() * 1.5).to(torch.bfloat16).contiguous()


def _compare(name: str, got: "torch.Tensor", want: "torch.Tensor") -> Optional[str]:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.equal(got, want):
        first = (got != want).nonzero()[:3].tolist()
        return f"{name}: differs from the reference (first at {first})"
    return None


def run_reuse(ctx, fields: dict) -> Optional[str]:
    """Worker side: ``rounds`` rounds issued back to back, then every result checked. None when all match."""
    import deep_ep
    import reference
    case = ReuseCase(**fields)
    rank, world = ctx.rank, ctx.world_size
    cuda = case.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    experts = NUM_LOCAL * world
    buffers = []
    for key in ("reuse", "second")[:2 if case.second_buffer else 1]:
        buffer = ctx.cache.get((key, case.device))
        if buffer is None:
            rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, experts)
            buffer = deep_ep.Buffer(ctx.group, num_rdma_bytes=rdma, low_latency_mode=True,
                                    num_qps_per_rank=NUM_LOCAL)
            served = type(buffer._cuda_ll).__name__ if buffer._cuda_ll is not None else None
            if cuda and served != "LowLatencyCuda":
                return f"rank {rank}: the LL calls are not served by the CUDA kernels ({served})"
            ctx.cache[(key, case.device)] = buffer
        buffer.clean_low_latency_buffer(T, H, experts)
        buffers.append(buffer)
    lagging = rank == 1
    issued = []  # per round: (pattern, inputs, [dispatch results], [combine results])
    for r in range(case.rounds):
        buffer = buffers[r % len(buffers)]
        pattern = PATTERNS[r % len(PATTERNS)]
        inputs = round_inputs(case.seed, r, world)
        mine = {k: v.to(case.device) for k, v in inputs[rank].items()}
        dispatches, combines = [], []
        waiting = None  # lag="overlap": the hook of the round's previous call, run after the next call's send
        num = pattern.count("D")
        for i in range(num):
            # mixed: the first dispatch of a round asynchronous, the second (dispatch-dispatch-combine) hooked
            hook = lagging and (case.lag in ("hook", "overlap") or (case.lag == "mixed" and i == 1))
            asynchronous = lagging and case.lag == "mixed" and not hook
            res = buffer.low_latency_dispatch(mine["x"], mine["topk_idx"], T, experts, use_fp8=False,
                                              async_finish=asynchronous, return_recv_hook=hook)
            if lagging and cuda:
                torch.cuda._sleep(LAG_CYCLES)
            if waiting is not None:
                waiting()
                waiting = None
            if hook:
                if case.lag == "overlap" and i < num - 1:
                    waiting = res.hook
                else:
                    res.hook()
            dispatches.append(res)
        if asynchronous:  # the last dispatch: its outputs are read now
            res.event.current_stream_wait()
        y = _expert(dispatches[-1].recv_x)
        num = pattern.count("C")
        for i in range(num):
            hook = lagging and case.lag == "overlap"
            comb = buffer.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], dispatches[-1].handle,
                                              return_recv_hook=hook)
            if waiting is not None:
                waiting()
                waiting = None
            if hook:
                if i < num - 1:
                    waiting = comb.hook
                else:
                    comb.hook()
            combines.append(comb.combined_x)
        issued.append((pattern, inputs, dispatches, combines))
    if cuda:
        torch.cuda.synchronize()
        for buffer in buffers:
            buffer._cuda_ll.check_errors()  # a kernel that timed out raises here, naming rank, peer and phase
    for r, (pattern, inputs, dispatches, combines) in enumerate(issued):
        refs = reference.low_latency_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs], T, experts,
                                              use_fp8=False)
        want = reference.low_latency_combine([_expert(ref.recv_x) for ref in refs],
                                             [i["topk_idx"] for i in inputs], [i["topk_weights"] for i in inputs],
                                             [ref.handle for ref in refs])[rank]
        ref = refs[rank]
        counts = ref.packed_recv_count
        for d, res in enumerate(dispatches):
            where = f"round {r} ({pattern}) dispatch {d}"
            problem = _compare(f"{where} packed_recv_count", res.packed_recv_count, counts)
            for j in range(NUM_LOCAL):
                n = int(counts[j])
                problem = problem or _compare(f"{where} src_info[{j}]", res.handle.packed_recv_src_info[j, :n],
                                              ref.handle.packed_recv_src_info[j, :n])
                problem = problem or _compare(f"{where} recv_x[{j}]", res.recv_x[j, :n], ref.recv_x[j, :n])
            if problem:
                return f"rank {rank}: {problem}"
        for c, combined in enumerate(combines):
            if r == case.corrupt_round and c == 0 and combined.numel():
                combined = combined.clone()
                combined.view(-1)[0] += 1
            problem = _compare(f"round {r} ({pattern}) combine {c}", combined, want)
            if problem:
                return f"rank {rank}: {problem}"
    return None


GPU_ENV = {"DEEP_EP_BACKEND": "cuda", "DEEP_EP_TIMEOUT_S": "20"}


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lag", ["hook", "fused", "mixed", "overlap"])
def test_ll_back_to_back_rounds_with_a_lagging_rank(pools, lag):
    case = ReuseCase(rounds=ROUNDS, seed=int(os.environ.get("TEST_LL_REUSE_SEED", "3")), lag=lag)
    pools.get(2, GPU_ENV).check(WORKER_MODULE, "run_reuse", asdict(case), timeout_s=240)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_ll_two_buffers_in_one_process(pools):
    """A second LL Buffer of the same ranks in each process (the first one cached by the tests above, or built
    here) joins the process's NVSHMEM world; rounds alternate between the two."""
    case = ReuseCase(rounds=2 * len(PATTERNS), seed=7, second_buffer=True)
    pools.get(2, GPU_ENV).check(WORKER_MODULE, "run_reuse", asdict(case), timeout_s=240)


# The same loop on the torch backend (CPU, DEEP_EP_BACKEND=torch: no NVSHMEM Buffer even on a GPU host): it passes,
# and a changed result fails it.
CPU_ROUNDS = 2 * len(PATTERNS)
CPU_ENV = {"DEEP_EP_BACKEND": "torch"}


@pytest.mark.parametrize("lag", ["hook", "fused", "mixed", "overlap"])
def test_reuse_loop_passes_on_cpu(pools, lag):
    pools.get(2, CPU_ENV).check(WORKER_MODULE, "run_reuse",
                                asdict(ReuseCase(rounds=CPU_ROUNDS, seed=5, device="cpu", lag=lag)))


def test_reuse_loop_reports_a_changed_result(pools):
    corrupt = 0
    while not round_inputs(5, corrupt, 2)[0]["x"].size(0):  # a round where rank 0 has tokens to combine
        corrupt += 1
    reports = pools.get(2, CPU_ENV).run(WORKER_MODULE, "run_reuse",
                                        asdict(ReuseCase(rounds=CPU_ROUNDS, seed=5, device="cpu",
                                                         corrupt_round=corrupt)))
    assert reports[0] is not None and f"round {corrupt} (" in reports[0] and "combine 0" in reports[0], reports
