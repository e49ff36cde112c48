"""GPU property tests of the CUDA internode backend (``InternodeCuda``) on virtual nodes.

``DEEP_EP_GPUS_PER_NODE=1`` turns 2 ranks of one host into 2 nodes of one GPU (NVSHMEM symmetric buffer, PE = rank);
every example is checked against ``reference`` with the internode topology: recv_x (BF16 and FP8), top-k, the
per-expert list, all ten handle fields, cached and worst-token dispatch, combine with biases and weights (per-node
rounding, then across nodes). The worker pool and the inputs are those of ``test_intranode.py``.
``TEST_INTERNODE_PUT_ONLY=1`` builds every Buffer with ``deep_ep.testing.overrides(internode_put_only=True)``: every
pair is an NVSHMEM put pair (staged records, put-with-signal, signal twins: the path of peers behind a NIC) over
NVSHMEM's P2P transport. One GPU, the PEs time-sliced on it (correctness only)::

    TEST_RANKS_PER_GPU=2 python -m pytest tests/gpu/test_internode.py
    TEST_RANKS_PER_GPU=2 TEST_INTERNODE_PUT_ONLY=1 python -m pytest tests/gpu/test_internode.py
    TEST_RANKS_PER_GPU=8 TEST_INTERNODE_MANY_NODES=8 python -m pytest tests/gpu/test_internode.py -k many

``TEST_EXAMPLES_INTERNODE`` / ``TEST_EXAMPLES_MANY_NODES``: hypothesis examples (12 / 4).
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given

torch = pytest.importorskip("torch")

import test_intranode as ti  # noqa: E402  (tests/gpu is on sys.path: pytest's rootdir-less import)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

# TEST_INTERNODE_PUT_ONLY=1: every Buffer of this module is built with deep_ep.testing's internode_put_only.
PUT_ONLY = os.environ.get("TEST_INTERNODE_PUT_ONLY", "0") == "1"
NUM_RDMA_BYTES = 768 * 1024 * 1024  # 256 MB of output pool after the rings (direct receive)
if PUT_ONLY:
    # Put peers: the buffer also holds the put area (signal twins and two staging halves as large as the ring
    # halves). 1.5 GB keeps the rings at 256 MB each and leaves ~512 MB of pool.
    NUM_RDMA_BYTES = 1536 * 1024 * 1024
TASK = "test_internode:task_internode_roundtrip"


def _virtual_node_pool(num_nodes: int = 2, **env: str) -> ti.Pool:
    """``num_nodes`` ranks on the GPUs in turn (all on GPU 0 of a one-GPU machine under ``TEST_RANKS_PER_GPU``:
    NVSHMEM time-slices the PEs, correctness only), each its own node, with an RDMA (NVSHMEM) buffer."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 2
    return ti.Pool([rank % max(gpus, 1) for rank in range(num_nodes)],
                   env={"DEEP_EP_GPUS_PER_NODE": "1", "TEST_NUM_RDMA_BYTES": str(NUM_RDMA_BYTES), **env},
                   overrides={"internode_put_only": True} if PUT_ONLY else None)


def _internode_pool(num_nodes: int):
    """A pool of ``num_nodes`` virtual nodes checked to run ``InternodeCuda``; yields it and closes it (the body of
    the module-scoped fixtures)."""
    pool = _virtual_node_pool(num_nodes)
    try:
        if ti.DEVICE == "cuda":
            assert pool.backends == {"InternodeCuda"}, f"Buffer did not pick the CUDA internode backend at " \
                f"{num_nodes} nodes: {pool.backends}"
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def virtual_nodes():
    yield from _internode_pool(2)


def _per_node() -> int:
    """Ranks per virtual node of the worker (its ``DEEP_EP_GPUS_PER_NODE``): 1 here, 2 in test_composed.py."""
    return int(os.environ.get("DEEP_EP_GPUS_PER_NODE", "1"))


def _reference(case: ti.Case, inputs: list, num_channels: int, **extra):
    import reference
    from deep_ep.config import Topology
    topo = Topology(case.num_ranks, _per_node())
    layouts = [reference.get_dispatch_layout(inp["topk_idx"], case.num_experts, topo) for inp in inputs]
    kwargs = dict(extra)
    if case.with_topk:
        kwargs.update(topk_idx=[inp["topk_idx"] for inp in inputs],
                      topk_weights=[inp["topk_weights"] for inp in inputs])
    dispatched = reference.dispatch([inp["x"] for inp in inputs], [lay.is_token_in_rank for lay in layouts], topo,
                                    num_experts=case.num_experts, expert_alignment=case.expert_alignment,
                                    num_channels=num_channels, **kwargs)
    return topo, layouts, dispatched


def _check_recv_x(label: str, got, want, use_fp8: bool, rows: int | None = None) -> None:
    if use_fp8:
        ti._eq(f"{label} fp8", got[0][:rows], want[0])
        ti._eq(f"{label} scales", got[1][:rows], want[1].contiguous())
    else:
        ti._eq(label, got[:rows], want)


@ti.tuned
def task_internode_roundtrip(buffer, rank: int, case: ti.Case) -> str:
    """Layout, dispatch, cached dispatch, worst-token dispatch and combine against the internode reference."""
    import deep_ep
    import reference
    inputs = [ti.make_inputs(case, r) for r in range(case.num_ranks)]
    mine = inputs[rank]
    config = deep_ep.Config(case.num_sms, *(case.ring_tokens or (8, 256)))

    ti._poison_allocator()
    topk_idx = mine["topk_idx"].to(ti.DEVICE)
    layout = buffer.get_dispatch_layout(topk_idx, case.num_experts, async_finish=case.async_mode)
    ti._wait(layout.event, case.async_mode)

    ti._poison_allocator()
    x = ti._to_cuda(mine["x"])
    kwargs = dict(num_tokens_per_rank=layout.num_tokens_per_rank,
                  num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank,
                  is_token_in_rank=layout.is_token_in_rank, num_tokens_per_expert=layout.num_tokens_per_expert,
                  expert_alignment=case.expert_alignment, config=config, async_finish=case.async_mode)
    if case.with_topk:
        kwargs.update(topk_idx=topk_idx, topk_weights=mine["topk_weights"].to(ti.DEVICE))
    if case.previous_mode:
        kwargs["previous_event"] = buffer.capture()
    out = buffer.dispatch(x, **kwargs)
    ti._wait(out.event, case.async_mode)
    handle = out.handle
    assert isinstance(handle, deep_ep.handle.InternodeHandle), type(handle)
    num_channels = handle.gbl_channel_prefix_matrix.size(1)

    topo, layouts, dispatched = _reference(case, inputs, num_channels)
    ref_layout, ref = layouts[rank], dispatched[rank]
    for name in ("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank"):
        ti._eq(name, getattr(layout, name), getattr(ref_layout, name))
    _check_recv_x("recv_x", out.recv_x, ref.recv_x, case.use_fp8)
    if case.with_topk:
        ti._eq("recv_topk_idx", out.recv_topk_idx, ref.recv_topk_idx)
        ti._eq("recv_topk_weights", out.recv_topk_weights, ref.recv_topk_weights)
        assert list(out.num_recv_tokens_per_expert_list) == list(ref.num_recv_tokens_per_expert_list)
    else:
        assert out.recv_topk_idx is None and out.recv_topk_weights is None
    for field in deep_ep.handle.InternodeHandle._fields:
        ti._eq(f"handle.{field}", getattr(handle, field), getattr(ref.handle, field))

    # ---- cached dispatch ----
    ti._poison_allocator()
    cached = buffer.dispatch(x, handle=handle, config=config, async_finish=case.async_mode,
                             previous_event=buffer.capture() if case.previous_mode else None)
    ti._wait(cached.event, case.async_mode)
    _check_recv_x("cached recv_x", cached.recv_x, ref.recv_x, case.use_fp8)

    # ---- worst-token dispatch ----
    if case.with_topk:
        worst = sum(case.num_tokens) + 3
        ti._poison_allocator()
        wout = buffer.dispatch(x, **{**kwargs, "num_worst_tokens": worst,
                                     "previous_event": buffer.capture() if case.previous_mode else None})
        ti._wait(wout.event, case.async_mode)
        m = ref.handle.recv_src_meta.size(0)
        recv = wout.recv_x[0] if case.use_fp8 else wout.recv_x
        assert recv.size(0) == worst and wout.recv_topk_idx.size(0) == worst
        _check_recv_x("worst recv_x", wout.recv_x, ref.recv_x, case.use_fp8, m)
        ti._eq("worst recv_topk_idx", wout.recv_topk_idx[:m], ref.recv_topk_idx)
        assert bool((wout.recv_topk_idx[m:] == -1).all()), "worst-token rows past M must have recv_topk_idx == -1"
        _, _, wref = _reference(case, inputs, num_channels, num_worst_tokens=worst)
        for field in ("recv_gbl_rank_prefix_sum", "recv_gbl_channel_prefix_matrix", "recv_src_meta",
                      "send_rdma_head"):
            ti._eq(f"worst handle.{field}", getattr(wout.handle, field), getattr(wref[rank].handle, field))

    # ---- combine (two-level rounding: per node, then across nodes) ----
    gen = torch.Generator().manual_seed(case.seed * 7 + 1)
    ys = [torch.randn(dispatched[r].handle.recv_src_meta.size(0), case.hidden, generator=gen).to(torch.bfloat16)
          for r in range(case.num_ranks)]
    bias = [inp["bias"] for inp in inputs]
    bias_arg = None
    ref_kwargs = {}
    if case.num_bias:
        bias_arg = ti._to_cuda(bias[rank]) if case.num_bias == 2 else ti._to_cuda(bias[rank][0])
        ref_kwargs["bias"] = [b if case.num_bias == 2 else b[0] for b in bias]
    if case.with_topk:
        ref_kwargs["topk_weights"] = [d.recv_topk_weights for d in dispatched]
    ref_comb = reference.combine(ys, [d.handle for d in dispatched], topo, **ref_kwargs)[rank]
    ti._poison_allocator()
    comb = buffer.combine(ys[rank].to(ti.DEVICE), handle,
                          topk_weights=out.recv_topk_weights if case.with_topk else None, bias=bias_arg,
                          config=config, async_finish=case.async_mode,
                          previous_event=buffer.capture() if case.previous_mode else None)
    ti._wait(comb.event, case.async_mode)
    ti._eq("combined_x", comb.combined_x, ref_comb[0])
    if case.with_topk:
        ti._eq("combined_topk_weights", comb.combined_topk_weights, ref_comb[1])
    again = buffer.combine(ys[rank].to(ti.DEVICE), handle, bias=bias_arg, config=config)
    ti._eq("second combined_x", again.combined_x, ref_comb[0])
    if ti.DEVICE == "cuda":
        torch.cuda.synchronize()
    return "ok"


@pytest.mark.multi_gpu
@ti.gpu_settings(int(os.environ.get("TEST_EXAMPLES_INTERNODE", "12")))
@given(case=ti.case_strategy(2, max_tokens=1200))
def test_two_virtual_nodes(virtual_nodes, case):
    virtual_nodes.run(TASK, case)


@pytest.mark.multi_gpu
def test_two_virtual_nodes_bench_shape(virtual_nodes):
    """The benchmark's shape (4096 tokens, hidden 7168, top-8 of 256 experts, BF16 and FP8, 24 SMs)."""
    for use_fp8 in (False, True):
        case = ti.Case(num_ranks=2, seed=7, num_tokens=(4096, 4096), hidden=7168, num_topk=8, num_experts=256,
                       use_fp8=use_fp8, with_topk=True, num_sms=24, expert_alignment=1, mask_prob=0.0,
                       empty_rank=-1, async_mode=False, previous_mode=False, num_bias=0, scales_col_major=False)
        virtual_nodes.run(TASK, case)


# Virtual nodes of the many-node test: more than 8 nodes, up to NUM_MAX_RING_RANKS (24), on the ring kernels. They
# share the GPUs (rank % GPUs): on one GPU run it with TEST_RANKS_PER_GPU >= TEST_INTERNODE_MANY_NODES; the marker skips
# it where fewer slots exist.
MANY_NODES = int(os.environ.get("TEST_INTERNODE_MANY_NODES", "24"))


@pytest.fixture(scope="module")
def many_nodes():
    yield from _internode_pool(MANY_NODES)


@pytest.mark.multi_gpu(MANY_NODES)
@ti.gpu_settings(int(os.environ.get("TEST_EXAMPLES_MANY_NODES", "4")))
@given(case=ti.case_strategy(MANY_NODES, max_tokens=160))
def test_many_virtual_nodes(many_nodes, case):
    """More than 8 nodes of one GPU on the ring kernels (receiver groups of one warp and of several, Phase A's
    destinations shared by the sender warps, as the drawn warp split gives); every output against ``reference``."""
    many_nodes.run(TASK, case)


@pytest.mark.multi_gpu(MANY_NODES)
def test_many_virtual_nodes_fixed(many_nodes):
    """A fixed large case at MANY_NODES nodes: FP8, top-8 of 16 experts per node, -1 masks, an empty node, both
    directions through the rings, the fewest dispatch copy warps (2) and the most."""
    for use_fp8, warps, receive in ((True, 2, "rings"), (False, 32 - MANY_NODES, "auto")):
        case = ti.Case(num_ranks=MANY_NODES, seed=11, num_tokens=tuple(64 + 8 * r for r in range(MANY_NODES)),
                       hidden=2048, num_topk=8, num_experts=16 * MANY_NODES, use_fp8=use_fp8, with_topk=True,
                       num_sms=8, expert_alignment=4, mask_prob=0.1, empty_rank=MANY_NODES - 1, async_mode=False,
                       previous_mode=False, num_bias=1, scales_col_major=False, dispatch_warps=warps,
                       combine_warps=None, receive=receive, combine_send="rings")
        many_nodes.run(TASK, case)


def task_put_peers(buffer, rank: int, _payload) -> list:
    """The ranks this rank reaches by NVSHMEM puts (``InternodeCuda.put_peers``) and the runtime's mask of them."""
    backend = buffer.runtime
    return [list(backend.put_peers), int(backend.runtime.get_put_mask())]


@pytest.mark.multi_gpu
def test_put_peers_follow_the_switch(virtual_nodes):
    """Under ``TEST_INTERNODE_PUT_ONLY=1`` the other rank is a put peer on both sides; over NVLink (P2P) without
    the override, none is."""
    if ti.DEVICE != "cuda":
        pytest.skip("the CUDA internode backend only")
    replies = virtual_nodes.run("test_internode:task_put_peers", None)
    if PUT_ONLY:
        assert replies == [[[1], 0b10], [[0], 0b01]], replies
    else:
        assert replies == [[[], 0], [[], 0]], replies


@pytest.mark.multi_gpu
def test_cached_disagreement_raises_at_next_call(virtual_nodes):
    """Two virtual nodes: see ``test_intranode.task_cached_disagree`` (the output words that carry the signature
    hashes are read through ``nvshmem_ptr``, and under ``TEST_INTERNODE_PUT_ONLY=1`` a put peer's hash arrives as an
    NVSHMEM signal into the twin of its word)."""
    if ti.DEVICE != "cuda":
        pytest.skip("the CUDA kernels' agreement (the torch backend raises in the call itself)")
    print(virtual_nodes.run("test_intranode:task_cached_disagree", None))


@pytest.mark.multi_gpu
def test_combine_disagreement_raises_at_next_call(virtual_nodes):
    """Two virtual nodes: see ``test_intranode.task_combine_disagree``, on the ring senders (this backend's one send
    path). The words that carry the signature hashes go by ``nvshmem_ptr`` stores, and under
    ``TEST_INTERNODE_PUT_ONLY=1`` as NVSHMEM signals into their twins (put peers)."""
    if ti.DEVICE != "cuda":
        pytest.skip("the CUDA kernels' agreement (the torch backend raises in the call itself)")
    print(virtual_nodes.run("test_intranode:task_combine_disagree", {"paths": ["rings"]}))


@pytest.mark.multi_gpu
def test_stalled_node_times_out():
    """Node 1 never joins the dispatch: node 0 gets a timeout exception naming the peer within the budget, and a
    usable CUDA context (``test_intranode.task_stall``)."""
    timeout_s = 5
    pool = _virtual_node_pool(DEEP_EP_TIMEOUT_S=str(timeout_s))
    try:
        replies = pool.run("stall", {"stalled": 1, "timeout_s": timeout_s}, timeout=timeout_s * 6 + 60)
        assert "timeout" in replies[0], replies
    finally:
        pool.kill()  # rank 0's Buffer is in the failed state: discard the pool

