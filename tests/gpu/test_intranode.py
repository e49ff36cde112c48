"""GPU property tests of the intranode CUDA kernels against ``reference``.

A pool is a set of worker processes, one per rank, alive for the whole module: each joins a gloo group (gloo allows
several ranks per GPU) and builds one ``deep_ep.Buffer`` that serves every example. Hypothesis draws a small frozen
:class:`Case` in the driver; every rank regenerates all ranks' inputs from its seed, runs its own part and checks
it against ``reference`` on the CPU. Outputs are poisoned first (freed allocator blocks and the output pool filled
with 0x7f), so rows a kernel forgets to write fail. Each case picks, through ``deep_ep.testing.overrides``, the copy
warps, the dispatch receive path and the combine send path. Every driver wait is bounded.

    python -m pytest tests/gpu/test_intranode.py                         # 1..4 ranks on GPU 0, 2 GPUs
    TEST_RANKS_PER_GPU=2 python -m pytest tests/gpu/test_intranode.py    # one GPU: the 2-GPU tests time-sliced

``TEST_EXAMPLES_<TEST>`` sets a test's hypothesis examples (``_1``, ``_SHARED``, ``_2GPU``, ``_NCCL``, ``_EP``,
``_SEQ``); ``TEST_DEVICE=cpu`` puts the workers' tensors on the CPU (the torch backend then serves them);
``TEST_TIMEOUT_SCALE`` stretches the driver's and the workers' wait budgets.
"""
from __future__ import annotations

import contextlib
import faulthandler
import functools
import multiprocessing as mp
import os
import queue
import re
import tempfile
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

# Examples share long-lived worker pools; one test may run several minutes on the GPU machine.
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

# TEST_TIMEOUT_SCALE multiplies both budgets below (e.g. under compute-sanitizer, whose instrumentation slows
# every kernel).
TIMEOUT_SCALE = float(os.environ.get("TEST_TIMEOUT_SCALE", "1"))
# Seconds the driver waits for one example on every rank (several ranks time-slice one GPU, so be generous).
EXAMPLE_TIMEOUT_S = 240.0 * TIMEOUT_SCALE
# Kernel/host wait budget inside the workers: short, so a hang shows up as an exception quickly.
WORKER_TIMEOUT_S = str(round(20 * TIMEOUT_SCALE))
# Two full ring halves (2 x 256 MiB) plus a 256 MiB output pool for direct-to-output dispatch.
NUM_NVL_BYTES = 768 * 1024 * 1024
# Device of the tensors; "cpu" lets the task functions be dry-run against the torch backend without a GPU.
DEVICE = os.environ.get("TEST_DEVICE", "cuda")


# ----------------------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One drawn example; every rank rebuilds all ranks' tensors from it."""

    num_ranks: int
    seed: int
    num_tokens: tuple  # tokens per rank (may differ, may be 0)
    hidden: int
    num_topk: int
    num_experts: int
    use_fp8: bool
    with_topk: bool
    num_sms: int
    expert_alignment: int
    mask_prob: float  # probability of a -1 entry in topk_idx
    empty_rank: int  # a rank no token selects (-1: none)
    async_mode: bool
    previous_mode: bool
    num_bias: int  # 0, 1 or 2 combine biases
    scales_col_major: bool
    alloc_on_comm: bool = False  # allocate_on_comm_stream (only used with async_mode and previous_mode)
    # Copy warps per channel (deep_ep.testing overrides dispatch_warps / combine_warps, clamped to each kernel's
    # range for the ranks; None: the library's tuned choice).
    dispatch_warps: Optional[int] = 16
    combine_warps: Optional[int] = 8
    # Dispatch receive path: 'auto' (the library's choice), 'rings', 'direct' or 'mixed' (rank 0 direct, the other
    # ranks rings: each receiver chooses for itself).
    receive: str = "auto"
    # Combine send path: 'auto' (the library's choice: copy engine up to COMBINE_COPY_MAX_SMS, zone senders from
    # COMBINE_ZONE_MIN_SMS), 'copy' (copy engine where it applies), 'zone' (zone senders where they apply) or
    # 'rings'. The case's second combine takes the other path ('copy' <-> 'rings'), so the switch between the two
    # is covered as well.
    combine_send: str = "auto"
    # Ring sizes in tokens, DeepEP's Config order after num_sms: (nvl send, nvl recv) or (nvl send, nvl recv, rdma
    # send, rdma recv); the internode task's default (8, 256) when None.
    ring_tokens: Optional[tuple] = None

    def describe(self) -> str:
        return "Case(" + ", ".join(f"{k}={v!r}" for k, v in asdict(self).items()) + ")"


def case_strategy(num_ranks: int, max_tokens: int = 300):
    """Cases for ``num_ranks`` ranks: BF16/FP8, top-k on/off, -1 masks, empty ranks, alignment, modes."""
    def build(draw):
        use_fp8 = draw(st.booleans())
        hidden = draw(st.sampled_from([128, 256, 512, 1024, 2048, 7168] if use_fp8 else
                                      [8, 64, 136, 256, 1000, 2048, 7168]))
        local = draw(st.integers(1, 8))
        num_experts = local * num_ranks
        num_topk = draw(st.integers(1, min(16, num_experts)))
        tokens = tuple(draw(st.lists(st.integers(0, max_tokens), min_size=num_ranks, max_size=num_ranks)))
        return Case(num_ranks=num_ranks, seed=draw(st.integers(0, 2**31 - 1)), num_tokens=tokens, hidden=hidden,
                    num_topk=num_topk, num_experts=num_experts, use_fp8=use_fp8, with_topk=draw(st.booleans()),
                    num_sms=draw(st.sampled_from([2, 4, 8, 24])),
                    expert_alignment=draw(st.sampled_from([1, 1, 4, 128])),
                    mask_prob=draw(st.sampled_from([0.0, 0.0, 0.1, 0.5])),
                    empty_rank=draw(st.integers(-1, num_ranks - 1)) if num_ranks > 1 else -1,
                    async_mode=draw(st.booleans()), previous_mode=draw(st.booleans()),
                    num_bias=draw(st.integers(0, 2)), scales_col_major=draw(st.booleans()),
                    alloc_on_comm=draw(st.booleans()),
                    dispatch_warps=draw(st.sampled_from([None, 1, 9, 16, 31])),
                    combine_warps=draw(st.sampled_from([None, 1, 4, 8, 30])),
                    receive=draw(st.sampled_from(["auto", "rings", "direct", "mixed"])),
                    combine_send=draw(st.sampled_from(["auto", "copy", "rings", "zone"])))
    return st.composite(lambda draw: build(draw))()


def make_inputs(case: Case, rank: int) -> dict:
    """CPU tensors of ``rank`` for ``case``: x (BF16 or FP8 tuple), topk_idx/weights, combine input, biases."""
    import deep_ep
    gen = torch.Generator().manual_seed(case.seed * 131 + rank)
    n, h, k, e = case.num_tokens[rank], case.hidden, case.num_topk, case.num_experts
    num_local = e // case.num_ranks
    # Small integers are exact in BF16, so sums over up to 8 ranks stay exact too.
    x = torch.randint(-8, 9, (n, h), generator=gen).to(torch.bfloat16)
    allowed = torch.ones(e, dtype=torch.bool)
    if case.empty_rank >= 0:
        allowed[case.empty_rank * num_local:(case.empty_rank + 1) * num_local] = False
    scores = torch.rand(n, e, generator=gen) + 0.01
    scores[:, ~allowed] = -1.0
    num_allowed = int(allowed.sum())
    topk_idx = scores.topk(min(k, num_allowed), dim=1, sorted=False).indices if n > 0 else \
        torch.empty(0, min(k, num_allowed), dtype=torch.int64)
    if topk_idx.size(1) < k:  # fewer allowed experts than k: pad with -1
        topk_idx = torch.cat([topk_idx, torch.full((n, k - topk_idx.size(1)), -1, dtype=torch.int64)], dim=1)
    if case.mask_prob > 0:
        topk_idx[torch.rand(n, k, generator=gen) < case.mask_prob] = -1
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)
    topk_weights = torch.randn(n, k, generator=gen, dtype=torch.float32)
    out = {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights}
    if case.use_fp8:
        fp8, scales = deep_ep.per_token_cast_to_fp8(torch.randn(n, h, generator=gen).to(torch.bfloat16))
        if case.scales_col_major:
            scales = scales.t().contiguous().t()
        out["x"] = (fp8, scales)
    biases = tuple(torch.randint(-4, 5, (n, h), generator=gen).to(torch.bfloat16) for _ in range(case.num_bias))
    out["bias"] = biases
    return out


# ----------------------------------------------------------------------------------------------------------------
# Worker pool
# ----------------------------------------------------------------------------------------------------------------
def _rendezvous_file() -> str:
    """A new empty file for the workers' ``file://`` rendezvous (no port that another process could take first)."""
    fd, path = tempfile.mkstemp(prefix="deep_ep_pool_")
    os.close(fd)
    return path


def _worker(rank: int, world: int, device: int, rendezvous: str, env: dict, overrides: dict, tasks, results) -> None:
    os.environ.update(env)
    # The workers' CPU work (inputs, the reference) in small torch ops: with torch's default of one thread per core
    # in every worker, 16 workers on 16 cores spent minutes per example in OpenMP contention.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        import torch.distributed as dist
        if DEVICE == "cuda":
            torch.cuda.set_device(device)
        # TEST_GROUP=nccl: an NCCL group (one rank per GPU), for the torch backend's CUDA path.
        group_backend = os.environ.get("TEST_GROUP", "gloo")
        device_id = dict(device_id=torch.device("cuda", device)) if group_backend == "nccl" else {}
        dist.init_process_group(group_backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                **device_id)
        import deep_ep
        import deep_ep.testing
        # tests/gpu/test_internode.py reuses this pool with an RDMA (NVSHMEM) buffer and virtual nodes.
        num_rdma_bytes = int(os.environ.get("TEST_NUM_RDMA_BYTES", "0"))
        num_nvl_bytes = int(os.environ.get("TEST_NUM_NVL_BYTES", str(NUM_NVL_BYTES)))
        with deep_ep.testing.overrides(**overrides):  # the pool's construction-time choices
            buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                                    explicitly_destroy=True)
        results.put((rank, "ready", _backend_name(buffer)))
    except Exception:  # noqa: BLE001 - reported to the driver
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        name, payload = tasks.get()
        if name == "stop":
            try:
                buffer.destroy()
                dist.destroy_process_group()
            finally:
                results.put((rank, "stopped", ""))
            return
        # A task that outlives the driver's patience leaves this worker's Python stack on stderr (a hang's where).
        faulthandler.dump_traceback_later(EXAMPLE_TIMEOUT_S - 10)
        try:
            dist.barrier()  # every example starts on all ranks together
            message = _task(name)(buffer, rank, payload)
            results.put((rank, "ok", message))
        except Exception:  # noqa: BLE001 - reported to the driver
            text = f"{_describe(payload)}\n{traceback.format_exc()}"
            _abort_peers(buffer)
            results.put((rank, "fail", text))
        finally:
            faulthandler.cancel_dump_traceback_later()


def _describe(payload) -> str:
    """A failure's first line: the case's ``describe()``, or the payload itself."""
    return payload.describe() if hasattr(payload, "describe") else str(payload)


def _task(name: str) -> Callable:
    """A task of this module by name, or ``"module:function"`` of another test module on ``sys.path``."""
    if ":" in name:
        import importlib
        module, function = name.split(":")
        return getattr(importlib.import_module(module), function)
    return TASKS[name]


def _abort_peers(buffer) -> None:
    """After a failure in this rank, set every rank's abort word so peers blocked in a kernel stop at once instead
    of at their timeout (the driver then resets all ranks)."""
    backend = getattr(buffer, "runtime", None)
    runtime = getattr(backend, "runtime", None)
    if runtime is None or not hasattr(runtime, "signal_abort"):
        return
    with contextlib.suppress(Exception):  # best effort; the peers' timeouts remain
        runtime.signal_abort(torch.cuda.current_stream().cuda_stream)  # not comm: it may be blocked


def _backend_name(buffer) -> str:
    """Name of the backend object the Buffer uses for CUDA tensors (``Buffer.runtime``: the CUDA backend if any)."""
    return type(getattr(buffer, "runtime", None)).__name__


class Pool:
    """``world`` worker processes on ``devices[rank]``, fed one task at a time. ``env``: environment variables of
    the workers; ``overrides``: ``deep_ep.testing.overrides`` fields in force while each worker builds its Buffer."""

    def __init__(self, devices: list[int], env: Optional[dict] = None, overrides: Optional[dict] = None) -> None:
        ctx = mp.get_context("spawn")
        self.world = len(devices)
        self.tasks = [ctx.Queue() for _ in devices]
        self.results = ctx.Queue()
        self.rendezvous = _rendezvous_file()
        full_env = {"DEEP_EP_TIMEOUT_S": WORKER_TIMEOUT_S, "DEEP_EP_BACKEND": "cuda" if DEVICE == "cuda" else "torch",
                    "TEST_DEVICE": DEVICE, **(env or {})}
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, d, self.rendezvous, full_env,
                                                         dict(overrides or {}), self.tasks[r], self.results),
                                  daemon=True)
                      for r, d in enumerate(devices)]
        for p in self.procs:
            p.start()
        replies = self._collect(EXAMPLE_TIMEOUT_S)
        bad = [msg for _, status, msg in replies if status != "ready"]
        if bad:
            self.close()
            raise RuntimeError("worker start failed:\n" + "\n".join(bad))
        self.backends = {msg for _, _, msg in replies}
        self.broken = False

    def _collect(self, timeout: float, ranks: Optional[list] = None) -> list:
        """Replies of ``ranks`` (default: every worker); raises TimeoutError when one of them died or is late."""
        replies = []
        import time
        wanted = self.world if ranks is None else len(ranks)
        deadline = time.monotonic() + timeout
        while len(replies) < wanted:
            left = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and (ranks is None or r in ranks)]
            if left <= 0 or (dead and len(replies) + len(dead) < wanted and left < timeout - 5):
                got = sorted(r for r, _, _ in replies)
                raise TimeoutError(f"workers answered {got} of {self.world} within {timeout} s; dead: {dead}; "
                                   f"replies: {replies}")
            try:
                replies.append(self.results.get(timeout=min(left, 1.0)))
            except queue.Empty:
                continue
        return replies

    def run(self, name: str, payload, timeout: float = EXAMPLE_TIMEOUT_S, ranks: Optional[list] = None) -> list:
        """Run task ``name`` on every worker; the replies of ``ranks`` (default: all) in rank order."""
        for q in self.tasks:
            q.put((name, payload))
        try:
            replies = self._collect(timeout, ranks)
        except TimeoutError:
            self.broken = True
            raise
        failures = [f"rank {r}: {msg}" for r, status, msg in sorted(replies) if status != "ok"]
        if failures:
            if name != "reset":
                try:  # leave the pool usable for the next example
                    self.run("reset", None, timeout=float(WORKER_TIMEOUT_S) * 2 + 60)
                except (AssertionError, TimeoutError):
                    self.broken = True
            raise AssertionError("\n".join(failures))
        return [msg for _, _, msg in sorted(replies)]

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
        with contextlib.suppress(OSError):
            os.remove(self.rendezvous)

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


def _devices(world: int, spread: bool) -> list[int]:
    return [r % torch.cuda.device_count() if spread else 0 for r in range(world)]


@pytest.fixture(scope="module")
def pools():
    opened: dict = {}

    def get(world: int, spread: bool = False) -> Pool:
        key = (world, spread)
        if key in opened and opened[key].broken:
            opened.pop(key).kill()
        if key not in opened:
            opened[key] = Pool(_devices(world, spread))
            backends = opened[key].backends
            assert backends == {"CudaBackend"}, f"Buffer did not pick the CUDA backend: {backends}"
        return opened[key]

    yield get
    for pool in opened.values():
        pool.close()


# ----------------------------------------------------------------------------------------------------------------
# Checks that run inside a rank
# ----------------------------------------------------------------------------------------------------------------
def _poison_allocator(num_bytes: int = 64 << 20) -> None:
    """Fill freed caching-allocator blocks with 0x7f so unwritten outputs hold garbage, not zeros."""
    if DEVICE != "cuda":
        return
    block = torch.full((num_bytes,), 0x7F, dtype=torch.uint8, device=DEVICE)
    del block


def _eq(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()
    want = want.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{name}: shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}")
    if got.dtype.is_floating_point and got.dtype.itemsize == 1:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if not torch.equal(got, want):
        diff = (got != want) if not got.is_floating_point() else ~((got == want) | (got.isnan() & want.isnan()))
        where = diff.nonzero()[:5].tolist()
        first_got, first_want = (got[tuple(where[0])], want[tuple(where[0])]) if where else ("?", "?")
        raise AssertionError(f"{name}: {int(diff.sum())} mismatching elements, first at {where}; "
                             f"got {first_got} want {first_want}")


def _wait(event, async_mode: bool) -> None:
    if async_mode:
        event.current_stream_wait()


def _to_cuda(obj):
    if isinstance(obj, tuple):
        return tuple(_to_cuda(o) for o in obj)
    return obj.to(DEVICE) if isinstance(obj, torch.Tensor) else obj


def _global_reference(case: Case, inputs: list, num_channels: int):
    """Run ``reference`` over every rank's inputs; returns (layouts, dispatch results)."""
    import reference
    from deep_ep.config import Topology
    topo = Topology(case.num_ranks, case.num_ranks)
    layouts = [reference.get_dispatch_layout(inp["topk_idx"], case.num_experts, topo) for inp in inputs]
    kwargs = {}
    if case.with_topk:
        kwargs = dict(topk_idx=[inp["topk_idx"] for inp in inputs],
                      topk_weights=[inp["topk_weights"] for inp in inputs])
    dispatched = reference.dispatch([inp["x"] for inp in inputs], [lay.is_token_in_rank for lay in layouts], topo,
                                    num_experts=case.num_experts, expert_alignment=case.expert_alignment,
                                    num_channels=num_channels, **kwargs)
    return topo, layouts, dispatched


def _tuning(case: Case, rank: int):
    """The case's copy warps, dispatch receive path and combine send path on this rank: a ``deep_ep.testing``
    overrides block ('auto' leaves the choice to the library)."""
    import deep_ep.testing
    receive = case.receive if case.receive != "mixed" else ("direct" if rank == 0 else "rings")
    return deep_ep.testing.overrides(dispatch_warps=case.dispatch_warps, combine_warps=case.combine_warps,
                                     dispatch_receive=None if receive == "auto" else receive,
                                     combine_send=None if case.combine_send == "auto" else case.combine_send)


def tuned(task: Callable) -> Callable:
    """``task(buffer, rank, case)`` run within the case's overrides (:func:`_tuning`)."""
    @functools.wraps(task)
    def run(buffer, rank: int, case: Case):
        with _tuning(case, rank):
            return task(buffer, rank, case)
    return run


def _kernel_runtime(buffer):
    """The CUDA kernels' runtime behind this rank's Buffer, or None (CPU tests; the torch backend on CUDA tensors)."""
    return getattr(getattr(buffer, "runtime", None), "runtime", None) if DEVICE == "cuda" else None


def _pool_range(buffer) -> tuple[int, int]:
    """Device address range ``[begin, end)`` of this rank's output pool."""
    runtime = _kernel_runtime(buffer)
    base = runtime.get_local_buffer_tensor(torch.uint8, 0).data_ptr()
    begin = base + runtime.get_pool_offset()
    return begin, begin + runtime.get_pool_bytes()


def _in_pool(buffer, tensor: torch.Tensor) -> bool:
    begin, end = _pool_range(buffer)
    return begin <= tensor.data_ptr() < end


def _expect_path(buffer, tensor: torch.Tensor, receive: str, rank: int, label: str) -> None:
    """The receive path that produced ``tensor`` (rows > 0) is the one asked for."""
    if _kernel_runtime(buffer) is None or tensor.numel() == 0:
        return
    want_direct = receive == "direct" or (receive == "mixed" and rank == 0)
    if receive == "auto":
        return  # either, depending on the pool's room
    assert _in_pool(buffer, tensor) == want_direct, f"{label}: receive path is not {receive!r} on rank {rank}"


def _copy_epoch(buffer) -> int:
    """Copy-engine combines of this rank's runtime so far (-1 without the CUDA runtime)."""
    runtime = _kernel_runtime(buffer)
    return runtime.get_copy_epoch() if hasattr(runtime, "get_copy_epoch") else -1


def _expect_combine_path(buffer, handle, case: Case, epoch_before: int, label: str) -> None:
    """The combine just run took the copy engine exactly when it should: mode 'copy' (or 'auto' within the SM budget
    limit), several ranks, the handle's pair counts known and every landing zone fitting."""
    if epoch_before < 0:
        return
    runtime = _kernel_runtime(buffer)
    counts = _pair_counts(handle)
    from deep_ep.backends.cuda_tuning import combine_send_path
    asked = (case.combine_send if case.combine_send != "auto" else combine_send_path(case.num_sms)) != "rings"
    want = (asked and case.num_ranks > 1 and bool(counts) and
            runtime.would_copy(counts, case.hidden, case.num_topk if case.with_topk else 0))
    used = _copy_epoch(buffer) == epoch_before + 1
    assert used == want, f"{label}: copy-engine path used={used}, expected {want} ({case.combine_send})"


def _pair_counts(handle) -> Optional[list]:
    """The (source, destination) row counts the dispatch left for the copy-engine combine, or None."""
    return getattr(handle, "backend_state", None)


def _poison_pool(buffer) -> None:
    """Fill the output pool with 0x7f (call with nothing in flight and no live pool tensor that matters)."""
    runtime = _kernel_runtime(buffer)
    if runtime is None:
        return
    torch.cuda.synchronize()
    offset, size = runtime.get_pool_offset(), runtime.get_pool_bytes()
    if size > 0:
        runtime.get_local_buffer_tensor(torch.uint8, offset)[:size].fill_(0x7F)
    torch.cuda.synchronize()


@tuned
def task_roundtrip(buffer, rank: int, case: Case) -> str:
    """Layout, dispatch (all modes), cached dispatch, worst-token dispatch and combine against the reference."""
    import deep_ep
    import deep_ep.testing
    import reference
    _poison_pool(buffer)
    inputs = [make_inputs(case, r) for r in range(case.num_ranks)]
    mine = inputs[rank]
    config = deep_ep.Config(case.num_sms, 8, 256)

    # ---- layout ----
    _poison_allocator()
    topk_idx = mine["topk_idx"].to(DEVICE)
    on_comm = case.alloc_on_comm and case.async_mode and case.previous_mode
    layout = buffer.get_dispatch_layout(topk_idx, case.num_experts,
                                        previous_event=buffer.capture() if case.previous_mode else None,
                                        async_finish=case.async_mode, allocate_on_comm_stream=on_comm)
    _wait(layout.event, case.async_mode)

    # ---- dispatch ----
    _poison_allocator()
    x = _to_cuda(mine["x"])
    kwargs = dict(num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                  num_tokens_per_expert=layout.num_tokens_per_expert, expert_alignment=case.expert_alignment,
                  config=config, async_finish=case.async_mode, allocate_on_comm_stream=on_comm)
    if case.with_topk:
        kwargs.update(topk_idx=topk_idx, topk_weights=mine["topk_weights"].to(DEVICE))
    if case.previous_mode:
        kwargs["previous_event"] = buffer.capture()
    out = buffer.dispatch(x, **kwargs)
    _wait(out.event, case.async_mode)
    handle = out.handle
    num_channels = handle.channel_prefix_matrix.size(1)

    topo, layouts, dispatched = _global_reference(case, inputs, num_channels)
    ref_layout, ref = layouts[rank], dispatched[rank]
    _eq("num_tokens_per_rank", layout.num_tokens_per_rank, ref_layout.num_tokens_per_rank)
    _eq("num_tokens_per_expert", layout.num_tokens_per_expert, ref_layout.num_tokens_per_expert)
    _eq("is_token_in_rank", layout.is_token_in_rank, ref_layout.is_token_in_rank)

    _expect_path(buffer, out.recv_x[0] if case.use_fp8 else out.recv_x, case.receive, rank, "dispatch")
    if case.use_fp8:
        _eq("recv_x fp8", out.recv_x[0], ref.recv_x[0])
        _eq("recv_x scales", out.recv_x[1], ref.recv_x[1].contiguous())
        assert out.recv_x[1].is_contiguous(), "recv scales must be row-major contiguous"
    else:
        _eq("recv_x", out.recv_x, ref.recv_x)
    if case.with_topk:
        _eq("recv_topk_idx", out.recv_topk_idx, ref.recv_topk_idx)
        _eq("recv_topk_weights", out.recv_topk_weights, ref.recv_topk_weights)
    else:
        assert out.recv_topk_idx is None and out.recv_topk_weights is None
    # DeepEP's definition (from num_tokens_per_expert, so defined with and without top-k); with top-k it is the
    # reference's list too.
    num_local = case.num_experts // case.num_ranks
    want_list = [-(-sum(int(lay.num_tokens_per_expert[rank * num_local + j]) for lay in layouts)
                   // case.expert_alignment) * case.expert_alignment for j in range(num_local)]
    if ref.num_recv_tokens_per_expert_list is not None:
        assert want_list == list(ref.num_recv_tokens_per_expert_list)
    assert list(out.num_recv_tokens_per_expert_list) == want_list, \
        f"per-expert list {out.num_recv_tokens_per_expert_list} != {want_list}"
    for field in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                  "is_token_in_rank"):
        _eq(f"handle.{field}", getattr(handle, field), getattr(ref.handle, field))
    _eq("handle.send_head >= 0", handle.send_head >= 0, ref.handle.send_head >= 0)
    _eq("handle.send_head", handle.send_head, ref.handle.send_head)

    # ---- cached dispatch ----
    _poison_allocator()
    cached = buffer.dispatch(x, handle=handle, config=config, async_finish=case.async_mode,
                             previous_event=buffer.capture() if case.previous_mode else None,
                             allocate_on_comm_stream=on_comm)
    _wait(cached.event, case.async_mode)
    _expect_path(buffer, cached.recv_x[0] if case.use_fp8 else cached.recv_x, case.receive, rank, "cached dispatch")
    if case.use_fp8:
        _eq("cached recv_x fp8", cached.recv_x[0], ref.recv_x[0])
        _eq("cached recv_x scales", cached.recv_x[1], ref.recv_x[1].contiguous())
    else:
        _eq("cached recv_x", cached.recv_x, ref.recv_x)

    # ---- worst-token dispatch ----
    if case.with_topk:
        worst = sum(case.num_tokens) + 3
        _poison_allocator()
        wout = buffer.dispatch(x, **{**kwargs, "num_worst_tokens": worst,
                                     "previous_event": buffer.capture() if case.previous_mode else None})
        _wait(wout.event, case.async_mode)
        m = handle.recv_src_idx.size(0)
        assert wout.num_recv_tokens_per_expert_list == [], "worst-token mode returns an empty per-expert list"
        recv = wout.recv_x[0] if case.use_fp8 else wout.recv_x
        assert recv.size(0) == worst and wout.recv_topk_idx.size(0) == worst
        _eq("worst recv_x", recv[:m], ref.recv_x[0] if case.use_fp8 else ref.recv_x)
        _eq("worst recv_topk_idx", wout.recv_topk_idx[:m], ref.recv_topk_idx)
        _eq("worst recv_topk_weights", wout.recv_topk_weights[:m], ref.recv_topk_weights)
        assert bool((wout.recv_topk_idx[m:] == -1).all()), "worst-token rows past M must have recv_topk_idx == -1"

    # ---- combine ----
    gen = torch.Generator().manual_seed(case.seed * 7 + 1)
    ys = [torch.randint(-8, 9, (dispatched[r].handle.recv_src_idx.size(0), case.hidden), generator=gen)
          .to(torch.bfloat16) for r in range(case.num_ranks)]
    bias = [inp["bias"] for inp in inputs]
    bias_arg = None
    if case.num_bias:
        bias_arg = _to_cuda(bias[rank]) if case.num_bias == 2 else _to_cuda(bias[rank][0])
    ref_kwargs = {}
    if case.num_bias:
        ref_kwargs["bias"] = [b if case.num_bias == 2 else b[0] for b in bias]
    if case.with_topk:
        ref_kwargs["topk_weights"] = [d.recv_topk_weights for d in dispatched]
    ref_comb = reference.combine(ys, [d.handle for d in dispatched], topo, **ref_kwargs)[rank]
    _poison_allocator()
    epoch = _copy_epoch(buffer)
    comb = buffer.combine(ys[rank].to(DEVICE), handle, topk_weights=out.recv_topk_weights if case.with_topk else None,
                          bias=bias_arg, config=config, async_finish=case.async_mode,
                          previous_event=buffer.capture() if case.previous_mode else None,
                          allocate_on_comm_stream=on_comm)
    _wait(comb.event, case.async_mode)
    _eq("combined_x", comb.combined_x, ref_comb[0])
    if case.with_topk:
        _eq("combined_topk_weights", comb.combined_topk_weights, ref_comb[1])
    else:
        assert comb.combined_topk_weights is None
    _expect_combine_path(buffer, handle, case, epoch, "combine")
    # Combine must leave the handle usable: a second combine gives the same bits, by the other send path.
    with deep_ep.testing.overrides(combine_send="copy" if case.combine_send == "rings" else "rings"):
        again = buffer.combine(ys[rank].to(DEVICE), handle, bias=bias_arg, config=config)
    _eq("second combined_x", again.combined_x, ref_comb[0])
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return "ok"


@tuned
def task_graph(buffer, rank: int, case: Case) -> str:
    """Worst-token dispatch -> toy expert (x * 2) -> combine captured in one CUDA graph, replayed on fresh inputs,
    interleaved with eager calls; every replay is compared with the reference."""
    import deep_ep
    import reference
    config = deep_ep.Config(case.num_sms, 8, 256)
    worst = sum(case.num_tokens) + 1
    n, h, k = case.num_tokens[rank], case.hidden, case.num_topk
    static_x = torch.zeros(n, h, dtype=torch.bfloat16, device=DEVICE)
    static_idx = torch.full((n, k), -1, dtype=make_inputs(case, rank)["topk_idx"].dtype, device=DEVICE)
    static_w = torch.zeros(n, k, dtype=torch.float32, device=DEVICE)
    static_rank = torch.zeros(case.num_ranks, dtype=torch.int32, device=DEVICE)
    static_expert = torch.zeros(case.num_experts, dtype=torch.int32, device=DEVICE)
    static_in_rank = torch.zeros(n, case.num_ranks, dtype=torch.bool, device=DEVICE)

    def step():
        d = buffer.dispatch(static_x, num_tokens_per_rank=static_rank, is_token_in_rank=static_in_rank,
                            num_tokens_per_expert=static_expert, topk_idx=static_idx, topk_weights=static_w,
                            num_worst_tokens=worst, config=config)
        y = d.recv_x * 2
        c = buffer.combine(y, d.handle, topk_weights=d.recv_topk_weights, config=config)
        return d, c

    def load(seed_offset: int) -> list:
        sub = Case(**{**asdict(case), "seed": case.seed + seed_offset, "use_fp8": False, "with_topk": True})
        inputs = [make_inputs(sub, r) for r in range(case.num_ranks)]
        from deep_ep.config import Topology
        lay = reference.get_dispatch_layout(inputs[rank]["topk_idx"], case.num_experts,
                                            Topology(case.num_ranks, case.num_ranks))
        static_x.copy_(inputs[rank]["x"])
        static_idx.copy_(inputs[rank]["topk_idx"])
        static_w.copy_(inputs[rank]["topk_weights"])
        static_rank.copy_(lay.num_tokens_per_rank)
        static_expert.copy_(lay.num_tokens_per_expert)
        static_in_rank.copy_(lay.is_token_in_rank)
        return inputs

    def check(inputs, d, c, label: str) -> None:
        from deep_ep.config import Topology
        topo = Topology(case.num_ranks, case.num_ranks)
        layouts = [reference.get_dispatch_layout(i["topk_idx"], case.num_experts, topo) for i in inputs]
        refs = reference.dispatch([i["x"] for i in inputs], [lay.is_token_in_rank for lay in layouts], topo,
                                  topk_idx=[i["topk_idx"] for i in inputs],
                                  topk_weights=[i["topk_weights"] for i in inputs], num_experts=case.num_experts,
                                  num_channels=d.handle.channel_prefix_matrix.size(1))
        m = refs[rank].recv_x.size(0)
        _eq(f"{label} recv_x", d.recv_x[:m], refs[rank].recv_x)
        _eq(f"{label} recv_topk_idx", d.recv_topk_idx[:m], refs[rank].recv_topk_idx)
        assert bool((d.recv_topk_idx[m:] == -1).all())
        ys = [(r.recv_x.float() * 2).to(torch.bfloat16) for r in refs]
        want = reference.combine(ys, [r.handle for r in refs], topo,
                                 topk_weights=[r.recv_topk_weights for r in refs])[rank]
        _eq(f"{label} combined_x", c.combined_x, want[0])
        _eq(f"{label} combined_topk_weights", c.combined_topk_weights, want[1])

    inputs = load(0)
    d, c = step()  # eager warm-up (allocator pools, lazy init)
    torch.cuda.synchronize()
    check(inputs, d, c, "eager")
    _expect_path(buffer, d.recv_x, case.receive, rank, "eager")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        gd, gc = step()
    if DEVICE == "cuda":
        assert not _in_pool(buffer, gd.recv_x), "a dispatch captured in a CUDA graph must receive through the rings"
    for replay in range(3):
        inputs = load(100 + replay)
        graph.replay()
        torch.cuda.synchronize()
        check(inputs, gd, gc, f"replay {replay}")
        inputs = load(200 + replay)  # an eager call between replays keeps the device sequence words in step
        d, c = step()
        torch.cuda.synchronize()
        check(inputs, d, c, f"eager after replay {replay}")
    return "ok"


def task_stall(buffer, rank: int, payload: dict) -> str:
    """Rank ``payload['stalled']`` skips a dispatch (or, with ``op='combine'``, the combine by the send path
    ``payload['combine_send']``, None: the library's choice); the others must get a timeout exception naming the
    peer, and a usable CUDA context afterwards."""
    import deep_ep.testing
    with deep_ep.testing.overrides(combine_send=payload.get("combine_send")):
        return _stall(buffer, rank, payload)


def _stall(buffer, rank: int, payload: dict) -> str:
    import time

    import deep_ep
    stalled = payload["stalled"]
    if rank == stalled and payload.get("kill"):  # a killed peer: gone without a word, its process torn down
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
    n, h = 4096, 1024
    x = torch.ones(n, h, dtype=torch.bfloat16, device=DEVICE)
    config = deep_ep.Config(4, 8, 256)
    in_rank = torch.ones(n, buffer.group_size, dtype=torch.bool, device=DEVICE)
    per_rank = torch.full((buffer.group_size,), n, dtype=torch.int32, device=DEVICE)
    per_expert = torch.zeros(buffer.group_size, dtype=torch.int32, device=DEVICE)
    per_expert[:] = n
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    if buffer.topology.is_internode:  # test_internode.py: every token goes to every node too
        layout["num_tokens_per_rdma_rank"] = torch.full((buffer.topology.num_scaleout_ranks,), n, dtype=torch.int32,
                                                        device=DEVICE)
    op = payload.get("op", "dispatch")
    if op == "combine":  # every rank dispatches; the stalled one then skips the combine
        handle = buffer.dispatch(x, config=config, **layout).handle
        torch.cuda.synchronize()
    if rank == stalled:
        return "stalled"
    if op == "combine" and payload.get("combine_send") in ("copy", "zone") and not buffer.topology.is_internode:
        counts = _pair_counts(handle)
        assert counts and buffer.runtime.runtime.would_copy(counts, h, 0), "the landing zones must apply here"
    start = time.monotonic()
    try:
        if op == "combine":
            y = torch.ones(handle.recv_src_idx.size(0), h, dtype=torch.bfloat16, device=DEVICE)
            buffer.combine(y, handle, config=config)
            torch.cuda.synchronize()
            buffer.combine(y, handle, config=config)  # the error record is read at the next call at the latest
        else:
            buffer.dispatch(x, config=config, **layout)
            torch.cuda.synchronize()
            buffer.dispatch(x, config=config, **layout)  # the error record is read at the next call at the latest
    except TimeoutError as exc:
        elapsed = time.monotonic() - start
        text = str(exc)
        peer = payload.get("expect_peer", {}).get(rank, stalled)  # a later rank can wait for one that gave up first
        # "rank R peer P" (kernels), "rank R timed out ... from peer P" (a torch stage's point-to-point wait) or
        # "... from all ranks" (a torch stage's collective: expect_peer "all ranks")
        who = "all ranks" if peer == "all ranks" else f"peer {peer}"
        assert re.search(rf"\brank {rank}\b.*\b{who}\b", text), f"timeout message lacks rank {rank} / {who}: {text}"
        assert elapsed < float(payload["timeout_s"]) * 3 + 30, f"timeout took {elapsed:.1f} s"
        # The CUDA context must still work.
        assert float((torch.ones(4, device=DEVICE) * 2).sum()) == 8.0
        return f"timeout after {elapsed:.1f} s: {text}"
    raise AssertionError(f"{op} with a stalled peer did not raise a timeout")


def task_bad_routing(buffer, rank: int, payload: dict) -> str:
    """Inconsistent inputs that make DeepEP hang must raise here instead, on every rank, and leave a usable Buffer
    after a collective reset: (a) rank 0's num_tokens_per_rank disagrees with its is_token_in_rank; (b) more rows
    arrive than num_worst_tokens allows."""
    import deep_ep
    from deep_ep import CommError
    n, h, world = 64, 256, buffer.group_size
    config = deep_ep.Config(4, 8, 256)
    x = torch.ones(n, h, dtype=torch.bfloat16, device=DEVICE)
    in_rank = torch.ones(n, world, dtype=torch.bool, device=DEVICE)
    per_rank = torch.full((world,), n, dtype=torch.int32, device=DEVICE)
    per_expert = torch.full((world,), n, dtype=torch.int32, device=DEVICE)
    if rank == 0:
        per_rank[world - 1] += 1  # the lie
    seen = []
    try:
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        config=config)
        torch.cuda.synchronize()
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        config=config)
    except CommError as exc:
        seen.append(f"counts: {type(exc).__name__}: {exc}")
    else:
        raise AssertionError("num_tokens_per_rank inconsistent with is_token_in_rank did not raise")
    if rank == 0:
        assert "count mismatch" in seen[0], seen[0]
    buffer.runtime.reset()

    # (b) worst-token mode with too few rows: every rank receives n * world rows but allows n.
    per_rank[:] = n
    topk_idx = torch.arange(world, device=DEVICE).repeat(n, 1).to(deep_ep.topk_idx_t)
    weights = torch.ones(n, world, dtype=torch.float32, device=DEVICE)
    try:
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=topk_idx, topk_weights=weights, num_worst_tokens=n, config=config)
        torch.cuda.synchronize()
        buffer.runtime.check_errors()
    except CommError as exc:
        seen.append(f"worst: {type(exc).__name__}: {exc}")
    else:
        raise AssertionError("num_worst_tokens smaller than the received rows did not raise")
    buffer.runtime.reset()
    # The Buffer works again.
    out = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                          num_tokens_per_expert=per_expert, config=config)
    assert out.recv_x.size(0) == n * world and bool((out.recv_x == 1).all())
    return " | ".join(seen)


def task_disagree(buffer, rank: int, payload: dict) -> str:
    """Rank 1 differs from rank 0 in one argument per step (hidden size, dtype, expert count, top-k, config,
    top-k given or not): every rank raises ArgumentMismatchError naming it, well under a second, and no dispatch kernel
    runs; rank 1 refuses its own num_tokens_per_rank: rank 0 raises at once; a worst-token dispatch whose hidden sizes
    differ raises at the next call. After each, a correct dispatch and combine give every rank's rows in (source rank,
    token) order and their sum."""
    import time

    import deep_ep
    n, h, world = 32, 256, buffer.group_size
    num_experts, config = 2 * world, deep_ep.Config(4, 8, 256)
    x = _pattern_x(rank, n, h, 0).to(DEVICE)
    # Every token selects expert 2r on every rank r: all rows reach every rank.
    topk_idx = (torch.arange(world, device=DEVICE) * 2).repeat(n, 1).to(deep_ep.topk_idx_t)
    weights = torch.ones(n, world, dtype=torch.float32, device=DEVICE)

    def dispatch(data=x, idx=topk_idx, w=weights, experts=num_experts, cfg=config, **kwargs):
        layout = buffer.get_dispatch_layout(idx if idx is not None else topk_idx, experts)
        torch.cuda.synchronize()
        start = time.monotonic()
        try:
            return buffer.dispatch(data, num_tokens_per_rank=kwargs.pop("per_rank", layout.num_tokens_per_rank),
                                   is_token_in_rank=layout.is_token_in_rank,
                                   num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=idx, topk_weights=w,
                                   config=cfg, **kwargs)
        finally:
            dispatch.elapsed = time.monotonic() - start

    def correct(label: str) -> None:
        d = dispatch()
        want = torch.cat([_pattern_x(r, n, h, 0) for r in range(world)]).to(DEVICE)
        assert torch.equal(d.recv_x, want), f"after {label}: recv_x differs from every rank's rows in rank order"
        c = buffer.combine(d.recv_x, d.handle, config=config)
        torch.cuda.synchronize()
        assert torch.equal(c.combined_x.float(), x.float() * world), f"after {label}: combine differs"

    other = rank == 1
    wide_idx = (torch.arange(world, device=DEVICE) * 4).repeat(n, 1).to(deep_ep.topk_idx_t)
    steps = [
        ("x.size(1) (hidden)", dict(data=torch.cat([x, x], 1) if other else x)),
        ("x.dtype", dict(data=x.to(torch.float16) if other else x)),
        ("num_experts", dict(idx=wide_idx if other else topk_idx, experts=2 * num_experts if other else num_experts)),
        ("num_topk", dict(idx=topk_idx[:, :1].contiguous() if other else topk_idx,
                          w=weights[:, :1].contiguous() if other else weights)),
        ("config", dict(cfg=deep_ep.Config(6, 8, 256) if other else config)),
        ("topk_idx given", dict(idx=None if other else topk_idx, w=None if other else weights)),
    ]
    seen = []
    correct("start")
    for name, kwargs in steps:
        try:
            dispatch(**kwargs)
        except deep_ep.ArgumentMismatchError as exc:
            assert name in str(exc), f"{name}: {exc}"
            assert dispatch.elapsed < 1.0, f"{name}: raised after {dispatch.elapsed:.3f} s"
            seen.append(f"{name}: {dispatch.elapsed * 1e3:.0f} ms")
        else:
            raise AssertionError(f"{name} differing between the ranks did not raise")
        correct(name)
    # Rank 1's own validation fails: it raises its error, rank 0 ArgumentMismatchError naming rank 1.
    try:
        dispatch(**(dict(per_rank=torch.zeros(world, dtype=torch.int64, device=DEVICE)) if other else {}))
    except (TypeError, ValueError) as exc:
        assert dispatch.elapsed < 1.0, f"refusal: raised after {dispatch.elapsed:.3f} s"
        if other:
            assert not isinstance(exc, deep_ep.ArgumentMismatchError) and "num_tokens_per_rank" in str(exc), exc
        else:
            assert isinstance(exc, deep_ep.ArgumentMismatchError) and "rank 1 (num_tokens_per_rank)" in str(exc), exc
        seen.append(f"refusal: {dispatch.elapsed * 1e3:.0f} ms")
    else:
        raise AssertionError("a refusal on rank 1 did not raise")
    correct("refusal")
    # Worst-token mode: no host wait, so the next call raises (on every rank: it waits for the notify first).
    dispatch(data=torch.cat([x, x], 1) if other else x, num_worst_tokens=n * world)
    try:
        dispatch()
    except deep_ep.ArgumentMismatchError as exc:
        assert "x.size(1) (hidden)" in str(exc), str(exc)
        seen.append("worst: at the next call")
    else:
        raise AssertionError("a worst-token dispatch with differing hidden sizes did not raise at the next call")
    correct("worst")
    return "; ".join(seen)


def _raises_mismatch_promptly(call, needle, label: str, world: int, rank: int, not_raised: str) -> str:
    """``call()`` (the call after one the ranks disagreed on) raises ArgumentMismatchError mentioning ``needle`` (a
    string, or each string of a tuple) and, with two ranks, the peer, within a second; returns "``label``: N ms"."""
    import time

    import deep_ep
    start = time.monotonic()
    try:
        call()
    except deep_ep.ArgumentMismatchError as exc:
        elapsed = time.monotonic() - start
        assert all(n in str(exc) for n in ((needle,) if isinstance(needle, str) else needle)), f"{label}: {exc}"
        assert world != 2 or f"peer {1 - rank}" in str(exc), f"{label}: {exc}"
        assert elapsed < 1.0, f"{label}: raised after {elapsed:.3f} s"
        return f"{label}: {elapsed * 1e3:.0f} ms"
    raise AssertionError(not_raised)


def task_cached_disagree(buffer, rank: int, payload: dict) -> str:
    """Rank 1 passes a cached dispatch a different hidden size, dtype, FP8 payload or config chunking: its kernel
    moves no row on any rank, and every rank's next call raises ArgumentMismatchError naming the cached dispatch,
    well under a second, before it launches anything. Then rank 1 refuses a cached dispatch (a row too few): it
    raises its own ValueError at once, and every rank's next call raises as above. After each, a correct cached
    dispatch and combine give every rank's rows in (source rank, token) order and their sum (the rings and epochs
    stayed in step). Last, rank 1 passes a handle that is not the Buffer's (a plain tuple of its fields): it refuses
    and launches the kernel over a stand-in handle, with the same outcome."""
    import deep_ep
    n, h, world = 32, 256, buffer.group_size
    num_experts, config = 2 * world, deep_ep.Config(4, 8, 256)
    x = _pattern_x(rank, n, h, 0).to(DEVICE)
    # Every token selects expert 2r on every rank r: all rows reach every rank.
    topk_idx = (torch.arange(world, device=DEVICE) * 2).repeat(n, 1).to(deep_ep.topk_idx_t)
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    handle = buffer.dispatch(x, num_tokens_per_rank=layout.num_tokens_per_rank,
                             num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank,
                             is_token_in_rank=layout.is_token_in_rank,
                             num_tokens_per_expert=layout.num_tokens_per_expert, config=config).handle
    want = torch.cat([_pattern_x(r, n, h, 0) for r in range(world)]).to(DEVICE)

    def correct(label: str) -> None:
        recv_x = buffer.dispatch(x, handle=handle, config=config).recv_x
        assert torch.equal(recv_x, want), f"after {label}: the cached recv_x differs from every rank's rows"
        c = buffer.combine(recv_x, handle, config=config)
        torch.cuda.synchronize()
        assert torch.equal(c.combined_x.float(), x.float() * world), f"after {label}: combine differs"

    other = rank == 1
    fp8 = (x.to(torch.float8_e4m3fn), torch.ones(n, h // 128, dtype=torch.float32, device=DEVICE))
    steps = [("hidden", torch.cat([x, x], 1) if other else x, config, handle),
             ("dtype", x.to(torch.float16) if other else x, config, handle),
             ("FP8", fp8 if other else x, config, handle),
             ("config", x, deep_ep.Config(4, 6, 256) if other else config, handle),
             ("refusal", x[:-1] if other else x, config, handle),
             ("handle", x, config, tuple(handle) if other else handle)]
    seen = []
    correct("start")
    for name, data, cfg, passed in steps:
        refused = False
        try:
            buffer.dispatch(data, handle=passed, config=cfg)
        except ValueError as exc:
            assert not isinstance(exc, deep_ep.ArgumentMismatchError), str(exc)
            assert str(exc).startswith("handle was not" if name == "handle" else "x must"), str(exc)
            refused = True
        assert refused == (name in ("refusal", "handle") and other), f"{name}: the call itself raised: {refused}"
        seen.append(_raises_mismatch_promptly(
            functools.partial(buffer.dispatch, x, handle=handle, config=config), "cached dispatch", name, world, rank,
            f"a cached dispatch whose {name} differs between the ranks did not raise"))
        correct(name)
    return "; ".join(seen)


def task_combine_disagree(buffer, rank: int, payload: Optional[dict]) -> str:
    """On each combine send path (copy engine, rings, zone senders; ``payload["paths"]``, when given, names the
    backend's), rank 1 passes a combine a different hidden size, topk_weights where rank 0 passes none, a bias where
    rank 0 passes none, a different config chunking, and (with several paths) hidden sizes that differ while the two
    ranks take different send paths: the kernels move no row on any rank, and every rank's next call raises
    ArgumentMismatchError naming the combine, well under a second, before it launches anything. Then rank 1 refuses
    a combine (a row too few, an FP16 x, then a handle that is not the Buffer's, whose refusal runs the kernel over
    a stand-in handle): it raises its own ValueError / TypeError at once, and every rank's
    next call raises as above. After each, a correct dispatch and combine give every rank's rows in (source rank,
    token) order and their sum (rings, landing-zone epochs and combine call numbers stayed in step)."""
    import time

    import deep_ep
    import deep_ep.testing
    paths = tuple((payload or {}).get("paths", ("copy", "rings", "zone")))
    n, h, world = 32, 256, buffer.group_size
    num_experts, config = 2 * world, deep_ep.Config(4, 8, 256)
    x = _pattern_x(rank, n, h, 0).to(DEVICE)
    # Every token selects expert 2r on every rank r: all rows reach every rank.
    topk_idx = (torch.arange(world, device=DEVICE) * 2).repeat(n, 1).to(deep_ep.topk_idx_t)
    weights = torch.ones(n, world, dtype=torch.float32, device=DEVICE)
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    want = torch.cat([_pattern_x(r, n, h, 0) for r in range(world)]).to(DEVICE)

    def dispatch():
        return buffer.dispatch(x, num_tokens_per_rank=layout.num_tokens_per_rank,
                               num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank,
                               is_token_in_rank=layout.is_token_in_rank,
                               num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=topk_idx,
                               topk_weights=weights, config=config)

    def correct(label: str, path: str):
        d = dispatch()
        assert torch.equal(d.recv_x, want), f"after {label}: recv_x differs from every rank's rows in rank order"
        epoch = _copy_epoch(buffer)
        c = buffer.combine(d.recv_x, d.handle, topk_weights=d.recv_topk_weights, config=config)
        torch.cuda.synchronize()
        assert torch.equal(c.combined_x.float(), x.float() * world), f"after {label}: combine differs"
        # Rank d's received weights are 1 in column d (its expert) and 0 elsewhere: their sum is every weight.
        assert torch.equal(c.combined_topk_weights, weights), f"after {label}: combined weights differ"
        assert (_copy_epoch(buffer) > epoch) == (path != "rings"), f"after {label}: not the {path} send path"
        return d

    other = rank == 1
    seen = []
    # Rank 1's own refusals: the exception type and the start of its message.
    refusals = {"refusal": (ValueError, "x must have the"), "dtype": (TypeError, "x must have dtype"),
                "handle": (ValueError, "handle was not returned")}
    for path in paths:
        with deep_ep.testing.overrides(combine_send=path):
            d = correct(f"{path} start", path)
            y, handle, w = d.recv_x, d.handle, d.recv_topk_weights
            bias = torch.ones(n, h, dtype=torch.bfloat16, device=DEVICE)
            steps = [("hidden", dict(x=torch.cat([y, y], 1) if other else y), path),
                     ("topk_weights", dict(topk_weights=w if other else None), path),
                     ("bias", dict(bias=bias if other else None), path),
                     ("config", dict(config=deep_ep.Config(4, 6, 256) if other else config), path),
                     ("paths", dict(x=torch.cat([y, y], 1) if other else y), "rings" if other else path),
                     ("refusal", dict(x=y[:-1] if other else y), path),
                     ("dtype", dict(x=y.to(torch.float16) if other else y), path),
                     ("handle", dict(handle=tuple(handle) if other else handle), path)]
            for name, kwargs, own_path in steps:
                if name == "paths" and len(paths) == 1:
                    continue
                call = {"x": y, "handle": handle, "config": config, **kwargs}
                refused = False
                start = time.monotonic()
                try:
                    with deep_ep.testing.overrides(combine_send=own_path):
                        buffer.combine(**call)
                except (TypeError, ValueError) as exc:
                    kind, prefix = refusals.get(name, (None, None))
                    assert type(exc) is kind and str(exc).startswith(prefix), f"{path} {name}: {exc!r}"
                    assert time.monotonic() - start < 1.0, f"{path} {name}: the refusal took too long"
                    refused = True
                assert refused == (name in refusals and other), f"{path} {name}: the call itself raised: {refused}"
                seen.append(_raises_mismatch_promptly(
                    functools.partial(buffer.combine, y, handle, config=config), "combine call signatures differ",
                    f"{path} {name}", world, rank,
                    f"{path}: a combine whose {name} differs between the ranks did not raise"))
                correct(f"{path} {name}", path)
    return "; ".join(seen)


def task_graph_disagree(buffer, rank: int, payload: Optional[dict]) -> str:
    """Every rank captures a combine in a CUDA graph, rank 1 with twice the hidden size: at the replay every rank's
    kernel compares the hashes (checked calls are numbered on the device, so a replay takes a new number) and moves
    no row, and every rank's next call raises ArgumentMismatchError naming the combine well under a second after
    the replay. Then every rank captures the same combine: three replays, each followed by an eager dispatch and
    combine, all give every rank's sum (the ranks' checked-call numbers stayed in step)."""
    import time

    import deep_ep
    n, h, world = 32, 256, buffer.group_size
    num_experts, config = 2 * world, deep_ep.Config(4, 8, 256)
    x = _pattern_x(rank, n, h, 0).to(DEVICE)
    # Every token selects expert 2r on every rank r: all rows reach every rank.
    topk_idx = (torch.arange(world, device=DEVICE) * 2).repeat(n, 1).to(deep_ep.topk_idx_t)
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)

    def dispatch():
        return buffer.dispatch(x, num_tokens_per_rank=layout.num_tokens_per_rank,
                               num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank,
                               is_token_in_rank=layout.is_token_in_rank,
                               num_tokens_per_expert=layout.num_tokens_per_expert, config=config)

    def eager(label: str) -> None:
        d = dispatch()
        c = buffer.combine(d.recv_x, d.handle, config=config)
        torch.cuda.synchronize()
        assert torch.equal(c.combined_x.float(), x.float() * world), f"{label}: the eager combine differs"

    d = dispatch()
    y, handle = d.recv_x.clone(), d.handle
    eager("start")
    captured = []
    for label, wide in (("disagreeing", rank == 1), ("agreeing", False)):
        graph = torch.cuda.CUDAGraph()
        staged = torch.cat([y, y], 1) if wide else y.clone()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = buffer.combine(staged, handle, config=config)
        captured.append((label, graph, out))
    label, graph, _ = captured[0]
    start = time.monotonic()
    graph.replay()
    torch.cuda.synchronize()
    seen = _raises_mismatch_promptly(lambda: eager("after the disagreeing replay"), "combine call signatures differ",
                                     "replay", world, rank, "a replayed combine whose hidden differs did not raise")
    elapsed = time.monotonic() - start
    assert elapsed < 1.0, f"raised {elapsed:.3f} s after the replay"
    eager("after the disagreement")
    label, graph, out = captured[1]
    for replay in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.combined_x.float(), x.float() * world), f"replay {replay}: the combine differs"
        eager(f"after replay {replay}")
    return seen


def _pattern_x(rank: int, n: int, h: int, salt: int) -> torch.Tensor:
    """Rows that identify (rank, token, salt); small integers, exact in BF16."""
    t = torch.arange(n, dtype=torch.int64).view(n, 1)
    j = torch.arange(h, dtype=torch.int64).view(1, h)
    return (((rank * 131 + t * 7 + j + salt * 17) % 61) - 30).to(torch.bfloat16)


def task_pool_lifetime(buffer, rank: int, payload: dict) -> str:
    """Direct-to-output bookkeeping on real kernels (every token goes to every rank, so recv_x is the sources' x
    concatenated): outputs kept alive while later calls run stay intact; when the pool is full, 'auto' falls back to
    the rings and 'direct' raises; blocks come back once their tensors are gone."""
    import deep_ep
    import deep_ep.testing
    n, h, world = payload["num_tokens"], payload["hidden"], buffer.group_size
    config = deep_ep.Config(payload["num_sms"], 8, 256)
    in_rank = torch.ones(n, world, dtype=torch.bool, device=DEVICE)
    per_rank = torch.full((world,), n, dtype=torch.int32, device=DEVICE)
    per_expert = torch.full((world,), n, dtype=torch.int32, device=DEVICE)

    def reclaim() -> None:  # blocks of dead tensors: events recorded, then (after the sync) complete
        buffer.runtime.reclaim_pool_blocks()
        torch.cuda.synchronize()
        buffer.runtime.reclaim_pool_blocks()

    reclaim()
    _poison_pool(buffer)

    def call(salt: int):
        x = _pattern_x(rank, n, h, salt).to(DEVICE)
        out = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, config=config)
        want = torch.cat([_pattern_x(r, n, h, salt) for r in range(world)])
        return out, want

    kept, paths = [], []
    for salt in range(64):
        out, want = call(salt)
        kept.append((out, want, salt))
        paths.append(_in_pool(buffer, out.recv_x))
        if not paths[-1]:
            break
    torch.cuda.synchronize()
    assert paths[0], "the first dispatch did not use the output pool"
    assert not paths[-1], f"the pool never filled up in {len(paths)} calls"
    for out, want, salt in kept:  # every kept output survived the later calls
        _eq(f"kept recv_x (call {salt}, {'pool' if paths[salt] else 'rings'})", out.recv_x, want)
        _eq(f"kept recv_src_idx (call {salt})", out.handle.recv_src_idx,
            torch.arange(n, dtype=torch.int32).repeat(world))
    # A cached call with the pool full: 'direct' raises on every rank (before any kernel), 'auto' uses the rings.
    handle = kept[0][0].handle
    x0 = _pattern_x(rank, n, h, 0).to(DEVICE)
    try:
        with deep_ep.testing.overrides(dispatch_receive="direct"):
            buffer.dispatch(x0, handle=handle, config=config)
    except RuntimeError as exc:
        assert "no room" in str(exc), str(exc)
    else:
        raise AssertionError("'direct' dispatch with a full pool did not raise")
    ring_out = buffer.dispatch(x0, handle=handle, config=config)
    assert not _in_pool(buffer, ring_out.recv_x)
    _eq("cached recv_x with a full pool", ring_out.recv_x, kept[0][1])
    # Keep only the first output (as if saved for backward): the freed blocks come back for the next calls.
    first = kept[0]
    del kept, out, want, ring_out
    reclaim()
    for salt in range(100, 104):  # each output dies before the next call, whose dispatch may reuse its block
        out, want = call(salt)
        assert _in_pool(buffer, out.recv_x), "freed pool blocks were not reused"
        _eq(f"recv_x after reuse (call {salt})", out.recv_x, want)
        del out, want
    torch.cuda.synchronize()
    _eq("first recv_x after many later calls", first[0].recv_x, first[1])
    return f"{paths.count(True)} calls fit the pool"


def task_sequence(buffer, rank: int, cases: list) -> str:
    """Several examples back to back with no host barrier in between (one rank may run a call ahead of its peers,
    and the ring geometry changes from call to call: SM count, hidden size, top-k)."""
    for i, case in enumerate(cases):
        try:
            task_roundtrip(buffer, rank, case)
        except Exception as exc:
            raise AssertionError(f"example {i} of {len(cases)} in the sequence failed: {case.describe()}") from exc
    return "ok"


def task_reset(buffer, rank: int, payload) -> str:
    """Collective recovery after a failed example: wait for the GPU (failed kernels end at their timeout), clear
    the error record and the kernels' private state on every rank."""
    buffer.runtime.reset()
    return "reset"


def task_roundtrip_cuda_default(buffer, rank: int, case: Case) -> str:
    """``task_roundtrip`` with every Buffer call under ``torch.set_default_device("cuda")``, as DeepEP's own test
    scripts set it (the test's own input generation keeps the default)."""
    from test_misuse import OnDefaultDevice
    return task_roundtrip(OnDefaultDevice(buffer, "cuda"), rank, case)


TASKS: dict[str, Callable] = {"roundtrip": task_roundtrip, "graph": task_graph, "stall": task_stall,
                              "sequence": task_sequence, "bad_routing": task_bad_routing, "reset": task_reset,
                              "pool_lifetime": task_pool_lifetime, "disagree": task_disagree,
                              "cached_disagree": task_cached_disagree, "combine_disagree": task_combine_disagree,
                              "graph_disagree": task_graph_disagree,
                              "roundtrip_cuda_default": task_roundtrip_cuda_default}


# ----------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------
def gpu_settings(max_examples: int) -> settings:
    """Few examples (each launches real kernels on every rank), no deadline, fixtures shared across examples."""
    # No shrinking: every example costs GPU time, and the first failing example is the informative one.
    return settings(max_examples=max_examples, deadline=None, database=None, print_blob=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate], report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@gpu_settings(int(os.environ.get("TEST_EXAMPLES_1", "12")))
@given(case=case_strategy(1, max_tokens=600))
def test_one_rank(pools, case):
    pools(1).run("roundtrip", case)


@pytest.mark.parametrize("world", [2, 3, 4])
@gpu_settings(int(os.environ.get("TEST_EXAMPLES_SHARED", "6")))
@given(data=st.data())
def test_ranks_sharing_one_gpu(pools, world, data):
    case = data.draw(case_strategy(world, max_tokens=200))
    pools(world).run("roundtrip", case)


@pytest.mark.multi_gpu
@gpu_settings(int(os.environ.get("TEST_EXAMPLES_2GPU", "15")))
@given(case=case_strategy(2, max_tokens=1200))
def test_two_gpus(pools, case):
    pools(2, spread=True).run("roundtrip", case)


@pytest.mark.multi_gpu
@gpu_settings(int(os.environ.get("TEST_EXAMPLES_NCCL", "6")))
@given(case=case_strategy(2, max_tokens=600))
def test_torch_backend_over_nccl(nccl_torch_pool, case):
    """The torch backend's CUDA path (comm stream, events, NCCL batch_isend_irecv of CUDA rows): what a cluster runs
    where the kernels do not serve the group (one GPU per node beyond NUM_MAX_RING_RANKS nodes, the composed path's
    torch rail). Two ranks on two GPUs over NCCL (NCCL refuses two ranks of one communicator on one GPU), the same
    round trip against the reference as the kernels' tests."""
    nccl_torch_pool.run("roundtrip", case)


@gpu_settings(int(os.environ.get("TEST_EXAMPLES_GLOO", "4")))
@given(case=case_strategy(2, max_tokens=600))
def test_torch_backend_over_gloo_with_cuda_default_device(gloo_torch_pool, case):
    """The torch backend with CUDA tensors over a gloo group, two ranks sharing GPU 0 (how DeepEP's own scripts run
    on one GPU): rows cross through page-locked host staging, and every Buffer call runs under
    ``torch.set_default_device("cuda")`` (host-side allocations must name their device). Against the reference."""
    gloo_torch_pool.run("roundtrip_cuda_default", case)


@pytest.fixture(scope="module")
def gloo_torch_pool():
    pool = Pool(_devices(2, spread=False), env={"DEEP_EP_BACKEND": "torch"})
    try:
        assert pool.backends == {"TorchBackend"}, f"DEEP_EP_BACKEND=torch gave {pool.backends}"
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def nccl_torch_pool():
    if torch.cuda.device_count() < 2:  # TEST_RANKS_PER_GPU may admit the test on one GPU: NCCL refuses that
        pytest.skip(f"NCCL needs a GPU per rank: 2 ranks, {torch.cuda.device_count()} GPU(s)")
    pool = Pool(_devices(2, spread=True), env={"DEEP_EP_BACKEND": "torch", "TEST_GROUP": "nccl"})
    try:
        assert pool.backends == {"TorchBackend"}, f"DEEP_EP_BACKEND=torch gave {pool.backends}"
        yield pool
    finally:
        pool.close()


@pytest.mark.parametrize("world", [pytest.param(4, marks=pytest.mark.multi_gpu(4)),
                                   pytest.param(8, marks=pytest.mark.multi_gpu(8))])
@gpu_settings(int(os.environ.get("TEST_EXAMPLES_EP", "8")))
@given(data=st.data())
def test_one_rank_per_gpu(pools, world, data):
    """EP4 / EP8: one rank per GPU over NVLink (skipped with fewer GPUs)."""
    case = data.draw(case_strategy(world, max_tokens=1200))
    pools(world, spread=True).run("roundtrip", case)


@pytest.mark.multi_gpu
@gpu_settings(int(os.environ.get("TEST_EXAMPLES_SEQ", "3")))
@given(cases=st.lists(case_strategy(2, max_tokens=600), min_size=3, max_size=5))
def test_two_gpus_back_to_back(pools, cases):
    pools(2, spread=True).run("sequence", cases)


@pytest.mark.parametrize("world,spread", [(1, False), (2, True)])
@gpu_settings(2)
@given(data=st.data())
def test_cuda_graph_worst_token(pools, world, spread, data):
    if spread and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    case = data.draw(case_strategy(world, max_tokens=256))
    pools(world, spread).run("graph", case)


@pytest.mark.parametrize("world,spread", [(2, True), (3, False)])
def test_output_pool_lifetime_and_fallback(pools, world, spread):
    """Direct-to-output: long-lived outputs, pool exhaustion (auto -> rings, direct -> error), block reuse."""
    if spread and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    # 2048 tokens x 7168 BF16 per rank: 2048 * world rows of 14 KB per call, so a handful of calls fill the pool.
    replies = pools(world, spread).run("pool_lifetime", {"num_tokens": 2048, "hidden": 7168, "num_sms": 8})
    print(replies)


@pytest.mark.parametrize("world,spread", [(2, True), (3, False)])
def test_bad_routing_raises(pools, world, spread):
    if spread and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    replies = pools(world, spread).run("bad_routing", None)
    print(replies)


def test_disagreeing_ranks_raise_and_recover(pools):
    """Two ranks on one GPU: see task_disagree."""
    print(pools(2).run("disagree", None))


def test_cached_disagreement_raises_at_next_call(pools):
    """Two ranks on one GPU: see task_cached_disagree."""
    if DEVICE != "cuda":
        pytest.skip("the CUDA kernels' agreement (the torch backend raises in the call itself)")
    print(pools(2).run("cached_disagree", None))


def test_combine_disagreement_raises_at_next_call(pools):
    """Two ranks on one GPU: see task_combine_disagree."""
    if DEVICE != "cuda":
        pytest.skip("the CUDA kernels' agreement (the torch backend raises in the call itself)")
    print(pools(2).run("combine_disagree", None))


def test_captured_combine_disagreement_raises_at_next_call(pools):
    """Two ranks on one GPU: see task_graph_disagree."""
    if DEVICE != "cuda":
        pytest.skip("the CUDA kernels' agreement under CUDA-graph capture")
    print(pools(2).run("graph_disagree", None))


def test_killed_peer_times_out():
    """Rank 1's process is killed (SIGKILL) as the dispatch starts: rank 0 gets a timeout exception naming the peer
    within the budget, no hang and no exit, and its CUDA context still works (its kernels keep writing into the
    dead peer's IPC mapping: this checks that the driver keeps that memory valid until rank 0 unmaps it)."""
    timeout_s = 5
    pool = Pool(_devices(2, torch.cuda.device_count() >= 2), env={"DEEP_EP_TIMEOUT_S": str(timeout_s)})
    try:
        replies = pool.run("stall", {"stalled": 1, "timeout_s": timeout_s, "kill": True},
                           timeout=timeout_s * 6 + 60, ranks=[0])
        assert "timeout" in replies[0], replies
    finally:
        pool.kill()


@pytest.mark.parametrize("op, combine_send", [("dispatch", None), ("combine", "copy"), ("combine", "zone"),
                                              ("combine", "rings")])
def test_stalled_peer_times_out(op, combine_send):
    """Rank 1 never joins the dispatch (or the combine, on each send path): rank 0 gets a timeout exception within
    the budget naming the peer, no hang, no exit."""
    timeout_s = 5
    world = 2
    pool = Pool(_devices(world, torch.cuda.device_count() >= 2), env={"DEEP_EP_TIMEOUT_S": str(timeout_s)})
    try:
        replies = pool.run("stall", {"stalled": 1, "timeout_s": timeout_s, "op": op, "combine_send": combine_send},
                           timeout=timeout_s * 6 + 60)
        assert "timeout" in replies[0], replies
    finally:
        # Rank 0's buffer is in the failed state; the pool is discarded (destroy may itself time out).
        for p in pool.procs:
            p.kill()
