"""Handle bookkeeping math (deep_ep.handle): literal examples, then properties against naive loops."""
from __future__ import annotations

import pytest
import strategies
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from deep_ep import handle as hd
from deep_ep.config import Topology
from deep_ep.layout import channel_token_range


def _mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------------------------
# Literal examples (computed by hand).
# ---------------------------------------------------------------------------------------------------------------

def test_intranode_sender_literal():
    # 5 tokens, 2 destinations, 2 channels of ceil(5/2) = 3 tokens: channel 0 = tokens 0..2, channel 1 = 3..4.
    m = _mask([[1, 0], [1, 1], [0, 1], [1, 1], [1, 0]])
    sender = hd.intranode_sender(m, 2)
    assert sender.channel_prefix_matrix.tolist() == [[2, 4], [2, 3]]
    assert sender.send_head.tolist() == [[0, -1], [1, 0], [-1, 1], [0, 0], [1, -1]]
    assert sender.channel_prefix_matrix.dtype == torch.int32 and sender.send_head.dtype == torch.int32


def test_layout_literal():
    # R = 4 ranks in 2 nodes of 2, E = 8 (2 experts per rank).
    topk = torch.tensor([[0, 3, -1], [5, 5, 1], [-1, -1, -1]])
    lay = hd.layout_from_topk(topk, 8, Topology(4, 2))
    assert lay.num_tokens_per_rank.tolist() == [2, 1, 1, 0]
    assert lay.num_tokens_per_rdma_rank.tolist() == [2, 1]
    assert lay.num_tokens_per_expert.tolist() == [1, 1, 0, 1, 0, 2, 0, 0]  # duplicate 5 counts twice
    assert lay.is_token_in_rank.tolist() == [[True, True, False, False], [True, False, True, False],
                                             [False, False, False, False]]
    assert hd.layout_from_topk(topk, 8, Topology(4, 8)).num_tokens_per_rdma_rank is None


def test_src_meta_literal():
    meta = hd.encode_src_meta(torch.tensor([1, 0]), _mask([[1, 0], [1, 1]]))
    assert meta.dtype == torch.uint8 and meta.tolist() == [[1, 0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 3, 0, 0, 0]]
    node, mask = hd.decode_src_meta(meta)
    assert node.tolist() == [1, 0]
    assert mask[:, :2].tolist() == [[True, False], [True, True]] and not mask[:, 2:].any()


def test_forwarder_send_nvl_head_literal():
    # Rows: (node 0, ch 0), (node 0, ch 1), (node 1, ch 0), (node 1, ch 0); two local ranks.
    head = hd.forwarder_send_nvl_head(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 0]),
                                      _mask([[1, 0], [1, 1], [1, 1], [0, 1]]))
    assert head.shape == (4, 8)
    assert head[:, :2].tolist() == [[0, -1], [0, 0], [0, 0], [-1, 1]]
    assert (head[:, 2:] == -1).all()


def test_receiver_prefix_literals():
    counts = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)  # [s, d]
    assert hd.rank_prefix_matrix(counts).tolist() == [[1, 2], [4, 2]]
    src_prefix = torch.tensor([[1, 3, 3], [0, 2, 5]], dtype=torch.int32)  # per source, inclusive over channels
    assert hd.recv_channel_prefix_matrix(src_prefix).tolist() == [[0, 1, 3], [0, 0, 2]]
    rank_sum = hd.recv_gbl_rank_prefix_sum(torch.tensor([3, 5]))
    assert rank_sum.tolist() == [3, 8]
    assert hd.recv_gbl_channel_prefix_matrix(src_prefix, rank_sum).tolist() == [[0, 1, 3], [3, 3, 5]]
    assert hd.recv_rdma_rank_prefix_sum(src_prefix).tolist() == [3, 8]


def test_bad_mask_rejected():
    with pytest.raises(ValueError, match="is_token_in_rank"):
        hd.intranode_sender(torch.zeros(3, 2, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="num_channels"):
        hd.intranode_sender(torch.zeros(3, 2, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="topk_idx"):
        hd.layout_from_topk(torch.tensor([[9]]), 8, Topology(2))
    with pytest.raises(ValueError, match="num_experts"):
        hd.layout_from_topk(torch.tensor([[1]]), 7, Topology(2))


# ---------------------------------------------------------------------------------------------------------------
# Properties against naive loops.
# ---------------------------------------------------------------------------------------------------------------

def _naive_send_head(mask: torch.Tensor, num_channels: int) -> list[list[int]]:
    n, r = mask.shape
    out = [[-1] * r for _ in range(n)]
    for c in range(num_channels):
        begin, end = channel_token_range(n, num_channels, c)
        for d in range(r):
            seq = 0
            for t in range(begin, end):
                if mask[t, d]:
                    out[t][d] = seq
                    seq += 1
    return out


@settings(deadline=None)
@given(n=st.integers(0, 20), r=st.integers(1, 6), c=st.integers(1, 5), seed=st.integers(0, 1000))
def test_sender_matches_naive(n, r, c, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, r, generator=gen) < 0.5
    sender = hd.intranode_sender(mask, c)
    assert sender.send_head.tolist() == _naive_send_head(mask, c)
    prefix = sender.channel_prefix_matrix
    assert prefix.shape == (r, c)
    assert (prefix[:, 1:] >= prefix[:, :-1]).all()                       # monotone over channels
    assert prefix[:, -1].tolist() == mask.sum(0).tolist()                # last column = tokens per destination
    assert ((sender.send_head >= 0) == mask).all()                      # -1 exactly where not routed
    for ch in range(c):
        begin, end = channel_token_range(n, c, ch)
        before = prefix[:, ch - 1] if ch else torch.zeros(r, dtype=torch.int32)
        assert (prefix[:, ch] - before).tolist() == mask[begin:end].sum(0).tolist()


@settings(deadline=None)
@given(case=strategies.cases(max_ranks=8, max_tokens=10))
def test_layout_matches_reference_loops(case):
    for rank in range(case.num_ranks):
        topk = case.make_inputs(rank).topk_idx
        fast = hd.layout_from_topk(topk, case.num_experts, case.topology)
        slow = reference.get_dispatch_layout(topk, case.num_experts, case.topology)
        assert torch.equal(fast.num_tokens_per_rank, slow.num_tokens_per_rank), case.describe()
        assert torch.equal(fast.num_tokens_per_expert, slow.num_tokens_per_expert), case.describe()
        assert torch.equal(fast.is_token_in_rank, slow.is_token_in_rank), case.describe()
        if case.topology.is_internode:
            assert torch.equal(fast.num_tokens_per_rdma_rank, slow.num_tokens_per_rdma_rank), case.describe()
        else:
            assert fast.num_tokens_per_rdma_rank is None and slow.num_tokens_per_rdma_rank is None


@settings(deadline=None)
@given(case=strategies.cases(max_ranks=8, max_tokens=10, internode=True))
def test_internode_sender_consistent(case):
    topo = case.topology
    for rank in range(case.num_ranks):
        mask = hd.layout_from_topk(case.make_inputs(rank).topk_idx, case.num_experts, topo).is_token_in_rank
        sender = hd.internode_sender(mask, case.num_channels, topo)
        nodes = hd.node_mask(mask, topo)
        assert sender.rdma_channel_prefix_matrix[:, -1].tolist() == nodes.sum(0).tolist()
        assert torch.equal(sender.gbl_channel_prefix_matrix,
                           hd.intranode_sender(mask, case.num_channels).channel_prefix_matrix)
        assert sender.send_rdma_head.tolist() == _naive_send_head(nodes, case.num_channels)


# ---------------------------------------------------------------------------------------------------------------
# One GPU per node: the CUDA internode backend's handle conversion against the torch backend's construction.
# ---------------------------------------------------------------------------------------------------------------

def _single_gpu_nodes_expected(masks: list[torch.Tensor], me: int, num_channels: int,
                               num_pad: int) -> hd.InternodeHandle:
    """Rank ``me``'s internode handle for ``R`` nodes of one GPU, built the way deep_ep/torch_backend.py does."""
    num_ranks = len(masks)
    topo = Topology(num_ranks, 1)
    senders = [hd.internode_sender(m, num_channels, topo) for m in masks]
    recv_counts = torch.tensor([int(m[:, me].sum()) for m in masks])
    src_chan_prefix = torch.stack([s.gbl_channel_prefix_matrix[me] for s in senders])
    src_rdma_prefix = torch.stack([s.rdma_channel_prefix_matrix[me] for s in senders])
    gbl_rank_prefix = hd.recv_gbl_rank_prefix_sum(recv_counts)
    gbl_chan_prefix = hd.recv_gbl_channel_prefix_matrix(src_chan_prefix, gbl_rank_prefix)
    source = torch.repeat_interleave(torch.arange(num_ranks), recv_counts)
    num_recv = int(recv_counts.sum())
    src_meta = hd.encode_src_meta(source, torch.ones(num_recv, 1, dtype=torch.bool))
    src_meta = torch.cat([src_meta, torch.zeros(num_pad, 8, dtype=torch.uint8)])
    channel = torch.cat([hd.token_channels(m.size(0), num_channels)[m[:, me]] for m in masks])
    nvl_head = hd.forwarder_send_nvl_head(source, channel, torch.ones(num_recv, 1, dtype=torch.bool))
    nvl_head = torch.cat([nvl_head, torch.full((num_pad, 8), -1, dtype=torch.int32)])
    sender = senders[me]
    return hd.InternodeHandle(masks[me], sender.rdma_channel_prefix_matrix, sender.gbl_channel_prefix_matrix,
                              hd.recv_rdma_channel_prefix_matrix(src_rdma_prefix),
                              hd.recv_rdma_rank_prefix_sum(src_rdma_prefix), gbl_chan_prefix, gbl_rank_prefix,
                              src_meta, sender.send_rdma_head, nvl_head)


@settings(max_examples=60, deadline=None)
@given(num_ranks=st.integers(2, 5), num_channels=st.integers(1, 6), num_pad=st.integers(0, 3), data=st.data())
def test_single_gpu_nodes_handle_matches_torch_backend(num_ranks, num_channels, num_pad, data):
    """The CUDA kernels' intranode fields convert to the torch backend's internode handle (G = 1), and back."""
    masks = []
    for _ in range(num_ranks):
        num_tokens = data.draw(st.integers(0, 12))
        bits = data.draw(st.lists(st.booleans(), min_size=num_tokens * num_ranks, max_size=num_tokens * num_ranks))
        masks.append(torch.tensor(bits, dtype=torch.bool).view(num_tokens, num_ranks))
    me = data.draw(st.integers(0, num_ranks - 1))
    count_matrix = torch.tensor([[int(m[:, d].sum()) for d in range(num_ranks)] for m in masks])
    senders = [hd.intranode_sender(m, num_channels) for m in masks]
    recv_src_idx = torch.cat([torch.nonzero(m[:, me]).flatten() for m in masks]).to(torch.int32)
    recv_src_idx = torch.cat([recv_src_idx, torch.zeros(num_pad, dtype=torch.int32)])
    intra = hd.IntranodeHandle(hd.rank_prefix_matrix(count_matrix), senders[me].channel_prefix_matrix,
                               hd.recv_channel_prefix_matrix(torch.stack([s.channel_prefix_matrix[me]
                                                                          for s in senders])),
                               recv_src_idx, masks[me], senders[me].send_head)
    got = hd.single_gpu_nodes_handle(intra, me)
    want = _single_gpu_nodes_expected(masks, me, num_channels, num_pad)
    for name, a, b in zip(hd.InternodeHandle._fields, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    back = hd.single_gpu_nodes_kernel_handle(got, me)
    assert torch.equal(back.rank_prefix_matrix[:, me], intra.rank_prefix_matrix[:, me])
    for name in ("channel_prefix_matrix", "recv_channel_prefix_matrix", "is_token_in_rank", "send_head"):
        assert torch.equal(getattr(back, name), getattr(intra, name)), name
    assert back.recv_src_idx.shape == intra.recv_src_idx.shape


def test_handles_are_deepep_tuples_with_state_beside_them():
    """A handle unpacks and indexes as DeepEP's tuple; its owner (the Buffer that returned it) and its backend's
    state are attributes, not positions, default None, and stay with that object (``_replace`` makes a new one)."""
    fields = [torch.zeros(1)] * 6
    handle = hd.IntranodeHandle(*fields)
    assert len(handle) == 6 and tuple(handle) == tuple(fields) and handle[3] is fields[3]
    assert handle.owner is None and handle.backend_state is None
    handle.owner, handle.backend_state = "buffer", [1, 2]
    assert (handle.owner, handle.backend_state) == ("buffer", [1, 2]) and len(handle) == 6
    other = handle._replace(send_head=torch.ones(1))
    assert type(other) is hd.IntranodeHandle and other.owner is None and other.backend_state is None
    assert hd.IntranodeHandle._fields[0] == "rank_prefix_matrix" and hd.InternodeHandle._fields[6] == \
        "recv_gbl_rank_prefix_sum" and len(hd.LowLatencyHandle._fields) == 5
    assert hd.LowLatencyHandle(torch.zeros(1), torch.zeros(1), 8, 128, 4).owner is None
