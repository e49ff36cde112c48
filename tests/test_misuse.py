"""Failures and misuse of ``deep_ep.Buffer`` on the torch backend (gloo, 2 and 4 ranks): a dead peer raises a
``deep_ep.CommError`` naming rank, peer and phase (and, in shrink mode, the rank to mask); ``DEEP_EP_TIMEOUT_S``
must be finite and positive; dropped receive hooks are drained; misuse of the low-latency double buffer across
calls raises; any low-latency hidden size works on the torch backend; calls ignore ``torch.set_default_device``.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import dist
import pytest
import torch
from fake_cuda import PROBE_HEAD, run_probe

MODULE = "test_misuse"
NUM_TOKENS = 6
HIDDEN = 128
LL_TOKENS = 4
LL_HIDDEN = 256


def _ll_buffer(ctx: dist.WorkerContext, num_experts: int, hidden: int = LL_HIDDEN, **kwargs: Any) -> Any:
    import deep_ep
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, hidden, ctx.world_size, num_experts)
    return deep_ep.Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=1, **kwargs)


def _ll_identity(buf: Any, x: torch.Tensor, idx: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """A BF16 low-latency dispatch and a combine of the received rows with weight 1: returns ``x`` when every
    token has one valid expert."""
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, LL_TOKENS, kwargs.pop("num_experts"), use_fp8=False)
    weights = torch.ones(idx.shape, dtype=torch.float32)
    combined, _, _ = buf.low_latency_combine(recv_x, idx, weights, handle)
    return combined


# ---------------------------------------------------------------------------------------------------------------
# Item: DEEP_EP_TIMEOUT_S is refused at construction unless finite and > 0.
# ---------------------------------------------------------------------------------------------------------------

def run_bad_timeout(ctx: dist.WorkerContext, case: None) -> Optional[str]:
    import deep_ep
    errors = []
    saved = os.environ.get("DEEP_EP_TIMEOUT_S")
    try:
        for value in ("0", "-1", "inf", "nan", "-inf", "soon"):
            os.environ["DEEP_EP_TIMEOUT_S"] = value
            try:
                deep_ep.Buffer(ctx.group, num_nvl_bytes=1 << 20)
            except ValueError as exc:
                if "DEEP_EP_TIMEOUT_S" not in str(exc) or value not in str(exc):
                    errors.append(f"{value}: the error does not name the variable and value: {exc}")
            else:
                errors.append(f"DEEP_EP_TIMEOUT_S={value} was accepted")
        os.environ["DEEP_EP_TIMEOUT_S"] = "0.5"
        deep_ep.Buffer(ctx.group, num_nvl_bytes=1 << 20)
    finally:
        if saved is None:
            os.environ.pop("DEEP_EP_TIMEOUT_S", None)
        else:
            os.environ["DEEP_EP_TIMEOUT_S"] = saved
    return "\n".join(errors) or None


# ---------------------------------------------------------------------------------------------------------------
# Item: a dead peer surfaces as a CommError naming rank, peer and phase; in shrink mode the rank to mask.
# ---------------------------------------------------------------------------------------------------------------

def run_dead_peer(ctx: dist.WorkerContext, mode: str) -> Optional[str]:
    """The last rank dies after a good call; the others' next call raises CommError naming it, and (shrink) masking
    it lets the survivors go on."""
    import time

    import deep_ep
    rank, world = ctx.rank, ctx.world_size
    dead = world - 1
    num_experts = 2 * world
    shrink = mode == "shrink"
    hidden = 1024
    buf = _ll_buffer(ctx, num_experts, hidden, enable_shrink=True) if shrink else deep_ep.Buffer(ctx.group, 1 << 20)
    x = torch.arange(LL_TOKENS * hidden, dtype=torch.float32).view(LL_TOKENS, hidden).remainder(7)
    x = x.to(torch.bfloat16)
    # Every token goes to an expert of the next rank (the dead rank's experts are never chosen after the fault).
    idx = torch.full((LL_TOKENS, 1), 2 * ((rank + 1) % world), dtype=torch.int64)

    def call() -> None:
        if shrink:
            _ll_identity(buf, x, idx, num_experts=num_experts)
        else:
            layout = buf.get_dispatch_layout(idx, num_experts)
            buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                         num_tokens_per_expert=layout[2])

    call()
    ctx.group.barrier() if hasattr(ctx.group, "barrier") else torch.distributed.barrier(group=ctx.group)
    if rank == dead:
        os._exit(0)
    time.sleep(0.5)  # let the survivors' gloo pairs see the closed connection
    start = time.monotonic()
    try:
        call()
    except deep_ep.CommError as exc:
        waited = time.monotonic() - start
        text = str(exc)
        if exc.rank != rank or exc.phase is None:
            return f"CommError attributes rank={exc.rank} phase={exc.phase!r}: {text}"
        if f"rank {rank}" not in text or exc.phase not in text:
            return f"the message does not name this rank and the phase: {text}"
        if shrink and (exc.peer != dead or f"mask rank {dead}" not in text):
            return f"shrink mode: the error does not name rank {dead} to mask (peer={exc.peer}): {text}"
        if waited > 10:
            return f"the fault took {waited:.1f} s to surface"
    except RuntimeError as exc:
        return f"a raw {type(exc).__name__} instead of deep_ep.CommError: {exc}"
    else:
        return "no error although a peer died"
    if not shrink:
        return None
    buf.low_latency_update_mask_buffer(dead, True)
    if rank == dead - 1:
        idx = torch.zeros(LL_TOKENS, 1, dtype=torch.int64)
    combined = _ll_identity(buf, x, idx, num_experts=num_experts)
    if not torch.equal(combined, x):
        return "after masking the dead rank, the survivors' low-latency round trip is wrong"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Items: a dropped receive hook never breaks the group; misuse of the double buffer across calls raises.
# ---------------------------------------------------------------------------------------------------------------

def _ll_case(ctx: dist.WorkerContext) -> tuple[Any, int, torch.Tensor, torch.Tensor]:
    """The pool's low-latency Buffer, E, and this rank's x and routing (every token to one expert of the next
    rank, so that the round trip returns x)."""
    num_experts = 2 * ctx.world_size
    if "ll" not in ctx.cache:
        ctx.cache["ll"] = _ll_buffer(ctx, num_experts, 1024)
    x = (torch.arange(LL_TOKENS * 1024, dtype=torch.float32).view(LL_TOKENS, 1024) + ctx.rank).remainder(11)
    idx = torch.full((LL_TOKENS, 1), 2 * ((ctx.rank + 1) % ctx.world_size) + 1, dtype=torch.int64)
    return ctx.cache["ll"], num_experts, x.to(torch.bfloat16), idx


def _check_round_trips(ctx: dist.WorkerContext) -> Optional[str]:
    """A low-latency and a normal round trip on every rank must return x."""
    import deep_ep
    buf, num_experts, x, idx = _ll_case(ctx)
    if not torch.equal(_ll_identity(buf, x, idx, num_experts=num_experts), x):
        return "the low-latency round trip after the misuse is wrong"
    if "normal" not in ctx.cache:
        ctx.cache["normal"] = deep_ep.Buffer(ctx.group, 1 << 20)
    normal = ctx.cache["normal"]
    layout = normal.get_dispatch_layout(idx, num_experts)
    recv_x, _, _, _, handle, _ = normal.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                 num_tokens_per_expert=layout[2])
    combined, _, _ = normal.combine(recv_x, handle)
    return None if torch.equal(combined, x) else "the normal round trip after the misuse is wrong"


def run_dropped_hook(ctx: dist.WorkerContext, which: str) -> Optional[str]:
    """Rank 0 drops a hook uncalled (its result is garbage), the others call theirs; the next calls all work."""
    import gc
    buf, num_experts, x, idx = _ll_case(ctx)
    recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, LL_TOKENS, num_experts, use_fp8=False,
                                                          return_recv_hook=which == "dispatch")
    if which == "dispatch":  # rank 0 drops its hook, the others call theirs; then every rank goes on
        if ctx.rank == 0:
            del recv_x, handle, hook
            gc.collect()
        else:
            hook()
        return _check_round_trips(ctx)
    weights = torch.ones(LL_TOKENS, 1)
    combined, _, hook = buf.low_latency_combine(recv_x, idx, weights, handle, return_recv_hook=which == "combine")
    if ctx.rank == 0 and which == "combine":
        del combined, hook
        gc.collect()
    elif which == "combine":
        hook()
        if not torch.equal(combined, x):
            return "the combine of the ranks that called their hook is wrong"
    return _check_round_trips(ctx)


def run_third_call(ctx: dist.WorkerContext, which: str) -> Optional[str]:
    """Two calls with pending hooks, then a third: it raises on every rank; the hooks then give the right data."""
    from deep_ep.errors import LowLatencyMisuseError
    buf, num_experts, x, idx = _ll_case(ctx)
    first = buf.low_latency_dispatch(x, idx, LL_TOKENS, num_experts, use_fp8=False, return_recv_hook=True)
    second = buf.low_latency_dispatch(x + 1, idx, LL_TOKENS, num_experts, use_fp8=False,
                                      return_recv_hook=which == "hooks")
    try:
        if which == "hooks":
            buf.low_latency_dispatch(x + 2, idx, LL_TOKENS, num_experts, use_fp8=False)
        else:  # the first hook would be called after two more calls
            buf.low_latency_combine(second[0], idx, torch.ones(LL_TOKENS, 1), second[2])
    except LowLatencyMisuseError as exc:
        if "third low-latency call" not in str(exc) or "has not been called" not in str(exc):
            return f"the misuse error does not say what happened: {exc}"
    else:
        return "a third low-latency call in flight was accepted"
    first[4]()
    if which == "hooks":
        second[4]()
    for shift, (recv_x, _, handle, _, _) in enumerate((first, second)):
        combined, _, _ = buf.low_latency_combine(recv_x, idx, torch.ones(LL_TOKENS, 1), handle)
        if not torch.equal(combined, (x + shift)):
            return f"call {shift}'s data is wrong after the refused third call"
    return _check_round_trips(ctx)


def run_zero_copy_reuse(ctx: dist.WorkerContext, case: None) -> Optional[str]:
    """A zero-copy buffer filled before another low-latency call is refused; filled after it, it works."""
    from deep_ep.errors import LowLatencyMisuseError
    buf, num_experts, x, idx = _ll_case(ctx)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, LL_TOKENS, num_experts, use_fp8=False)
    buf.get_next_low_latency_combine_buffer(handle).copy_(recv_x)
    other = buf.low_latency_dispatch(x, idx, LL_TOKENS, num_experts, use_fp8=False)
    for attempt in ("after another call", "never fetched"):
        try:
            buf.low_latency_combine(recv_x, idx, torch.ones(LL_TOKENS, 1), other[2] if attempt[0] == "n" else handle,
                                    zero_copy=True)
        except LowLatencyMisuseError as exc:
            if "get_next_low_latency_combine_buffer" not in str(exc):
                return f"the zero-copy error does not say what to do: {exc}"
        else:
            return f"a zero-copy combine with a buffer {attempt} was accepted"
        if attempt[0] == "a":
            buf.low_latency_dispatch(x, idx, LL_TOKENS, num_experts, use_fp8=False)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, LL_TOKENS, num_experts, use_fp8=False)
    buf.get_next_low_latency_combine_buffer(handle).copy_(recv_x)
    combined, _, _ = buf.low_latency_combine(torch.zeros_like(recv_x), idx, torch.ones(LL_TOKENS, 1), handle,
                                             zero_copy=True)
    if not torch.equal(combined, x):
        return "a correct zero-copy combine is wrong"
    return _check_round_trips(ctx)


# ---------------------------------------------------------------------------------------------------------------
# Item: the library works whatever torch.set_default_device says.
# ---------------------------------------------------------------------------------------------------------------

class OnDefaultDevice:
    """A Buffer whose every method (and every receive hook it returns) runs with ``torch.set_default_device(device)``
    in force; the caller's own tensors and the reference are built outside."""

    def __init__(self, buffer: Any, device: str) -> None:
        self._buffer, self._device = buffer, device

    def _run(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        torch.set_default_device(self._device)
        try:
            return function(*args, **kwargs)
        finally:
            torch.set_default_device(None)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._buffer, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            result = self._run(attr, *args, **kwargs)
            hook = getattr(result, "hook", None)
            if hook is not None:
                result = result._replace(hook=lambda: self._run(hook))
            return result
        return call


def run_default_device(ctx: dist.WorkerContext, case: Any) -> Optional[str]:
    """A normal or low-latency case of ``tests/test_buffer_torch.py`` (checked against ``reference`` there) with
    the default device set to ``meta`` inside every Buffer call."""
    import test_buffer_torch as tb

    import deep_ep
    low_latency = isinstance(case, tb.LowLatencyCase)
    if low_latency:
        key = f"ll-shrink={case.masked_rank >= 0}"
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(tb.LL_TOKENS, tb.LL_HIDDEN, ctx.world_size,
                                                             ctx.world_size * tb.LL_MAX_LOCAL_EXPERTS)
        kwargs = dict(num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=tb.LL_MAX_LOCAL_EXPERTS,
                      enable_shrink=case.masked_rank >= 0)
    else:
        key, kwargs = "normal", dict(num_nvl_bytes=1 << 20)
    if key not in ctx.cache:
        ctx.cache[key] = OnDefaultDevice(deep_ep.Buffer(ctx.group, **kwargs), "meta")
    return (tb.run_low_latency if low_latency else tb.run_normal)(ctx, case)


def run_composed(ctx: dist.WorkerContext, case: Any) -> Optional[str]:
    """The composed path's torch stages (``internode='composed'``): a normal case under the ``meta`` default device
    matches ``reference``, and a hidden size that differs on one rank raises ArgumentMismatchError on every rank
    within a second."""
    import time

    import test_buffer_torch as tb

    import deep_ep
    from deep_ep.errors import ArgumentMismatchError
    if "composed" not in ctx.cache:
        with deep_ep.testing.overrides(internode="composed"):
            ctx.cache["composed"] = OnDefaultDevice(deep_ep.Buffer(ctx.group, 1 << 20), "meta")
    buf = ctx.cache["composed"]
    if buf._composed is None:
        return "the Buffer was built without the composed path"
    num_experts = 2 * ctx.world_size
    hidden = 256 if ctx.rank == 1 else 128
    idx = torch.zeros(NUM_TOKENS, 1, dtype=torch.int64)
    layout = buf.get_dispatch_layout(idx, num_experts)
    start = time.monotonic()
    try:
        buf.dispatch(torch.zeros(NUM_TOKENS, hidden, dtype=torch.bfloat16), num_tokens_per_rank=layout[0],
                     num_tokens_per_rdma_rank=layout[1], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
    except ArgumentMismatchError as exc:
        if "hidden" not in str(exc) or time.monotonic() - start > 1.0:
            return f"the composed path's disagreement error is late or does not name the argument: {exc}"
    else:
        return "the composed path accepted ranks that disagree on the hidden size"
    saved = ctx.cache.get("normal")
    ctx.cache["normal"] = buf  # tb.run_normal takes the Buffer cached under "normal"
    try:
        return tb.run_normal(ctx, case)
    finally:
        if saved is None:
            del ctx.cache["normal"]
        else:
            ctx.cache["normal"] = saved


def _default_device_cases(world: int, per_node: int) -> list:
    import strategies
    import test_buffer_torch as tb
    cases = []
    for seed, (use_fp8, with_topk) in enumerate(((True, True), (False, False))):
        routing = strategies.Case(num_ranks=world, num_scaleup_ranks=per_node, num_tokens=tuple(range(3, 3 + world)),
                                  hidden=128, num_topk=2, num_experts=2 * world, mask_percent=20, num_channels=2,
                                  seed=seed)
        cases.append(tb.NormalCase(routing, use_fp8, with_topk, expert_alignment=2, worst_tokens=with_topk,
                                   num_bias=2 - seed, async_finish=bool(seed), previous_event=False))
    for seed, (use_fp8, hook, masked) in enumerate(((True, True, -1), (False, False, world - 1))):
        routing = strategies.Case(num_ranks=world, num_scaleup_ranks=per_node, num_tokens=(tb.LL_TOKENS,) * world,
                                  hidden=tb.LL_HIDDEN, num_topk=2, num_experts=2 * world, mask_percent=20,
                                  num_channels=2, seed=seed)
        cases.append(tb.LowLatencyCase(routing, use_fp8, round_scale=use_fp8, use_ue8m0=use_fp8,
                                       use_logfmt=not use_fp8, zero_copy=use_fp8, use_out=True,
                                       return_recv_hook=hook, back_to_back=True, masked_rank=masked))
    return cases


def _env(world: int) -> dict:
    """Every test of this module shares one pool per world size."""
    return {"DEEP_EP_GPUS_PER_NODE": str(world), "DEEP_EP_TIMEOUT_S": "5"}


@pytest.mark.timeout(300)
def test_timeout_must_be_finite_and_positive(pools):
    pools.get(2, _env(2)).check(MODULE, "run_bad_timeout", None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("function, case", [("run_dropped_hook", "dispatch"), ("run_dropped_hook", "combine"),
                                            ("run_third_call", "hooks"), ("run_third_call", "late hook"),
                                            ("run_zero_copy_reuse", None)])
def test_dropped_hooks_and_double_buffer_misuse(pools, world, function, case):
    pools.get(world, _env(world)).check(MODULE, function, case)


# ---------------------------------------------------------------------------------------------------------------
# Item: the torch backend serves any low-latency hidden size its semantics allow.
# ---------------------------------------------------------------------------------------------------------------

def run_small_hidden(ctx: dist.WorkerContext, case: tuple[int, bool]) -> Optional[str]:
    """A low-latency dispatch and combine of a hidden size the kernels do not serve, against ``reference``."""
    import reference
    hidden, use_fp8 = case
    world, rank = ctx.world_size, ctx.rank
    num_experts = 2 * world
    buf = _ll_buffer(ctx, num_experts, hidden)
    gen = torch.Generator().manual_seed(hidden)
    xs = [torch.randint(-8, 9, (LL_TOKENS, hidden), generator=gen).to(torch.bfloat16) for _ in range(world)]
    idxs = [torch.rand(LL_TOKENS, num_experts, generator=gen).argsort(1)[:, :2].contiguous() for _ in range(world)]
    weights = [torch.rand(LL_TOKENS, 2, generator=gen) for _ in range(world)]
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], LL_TOKENS, num_experts,
                                                           use_fp8=use_fp8)
    refs = reference.low_latency_dispatch(xs, idxs, LL_TOKENS, num_experts, use_fp8=use_fp8)
    want = refs[rank]
    got_data = recv_x[0] if use_fp8 else recv_x
    want_data = want.recv_x[0] if use_fp8 else want.recv_x
    for j in range(num_experts // world):
        n = int(count[j])
        if n != int(want.packed_recv_count[j]):
            return f"hidden={hidden}: expert {j} received {n} rows, reference {int(want.packed_recv_count[j])}"
        if not torch.equal(got_data[j, :n].view(torch.uint8), want_data[j, :n].view(torch.uint8)):
            return f"hidden={hidden}: expert {j}'s received rows differ from the reference"
    ys = [torch.randint(-4, 5, (num_experts // world, world * LL_TOKENS, hidden), generator=gen).to(torch.bfloat16)
          for _ in range(world)]
    combined, _, _ = buf.low_latency_combine(ys[rank], idxs[rank], weights[rank], handle)
    ref_c = reference.low_latency_combine(ys, idxs, weights, [r.handle for r in refs])
    if not torch.equal(combined, ref_c[rank]):
        return f"hidden={hidden}: the combine differs from the reference"
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_low_latency_any_hidden_on_the_torch_backend(pools, world):
    pool = pools.get(world, _env(world))
    for case in ((256, True), (200, False), (64, False)):
        pool.check(MODULE, "run_small_hidden", case)


# A CUDA low-latency Buffer on the fake extension (tests/fake_cuda.py): hidden 256 is not served by the kernels, so
# the torch backend carries it with one RuntimeWarning (auto), or the call raises (DEEP_EP_BACKEND=cuda); hidden
# 1024 still reaches the kernels.
_FALLBACK_PROBE = PROBE_HEAD + r"""
kernel_calls = []
class Recording(ext.LowLatencyRuntime):
    def dispatch(self, *args):
        kernel_calls.append(args[0].size(1))
        return super().dispatch(*args)
ext.LowLatencyRuntime = Recording
import deep_ep

os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(29900 + os.getpid() % 90)
dist.init_process_group("gloo", rank=0, world_size=1)
out = {}
x = torch.arange(4 * 256, dtype=torch.float32).view(4, 256).remainder(13).to(torch.bfloat16)
idx = torch.tensor([[1], [0], [1], [1]], dtype=deep_ep.topk_idx_t)
with fake.patched(torch, cuda_tensors=True):
    for choice in ("auto", "cuda"):
        os.environ["DEEP_EP_BACKEND"] = choice
        buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=1 << 26, low_latency_mode=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for _ in range(2):
                    d = buffer.low_latency_dispatch(x, idx, 4, 2, use_fp8=False)
                    c = buffer.low_latency_combine(d.recv_x, idx, torch.ones(4, 1), d.handle)
                out[choice] = ["ok", torch.equal(c.combined_x, x)]
            except ValueError as exc:
                out[choice] = ["ValueError", str(exc)]
        out[choice + " warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
        buffer.low_latency_dispatch(torch.zeros(4, 1024, dtype=torch.bfloat16), idx, 4, 2, use_fp8=False)
    out["kernel hidden sizes"] = kernel_calls
print(json.dumps(out))
"""


def test_cuda_low_latency_falls_back_for_hidden_the_kernels_do_not_serve():
    out = run_probe(_FALLBACK_PROBE)
    assert out["auto"] == ["ok", True], out
    warned = out["auto warnings"]
    assert len(warned) == 1 and "hidden=256" in warned[0] and "torch backend" in warned[0], warned
    assert out["cuda"][0] == "ValueError" and "256" in out["cuda"][1] and "hidden" in out["cuda"][1], out
    assert out["cuda warnings"] == [], out
    assert out["kernel hidden sizes"] == [1024, 1024], out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, per_node", [(2, 2), (4, 2)])
def test_calls_ignore_the_default_device(pools, world, per_node):
    pool = pools.get(world, {"DEEP_EP_GPUS_PER_NODE": str(per_node), "DEEP_EP_TIMEOUT_S": "5"})
    for case in _default_device_cases(world, per_node):
        pool.check(MODULE, "run_default_device", case)
    if per_node < world:
        pool.check(MODULE, "run_composed", _default_device_cases(world, per_node)[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, mode", [(2, "normal"), (4, "shrink")])
def test_dead_peer_raises_comm_error(pools, world, mode):
    # Last in this module: it leaves the pool broken (a rank is gone).
    pool = pools.get(world, _env(world))
    reports = pool.run(MODULE, "run_dead_peer", mode)
    failures = {r: m for r, m in reports.items() if m is not None and r != world - 1}
    assert not failures, failures
    assert "died" in (reports[world - 1] or ""), reports


# The CUDA low-latency backend's host side on the fake extension (tests/fake_cuda.py): a dropped hook's receive
# launch runs at the next call, a third call in flight and a stale zero-copy buffer are refused before any launch.
_CUDA_MISUSE_PROBE = PROBE_HEAD + r"""
launches = []
class Recording(ext.LowLatencyRuntime):
    def dispatch(self, *args):
        launches.append(["dispatch", args[10]])
        return super().dispatch(*args)
    def combine(self, *args):
        launches.append(["combine", args[12]])
        return super().combine(*args)
    def combine_buffer(self, tokens, hidden, num_experts, parity):
        return torch.empty(num_experts // self.num_ranks, self.num_ranks * tokens, hidden, dtype=torch.bfloat16)
ext.LowLatencyRuntime = Recording
import deep_ep
from deep_ep.errors import LowLatencyMisuseError

os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(29800 + os.getpid() % 90)
dist.init_process_group("gloo", rank=0, world_size=1)
os.environ["DEEP_EP_BACKEND"] = "cuda"
out = {}
x, idx = torch.zeros(4, 1024, dtype=torch.bfloat16), torch.zeros(4, 1, dtype=deep_ep.topk_idx_t)
weights = torch.ones(4, 1)
with fake.patched(torch, cuda_tensors=True):
    buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=1 << 26, low_latency_mode=True)
    def dispatch(**kwargs):
        return buffer.low_latency_dispatch(x, idx, 4, 2, use_fp8=False, **kwargs)
    dropped = dispatch(return_recv_hook=True)
    del dropped
    gc.collect()
    dispatch()
    out["dropped"] = list(launches)
    launches.clear()
    first, second = dispatch(return_recv_hook=True), dispatch(return_recv_hook=True)
    try:
        dispatch()
        out["third"] = "accepted"
    except LowLatencyMisuseError as exc:
        out["third"] = str(exc)
    first.hook()
    second.hook()
    out["third launches"] = list(launches)
    launches.clear()
    result = dispatch()
    buffer.get_next_low_latency_combine_buffer(result.handle)
    dispatch()
    try:
        buffer.low_latency_combine(result.recv_x, idx, weights, result.handle, zero_copy=True)
        out["zero copy"] = "accepted"
    except LowLatencyMisuseError as exc:
        out["zero copy"] = str(exc)
    out["zero copy launches"] = list(launches)
print(json.dumps(out))
"""


def test_cuda_low_latency_host_side_drains_and_refuses_misuse():
    out = run_probe(_CUDA_MISUSE_PROBE)
    # Phases: 1 send, 2 receive, 3 both. The dropped hook's receive runs before the next call's launch.
    assert out["dropped"] == [["dispatch", 1], ["dispatch", 2], ["dispatch", 3]], out
    assert "third low-latency call" in out["third"], out
    assert out["third launches"] == [["dispatch", 1], ["dispatch", 1], ["dispatch", 2], ["dispatch", 2]], out
    assert "get_next_low_latency_combine_buffer" in out["zero copy"], out
    assert out["zero copy launches"] == [["dispatch", 3], ["dispatch", 3]], out
