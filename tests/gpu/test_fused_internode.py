"""GPU property tests of the fused internode kernels (``FusedInternodeCuda``, built under
``deep_ep.testing.overrides(internode='fused')``) on virtual nodes of one host.

``DEEP_EP_GPUS_PER_NODE`` splits the ranks into 2 x 2, 2 x 4 and 4 x 2 nodes, and the wide groups 16 x 2 and
8 x 4 (32 ranks: one warp per role), 8 x 8 (64 ranks: each receiver and combine-sender warp serves two source
ranks in turn) and 32 x 2 (besides, each sender and forwarder warp serves two nodes, one combine forwarder warp
two owners' nodes) on small fixed cases; every example runs
``test_internode.task_internode_roundtrip`` against ``reference``: layout, recv_x (BF16 and FP8 with scales), top-k,
the per-expert list, all ten handle fields, cached and worst-token dispatch, and combine with biases and top-k
weights (per-node rounding at the forwarder, then across nodes at the owner).
One GPU, the ranks time-sliced on it (correctness only)::

    TEST_RANKS_PER_GPU=8 python -m pytest tests/gpu/test_fused_internode.py
    TEST_RANKS_PER_GPU=32 python -m pytest tests/gpu/test_fused_internode.py -k wide   (64 for 8 x 8, 32 x 2)
    TEST_RANKS_PER_GPU=32 python -m pytest tests/gpu/test_fused_internode.py -k "put_rail_peers and 16x2"

``TEST_EXAMPLES_FUSED``: hypothesis examples per shape (4). A stalled rank: every survivor raises within the budget.
Ranks that disagree on a combine (pointer and put rail peers): every rank raises at its next call, well under a
second, and the calls after it work.
Under ``internode_put_only`` (2 x 2, 2 x 4, 16 x 2 and 8 x 8, small and wide cases, and the stalled rank) every
rank of another node is an NVSHMEM put peer: the rail hops and notify go through staged puts and signals, the NVLink
hops stay pointer.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given

torch = pytest.importorskip("torch")

import test_internode as tn  # noqa: E402  (tests/gpu is on sys.path, as for test_internode.py)
import test_intranode as ti  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

FUSED = {"internode": "fused"}
# The fused kernels' buffer is num_nvl_bytes + num_rdma_bytes: the pools give num_nvl_bytes 1 MiB, so that the
# sizes below are (within 1 MiB) the buffer's.
FUSED_NVL_BYTES = 1 << 20
# Two halves (dispatch, combine), each holding the rail and node rings of 12 channels of 7168-BF16 records at 256
# slots for 4 x 2 (about 540 MB).
NUM_RDMA_BYTES = 1280 << 20
# The wide groups' cases (hidden <= 512, at most 12 SMs): their rings take at most about 130 MB per direction, and
# up to 64 ranks share one GPU's memory.
WIDE_RDMA_BYTES = 384 << 20
EXAMPLES = int(os.environ.get("TEST_EXAMPLES_FUSED", "4"))
# Put-peer groups (small cases): the put area's staging halves take half of the buffer after the rings.
PUT_RDMA_BYTES = 256 << 20
# Wide put-peer groups: the wide cases' rings (about 140 MB per direction at 16 x 2, 210 MB at 8 x 8) twice over,
# with the put area.
PUT_WIDE_RDMA_BYTES = 480 << 20


def _make_pool(num_nodes: int, per_node: int, rdma_bytes: int = NUM_RDMA_BYTES, put_only: bool = False,
               **env: str) -> ti.Pool:
    """``num_nodes`` x ``per_node`` ranks on the GPUs in turn, checked to run ``FusedInternodeCuda``; ``put_only``:
    built under ``internode_put_only`` (every pair of different nodes a put pair)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 2
    num_ranks = num_nodes * per_node
    pool = ti.Pool([rank % max(gpus, 1) for rank in range(num_ranks)],
                   env={"DEEP_EP_GPUS_PER_NODE": str(per_node), "TEST_NUM_RDMA_BYTES": str(rdma_bytes),
                        "TEST_NUM_NVL_BYTES": str(FUSED_NVL_BYTES), **env},
                   overrides={**FUSED, "internode_put_only": True} if put_only else FUSED)
    if ti.DEVICE == "cuda" and pool.backends != {"FusedInternodeCuda"}:
        pool.close()
        raise AssertionError(f"Buffer did not pick the fused kernels: {pool.backends}")
    return pool


def _fused_pool(num_nodes: int, per_node: int):
    """The body of the module-scoped fixtures: yields the pool and closes it."""
    pool = _make_pool(num_nodes, per_node)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def two_by_two():
    yield from _fused_pool(2, 2)


@pytest.fixture(scope="module", params=[(2, 4), (4, 2)], ids=["2x4", "4x2"])
def eight_ranks(request):
    yield from _fused_pool(*request.param)


@pytest.mark.multi_gpu(4)
@ti.gpu_settings(EXAMPLES)
@given(case=ti.case_strategy(4, max_tokens=300))
def test_two_by_two(two_by_two, case):
    two_by_two.run(tn.TASK, case)


@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize(("hidden", "use_fp8"), [(8, False), (136, False), (128, True)])
def test_two_by_two_rows_narrower_than_a_team(two_by_two, hidden, use_fp8):
    """Rows of 1, 17 and 8 16-byte units over teams of 8 to 11 warps (every role at 2 x 2): a warp copies whole
    records of a window in turn, so most warps have few records or none in a window, and the handle rows are the
    team's first warp's."""
    case = ti.Case(num_ranks=4, seed=17, num_tokens=(300, 0, 257, 64), hidden=hidden, num_topk=4, num_experts=16,
                   use_fp8=use_fp8, with_topk=True, num_sms=4, expert_alignment=1, mask_prob=0.1, empty_rank=-1,
                   async_mode=False, previous_mode=False, num_bias=2, scales_col_major=False)
    two_by_two.run(tn.TASK, case)


@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize("put_only", [False, True], ids=["pointer", "put"])
@pytest.mark.parametrize("ring_tokens", [(1, 4, 1, 2), (2, 8, 2, 5), (3, 14, 5, 10)], ids=["window1", "window3",
                                                                                          "window5"])
def test_two_by_two_small_rings(put_only, ring_tokens):
    """Rings of 2 to 10 records (DeepEP's Config: nvl send / recv, rdma send / recv tokens; a node ring holds nvl
    recv / N): windows of 1, 3 and 5 records, so windows wait for room, rings wrap many times per call and a
    forwarder waits for a whole window that its sender publishes in chunks of other sizes; BF16 and FP8, 300 tokens
    on one rank."""
    pool = _make_pool(2, 2, PUT_RDMA_BYTES if put_only else NUM_RDMA_BYTES, put_only=put_only)
    try:
        for hidden, use_fp8 in ((256, False), (512, True)):
            pool.run(tn.TASK, ti.Case(
                num_ranks=4, seed=31, num_tokens=(300, 0, 257, 64), hidden=hidden, num_topk=4, num_experts=16,
                use_fp8=use_fp8, with_topk=True, num_sms=4, expert_alignment=1, mask_prob=0.1, empty_rank=-1,
                async_mode=False, previous_mode=False, num_bias=1, scales_col_major=False, ring_tokens=ring_tokens))
    finally:
        pool.close()


@pytest.mark.multi_gpu(8)
@ti.gpu_settings(EXAMPLES)
@given(case=ti.case_strategy(8, max_tokens=200))
def test_eight_ranks(eight_ranks, case):
    eight_ranks.run(tn.TASK, case)


@pytest.mark.multi_gpu(8)
def test_eight_ranks_large(eight_ranks):
    """1024 tokens per rank, hidden 7168, top-8 of 64 experts, FP8 and BF16, 24 SMs (12 channels), an empty rank,
    asynchronous with a previous event (FP8)."""
    for use_fp8 in (True, False):
        case = ti.Case(num_ranks=8, seed=5, num_tokens=(1024,) * 7 + (0,), hidden=7168, num_topk=8,
                       num_experts=64, use_fp8=use_fp8, with_topk=True, num_sms=24, expert_alignment=4,
                       mask_prob=0.1, empty_rank=-1, async_mode=use_fp8, previous_mode=use_fp8, num_bias=1,
                       scales_col_major=use_fp8)
        eight_ranks.run(tn.TASK, case)


def test_limits_mirror_the_extension():
    """The Python mirrors of the kernels' group limits and of the control region (deep_ep/config.py, layout.py)."""
    from deep_ep import config, layout
    from deep_ep.backends.cuda_common import _C
    assert (_C.MAX_RUNTIME_RANKS, _C.FUSED_MAX_RANKS) == (config.NUM_MAX_RUNTIME_RANKS, config.NUM_MAX_FUSED_RANKS)
    import fake_cuda  # the CPU tests' stand-in runtime takes put peers in groups of the same size
    assert fake_cuda.make_fake_extension(torch).MAX_RUNTIME_RANKS == _C.MAX_RUNTIME_RANKS
    assert _C.CONTROL_BYTES == layout.intranode_control_bytes()


def _wide_cases(num_nodes: int, per_node: int) -> list:
    """Small cases of a wide group: BF16 with two biases, -1 masks and an empty rank; FP8 with column-major scales,
    top-8, 6 channels, asynchronous with a previous event; uneven token counts (some ranks send nothing). At 64
    ranks the larger one's rings take about 130 MB per direction."""
    ranks = num_nodes * per_node
    tokens = tuple((7 * r + 3) % 65 for r in range(ranks))
    return [ti.Case(num_ranks=ranks, seed=23, num_tokens=tokens, hidden=256, num_topk=4, num_experts=2 * ranks,
                    use_fp8=False, with_topk=True, num_sms=8, expert_alignment=4, mask_prob=0.1, empty_rank=ranks - 3,
                    async_mode=False, previous_mode=False, num_bias=2, scales_col_major=False),
            ti.Case(num_ranks=ranks, seed=29, num_tokens=tokens[::-1], hidden=512, num_topk=8,
                    num_experts=4 * ranks, use_fp8=True, with_topk=True, num_sms=12, expert_alignment=1,
                    mask_prob=0.0, empty_rank=-1, async_mode=True, previous_mode=True, num_bias=0,
                    scales_col_major=True)]


@pytest.mark.parametrize(("num_nodes", "per_node"), [
    pytest.param(16, 2, marks=pytest.mark.multi_gpu(32), id="16x2"),
    pytest.param(8, 4, marks=pytest.mark.multi_gpu(32), id="8x4"),
    pytest.param(8, 8, marks=pytest.mark.multi_gpu(64), id="8x8"),
    pytest.param(32, 2, marks=pytest.mark.multi_gpu(64), id="32x2"),
])
def test_wide_groups(num_nodes, per_node):
    """Past the ring kernels' 24 ranks: the fused kernels' own notify slots and counters, 16 nodes of one sender and
    one forwarder warp each, and at 64 ranks warps that serve several roles in turn; every output against
    ``reference``."""
    pool = _make_pool(num_nodes, per_node, WIDE_RDMA_BYTES)
    try:
        for case in _wide_cases(num_nodes, per_node):
            pool.run(tn.TASK, case)
    finally:
        pool.close()


def task_put_mask(buffer, rank: int, payload) -> int:
    """This rank's put mask (bit r: rank r is reached by NVSHMEM puts)."""
    return int(ti._kernel_runtime(buffer).get_put_mask())


@pytest.mark.parametrize(("num_nodes", "per_node"), [
    pytest.param(2, 2, marks=pytest.mark.multi_gpu(4), id="2x2"),
    pytest.param(2, 4, marks=pytest.mark.multi_gpu(8), id="2x4"),
    pytest.param(4, 2, marks=pytest.mark.multi_gpu(8), id="4x2"),
    pytest.param(16, 2, marks=pytest.mark.multi_gpu(32), id="16x2"),
    pytest.param(8, 8, marks=pytest.mark.multi_gpu(64), id="8x8"),
])
def test_put_rail_peers(num_nodes, per_node):
    """Every rank of another node a put peer (``internode_put_only``): the notify slots and flags, the dispatch rail
    records (staged, put as runs; the 300 tokens of one channel pass the 258-slot rail rings, so runs wrap), the
    combine partials and both directions' credits travel as puts and signals; every output against ``reference``.
    16 x 2 and 8 x 8: past the ring kernels' 24 ranks (at 8 x 8 the put mask's bits past 31 too, and the warps that
    serve several roles in turn)."""
    ranks = num_nodes * per_node
    pool = _make_pool(num_nodes, per_node, PUT_RDMA_BYTES if ranks <= 8 else PUT_WIDE_RDMA_BYTES, put_only=True)
    try:
        if ti.DEVICE == "cuda":
            masks = pool.run("test_fused_internode:task_put_mask", None)
            assert masks == [sum(1 << d for d in range(ranks) if d // per_node != r // per_node)
                             for r in range(ranks)], masks
        for hidden, use_fp8 in ((136, False), (128, True)):
            pool.run(tn.TASK, ti.Case(
                num_ranks=ranks, seed=17, num_tokens=tuple((300, 0, 257, 64)[r % 4] for r in range(ranks)),
                hidden=hidden, num_topk=4, num_experts=4 * ranks, use_fp8=use_fp8, with_topk=True, num_sms=2,
                expert_alignment=1, mask_prob=0.1, empty_rank=-1, async_mode=use_fp8, previous_mode=False,
                num_bias=2, scales_col_major=False))
        for case in _wide_cases(num_nodes, per_node):
            pool.run(tn.TASK, case)
    finally:
        pool.close()


# benchmarks/bench_internode.py --composed: 128 tokens per rank, hidden 7168, top-8 of 256 experts, 24 SMs (12
# channels) at Config(24, 8, 256): 258 rail and 256 / 2 node slots (2 nodes) of 14416-byte records.
BENCH_SMS, BENCH_HIDDEN = 24, 7168


def _bench_rdma_bytes() -> int:
    """The smallest num_rdma_bytes, in whole MiB, whose buffer holds the benchmark's rings with put peers."""
    from deep_ep import config, layout
    record = layout.intranode_dispatch_record_bytes(BENCH_HIDDEN * 2, 0, 8)
    rail = config.Config(BENCH_SMS, 8, 256).num_max_rdma_chunked_recv_tokens
    used = layout.fused_ring_bytes(2, 2, BENCH_SMS // 2, record, rail, 256 // 2, True)
    return -(-(layout.fused_min_rdma_bytes(used, True) - FUSED_NVL_BYTES) // (1 << 20)) * (1 << 20)


def _bench_inputs(buffer, rank: int) -> tuple:
    """The benchmark's first dispatch on this rank: ``(x, kwargs)`` (layout tensors, top-k, config)."""
    import deep_ep
    n, k, e = 128, 8, 256
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(n, BENCH_HIDDEN, generator=gen).to(torch.bfloat16).to(ti.DEVICE)
    scores = torch.randn(n, e, generator=gen).abs() + 1
    topk_idx = torch.topk(scores, k, dim=-1, sorted=False).indices.to(deep_ep.topk_idx_t).to(ti.DEVICE)
    layout = buffer.get_dispatch_layout(topk_idx, e)
    return x, dict(num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                   num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank,
                   num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=topk_idx,
                   topk_weights=torch.ones(n, k, dtype=torch.float32, device=ti.DEVICE),
                   config=deep_ep.Config(BENCH_SMS, 8, 256))


def task_rings_too_small(buffer, rank: int, payload) -> str:
    """The benchmark's first dispatch on a put buffer too small for its rings raises ValueError naming
    num_rdma_bytes before any kernel (the extension's own ring check is never reached)."""
    x, kwargs = _bench_inputs(buffer, rank)
    try:
        buffer.dispatch(x, **kwargs)
    except ValueError as exc:
        text = str(exc)
        assert "is too small for this fused internode dispatch" in text and "num_rdma_bytes >= " in text, text
    else:
        raise AssertionError("a dispatch whose rings do not fit the buffer was accepted")
    torch.cuda.synchronize()
    return text


@pytest.mark.multi_gpu(4)
def test_put_rings_too_small_raise_and_the_buffer_stays_usable():
    """2 x 2 under internode_put_only with the put tests' 256 MiB: the benchmark's first dispatch (12 channels of
    7168-BF16 records) raises ValueError on every rank before any kernel, and a round trip afterwards matches
    ``reference``."""
    pool = _make_pool(2, 2, PUT_RDMA_BYTES, put_only=True)
    try:
        replies = pool.run("test_fused_internode:task_rings_too_small", None)
        assert all("num_rdma_bytes" in r for r in replies), replies
        for case in _wide_cases(2, 2):
            pool.run(tn.TASK, case)
    finally:
        pool.close()


@pytest.mark.multi_gpu(4)
def test_put_rail_peers_at_the_benchmark_geometry():
    """2 x 2 under internode_put_only with the smallest buffer (whole MiB) that holds the benchmark's rings with the
    put area: 128 tokens per rank, hidden 7168, top-8 of 256 experts, 24 SMs (12 channels), BF16 and FP8, every
    output against ``reference``."""
    pool = _make_pool(2, 2, _bench_rdma_bytes(), put_only=True)
    try:
        for use_fp8 in (False, True):
            pool.run(tn.TASK, ti.Case(
                num_ranks=4, seed=31, num_tokens=(128,) * 4, hidden=BENCH_HIDDEN, num_topk=8, num_experts=256,
                use_fp8=use_fp8, with_topk=True, num_sms=BENCH_SMS, expert_alignment=1, mask_prob=0.0,
                empty_rank=-1, async_mode=use_fp8, previous_mode=False, num_bias=1, scales_col_major=use_fp8))
    finally:
        pool.close()


def task_combine_disagree(buffer, rank: int, payload) -> str:
    """Rank 1 passes a fused combine a different hidden size, topk_weights where the others pass none, a bias where
    they pass none, or a different config chunking: the kernels move no row on any rank, and every rank's next call
    raises ArgumentMismatchError naming the combine and the first rank whose hash differs from its own (rank 1, or
    rank 0 on rank 1) with its node and local index, well under a second, before it launches anything. Then rank 1
    refuses a combine (an x of another dtype, a row too few, a handle that is not the Buffer's: its kernel then runs
    over a stand-in handle): it raises its own error at once, and every rank's next call raises as above. After
    each, a correct dispatch and combine give every rank's rows in (source rank, token) order and their sum (ring
    positions and combine call numbers stayed in step on every rank)."""
    import functools
    import time

    import deep_ep
    n, h, world = 32, 256, buffer.group_size
    per_node = buffer.topology.num_scaleup_ranks
    num_experts, config = 2 * world, deep_ep.Config(4, 8, 256)
    x = ti._pattern_x(rank, n, h, 0).to(ti.DEVICE)
    # Every token selects expert 2r on every rank r: all rows reach every rank.
    topk_idx = (torch.arange(world, device=ti.DEVICE) * 2).repeat(n, 1).to(deep_ep.topk_idx_t)
    weights = torch.ones(n, world, dtype=torch.float32, device=ti.DEVICE)
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    want = torch.cat([ti._pattern_x(r, n, h, 0) for r in range(world)]).to(ti.DEVICE)

    def correct(label: str):
        d = buffer.dispatch(x, num_tokens_per_rank=layout.num_tokens_per_rank,
                            num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank,
                            is_token_in_rank=layout.is_token_in_rank,
                            num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=topk_idx,
                            topk_weights=weights, config=config)
        assert torch.equal(d.recv_x, want), f"after {label}: recv_x differs from every rank's rows in rank order"
        c = buffer.combine(d.recv_x, d.handle, topk_weights=d.recv_topk_weights, config=config)
        torch.cuda.synchronize()
        assert torch.equal(c.combined_x.float(), x.float() * world), f"after {label}: combine differs"
        # Rank d's received weights are 1 in column d (its expert) and 0 elsewhere: their sum is every weight.
        assert torch.equal(c.combined_topk_weights, weights), f"after {label}: combined weights differ"
        return d

    other = rank == 1
    peer = 0 if other else 1  # the first rank whose hash differs from this rank's
    d = correct("start")
    y, handle, w = d.recv_x, d.handle, d.recv_topk_weights
    bias = torch.ones(n, h, dtype=torch.bfloat16, device=ti.DEVICE)
    steps = [("hidden", dict(x=torch.cat([y, y], 1) if other else y)),
             ("topk_weights", dict(topk_weights=w if other else None)),
             ("bias", dict(bias=bias if other else None)),
             ("config", dict(config=deep_ep.Config(4, 6, 256) if other else config)),
             ("dtype", dict(x=y.to(torch.float16) if other else y)),
             ("refusal", dict(x=y[:-1] if other else y)),
             ("handle", dict(handle=tuple(handle) if other else handle))]
    seen = []
    for name, kwargs in steps:
        refused = False
        start = time.monotonic()
        try:
            buffer.combine(**{"x": y, "handle": handle, "config": config, **kwargs})
        except (TypeError, ValueError) as exc:
            assert not isinstance(exc, deep_ep.ArgumentMismatchError), exc
            assert str(exc).startswith("handle was not" if name == "handle" else "x must"), exc
            assert time.monotonic() - start < 1.0, f"{name}: the refusal took too long"
            refused = True
        assert refused == (name in ("dtype", "refusal", "handle") and other), \
            f"{name}: the call itself raised: {refused}"
        where = f"peer {peer} is node {peer // per_node}, local {peer % per_node}"
        seen.append(ti._raises_mismatch_promptly(
            functools.partial(buffer.combine, y, handle, config=config), ("combine call signatures differ", where),
            name, world, rank,
            f"a fused combine whose {name} differs between the ranks did not raise"))
        correct(name)
    return "; ".join(seen)


@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize("put_only", [False, True], ids=["pointer", "put"])
@pytest.mark.parametrize("task", ["test_fused_internode:task_combine_disagree", "test_intranode:task_cached_disagree",
                                  "test_intranode:task_graph_disagree"], ids=["combine", "cached", "graph"])
def test_disagreement_raises_at_next_call(put_only, task):
    """2 x 2, the rail peers reached by pointer or (``internode_put_only``) by NVSHMEM signals: see
    task_combine_disagree, ``test_intranode.task_cached_disagree`` (a cached dispatch's kernel compares the ranks'
    signature hashes in the agreement words the combine uses) and ``test_intranode.task_graph_disagree`` (a combine
    captured in a CUDA graph)."""
    if ti.DEVICE != "cuda":
        pytest.skip("the CUDA kernels' agreement (the torch backend raises in the call itself)")
    pool = _make_pool(2, 2, PUT_RDMA_BYTES if put_only else NUM_RDMA_BYTES, put_only=put_only)
    try:
        print(pool.run(task, None))
    finally:
        pool.close()


def task_stall(buffer, rank: int, payload: dict) -> str:
    """Rank ``payload['stalled']`` skips a dispatch. Every other rank must raise a ``CommError`` within the budget
    that names it: a timeout naming the stalled rank (its node and local index too), or, when another survivor
    timed out first and aborted the call everywhere, a ``PeerAbortedError`` naming that survivor. The CUDA context
    must stay usable."""
    import re
    import time

    import deep_ep
    stalled, world = payload["stalled"], buffer.group_size
    n, h = 1024, 256
    x = torch.ones(n, h, dtype=torch.bfloat16, device=ti.DEVICE)
    layout = dict(num_tokens_per_rank=torch.full((world,), n, dtype=torch.int32, device=ti.DEVICE),
                  is_token_in_rank=torch.ones(n, world, dtype=torch.bool, device=ti.DEVICE),
                  num_tokens_per_expert=torch.full((world,), n, dtype=torch.int32, device=ti.DEVICE),
                  num_tokens_per_rdma_rank=torch.full((buffer.topology.num_scaleout_ranks,), n, dtype=torch.int32,
                                                      device=ti.DEVICE))
    if rank == stalled:
        return "stalled"
    start = time.monotonic()
    try:
        buffer.dispatch(x, config=deep_ep.Config(4, 8, 256), **layout)
        torch.cuda.synchronize()
        buffer.dispatch(x, config=deep_ep.Config(4, 8, 256), **layout)  # the error record is read here at the latest
    except deep_ep.CommError as exc:
        elapsed, text = time.monotonic() - start, str(exc)
        assert elapsed < payload["timeout_s"] * 3 + 30, f"the error took {elapsed:.1f} s"
        assert float((torch.ones(4, device=ti.DEVICE) * 2).sum()) == 8.0
        per_node = buffer.topology.num_scaleup_ranks
        if isinstance(exc, deep_ep.CommTimeoutError):
            where = f"peer {stalled} is node {stalled // per_node}, local {stalled % per_node}"
            assert re.search(rf"\brank {rank}\b.*\bpeer {stalled}\b", text) and where in text, text
            return f"timeout: {text}"
        assert isinstance(exc, deep_ep.PeerAbortedError), f"{type(exc).__name__}: {text}"
        assert re.search(rf"\brank {rank}\b.*\bpeer \d", text), text
        return f"aborted: {text}"
    raise AssertionError("dispatch with a stalled peer raised nothing")


@pytest.mark.multi_gpu(4)
@pytest.mark.parametrize("put_only", [False, True], ids=["pointer", "put"])
def test_stalled_rank_times_out(put_only):
    """Rank 3 (node 1, local 1) never joins the dispatch: every other rank raises within the budget, at least one
    with a timeout naming rank 3 and its node (under puts, its notify flag and rail tails are signals)."""
    timeout_s = 5
    pool = _make_pool(2, 2, PUT_RDMA_BYTES if put_only else NUM_RDMA_BYTES, put_only=put_only,
                      DEEP_EP_TIMEOUT_S=str(timeout_s))
    try:
        replies = pool.run("test_fused_internode:task_stall", {"stalled": 3, "timeout_s": timeout_s},
                           timeout=timeout_s * 8 + 60)
        assert replies[3] == "stalled", replies
        assert any(r.startswith("timeout") for r in replies[:3]), replies
    finally:
        pool.kill()  # the Buffers are in the failed state: discard the pool
