"""The composed internode path (``deep_ep/backends/composed.py``) on gloo: rail + node torch stages, vs ``reference``.

``deep_ep.testing.overrides(internode="composed")`` makes ``deep_ep.Buffer`` run ``N x G`` groups with ``G > 1`` as a
rail stage and a
node stage (``TorchBackend`` instances over gloo subgroups). The cases are those of ``test_buffer_torch``'s normal
mode (BF16/FP8, top-k with -1 slots and duplicates, empty ranks and nodes, expert alignment, cached dispatch,
worst-token mode, combine with 0..2 biases and top-k weights, async events); every output and all ten handle fields
are compared bit for bit with ``reference``. Plus: a case where the per-node BF16 rounding changes the result.
"""
from __future__ import annotations

import os
from typing import Optional

import dist
import pytest
import test_buffer_torch as tbt
import torch
from hypothesis import given, settings

from deep_ep.backends.base import Backend

# (world size, GPUs per node) -> examples: the 8-rank pools are the slowest per example; 18 ranks are 9 nodes, a
# rail stage of more ranks than a node has GPUs (Topology.one_domain).
TOPOLOGIES = {(4, 2): 30, (8, 4): 10, (8, 2): 5, (18, 2): 3}


def _examples(count: int) -> int:
    return max(1, int(count * float(os.environ.get("DEEP_EP_TEST_EXAMPLE_SCALE", "1"))))


def _env(per_node: int) -> dict:
    """The workers of a composed pool (TEST_INTERNODE keeps them apart from the plain torch pools)."""
    return {"DEEP_EP_GPUS_PER_NODE": str(per_node), "TEST_INTERNODE": "composed"}


def _composed_buffer(ctx: dist.WorkerContext) -> object:
    """The worker's Buffer, built under ``internode='composed'``: the composed path with torch stages."""
    from deep_ep import testing
    with testing.overrides(internode=os.environ["TEST_INTERNODE"]):
        return tbt._buffer(ctx, "normal", num_nvl_bytes=1 << 20)


# ---------------------------------------------------------------------------------------------------------------
# Worker side.
# ---------------------------------------------------------------------------------------------------------------

def run_normal_composed(ctx: dist.WorkerContext, case: tbt.NormalCase) -> Optional[str]:
    """``test_buffer_torch.run_normal`` on a Buffer that must have selected the composed path."""
    from deep_ep.backends.composed import ComposedInternode
    buf = _composed_buffer(ctx)
    if not isinstance(buf._composed, ComposedInternode):
        return f"rank {ctx.rank}: internode='composed' did not select the composed path ({buf._composed!r})"
    return tbt.run_normal(ctx, case)


def run_per_node_rounding(ctx: dist.WorkerContext, case: None) -> Optional[str]:
    """2 x 2: rank 0's token 0 goes to ranks 0, 1 (node 0) and 2 (node 1); the expert rows are 1, 2^-8 and 2^-8.
    Per node: bf16(1 + 2^-8) = 1 (tie to even), then bf16(1 + 2^-8) = 1. One rounding would give 1 + 2^-7."""
    import reference
    from deep_ep.backends.cuda_tuning import intranode_channels
    from deep_ep.config import Config, Topology

    topo = Topology(4, 2)
    buf = _composed_buffer(ctx)
    hidden, num_experts = 128, 4
    idx = [torch.tensor([[0, 1, 2]]), *[torch.empty(0, 3, dtype=torch.int64)] * 3]
    xs = [torch.ones(i.size(0), hidden, dtype=torch.bfloat16) for i in idx]
    layout = buf.get_dispatch_layout(idx[ctx.rank], num_experts)
    config = Config(num_sms=2)
    result = buf.dispatch(xs[ctx.rank], num_tokens_per_rank=layout.num_tokens_per_rank,
                          num_tokens_per_rdma_rank=layout.num_tokens_per_rdma_rank,
                          is_token_in_rank=layout.is_token_in_rank,
                          num_tokens_per_expert=layout.num_tokens_per_expert, config=config)
    values = {0: 1.0, 1: 2.0 ** -8, 2: 2.0 ** -8, 3: 0.0}
    ys = [torch.full((1 if r < 3 else 0, hidden), values[r], dtype=torch.bfloat16) for r in range(4)]
    combined = buf.combine(ys[ctx.rank], result.handle, config=config)
    masks = [reference.get_dispatch_layout(i, num_experts, topo).is_token_in_rank for i in idx]
    refs = reference.dispatch(xs, masks, topo, num_channels=intranode_channels(config.num_sms, topo.num_ranks))
    want = reference.combine(ys, [r.handle for r in refs], topo)[ctx.rank].combined_x
    errors = []
    tbt._expect(errors, "combined_x", combined.combined_x, want)
    if ctx.rank == 0:
        single = torch.full((1, hidden), 1.0 + 2.0 ** -7, dtype=torch.bfloat16)
        if not torch.equal(want, torch.ones(1, hidden, dtype=torch.bfloat16)) or torch.equal(want, single):
            errors.append(f"the case does not separate per-node from single rounding: reference gives {want[0, 0]}")
    return "\n".join(errors) or None


def run_auto_is_torch(ctx: dist.WorkerContext, case: None) -> Optional[str]:
    buf = tbt._buffer(ctx, "normal", num_nvl_bytes=1 << 20)
    return None if buf._composed is None else f"rank {ctx.rank}: auto selected {buf._composed!r} on CPU"


# ---------------------------------------------------------------------------------------------------------------
# Driver side.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("topology", list(TOPOLOGIES), ids=lambda t: f"{t[0]}ranks-{t[0] // t[1]}x{t[1]}")
def test_composed_dispatch_combine(pools, topology):
    world, per_node = topology

    @settings(max_examples=_examples(TOPOLOGIES[topology]), phases=tbt.PHASES)
    @given(case=tbt.normal_cases(world, per_node))
    def check(case: tbt.NormalCase) -> None:
        pools.get(world, _env(per_node)).check("test_composed_internode", "run_normal_composed", case)

    check()


@pytest.mark.timeout(300)
def test_composed_per_node_rounding(pools):
    pools.get(4, _env(2)).check("test_composed_internode", "run_per_node_rounding", None)


@pytest.mark.timeout(300)
def test_auto_keeps_torch_backend_on_cpu(pools):
    """Without an ``internode`` override the torch backend serves gloo groups: the composed path with torch stages
    is only for tests and CPU runs that ask for it."""
    pools.get(4, {"DEEP_EP_GPUS_PER_NODE": "2"}).check("test_composed_internode", "run_auto_is_torch", None)


class _TorchStage(Backend):
    """A stage without rings (a torch stage): only named."""

    def set_rank_names(self, names, scope) -> None:
        self.names, self.scope = list(names), scope


class _Stage(_TorchStage):
    """What the ring check reads of a CUDA node stage backend."""

    def __init__(self, num_bytes: int) -> None:
        self.num_nvl_bytes = num_bytes

    def ring_bytes(self) -> int:
        return self.num_nvl_bytes


def test_cuda_stage_ring_check():
    """A CUDA node stage: a call whose stage records do not fit the rings raises ValueError naming num_nvl_bytes and
    the size needed (``stage_nvl_bytes``), which fits exactly (128 bytes less does not); torch stages are not
    checked."""
    from deep_ep import layout as lay
    from deep_ep.backends.composed import ComposedInternode, stage_nvl_bytes
    from deep_ep.backends.cuda_tuning import intranode_channels
    from deep_ep.config import Config, Topology

    topo, config = Topology(4, 2), Config(24, 8, 256)
    record = lay.intranode_dispatch_record_bytes(14336 + 48, 0, 8)
    need = stage_nvl_bytes(record, 2, intranode_channels(config.num_sms, 2), config.num_max_nvl_chunked_send_tokens)
    ComposedInternode(_TorchStage(), _Stage(need), 0, topo, cuda_node=True)._check_stage("dispatch", record, config)
    ComposedInternode(_TorchStage(), _TorchStage(), 0, topo)._check_stage(
        "dispatch", record, config)  # torch stages: no check
    for num_bytes in (1 << 20, need - 128):
        with pytest.raises(ValueError, match=f"num_nvl_bytes={num_bytes} .*node stage dispatch.*num_nvl_bytes >= "
                                             f"{need}"):
            ComposedInternode(_TorchStage(), _Stage(num_bytes), 0, topo, cuda_node=True)._check_stage(
                "dispatch", record, config)


def test_stage_errors_name_buffer_ranks():
    """A stage numbers its own ranks; the composed path has each CUDA stage report the Buffer's ranks (rail rank n
    of local index l is n * G + l, node rank l' of node m is m * G + l'), keeping the stage's numbers in brackets."""
    from deep_ep.backends.composed import ComposedInternode
    from deep_ep.config import Topology
    from deep_ep.errors import name_ranks

    rail, node = _TorchStage(), _TorchStage()
    ComposedInternode(rail, node, 5, Topology(8, 2))  # 4 nodes x 2: rank 5 = (node 2, local 1)
    assert (rail.names, rail.scope) == ([1, 3, 5, 7], "composed rail stage")
    assert (node.names, node.scope) == ([4, 5], "composed node stage")
    text = "dispatch recv wait tail: rank 2 peer 3 channel 1 expected 5 observed 4 after 10.000 s (timeout; block 2)"
    assert name_ranks(text, rail.names, rail.scope) == text.replace(
        "rank 2 peer 3", "rank 5 peer 7 (composed rail stage ranks 2 / 3)")
    host = "dispatch CPU wait for notify counts: rank 1 peer -1 channel -1 expected >= 0 rows observed -1"
    assert "rank 5 peer -1 (composed node stage ranks 1 / -1)" in name_ranks(host, node.names, node.scope)
    assert name_ranks(text, None, "") == text


def test_torch_stage_errors_name_the_buffer_ranks():
    """A torch stage (the torch rail, or torch stages on CPU) reports its timeouts with the Buffer's ranks too: the
    composed path gives it the names, its point-to-point and collective waits use them."""
    from deep_ep.backends.composed import ComposedInternode
    from deep_ep.backends.torch_dist import CommTimeoutError, TorchBackend, _Comm
    from deep_ep.config import Topology

    class Stage(TorchBackend):
        def __init__(self, rank: int) -> None:  # no process group: only the error path is exercised
            self.comm = _Comm.__new__(_Comm)
            self.comm.rank, self.comm.rank_names, self.comm.rank_scope = rank, None, ""

    class Stalled:
        def wait(self, timeout):
            raise RuntimeError("Timed out waiting for recv")

    rail, node = Stage(2), Stage(1)
    ComposedInternode(rail, node, 5, Topology(8, 2))  # 4 nodes x 2: rank 5 = (node 2, local 1)
    with pytest.raises(CommTimeoutError, match=r"rank 5 timed out .* waiting for receive of rows from peer 7 "
                                               r"\(composed rail stage ranks 2 / 3\)"):
        rail.comm.wait_work(Stalled(), "dispatch", "receive of rows", 3)
    with pytest.raises(CommTimeoutError, match=r"rank 5 \(composed node stage rank 1\) timed out .* from all ranks"):
        node.comm.wait_work(Stalled(), "dispatch", "counts", None)
    plain = Stage(2)
    with pytest.raises(CommTimeoutError, match=r"rank 2 timed out .* from peer 3: Timed out"):
        plain.comm.wait_work(Stalled(), "dispatch", "receive of rows", 3)


def test_node_stage_needs_one_host_per_node():
    """The CUDA node stage is CUDA IPC: each node's ranks must share a host (the rail stage, torch, may span
    hosts); the refusal names the node, its hosts and DEEP_EP_GPUS_PER_NODE."""
    from deep_ep.backends.selection import _node_spans_hosts
    from deep_ep.config import Topology

    topo = Topology(4, 2)  # 2 nodes x 2
    assert _node_spans_hosts(["a"] * 4, topo) is None
    assert _node_spans_hosts(["a", "a", "b", "b"], topo) is None
    why = _node_spans_hosts(["a", "a", "b", "c"], topo)
    assert why is not None and "node 1 span hosts ['b', 'c']" in why and "DEEP_EP_GPUS_PER_NODE" in why, why


def test_node_stage_checks_and_any_node_count():
    """The ring check and the kernels' top-k limit apply to a CUDA node stage only, before any communication; the
    torch rail serves any node count and E / N beyond the ring kernels' local experts."""
    from deep_ep import layout as lay
    from deep_ep.backends.composed import ComposedInternode
    from deep_ep.config import NUM_MAX_RING_RANKS, Config, Topology

    topo, config = Topology(4, 2), Config(24, 8, 256)
    record = lay.intranode_dispatch_record_bytes(14336 + 48, 0, 8)
    with pytest.raises(ValueError, match="node stage dispatch"):
        ComposedInternode(_TorchStage(), _Stage(1 << 20), 0, topo, cuda_node=True)._check_stage(
            "dispatch", record, config)
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    idx = torch.zeros(1, 4, dtype=torch.int64)
    many = Topology(2 * (NUM_MAX_RING_RANKS + 1), 2)
    composed_big = ComposedInternode(_TorchStage(), _Stage(1 << 30), 0, many, cuda_node=True)
    composed_big._check_dispatch([x], idx, Config(8, 8, 256))
    wide = torch.zeros(1, lay.INTRANODE_MAX_TOPK + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"at most {lay.INTRANODE_MAX_TOPK} top-k .*got "
                                         f"{lay.INTRANODE_MAX_TOPK + 1}"):
        composed_big._check_dispatch([x], wide, Config(8, 8, 256))
    ComposedInternode(_TorchStage(), _TorchStage(), 0, many)._check_dispatch([x], wide, Config(8, 8, 256))


def test_automatic_fallback_says_why(monkeypatch):
    """With a GPU present, a group the kernels do not serve (here: more nodes than a ring group has ranks) falls back
    to the torch backend with a RuntimeWarning naming the reason; without a GPU the torch backend is the plain choice
    (no warning); ``DEEP_EP_BACKEND=cuda`` turns the reason into an error; ``comm=`` alone into a ValueError."""
    import warnings

    from deep_ep.backends.selection import without_cuda

    reason = "25 nodes exceed the kernels' 24 ranks"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(RuntimeWarning, match=r"CUDA internode backend does not serve this group \(25 nodes exceed"):
        assert without_cuda("auto", object(), "CUDA internode backend", reason) is None
    with pytest.raises(RuntimeError, match="DEEP_EP_BACKEND=cuda but the CUDA internode backend cannot be used: 25"):
        without_cuda("cuda", object(), "CUDA internode backend", reason)
    with pytest.raises(ValueError, match="comm= .* without group="):
        without_cuda("auto", None, "CUDA internode backend", reason)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert without_cuda("auto", object(), "CUDA internode backend", "CUDA is not available") is None


def test_composed_calls_agree_over_the_whole_group_whatever_the_device():
    """The composed path's stages run on subgroups (a rail, a node), so no stage alone sees every rank: a call it
    serves exchanges the signature over the whole group through the torch backend first, whatever the device of its
    tensors (a CUDA node stage too). Calls the CUDA kernels serve carry their agreement in the kernels instead."""
    import types

    from deep_ep.buffer import Buffer
    torch_backend, composed, kernels = object(), object(), object()
    for device in ("cpu", "cuda"):
        buf = types.SimpleNamespace(group_size=4, _torch=torch_backend, _destroyed=False, _composed=composed,
                                    _composed_device=device, _routes={("normal", device): composed},
                                    _ll_carving_handshake=lambda *args: False)
        assert Buffer._agreeing(buf, "normal", device) is torch_backend, device
        assert Buffer._agreeing(buf, "normal", device, composed) is torch_backend, device
    buf = types.SimpleNamespace(group_size=4, _torch=torch_backend, _destroyed=False, _composed=None,
                                _composed_device=None, _routes={("normal", "cuda"): kernels},
                                _ll_carving_handshake=lambda *args: False)
    assert Buffer._agreeing(buf, "normal", "cuda") is None
    assert Buffer._agreeing(buf, "normal", "cpu") is torch_backend  # no route: the torch backend serves
