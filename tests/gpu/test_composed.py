"""GPU tests of the composed internode path (``ComposedInternode``): a torch rail stage beside a CUDA node stage.

4 ranks on GPUs ``[0, 1, 0, 1]`` (one per GPU with 4 or more) with ``DEEP_EP_GPUS_PER_NODE=2`` are 2 virtual nodes
x 2: the node stage spans both GPUs, each rail stage shares one (gloo group: NCCL refuses two ranks on one GPU). The
Buffers are built under ``deep_ep.testing.overrides(internode='composed')`` (the automatic choice is the fused
kernels, tests/gpu/test_fused_internode.py; the composition serves groups beyond them); the composed path must then
run a ``TorchBackend`` rail stage and a ``CudaBackend`` node stage (one host, CUDA IPC). Every example runs
``test_internode.task_internode_roundtrip`` bit for bit against ``reference``. ``test_many_nodes_by_two``:
``TEST_COMPOSED_MANY_NODES`` (9) nodes x 2; ``test_eight_ranks``: 2 x 4 and 4 x 2 on 8 GPUs. One GPU, all ranks
time-sliced on it (correctness only)::

    TEST_RANKS_PER_GPU=2 python -m pytest tests/gpu/test_composed.py
    TEST_RANKS_PER_GPU=8 TEST_COMPOSED_MANY_NODES=4 python -m pytest tests/gpu/test_composed.py -k many_nodes

``TEST_EXAMPLES_COMPOSED`` / ``TEST_EXAMPLES_MANY_NODES``: hypothesis examples (6 / 4).
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given

torch = pytest.importorskip("torch")

import test_internode as tn  # noqa: E402  (tests/gpu is on sys.path, as for test_internode.py)
import test_intranode as ti  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu, pytest.mark.timeout(600)]

ENV = {"DEEP_EP_GPUS_PER_NODE": "2"}
COMPOSED = {"internode": "composed"}
STAGES = "ComposedInternode cuda TorchBackend CudaBackend"


def task_stages(buffer, rank: int, payload) -> str:
    """What the Buffer selected: the composed path, its device type and the two stage backends."""
    composed = buffer._composed
    return f"{type(composed).__name__} {buffer._composed_device} {type(composed.rail).__name__} " \
        f"{type(composed.node).__name__}"


def task_disagree(buffer, rank: int, payload) -> str:
    """The last rank (another node and rail than rank 0) passes another hidden size, then no top-k: every rank
    raises ArgumentMismatchError naming the argument within a second (the whole group exchanges the call's signature
    before either stage runs; a stage alone spans only its rail or node), and a correct dispatch and combine
    follow."""
    import time

    import deep_ep
    n, h, world = 32, 256, buffer.group_size
    x = torch.full((n, h), float(rank + 1), dtype=torch.bfloat16, device=ti.DEVICE)
    # Every token selects expert 2r of every rank r: all rows reach every rank.
    idx = (torch.arange(world, device=ti.DEVICE) * 2).repeat(n, 1).to(deep_ep.topk_idx_t)
    weights = torch.ones(n, world, dtype=torch.float32, device=ti.DEVICE)
    layout = buffer.get_dispatch_layout(idx, 2 * world)
    sync = torch.cuda.synchronize if ti.DEVICE == "cuda" else (lambda: None)

    def dispatch(data=x, topk=idx, w=weights):
        return buffer.dispatch(data, num_tokens_per_rank=layout.num_tokens_per_rank,
                               num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank,
                               is_token_in_rank=layout.is_token_in_rank,
                               num_tokens_per_expert=layout.num_tokens_per_expert, topk_idx=topk, topk_weights=w)

    def correct(label: str) -> None:
        d = dispatch()
        want = torch.cat([torch.full((n, h), float(r + 1), dtype=torch.bfloat16) for r in range(world)]).to(ti.DEVICE)
        assert torch.equal(d.recv_x, want), f"after {label}: recv_x differs from every rank's rows in rank order"
        c = buffer.combine(d.recv_x, d.handle)
        sync()
        assert torch.equal(c.combined_x.float(), x.float() * world), f"after {label}: combine differs"

    other = rank == world - 1
    seen = []
    correct("start")
    for name, kwargs in (("x.size(1) (hidden)", dict(data=torch.cat([x, x], 1) if other else x)),
                         ("topk_idx given", dict(topk=None if other else idx, w=None if other else weights))):
        sync()
        start = time.monotonic()
        try:
            dispatch(**kwargs)
        except deep_ep.ArgumentMismatchError as exc:
            elapsed = time.monotonic() - start
            assert name in str(exc), f"{name}: {exc}"
            assert elapsed < 1.0, f"{name}: raised after {elapsed:.3f} s"
            seen.append(f"{name}: {elapsed * 1e3:.0f} ms")
        else:
            raise AssertionError(f"{name} differing between the ranks did not raise")
        correct(name)
    return "; ".join(seen)


def _composed_pool(devices: list, gpus_per_node: int):
    """A worker pool on ``devices`` as nodes of ``gpus_per_node`` ranks (Buffers built under
    ``internode='composed'``), checked to run the composed path with a torch rail and a CUDA node stage; yields it
    and closes it (the body of the module-scoped fixtures)."""
    pool = ti.Pool(devices, env={**ENV, "DEEP_EP_GPUS_PER_NODE": str(gpus_per_node)}, overrides=COMPOSED)
    try:
        if ti.DEVICE == "cuda":
            assert pool.backends == {"ComposedInternode"}, f"Buffer did not pick the composed path: {pool.backends}"
            found = set(pool.run("test_composed:task_stages", None))
            assert found == {STAGES}, f"the composed path does not run the expected stages: {found}"
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def two_by_two():
    """2 x 2, one rank per GPU where there are 4, else GPUs 0, 1, 0, 1."""
    gpus = min(4, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    yield from _composed_pool([rank % gpus for rank in range(4)], 2)


@ti.gpu_settings(int(os.environ.get("TEST_EXAMPLES_COMPOSED", "6")))
@given(case=ti.case_strategy(4, max_tokens=300))
def test_two_by_two(two_by_two, case):
    two_by_two.run(tn.TASK, case)


def test_disagreeing_ranks_raise_and_recover(two_by_two):
    """See task_disagree."""
    print(two_by_two.run("test_composed:task_disagree", None))


def test_two_by_two_large(two_by_two):
    """1024 tokens per rank, hidden 7168, top-8 of 64 experts, BF16 and FP8, 24 SMs, one bias."""
    for use_fp8 in (False, True):
        case = ti.Case(num_ranks=4, seed=11, num_tokens=(1024,) * 4, hidden=7168, num_topk=8, num_experts=64,
                       use_fp8=use_fp8, with_topk=True, num_sms=24, expert_alignment=1, mask_prob=0.1,
                       empty_rank=-1, async_mode=use_fp8, previous_mode=use_fp8, num_bias=1,
                       scales_col_major=use_fp8)
        two_by_two.run(tn.TASK, case)


# Nodes of the many-node test (x 2 GPUs per node): rail stages of more ranks than a node has GPUs. Its ranks share
# the GPUs; on one GPU run it with TEST_RANKS_PER_GPU >= 2 x TEST_COMPOSED_MANY_NODES.
MANY_NODES = int(os.environ.get("TEST_COMPOSED_MANY_NODES", "9"))


@pytest.fixture(scope="module")
def many_by_two():
    """MANY_NODES x 2."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 2
    yield from _composed_pool([rank % gpus for rank in range(2 * MANY_NODES)], 2)


@pytest.mark.multi_gpu(2 * MANY_NODES)
@ti.gpu_settings(int(os.environ.get("TEST_EXAMPLES_MANY_NODES", "4")))
@given(case=ti.case_strategy(2 * MANY_NODES, max_tokens=160))
def test_many_nodes_by_two(many_by_two, case):
    many_by_two.run(tn.TASK, case)


def test_stalled_rank_times_out():
    """Rank 3 never joins the dispatch: rank 2 (its node peer) times out naming it, rank 1 (its rail peer) in its
    count all-gather naming all ranks, rank 0 naming rank 1 (which left its node stage after its own timeout); each
    message names the Buffer's ranks (the stages' own numbers in brackets, ``deep_ep.errors.name_ranks``;
    ``TorchBackend.set_rank_names`` for the rail) within the time budget (``test_intranode.task_stall``)."""
    timeout_s = 5
    gpus = min(4, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    env = {**ENV, "DEEP_EP_TIMEOUT_S": str(timeout_s)}
    pool = ti.Pool([rank % gpus for rank in range(4)], env=env, overrides=COMPOSED)
    try:
        replies = pool.run("stall", {"stalled": 3, "timeout_s": timeout_s, "expect_peer": {0: 1, 1: "all ranks"}},
                           timeout=timeout_s * 8 + 60)
        assert replies[3] == "stalled" and all("timeout" in replies[r] for r in range(3)), replies
        assert "composed rail stage" in replies[1] and "composed node stage" in replies[2], replies
    finally:
        pool.kill()  # the Buffers are in the failed state: discard the pool


@pytest.fixture(scope="module", params=[4, 2], ids=["2x4", "4x2"])
def eight_ranks(request):
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < 8:
        pytest.skip(f"needs >= 8 CUDA devices, found {found}")
    yield from _composed_pool(list(range(8)), request.param)


@ti.gpu_settings(int(os.environ.get("TEST_EXAMPLES_COMPOSED", "6")))
@given(case=ti.case_strategy(8, max_tokens=300))
def test_eight_ranks(eight_ranks, case):
    eight_ranks.run(tn.TASK, case)
