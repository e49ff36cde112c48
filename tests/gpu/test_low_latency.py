"""GPU property tests of the CUDA low-latency kernels (NVSHMEM) against ``reference``.

Pools of 1 and 2 ranks (rank ``r`` on GPU ``r % GPUs``); each worker builds one low-latency ``deep_ep.Buffer`` (plus
an NVL buffer for the normal-mode-then-clean property) that serves every example. Every rank rebuilds all ranks'
inputs from the drawn :class:`Case` and compares with the global ``reference``: dispatch packs rows in the
reference's order (source rank, token, k), so valid rows, scales, ``src_info``, ``layout_range`` and counts match
exactly; combine is bit-exact for BF16 and within a small tolerance for LogFMT. Outputs are poisoned first.

    TEST_RANKS_PER_GPU=2 python -m pytest tests/gpu/test_low_latency.py                      # one GPU
    TEST_RANKS_PER_GPU=2 TEST_LL_PUT_ONLY=1 python -m pytest tests/gpu/test_low_latency.py   # peers by puts

``TEST_LL_PUT_ONLY=1`` builds every Buffer with ``deep_ep.testing.overrides(ll_put_only=True)`` (the RDMA path);
``TEST_EXAMPLES_LL``: examples per property (25); ``TEST_LL_FAILURE_LOG``: a file that gets each failure as it
happens; ``TEST_TIMEOUT_SCALE``: a factor on the driver's and the workers' wait budgets.
"""
from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

# TEST_TIMEOUT_SCALE multiplies both budgets (e.g. under compute-sanitizer, whose instrumentation slows every kernel).
TIMEOUT_SCALE = float(os.environ.get("TEST_TIMEOUT_SCALE", "1"))
EXAMPLE_TIMEOUT_S = 90.0 * TIMEOUT_SCALE
WORKER_TIMEOUT_S = str(round(10 * TIMEOUT_SCALE))
# No shrinking: every example costs real kernel launches; the failure text names the case.
NO_SHRINK = dict(phases=[Phase.explicit, Phase.reuse, Phase.generate], report_multiple_bugs=False)
# Largest case of the pools (the symmetric buffer is sized for it).
MAX_TOKENS, MAX_HIDDEN, MAX_EXPERTS_PER_RANK = 64, 7168, 16
HIDDEN_CHOICES = (1024, 1152, 2048, 2560, 4096, 7168)
NUM_NVL_BYTES = 64 * 1024 * 1024
# TEST_LL_PUT_ONLY=1: every Buffer of this module is built with deep_ep.testing's ll_put_only (peers by NVSHMEM put).
PUT_ONLY = os.environ.get("TEST_LL_PUT_ONLY", "0") == "1"


@dataclass(frozen=True)
class Case:
    num_ranks: int
    seed: int
    num_tokens: tuple
    max_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    mask_prob: float
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    hook: bool
    async_finish: bool
    use_logfmt: bool
    zero_copy: bool
    dispatch_twice: bool
    with_out: bool
    with_stats: bool

    def describe(self) -> str:
        return "Case(" + ", ".join(f"{k}={v!r}" for k, v in asdict(self).items()) + ")"


def case_strategy(num_ranks: int):
    def build(draw):
        use_fp8 = draw(st.booleans())
        round_scale = use_fp8 and draw(st.booleans())
        hidden = draw(st.sampled_from(HIDDEN_CHOICES))
        use_ue8m0 = round_scale and hidden % 512 == 0 and draw(st.booleans())
        local = draw(st.integers(1, MAX_EXPERTS_PER_RANK))
        num_experts = local * num_ranks
        max_tokens = draw(st.sampled_from([4, 16, 64]))
        hook = draw(st.booleans())
        use_logfmt = draw(st.booleans())
        return Case(num_ranks=num_ranks, seed=draw(st.integers(0, 2**31 - 1)),
                    num_tokens=tuple(draw(st.lists(st.integers(0, max_tokens), min_size=num_ranks,
                                                   max_size=num_ranks))),
                    max_tokens=max_tokens, hidden=hidden, num_topk=draw(st.integers(1, min(16, num_experts))),
                    num_experts=num_experts, mask_prob=draw(st.sampled_from([0.0, 0.1, 0.5])), use_fp8=use_fp8,
                    round_scale=round_scale, use_ue8m0=use_ue8m0, hook=hook,
                    async_finish=not hook and draw(st.booleans()), use_logfmt=use_logfmt,
                    zero_copy=not use_logfmt and draw(st.booleans()), dispatch_twice=draw(st.booleans()),
                    with_out=draw(st.booleans()), with_stats=draw(st.booleans()))
    return st.composite(lambda draw: build(draw))()


def make_inputs(case: Case, rank: int) -> dict:
    """CPU tensors of ``rank``: x (BF16, values of mixed magnitude), distinct top-k experts with -1 holes, weights."""
    import deep_ep
    gen = torch.Generator().manual_seed(case.seed * 131 + rank)
    n, h, k, e = case.num_tokens[rank], case.hidden, case.num_topk, case.num_experts
    x = (torch.randn(n, h, generator=gen) * torch.rand(n, 1, generator=gen) * 4).to(torch.bfloat16)
    scores = torch.rand(n, e, generator=gen)
    topk_idx = scores.topk(k, dim=1).indices if n > 0 else torch.empty(0, k, dtype=torch.int64)
    if case.mask_prob > 0 and n > 0:
        topk_idx[torch.rand(n, k, generator=gen) < case.mask_prob] = -1
    weights = torch.rand(n, k, generator=gen, dtype=torch.float32)
    return {"x": x, "topk_idx": topk_idx.to(deep_ep.topk_idx_t), "topk_weights": weights}


def expert_output(recv_x, use_fp8: bool) -> torch.Tensor:
    """A toy expert: dequantised input times 1.5 (exact in BF16 for the check), [L, R*T, H] BF16."""
    import deep_ep
    if use_fp8:
        data, scales = recv_x
        num_local, rows, hidden = data.shape
        flat = deep_ep.per_token_cast_back(data.reshape(-1, hidden), scales.reshape(num_local * rows, -1))
        y = flat.view(num_local, rows, hidden)
    else:
        y = recv_x
    return (y.float() * 1.5).to(torch.bfloat16).contiguous()


# ----------------------------------------------------------------------------------------------------------------
# Worker pool
# ----------------------------------------------------------------------------------------------------------------
def _rendezvous_file() -> str:
    """A new empty file for the workers' ``file://`` rendezvous (no port that another process could take first)."""
    fd, path = tempfile.mkstemp(prefix="deep_ep_pool_")
    os.close(fd)
    return path


def _worker(rank: int, world: int, rendezvous: str, env: dict, shrink: bool, put_only: bool, tasks, results) -> None:
    os.environ.update(env)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as test_intranode's workers: no OpenMP contention
    try:
        import torch.distributed as dist
        torch.cuda.set_device(rank % torch.cuda.device_count())  # ranks share GPUs when there are fewer
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        import deep_ep
        import deep_ep.testing
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, MAX_HIDDEN, world,
                                                              MAX_EXPERTS_PER_RANK * world)
        with deep_ep.testing.overrides(ll_put_only=put_only):
            buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=NUM_NVL_BYTES, num_rdma_bytes=rdma,
                                    low_latency_mode=True, num_qps_per_rank=MAX_EXPERTS_PER_RANK,
                                    explicitly_destroy=True, enable_shrink=shrink)
        # Under TEST_LL_PUT_ONLY=1 the kernels must really take the put path between ranks.
        if put_only and world > 1:
            assert not buffer._cuda_ll.runtime.all_p2p(), "ll_put_only but every peer is reached by pointer"
        results.put((rank, "ready", type(buffer._cuda_ll).__name__))
    except Exception:  # noqa: BLE001 - reported to the driver
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        name, payload = tasks.get()
        if name == "stop":
            try:
                buffer.destroy()
            finally:
                results.put((rank, "stopped", ""))
            return
        if name == "reset":  # after a failed example: make the Buffer usable again (collective)
            try:
                dist.barrier()
                buffer._cuda_ll.reset(payload.max_tokens, payload.hidden, payload.num_experts)
                dist.barrier()
                results.put((rank, "ok", ""))
            except Exception:  # noqa: BLE001 - reported to the driver
                results.put((rank, "fail", traceback.format_exc()))
            continue
        # A task that outlives the driver's patience leaves this worker's Python stack on stderr (a hang's where).
        faulthandler.dump_traceback_later(EXAMPLE_TIMEOUT_S - 10)
        try:
            dist.barrier()
            # Every example may change (T, H, E), which needs a (collective) clean.
            buffer.clean_low_latency_buffer(payload.max_tokens, payload.hidden, payload.num_experts)
            results.put((rank, "ok", TASKS[name](buffer, rank, payload)))
        except Exception:  # noqa: BLE001 - reported to the driver
            describe = payload.describe() if hasattr(payload, "describe") else str(payload)
            results.put((rank, "fail", f"{describe}\n{traceback.format_exc()}"))
        finally:
            faulthandler.cancel_dump_traceback_later()


class Pool:
    def __init__(self, world: int, shrink: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        env = {"DEEP_EP_TIMEOUT_S": WORKER_TIMEOUT_S, "DEEP_EP_BACKEND": "cuda"}
        self.rendezvous = _rendezvous_file()
        self.procs = [ctx.Process(target=_worker, args=(r, world, self.rendezvous, env, shrink, PUT_ONLY, self.tasks[r],
                                                         self.results), daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        replies = self._collect(EXAMPLE_TIMEOUT_S)
        bad = [msg for _, status, msg in replies if status != "ready"]
        if bad:
            self.close()
            raise RuntimeError("worker start failed:\n" + "\n".join(bad))
        assert {msg for _, _, msg in replies} == {"LowLatencyCuda"}, replies

    def _collect(self, timeout: float) -> list:
        replies, deadline = [], time.monotonic() + timeout
        while len(replies) < self.world:
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead and self.results.empty():
                raise RuntimeError(f"workers exited without answering (rank, exit code): {dead}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers answered {sorted(r for r, _, _ in replies)} of {self.world} within "
                                   f"{timeout} s; alive: {[p.is_alive() for p in self.procs]}")
            try:
                replies.append(self.results.get(timeout=1.0))
            except queue.Empty:
                continue
        return replies

    def run(self, name: str, payload) -> list:
        for q in self.tasks:
            q.put((name, payload))
        replies = self._collect(EXAMPLE_TIMEOUT_S)
        failures = [f"rank {r}: {msg}" for r, status, msg in sorted(replies) if status != "ok"]
        if failures:
            text = "\n".join(failures)
            log = os.environ.get("TEST_LL_FAILURE_LOG")
            if log:  # the first failures survive a killed run
                with open(log, "a") as f:
                    f.write(f"=== {name}\n{text}\n")
            if name != "reset":
                with contextlib.suppress(AssertionError, RuntimeError, TimeoutError):
                    self.run("reset", payload)
            raise AssertionError(text)
        return [msg for _, _, msg in sorted(replies)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(("stop", None))
        # Under compute-sanitizer (TEST_WORKER_NORMAL_EXIT) a worker's teardown is instrumented too, and a killed
        # worker writes no report.
        grace = 180 if os.environ.get("TEST_WORKER_NORMAL_EXIT") == "1" else 30
        for p in self.procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
        with contextlib.suppress(OSError):  # the store removes its file when its last rank leaves
            os.remove(self.rendezvous)


@pytest.fixture(scope="module")
def pools():
    opened: dict = {}

    def get(world: int, shrink: bool = False) -> Pool:
        if (world, shrink) not in opened:
            opened[(world, shrink)] = Pool(world, shrink)
        return opened[(world, shrink)]

    yield get
    for pool in opened.values():
        pool.close()


# ----------------------------------------------------------------------------------------------------------------
# Checks inside a rank
# ----------------------------------------------------------------------------------------------------------------
def _poison() -> None:
    block = torch.full((256 << 20,), 0x7F, dtype=torch.uint8, device="cuda")
    del block


def _eq(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu(), want.cpu()
    if got.dtype.is_floating_point and got.dtype.itemsize == 1:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if got.shape != want.shape or not torch.equal(got, want):
        diff = (got != want).nonzero()[:5].tolist() if got.shape == want.shape else "shape"
        raise AssertionError(f"{name}: mismatch (shape {tuple(got.shape)} vs {tuple(want.shape)}), first at {diff}")


def _ranges(layout_range: torch.Tensor) -> torch.Tensor:
    """``(begin << 32) | count`` with the begin of empty ranges cleared: DeepEP's contract fixes only ``count = 0``
    for silent or masked sources; the reference puts 0 there for masked ones, the kernels the running row."""
    layout_range = layout_range.cpu()
    return torch.where((layout_range & 0xFFFFFFFF) == 0, torch.zeros_like(layout_range), layout_range)


def _check_dispatch(case: Case, rank: int, res, ref) -> None:
    counts = ref.packed_recv_count
    _eq("packed_recv_count", res.packed_recv_count, counts)
    _eq("layout_range", _ranges(res.handle.packed_recv_layout_range), _ranges(ref.handle.packed_recv_layout_range))
    for j in range(counts.numel()):
        n = int(counts[j])
        _eq(f"src_info[{j}]", res.handle.packed_recv_src_info[j, :n], ref.handle.packed_recv_src_info[j, :n])
        if case.use_fp8:
            _eq(f"recv_x data[{j}]", res.recv_x[0][j, :n], ref.recv_x[0][j, :n])
            _eq(f"recv_x scales[{j}]", res.recv_x[1][j, :n], ref.recv_x[1][j, :n])
        else:
            _eq(f"recv_x[{j}]", res.recv_x[j, :n], ref.recv_x[j, :n])
    if case.use_fp8:
        scales = res.recv_x[1]
        assert scales.stride()[1] == 1 and scales.stride()[2] == scales.size(1), f"scales strides {scales.stride()}"


def _settle(buffer) -> None:
    """Wait for the device, then raise the error a kernel left pending (a timeout, a peer's abort), so that a failed
    kernel is reported as such and not as outputs that differ from the reference."""
    torch.cuda.synchronize()
    buffer._cuda_ll.check_errors()


def _ll_round(buffer, case: Case, rank: int, inputs: list, mine: dict, refs: list, ref_out: list) -> None:
    """One dispatch (twice when asked: both buffer halves) + combine on this rank, checked."""
    num_local = case.num_experts // case.num_ranks
    x, idx, w = (mine[k].cuda() for k in ("x", "topk_idx", "topk_weights"))
    stats = torch.zeros(num_local, dtype=torch.int32, device="cuda") if case.with_stats else None
    wait = torch.zeros(case.num_ranks, dtype=torch.int64, device="cuda") if case.with_stats else None
    for _ in range(2 if case.dispatch_twice else 1):
        _poison()
        res = buffer.low_latency_dispatch(x, idx, case.max_tokens, case.num_experts,
                                          cumulative_local_expert_recv_stats=stats,
                                          dispatch_wait_recv_cost_stats=wait, use_fp8=case.use_fp8,
                                          round_scale=case.round_scale, use_ue8m0=case.use_ue8m0,
                                          async_finish=case.async_finish, return_recv_hook=case.hook)
        if case.hook:
            assert res.hook is not None
            res.hook()
        elif case.async_finish:
            res.event.current_stream_wait()
        _settle(buffer)
        _check_dispatch(case, rank, res, refs[rank])
    if stats is not None:
        rounds = 2 if case.dispatch_twice else 1
        _eq("cumulative stats", stats, refs[rank].packed_recv_count * rounds)
    y = expert_output(res.recv_x, case.use_fp8)
    if case.zero_copy:
        buf = buffer.get_next_low_latency_combine_buffer(res.handle)
        buf[:, :, :] = y
    out = torch.empty(x.size(0), case.hidden, dtype=torch.bfloat16, device="cuda") if case.with_out else None
    comb = buffer.low_latency_combine(y, idx, w, res.handle, use_logfmt=case.use_logfmt, zero_copy=case.zero_copy,
                                      async_finish=case.async_finish, return_recv_hook=case.hook, out=out)
    if case.hook:
        comb.hook()
    elif case.async_finish:
        comb.event.current_stream_wait()
    _settle(buffer)
    if out is not None:
        assert comb.combined_x.data_ptr() == out.data_ptr()
    got, want = comb.combined_x.cpu(), ref_out[rank]
    if case.use_logfmt:
        err = (got.float() - want.float()).abs()
        bound = 0.05 * want.float().abs() + 1e-2 * (want.float().abs().max() if want.numel() else 0)
        if bool((err > bound).any()):
            raise AssertionError(f"LogFMT combine off by up to {float(err.max())}")
    else:
        _eq("combined_x", got, want)


def _references(case: Case):
    import reference
    inputs = [make_inputs(case, r) for r in range(case.num_ranks)]
    refs = reference.low_latency_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs], case.max_tokens,
                                          case.num_experts, use_fp8=case.use_fp8, round_scale=case.round_scale,
                                          use_ue8m0=case.use_ue8m0)
    ys = [expert_output(r.recv_x, case.use_fp8) for r in refs]
    ref_out = reference.low_latency_combine(ys, [i["topk_idx"] for i in inputs], [i["topk_weights"] for i in inputs],
                                            [r.handle for r in refs], use_logfmt=case.use_logfmt)
    return inputs, refs, ref_out


def task_round(buffer, rank: int, case: Case) -> str:
    inputs, refs, ref_out = _references(case)
    _ll_round(buffer, case, rank, inputs, inputs[rank], refs, ref_out)
    return "ok"


def task_graph(buffer, rank: int, case: Case) -> str:
    """Capture dispatch + combine in one CUDA graph; replay on fresh inputs copied into the static tensors."""
    num_tokens = case.num_tokens[rank]
    first = make_inputs(case, rank)
    static = {k: v.cuda() for k, v in first.items()}
    buffer.low_latency_dispatch(static["x"], static["topk_idx"], case.max_tokens, case.num_experts,
                                use_fp8=case.use_fp8)  # warm-up (and a parity flip) outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = buffer.low_latency_dispatch(static["x"], static["topk_idx"], case.max_tokens, case.num_experts,
                                          use_fp8=case.use_fp8)
        y = expert_output(res.recv_x, case.use_fp8)
        comb = buffer.low_latency_combine(y, static["topk_idx"], static["topk_weights"], res.handle)
    torch.cuda.synchronize()
    for replay in range(3):
        fresh = Case(**{**asdict(case), "seed": case.seed + 1000 * (replay + 1)})
        inputs, refs, ref_out = _references(fresh)
        for key in ("x", "topk_idx", "topk_weights"):
            static[key].copy_(inputs[rank][key][:num_tokens])
        graph.replay()
        _settle(buffer)
        _check_dispatch(fresh, rank, res, refs[rank])
        _eq(f"graph replay {replay} combined_x", comb.combined_x.cpu(), ref_out[rank])
    return "ok"


def task_normal_then_clean(buffer, rank: int, case: Case) -> str:
    """A normal-mode dispatch + combine on the same Buffer, then clean_low_latency_buffer, then an LL round."""
    mine = make_inputs(case, rank)
    x, idx = mine["x"].cuda(), mine["topk_idx"].cuda()
    layout = buffer.get_dispatch_layout(idx, case.num_experts)
    recv = buffer.dispatch(x, num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                           num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=idx,
                           topk_weights=mine["topk_weights"].cuda())
    buffer.combine(recv.recv_x, recv.handle)
    buffer.clean_low_latency_buffer(case.max_tokens, case.hidden, case.num_experts)
    inputs, refs, ref_out = _references(case)
    _ll_round(buffer, case, rank, inputs, inputs[rank], refs, ref_out)
    return "ok"


def task_bad_input(buffer, rank: int, case: Case) -> str:
    """Out-of-range expert ids raise ValueError before any launch; the Buffer stays usable."""
    mine = make_inputs(case, rank)
    try:
        buffer.low_latency_dispatch(mine["x"].cuda(), mine["topk_idx"].cuda(), case.max_tokens,
                                    case.num_experts, use_ue8m0=True, round_scale=False)
    except ValueError as exc:
        assert "use_ue8m0" in str(exc)
    else:
        raise AssertionError("use_ue8m0 without round_scale was accepted")
    inputs, refs, ref_out = _references(case)
    _ll_round(buffer, case, rank, inputs, inputs[rank], refs, ref_out)
    return "ok"


def task_disagree(buffer, rank: int, case: Case) -> str:
    """Rank 1 dispatches with use_fp8 flipped, then with twice the hidden size (refused on rank 1: the buffer's
    carving keeps the hidden size until a clean, and the refusal runs over that carving): the count messages'
    signature hashes differ, no rank takes rows from the other, and the next low-latency call raises
    ArgumentMismatchError on every rank, well under a second after the bad call, until clean_low_latency_buffer;
    then a correct round matches the reference."""
    import torch.distributed as dist

    import deep_ep
    inputs, refs, ref_out = _references(case)
    mine = inputs[rank]
    x, idx = mine["x"].cuda(), mine["topk_idx"].cuda()
    wide = torch.cat([x, x], 1)
    seen = []
    for label, kwargs in (("use_fp8", dict(x=x, use_fp8=case.use_fp8 != (rank == 1))),
                          ("hidden", dict(x=wide if rank == 1 else x, use_fp8=case.use_fp8))):
        if buffer._cuda_ll.parity != 0:
            # The count words of buffer half 0 lie where every rank's carving puts them, whatever the hidden size.
            buffer.low_latency_dispatch(x, idx, case.max_tokens, case.num_experts, use_fp8=case.use_fp8)
        start = time.monotonic()
        try:
            buffer.low_latency_dispatch(kwargs["x"], idx, case.max_tokens, case.num_experts,
                                        use_fp8=kwargs["use_fp8"])
        except ValueError as exc:
            assert label == "hidden" and rank == 1 and "clean_low_latency_buffer" in str(exc), f"{label}: {exc}"
        torch.cuda.synchronize()
        dist.barrier()
        try:
            buffer.low_latency_dispatch(x, idx, case.max_tokens, case.num_experts, use_fp8=case.use_fp8)
        except deep_ep.ArgumentMismatchError as exc:
            elapsed = time.monotonic() - start
            assert f"rank {1 - rank}" in str(exc), str(exc)
            assert elapsed < 1.0, f"{label}: raised after {elapsed:.3f} s"
            seen.append(f"{label}: {elapsed * 1e3:.0f} ms")
        else:
            raise AssertionError(f"{label} differing between the ranks did not raise")
        buffer.clean_low_latency_buffer(case.max_tokens, case.hidden, case.num_experts)
    _ll_round(buffer, case, rank, inputs, mine, refs, ref_out)
    return "; ".join(seen)


def task_refusal(buffer, rank: int, case: Case) -> str:
    """Rank 1 refuses its low_latency_dispatch, first with more tokens than num_max_dispatch_tokens_per_rank, then
    with a num_experts that is not a multiple of the group size (refused before (T, H, E) pass: the call runs over
    the last call's): it raises its own ValueError at once and still launches the call's kernel with no tokens and
    the hash of its refusal, so rank 0's dispatch finishes without waiting for the timeout; every rank's next
    low-latency call raises ArgumentMismatchError naming the other rank, well under a second after the refused
    call; after clean_low_latency_buffer a correct round matches the reference."""
    import torch.distributed as dist

    import deep_ep
    inputs, refs, ref_out = _references(case)
    mine = inputs[rank]
    x, idx = mine["x"].cuda(), mine["topk_idx"].cuda()
    extra = case.max_tokens + 1 - x.size(0)
    refusals = {"num_max_dispatch_tokens_per_rank": (torch.cat([x, x[:1].repeat(extra, 1)]),
                                                     torch.cat([idx, idx[:1].repeat(extra, 1)]), case.num_experts),
                "num_experts": (x, idx, case.num_experts + 1)}
    seen = []
    for name, (bad_x, bad_idx, bad_experts) in refusals.items():
        start = time.monotonic()
        if rank == 1:
            try:
                buffer.low_latency_dispatch(bad_x, bad_idx, case.max_tokens, bad_experts, use_fp8=case.use_fp8)
            except deep_ep.ArgumentMismatchError as exc:
                raise AssertionError(f"{name}: the refusing rank raised ArgumentMismatchError, not its own error: "
                                     f"{exc}") from None
            except ValueError as exc:
                assert name in str(exc), str(exc)
            else:
                raise AssertionError(f"a dispatch with a bad {name} was accepted")
        else:
            buffer.low_latency_dispatch(x, idx, case.max_tokens, case.num_experts, use_fp8=case.use_fp8)
        torch.cuda.synchronize()
        finished = time.monotonic() - start
        assert finished < 1.0, f"{name}: the refused dispatch's kernels finished after {finished:.3f} s"
        dist.barrier()
        try:
            buffer.low_latency_dispatch(x, idx, case.max_tokens, case.num_experts, use_fp8=case.use_fp8)
        except deep_ep.ArgumentMismatchError as exc:
            elapsed = time.monotonic() - start
            assert f"rank {1 - rank}" in str(exc) and "refused" in str(exc), str(exc)
            assert elapsed < 1.0, f"{name}: raised after {elapsed:.3f} s"
        else:
            raise AssertionError(f"{name}: the call after a refused low-latency dispatch did not raise")
        buffer.clean_low_latency_buffer(case.max_tokens, case.hidden, case.num_experts)
        _ll_round(buffer, case, rank, inputs, mine, refs, ref_out)
        seen.append(f"{name}: kernels done after {finished * 1e3:.0f} ms, raised after {elapsed * 1e3:.0f} ms")
    return "; ".join(seen)


def task_combine_disagree(buffer, rank: int, case: Case) -> str:
    """After an agreeing dispatch, rank 1 combines with use_logfmt flipped (then, after clean, refuses its combine:
    float64 topk_weights). The arrival words' signature hashes differ (the refusing rank tells every peer), so no
    rank reduces the other's rows and every combine kernel finishes well under a second; the next low-latency call
    raises ArgumentMismatchError on every rank until clean_low_latency_buffer; then a correct round matches the
    reference."""
    import torch.distributed as dist

    import deep_ep
    inputs, refs, ref_out = _references(case)
    mine = inputs[rank]
    x, idx, w = (mine[k].cuda() for k in ("x", "topk_idx", "topk_weights"))
    seen = []
    for label in ("use_logfmt", "refusal"):
        res = buffer.low_latency_dispatch(x, idx, case.max_tokens, case.num_experts, use_fp8=False)
        y = res.recv_x.clone()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.monotonic()
        if label == "use_logfmt":
            buffer.low_latency_combine(y, idx, w, res.handle, use_logfmt=rank == 1)
        elif rank == 1:
            try:
                buffer.low_latency_combine(y, idx, w.double(), res.handle)
            except deep_ep.ArgumentMismatchError as exc:
                raise AssertionError(f"the refusing rank raised ArgumentMismatchError, not its own error: {exc}") \
                    from None
            except TypeError as exc:
                assert str(exc).startswith("topk_weights"), str(exc)
            else:
                raise AssertionError("float64 topk_weights were accepted")
        else:
            buffer.low_latency_combine(y, idx, w, res.handle)
        torch.cuda.synchronize()
        finished = time.monotonic() - start
        assert finished < 1.0, f"{label}: the combine's kernels finished after {finished:.3f} s"
        dist.barrier()
        try:
            buffer.low_latency_dispatch(x, idx, case.max_tokens, case.num_experts, use_fp8=False)
        except deep_ep.ArgumentMismatchError as exc:
            elapsed = time.monotonic() - start
            assert "low_latency_combine" in str(exc) and "clean_low_latency_buffer" in str(exc), str(exc)
            assert elapsed < 1.0, f"{label}: raised after {elapsed:.3f} s"
            seen.append(f"{label}: kernels done after {finished * 1e3:.0f} ms, raised after {elapsed * 1e3:.0f} ms")
        else:
            raise AssertionError(f"{label}: the call after a disagreeing low_latency_combine did not raise")
        buffer.clean_low_latency_buffer(case.max_tokens, case.hidden, case.num_experts)
    _ll_round(buffer, case, rank, inputs, mine, refs, ref_out)
    return "; ".join(seen)


def task_combine_told(buffer, rank: int, case: Case) -> str:
    """Rank 1 has no tokens and combines with use_logfmt flipped: only rank 0 receives rows of the other hash, so
    rank 1 learns it from rank 0's tell. Rank 0's next low-latency call raises ArgumentMismatchError; rank 1's next
    kernel does nothing and records it, so its next call raises or returns at once and the call after raises; after
    clean_low_latency_buffer a correct round matches the reference."""
    import torch.distributed as dist

    import deep_ep
    inputs, refs, ref_out = _references(case)
    mine = inputs[rank]
    x, idx, w = (mine[k].cuda() for k in ("x", "topk_idx", "topk_weights"))
    res = buffer.low_latency_dispatch(x, idx, case.max_tokens, case.num_experts, use_fp8=False)
    y = res.recv_x.clone()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.monotonic()
    buffer.low_latency_combine(y, idx, w, res.handle, use_logfmt=rank == 1)
    torch.cuda.synchronize()
    finished = time.monotonic() - start
    assert finished < 1.0, f"the combine's kernels finished after {finished:.3f} s"
    dist.barrier()
    raised_at = None
    for call in (1, 2):
        try:
            buffer.low_latency_dispatch(x, idx, case.max_tokens, case.num_experts, use_fp8=False)
            torch.cuda.synchronize()
        except deep_ep.ArgumentMismatchError as exc:
            assert "low_latency_combine" in str(exc), str(exc)
            assert rank == 1 or "agreement: rank 0 peer 1" in str(exc), str(exc)
            raised_at = call
            break
        assert rank == 1, "rank 0 received rows of another hash and did not raise at its next call"
    if raised_at is None:
        raise AssertionError("rank 1 was not told of the disagreement within two calls")
    elapsed = time.monotonic() - start
    assert elapsed < 1.0, f"raised after {elapsed:.3f} s"
    buffer.clean_low_latency_buffer(case.max_tokens, case.hidden, case.num_experts)
    # The ranks made different numbers of calls since the combine; after the clean they use the same buffer half
    # and handle numbers.
    states = [None, None]
    dist.all_gather_object(states, [buffer._cuda_ll.parity, buffer._num_handles])
    assert states[0] == states[1], f"ranks' (parity, next handle number) after the clean: {states}"
    _ll_round(buffer, case, rank, inputs, mine, refs, ref_out)
    return f"raised at call {raised_at} after {elapsed * 1e3:.0f} ms"


def task_shrink(buffer, rank: int, case: Case) -> str:
    """Rank 1 "dies" before a dispatch: rank 0's dispatch times out on it (DEEP_EP_TIMEOUT_S), masks it and completes
    with rank 0's own rows; its combine drops rank 1's experts; the mask query reports rank 1."""
    import reference
    if rank == 1:
        return "ok"  # the dead rank calls nothing more
    inputs = [make_inputs(case, r) for r in range(case.num_ranks)]
    refs = reference.low_latency_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs], case.max_tokens,
                                          case.num_experts, use_fp8=case.use_fp8, masked_ranks=[1])
    mine = {k: v.cuda() for k, v in inputs[0].items()}
    res = buffer.low_latency_dispatch(mine["x"], mine["topk_idx"], case.max_tokens, case.num_experts,
                                      use_fp8=case.use_fp8)
    torch.cuda.synchronize()
    _check_dispatch(case, 0, res, refs[0])
    mask = torch.zeros(case.num_ranks, dtype=torch.int32, device="cuda")
    buffer.low_latency_query_mask_buffer(mask)
    _eq("mask after the timed-out dispatch", mask, torch.tensor([0, 1], dtype=torch.int32))
    y = expert_output(res.recv_x, case.use_fp8)
    ys = [expert_output(r.recv_x, case.use_fp8) for r in refs]
    want = reference.low_latency_combine(ys, [i["topk_idx"] for i in inputs], [i["topk_weights"] for i in inputs],
                                         [r.handle for r in refs], masked_ranks=[1])[0]
    comb = buffer.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], res.handle)
    torch.cuda.synchronize()
    _eq("combined_x without the masked rank", comb.combined_x, want)
    # Rank 1 rejoins for the next example: unmask it here; the worker's collective clean_low_latency_buffer then
    # zeroes any stale words.
    buffer.low_latency_clean_mask_buffer()
    return "ok"


def task_shrink_combine(buffer, rank: int, case: Case) -> str:
    """Rank 1 completes the dispatch but never runs the combine: rank 0's combine waits for rank 1's rows on the
    (token, rank 1) arrival words, times out once (DEEP_EP_TIMEOUT_S), masks rank 1 and finishes without rank 1's
    experts and without an error; the mask query reports rank 1."""
    import reference
    inputs = [make_inputs(case, r) for r in range(case.num_ranks)]
    refs = reference.low_latency_dispatch([i["x"] for i in inputs], [i["topk_idx"] for i in inputs], case.max_tokens,
                                          case.num_experts, use_fp8=case.use_fp8)
    mine = {k: v.cuda() for k, v in inputs[rank].items()}
    res = buffer.low_latency_dispatch(mine["x"], mine["topk_idx"], case.max_tokens, case.num_experts,
                                      use_fp8=case.use_fp8)
    torch.cuda.synchronize()
    _check_dispatch(case, rank, res, refs[rank])
    if rank == 1:
        # The silent rank skips the combine, so its parity is one call behind rank 0's until the worker's collective
        # clean_low_latency_buffer before the next example restarts both at half 0.
        return "ok"
    y = expert_output(res.recv_x, case.use_fp8)
    ys = [expert_output(r.recv_x, case.use_fp8) for r in refs]
    want = reference.low_latency_combine(ys, [i["topk_idx"] for i in inputs], [i["topk_weights"] for i in inputs],
                                         [r.handle for r in refs], masked_ranks=[1])[0]
    budget = float(WORKER_TIMEOUT_S)
    start = time.monotonic()
    comb = buffer.low_latency_combine(y, mine["topk_idx"], mine["topk_weights"], res.handle)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    # One timeout for the whole call: the other CTAs' waits on rank 1 stop as soon as one of them has masked it.
    assert 0.9 * budget <= elapsed < budget + 5.0, f"combine took {elapsed:.1f} s with a {budget} s timeout"
    buffer._cuda_ll.check_errors()  # shrink: masked, not reported
    mask = torch.zeros(case.num_ranks, dtype=torch.int32, device="cuda")
    buffer.low_latency_query_mask_buffer(mask)
    _eq("mask after the timed-out combine", mask, torch.tensor([0, 1], dtype=torch.int32))
    _eq("combined_x without the masked owner", comb.combined_x, want)
    buffer.low_latency_clean_mask_buffer()  # rank 1 rejoins: the worker's next clean zeroes its stale words
    return "ok"


TASKS = {"shrink": task_shrink, "shrink_combine": task_shrink_combine, "round": task_round, "graph": task_graph,
         "normal_then_clean": task_normal_then_clean, "bad_input": task_bad_input, "disagree": task_disagree,
         "refusal": task_refusal, "combine_disagree": task_combine_disagree, "combine_told": task_combine_told}


# ----------------------------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------------------------
@settings(max_examples=int(os.environ.get("TEST_EXAMPLES_LL", "25")), **NO_SHRINK)
@given(case=case_strategy(1))
def test_ll_one_rank(pools, case):
    pools(1).run("round", case)


@pytest.mark.multi_gpu(2)
@settings(max_examples=int(os.environ.get("TEST_EXAMPLES_LL", "25")), **NO_SHRINK)
@given(case=case_strategy(2))
def test_ll_two_ranks(pools, case):
    pools(2).run("round", case)


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.multi_gpu(2))])
def test_ll_combine_staged_and_global_rows(pools, world, hook):
    """H = 16384, top-16: the combine stages at most 7 rows of 32 KB in shared memory, so tokens with more valid
    entries are reduced from global memory and the others from the stage, in the same launch; both bit-exact."""
    case = Case(num_ranks=world, seed=5, num_tokens=(24,) * world, max_tokens=24, hidden=16384, num_topk=16,
                num_experts=16 * world, mask_prob=0.5, use_fp8=False, round_scale=False, use_ue8m0=False, hook=hook,
                async_finish=False, use_logfmt=False, zero_copy=False, dispatch_twice=False, with_out=False,
                with_stats=True)
    pools(world).run("round", case)


@pytest.mark.parametrize("world", [pytest.param(4, marks=pytest.mark.multi_gpu(4)),
                                   pytest.param(8, marks=pytest.mark.multi_gpu(8))])
@settings(max_examples=int(os.environ.get("TEST_EXAMPLES_LL", "25")), **NO_SHRINK)
@given(data=st.data())
def test_ll_one_rank_per_gpu(pools, world, data):
    """EP4 / EP8, one rank per GPU (skipped with fewer GPUs)."""
    pools(world).run("round", data.draw(case_strategy(world)))


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.multi_gpu(2))])
@settings(max_examples=3, **NO_SHRINK)
@given(data=st.data())
def test_ll_cuda_graph(pools, world, data):
    case = data.draw(case_strategy(world))
    case = Case(**{**asdict(case), "hook": False, "async_finish": False, "use_logfmt": False, "zero_copy": False,
                   "round_scale": False, "use_ue8m0": False})
    pools(world).run("graph", case)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.multi_gpu(2))])
@settings(max_examples=2, **NO_SHRINK)
@given(data=st.data())
def test_ll_after_normal_mode_and_clean(pools, world, data):
    pools(world).run("normal_then_clean", data.draw(case_strategy(world)))


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.multi_gpu(2))])
def test_ll_bad_input_keeps_buffer_usable(pools, world):
    case = Case(num_ranks=world, seed=7, num_tokens=(5,) * world, max_tokens=16, hidden=2048, num_topk=4,
                num_experts=4 * world, mask_prob=0.1, use_fp8=True, round_scale=False, use_ue8m0=False, hook=False,
                async_finish=False, use_logfmt=False, zero_copy=False, dispatch_twice=False, with_out=False,
                with_stats=False)
    pools(world).run("bad_input", case)


def _ep2_case(seed: int, num_tokens: int) -> Case:
    """EP2, ``num_tokens`` tokens per rank of top-4 over 8 experts, BF16, T = 16, H = 2048, no options."""
    return Case(num_ranks=2, seed=seed, num_tokens=(num_tokens, num_tokens), max_tokens=16, hidden=2048, num_topk=4,
                num_experts=8, mask_prob=0.0, use_fp8=False, round_scale=False, use_ue8m0=False, hook=False,
                async_finish=False, use_logfmt=False, zero_copy=False, dispatch_twice=False, with_out=False,
                with_stats=False)


@pytest.mark.multi_gpu(2)
def test_ll_ranks_that_disagree_raise_and_recover(pools):
    print(pools(2).run("disagree", _ep2_case(11, 6)))


@pytest.mark.multi_gpu(2)
def test_ll_refusal_on_one_rank_is_prompt(pools):
    print(pools(2).run("refusal", _ep2_case(12, 6)))


@pytest.mark.multi_gpu(2)
def test_ll_combine_disagreement_and_refusal_raise_promptly(pools):
    print(pools(2).run("combine_disagree", _ep2_case(13, 6)))


@pytest.mark.multi_gpu(2)
def test_ll_combine_disagreement_reaches_a_rank_without_rows(pools):
    case = Case(**{**asdict(_ep2_case(14, 6)), "num_tokens": (6, 0)})
    print(pools(2).run("combine_told", case))


def _shrink_case(seed: int) -> Case:
    """12 tokens per rank: every token almost surely has rows from both ranks."""
    return _ep2_case(seed, 12)


@pytest.mark.multi_gpu(2)
def test_ll_shrink_masks_a_silent_peer(pools):
    pools(2, shrink=True).run("shrink", _shrink_case(11))


@pytest.mark.multi_gpu(2)
def test_ll_shrink_masks_a_peer_silent_in_combine(pools):
    """Rank 1 dispatches, then never combines: rank 0's combine masks it within one timeout and completes."""
    pools(2, shrink=True).run("shrink_combine", _shrink_case(13))

