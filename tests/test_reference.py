"""The pure-PyTorch reference (the oracle): hand-computed examples, then properties over drawn routing cases."""
from __future__ import annotations

import pytest
import strategies
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from deep_ep import handle as hd
from deep_ep import numerics
from deep_ep.config import Topology, align_up
from deep_ep.layout import channel_token_range


def _dispatch_case(case: strategies.Case, topology: Topology | None = None, **kwargs):
    inputs = case.all_inputs()
    topo = topology or case.topology
    masks = [hd.layout_from_topk(i.topk_idx, case.num_experts, topo).is_token_in_rank for i in inputs]
    results = reference.dispatch([i.x for i in inputs], masks, topo, topk_idx=[i.topk_idx for i in inputs],
                                 topk_weights=[i.topk_weights for i in inputs], num_experts=case.num_experts,
                                 num_channels=case.num_channels, **kwargs)
    return inputs, masks, results


def _expected_rows(masks, d):
    """(source, token) pairs rank ``d`` receives, in contract order (source asc, token asc)."""
    return [(s, t) for s in range(len(masks)) for t in range(masks[s].size(0)) if masks[s][t, d]]


# ---------------------------------------------------------------------------------------------------------------
# Hand-computed example: R = 2, E = 4 (L = 2), N = (3, 2), C = 2.
# ---------------------------------------------------------------------------------------------------------------

TOPK = [torch.tensor([[0, 2], [1, -1], [3, 2]]), torch.tensor([[2, 3], [0, 0]])]
WEIGHTS = [torch.tensor([[0.5, 0.25], [1.0, 9.0], [2.0, 4.0]]), torch.tensor([[3.0, 5.0], [6.0, 7.0]])]
X = [torch.tensor([[1.0], [2.0], [3.0]]).repeat(1, 128).bfloat16(),
     torch.tensor([[10.0], [20.0]]).repeat(1, 128).bfloat16()]


def _hand_dispatch(**kwargs):
    topo = Topology(2)
    masks = [reference.get_dispatch_layout(t, 4, topo).is_token_in_rank for t in TOPK]
    return masks, reference.dispatch(X, masks, topo, topk_idx=TOPK, topk_weights=WEIGHTS, num_experts=4,
                                     num_channels=2, **kwargs)


def test_hand_layout():
    lay = reference.get_dispatch_layout(TOPK[1], 4, Topology(2))
    assert lay.num_tokens_per_rank.tolist() == [1, 1]
    assert lay.num_tokens_per_expert.tolist() == [2, 0, 1, 1]
    assert lay.is_token_in_rank.tolist() == [[False, True], [True, False]]


def test_hand_dispatch():
    _, (r0, r1) = _hand_dispatch()
    assert r0.recv_x[:, 0].tolist() == [1.0, 2.0, 20.0]
    assert r1.recv_x[:, 0].tolist() == [1.0, 3.0, 10.0]
    assert r0.recv_topk_idx.tolist() == [[0, -1], [1, -1], [0, 0]]
    assert r1.recv_topk_idx.tolist() == [[-1, 0], [1, 0], [0, 1]]
    assert r0.recv_topk_weights.tolist() == [[0.5, 0.0], [1.0, 0.0], [6.0, 7.0]]
    assert r1.recv_topk_weights.tolist() == [[0.0, 0.25], [2.0, 4.0], [3.0, 5.0]]
    assert r0.num_recv_tokens_per_expert_list == [3, 1]
    assert r1.num_recv_tokens_per_expert_list == [3, 2]
    h0, h1 = r0.handle, r1.handle
    assert isinstance(h0, hd.IntranodeHandle)
    assert h0.rank_prefix_matrix.tolist() == [[2, 2], [3, 3]] == h1.rank_prefix_matrix.tolist()
    assert h0.channel_prefix_matrix.tolist() == [[2, 2], [1, 2]]
    assert h1.channel_prefix_matrix.tolist() == [[0, 1], [1, 1]]
    assert h0.recv_channel_prefix_matrix.tolist() == [[0, 2], [0, 0]]
    assert h1.recv_channel_prefix_matrix.tolist() == [[0, 1], [0, 1]]
    assert h0.recv_src_idx.tolist() == [0, 1, 1] and h1.recv_src_idx.tolist() == [0, 2, 0]
    assert h0.send_head.tolist() == [[0, 0], [1, -1], [-1, 0]]
    assert h1.send_head.tolist() == [[-1, 0], [0, -1]]


def test_hand_alignment_and_combine():
    _, res = _hand_dispatch(expert_alignment=2)
    assert [r.num_recv_tokens_per_expert_list for r in res] == [[4, 2], [4, 2]]
    out = reference.combine([r.recv_x for r in res], [r.handle for r in res], Topology(2),
                            topk_weights=[r.recv_topk_weights for r in res])
    assert out[0].combined_x[:, 0].tolist() == [2.0, 2.0, 3.0]     # token 0 is held by both ranks
    assert out[1].combined_x[:, 0].tolist() == [10.0, 20.0]
    # Weights come back where the expert is valid, 0 for the -1 slot.
    assert out[0].combined_topk_weights.tolist() == [[0.5, 0.25], [1.0, 0.0], [2.0, 4.0]]
    assert out[1].combined_topk_weights.tolist() == WEIGHTS[1].tolist()


def test_hand_internode_combine_rounds_per_node():
    # R = 4 in nodes of 2, E = 4 (L = 1). Rank 0's single token goes to ranks 0, 1 (node 0) and 2 (node 1).
    # Contributions 1, 2^-8, 2^-8. One node: 1 + 2^-8 + 2^-8 = 1 + 2^-7, exact in BF16. Two nodes: node 0 gives
    # bf16(1 + 2^-8) = 1 (tie to even), node 1 gives 2^-8, and bf16(1 + 2^-8) = 1 again.
    topk = [torch.tensor([[0, 1, 2]]), *[torch.zeros(0, 3, dtype=torch.int64)] * 3]
    weights = [torch.ones(t.shape) for t in topk]
    xs = [torch.ones(t.size(0), 128, dtype=torch.bfloat16) for t in topk]
    values = [1.0, 2.0 ** -8, 2.0 ** -8, 0.0]
    for topo, expected in ((Topology(4, 2), 1.0), (Topology(4, 4), 1.0 + 2.0 ** -7)):
        masks = [reference.get_dispatch_layout(t, 4, topo).is_token_in_rank for t in topk]
        res = reference.dispatch(xs, masks, topo, topk_idx=topk, topk_weights=weights, num_experts=4)
        ys = [torch.full((r.recv_x.size(0), 128), v, dtype=torch.bfloat16) for r, v in zip(res, values)]
        out = reference.combine(ys, [r.handle for r in res], topo)
        assert out[0].combined_x[0, 0].item() == expected, topo


def test_hand_low_latency():
    res = reference.low_latency_dispatch(X, TOPK, 3, 4, use_fp8=False)
    # Rank 0, expert 0: (s0, t0), (s1, t1) twice (duplicate); expert 1: (s0, t1).
    assert res[0].packed_recv_count.tolist() == [3, 1]
    assert res[0].handle.packed_recv_src_info[0, :3].tolist() == [0, 1, 1]
    begin, count = reference.unpack_layout_range(res[0].handle.packed_recv_layout_range)
    assert begin.tolist() == [[0, 1], [0, 1]] and count.tolist() == [[1, 2], [1, 0]]
    assert res[0].recv_x[0, :3, 0].tolist() == [1.0, 20.0, 20.0]
    # Expert outputs = 2 * input for every row; combine = sum_k w_k * 2 * x.
    y = [r.recv_x * 2 for r in res]
    out = reference.low_latency_combine(y, TOPK, WEIGHTS, [r.handle for r in res])
    assert out[0][:, 0].tolist() == [(0.5 + 0.25) * 2, 1.0 * 2 * 2, (2.0 + 4.0) * 2 * 3]
    assert out[1][:, 0].tolist() == [(3.0 + 5.0) * 2 * 10, (6.0 + 7.0) * 2 * 20]


# ---------------------------------------------------------------------------------------------------------------
# Normal dispatch / combine properties.
# ---------------------------------------------------------------------------------------------------------------

@settings(deadline=None, max_examples=40)
@given(case=strategies.cases())
def test_dispatch_order_counts_and_topk(case):
    inputs, masks, results = _dispatch_case(case)
    experts_per_rank = case.num_local_experts
    for d, res in enumerate(results):
        rows = _expected_rows(masks, d)
        expected_x = torch.stack([inputs[s].x[t] for s, t in rows]) if rows else torch.empty(0, case.hidden)
        assert torch.equal(res.recv_x.float(), expected_x.float()), case.describe()
        lo = d * experts_per_rank
        for i, (s, t) in enumerate(rows):
            for k in range(case.num_topk):
                e = int(inputs[s].topk_idx[t, k])
                local = e - lo if lo <= e < lo + experts_per_rank else -1
                assert int(res.recv_topk_idx[i, k]) == local, case.describe()
                w = float(inputs[s].topk_weights[t, k]) if local >= 0 else 0.0
                assert float(res.recv_topk_weights[i, k]) == w, case.describe()
        counts = [sum(int((i.topk_idx == lo + j).sum()) for i in inputs) for j in range(experts_per_rank)]
        assert res.num_recv_tokens_per_expert_list == counts, case.describe()
        assert [int((res.recv_topk_idx == j).sum()) for j in range(experts_per_rank)] == counts
        if not case.topology.is_internode:
            assert res.handle.recv_src_idx.tolist() == [t for _, t in rows]
            assert res.handle.rank_prefix_matrix[-1, d] == len(rows)


@settings(deadline=None, max_examples=40)
@given(case=strategies.cases(), use_bias=st.sampled_from([0, 1, 2]))
def test_combine_of_dispatch_is_x_times_holders(case, use_bias):
    inputs, masks, results = _dispatch_case(case)
    bias = None
    if use_bias:
        gen = torch.Generator().manual_seed(case.seed)
        bias = []
        for i in inputs:
            parts = tuple(torch.randint(-4, 5, i.x.shape, generator=gen).bfloat16() for _ in range(use_bias))
            bias.append(parts if use_bias == 2 else parts[0])
    out = reference.combine([r.recv_x for r in results], [r.handle for r in results], case.topology,
                            topk_weights=[r.recv_topk_weights for r in results], bias=bias)
    for s, (inp, res) in enumerate(zip(inputs, out)):
        holders = masks[s].sum(1, keepdim=True).float()
        expected = inp.x.float() * holders
        if bias is not None:
            expected = expected + sum(b.float() for b in (bias[s] if isinstance(bias[s], tuple) else (bias[s],)))
        assert res.combined_x.dtype == torch.bfloat16
        assert torch.equal(res.combined_x.float(), expected), case.describe()
        valid = inp.topk_idx >= 0
        assert torch.equal(res.combined_topk_weights, torch.where(valid, inp.topk_weights, 0.0)), case.describe()


@settings(deadline=None, max_examples=25)
@given(case=strategies.cases(internode=True))
def test_internode_and_intranode_views_agree(case):
    flat = Topology(case.num_ranks, case.num_ranks)  # the same ranks as one node (max_ranks=8 keeps R <= 8)
    inputs, masks, inter = _dispatch_case(case)
    _, _, intra = _dispatch_case(case, topology=flat)
    gen = torch.Generator().manual_seed(case.seed + 1)
    ys = [torch.randn(r.recv_x.shape, generator=gen).bfloat16() for r in inter]
    out_inter = reference.combine(ys, [r.handle for r in inter], case.topology)
    out_intra = reference.combine(ys, [r.handle for r in intra], flat)
    # Per token, the sum of the magnitudes of its contributions: bounds each node's partial sum.
    out_abs = reference.combine([y.abs() for y in ys], [r.handle for r in intra], flat)
    for d in range(case.num_ranks):
        a, b = inter[d], intra[d]
        assert isinstance(a.handle, hd.InternodeHandle) and isinstance(b.handle, hd.IntranodeHandle)
        assert torch.equal(a.recv_x, b.recv_x) and torch.equal(a.recv_topk_idx, b.recv_topk_idx)
        assert torch.equal(a.recv_topk_weights, b.recv_topk_weights)
        assert a.num_recv_tokens_per_expert_list == b.num_recv_tokens_per_expert_list
        assert a.handle.recv_gbl_rank_prefix_sum.tolist() == b.handle.rank_prefix_matrix[:, d].tolist()
        assert torch.equal(a.handle.gbl_channel_prefix_matrix, b.handle.channel_prefix_matrix)
        # A BF16 rounding per node, then one at the end, vs one rounding: each node's rounding errs by at most
        # 2^-9 of its partial sum, which can exceed the result when partial sums cancel, so the bound is relative
        # to the sum of the contributions' magnitudes, not to the result.
        x_a, x_b = out_inter[d].combined_x.float(), out_intra[d].combined_x.float()
        bound = 2 ** -7 * out_abs[d].combined_x.float() + 2 ** -8 * x_b.abs() + 1e-6
        assert bool(((x_a - x_b).abs() <= bound).all()), case.describe()


@settings(deadline=None, max_examples=30)
@given(case=strategies.cases(internode=True))
def test_internode_handle_consistent(case):
    inputs, masks, results = _dispatch_case(case)
    topo = case.topology
    per_node = topo.num_scaleup_ranks
    for d, res in enumerate(results):
        h = res.handle
        rows = _expected_rows(masks, d)
        assert h.recv_gbl_rank_prefix_sum[-1] == len(rows) == h.recv_src_meta.size(0)
        node, mask = hd.decode_src_meta(h.recv_src_meta)
        my_node = topo.node_of(d)
        for i, (s, t) in enumerate(rows):
            assert int(node[i]) == topo.node_of(s)
            assert mask[i, :per_node].tolist() == masks[s][t, my_node * per_node:(my_node + 1) * per_node].tolist()
            assert not mask[i, per_node:].any()
        # Absolute channel starts: rows [start(s, c), start(s, c+1)) hold source s's channel-c tokens.
        for s in range(case.num_ranks):
            n_s = masks[s].size(0)
            end_s = int(h.recv_gbl_rank_prefix_sum[s])
            for c in range(case.num_channels):
                start = int(h.recv_gbl_channel_prefix_matrix[s, c])
                stop = int(h.recv_gbl_channel_prefix_matrix[s, c + 1]) if c + 1 < case.num_channels else end_s
                lo, hi = channel_token_range(n_s, case.num_channels, c)
                assert [rows[i] for i in range(start, stop)] == [(s, t) for t in range(lo, hi) if masks[s][t, d]]
        # Forwarder view: tokens of (n, my_local) needing my node; send_nvl_head counts per local destination.
        my_local = topo.local_of(d)
        peers = [n * per_node + my_local for n in range(topo.num_scaleout_ranks)]
        fwd = [masks[p][:, my_node * per_node:(my_node + 1) * per_node] for p in peers]
        fwd = [f[f.any(1)] for f in fwd]
        assert h.recv_rdma_rank_prefix_sum.tolist() == torch.tensor([f.size(0) for f in fwd]).cumsum(0).tolist()
        assert h.send_nvl_head.shape == (int(h.recv_rdma_rank_prefix_sum[-1]), 8)
        stacked = torch.cat(fwd) if fwd else torch.zeros(0, per_node, dtype=torch.bool)
        assert torch.equal(h.send_nvl_head[:, :per_node] >= 0, stacked)
        assert (h.send_nvl_head[:, per_node:] == -1).all()
        assert ((h.send_rdma_head >= 0) == hd.node_mask(masks[d], topo)).all()


@settings(deadline=None, max_examples=30)
@given(case=strategies.cases(internode=False))
def test_intranode_handle_consistent(case):
    inputs, masks, results = _dispatch_case(case)
    for d, res in enumerate(results):
        h = res.handle
        assert h.rank_prefix_matrix[-1].tolist() == [int(sum(m[:, r].sum() for m in masks))
                                                     for r in range(case.num_ranks)]
        assert ((h.send_head >= 0) == masks[d]).all()
        assert (h.channel_prefix_matrix[:, 1:] >= h.channel_prefix_matrix[:, :-1]).all()
        for s in range(case.num_ranks):
            block = int(h.rank_prefix_matrix[s - 1, d]) if s else 0
            n_s = masks[s].size(0)
            end = int(h.rank_prefix_matrix[s, d])
            for c in range(case.num_channels):
                start = block + int(h.recv_channel_prefix_matrix[s, c])
                stop = block + int(h.recv_channel_prefix_matrix[s, c + 1]) if c + 1 < case.num_channels else end
                lo, hi = channel_token_range(n_s, case.num_channels, c)
                assert h.recv_src_idx[start:stop].tolist() == [t for t in range(lo, hi) if masks[s][t, d]]


@settings(deadline=None, max_examples=20)
@given(case=strategies.cases(), fp8=st.booleans())
def test_cached_dispatch_reproduces_rows(case, fp8):
    inputs, masks, results = _dispatch_case(case)
    xs = [i.x for i in inputs]
    if fp8 and case.hidden % 128 == 0:
        xs = []
        for i in inputs:
            q, s = numerics.per_token_cast_to_fp8(i.x)
            xs.append((q, s.t().contiguous().t()))  # column-major scales, as the upstream test passes
    fresh = reference.dispatch(xs, masks, case.topology, num_channels=case.num_channels)
    cached = reference.dispatch(xs, None, case.topology, handles=[r.handle for r in results])
    for a, b in zip(fresh, cached):
        assert b.recv_topk_idx is None and b.num_recv_tokens_per_expert_list is None and b.handle is None
        if isinstance(a.recv_x, tuple):
            assert torch.equal(a.recv_x[0].view(torch.uint8), b.recv_x[0].view(torch.uint8))
            assert torch.equal(a.recv_x[1], b.recv_x[1]) and b.recv_x[1].is_contiguous()
        else:
            assert torch.equal(a.recv_x, b.recv_x)


def test_fp8_tuple_passthrough_int32_scales():
    topo = Topology(2)
    masks = [torch.tensor([[True, True], [False, True]]), torch.tensor([[True, False]])]
    q = [torch.randn(2, 512).to(torch.float8_e4m3fn), torch.randn(1, 512).to(torch.float8_e4m3fn)]
    scales = [torch.arange(4, dtype=torch.int32).view(2, 2).t(), torch.tensor([[7, 9]], dtype=torch.int32)]
    res = reference.dispatch(list(zip(q, scales)), masks, topo)
    data, sc = res[1].recv_x
    assert sc.is_contiguous() and sc.dtype == torch.int32
    assert sc.tolist() == [scales[0][0].tolist(), scales[0][1].tolist()]
    assert torch.equal(data.view(torch.uint8), q[0].view(torch.uint8))
    assert res[0].recv_x[1].tolist() == [scales[0][0].tolist(), [7, 9]]


@settings(deadline=None, max_examples=20)
@given(case=strategies.cases(), extra=st.integers(0, 5))
def test_worst_token_mode(case, extra):
    _, masks, normal = _dispatch_case(case)
    worst = max(sum(int(m[:, d].sum()) for m in masks) for d in range(case.num_ranks)) + extra
    worst = max(worst, 1)
    _, _, padded = _dispatch_case(case, num_worst_tokens=worst)
    for a, b in zip(normal, padded):
        m = a.recv_x.size(0)
        assert b.recv_x.size(0) == b.recv_topk_idx.size(0) == b.recv_topk_weights.size(0) == worst
        assert b.num_recv_tokens_per_expert_list == []
        assert torch.equal(b.recv_x[:m], a.recv_x) and torch.equal(b.recv_topk_idx[:m], a.recv_topk_idx)
        assert torch.equal(b.recv_topk_weights[:m], a.recv_topk_weights)
        assert (b.recv_topk_idx[m:] == -1).all()
    # Combine of the padded outputs ignores the extra rows.
    out = reference.combine([r.recv_x for r in padded], [r.handle for r in padded], case.topology)
    ref = reference.combine([r.recv_x for r in normal], [r.handle for r in normal], case.topology)
    assert all(torch.equal(a.combined_x, b.combined_x) for a, b in zip(out, ref))


def test_dispatch_rejects_bad_input():
    topo = Topology(2)
    masks, res = _hand_dispatch()
    with pytest.raises(ValueError, match="cached"):
        reference.dispatch(X, None, topo, topk_idx=TOPK, topk_weights=WEIGHTS, handles=[r.handle for r in res])
    with pytest.raises(ValueError, match="num_worst_tokens"):
        reference.dispatch(X, masks, topo, num_worst_tokens=8)
    with pytest.raises(ValueError, match="num_worst_tokens"):
        reference.dispatch(X, masks, topo, topk_idx=TOPK, topk_weights=WEIGHTS, num_experts=4, num_worst_tokens=2)
    with pytest.raises(ValueError, match="topk_idx and topk_weights"):
        reference.dispatch(X, masks, topo, topk_idx=TOPK, num_experts=4)
    with pytest.raises(ValueError, match="x must have one entry per rank"):
        reference.dispatch(X[:1], masks, topo)
    with pytest.raises(ValueError, match="expert_alignment"):
        reference.dispatch(X, masks, topo, expert_alignment=0)
    with pytest.raises(TypeError, match="y\\[0\\]"):
        reference.combine([r.recv_x.float() for r in res], [r.handle for r in res], topo)


# ---------------------------------------------------------------------------------------------------------------
# Low-latency properties.
# ---------------------------------------------------------------------------------------------------------------

def _ll_setup(case, **kwargs):
    inputs = case.all_inputs()
    cap = max(max(case.num_tokens), 1)
    res = reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], cap,
                                         case.num_experts, **kwargs)
    return inputs, cap, res


@settings(deadline=None, max_examples=25)
@given(case=strategies.ll_cases(), masked=st.sets(st.integers(0, 3), max_size=1))
def test_ll_dispatch_sets_and_counts(case, masked):
    masked = {m for m in masked if m < case.num_ranks}
    inputs, cap, res = _ll_setup(case, use_fp8=False, masked_ranks=masked)
    num_local = case.num_local_experts
    for d, r in enumerate(res):
        assert r.recv_x.shape == (num_local, case.num_ranks * cap, case.hidden)
        begin, count = reference.unpack_layout_range(r.handle.packed_recv_layout_range)
        for j in range(num_local):
            e = d * num_local + j
            expected = sorted((s, t) for s in range(case.num_ranks) if s not in masked and d not in masked
                              for t, k in (inputs[s].topk_idx == e).nonzero().tolist())
            n = int(r.packed_recv_count[j])
            assert n == len(expected) == int(count[j].sum()), case.describe()
            got = []
            for s in range(case.num_ranks):
                b, c = int(begin[j, s]), int(count[j, s])
                for row in range(b, b + c):
                    t = int(r.handle.packed_recv_src_info[j, row])
                    got.append((s, t))
                    assert torch.equal(r.recv_x[j, row], inputs[s].x[t])
            assert sorted(got) == expected, case.describe()


@settings(deadline=None, max_examples=25)
@given(case=strategies.ll_cases(), round_scale=st.booleans(), ue8m0=st.booleans())
def test_ll_fp8_layout_and_bound(case, round_scale, ue8m0):
    ue8m0 = ue8m0 and round_scale
    inputs, cap, res = _ll_setup(case, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0)
    num_local, slots, hidden = case.num_local_experts, case.num_ranks * cap, case.hidden
    for r in res:
        data, scales = r.recv_x
        assert data.dtype == torch.float8_e4m3fn and data.shape == (num_local, slots, hidden)
        num_scales = hidden // 512 if ue8m0 else hidden // 128
        assert scales.dtype == (torch.int32 if ue8m0 else torch.float32)
        assert scales.shape == (num_local, slots, num_scales)
        assert scales.stride() == (num_scales * slots, 1, slots)
        back = numerics.per_token_cast_back(data.view(-1, hidden), scales.reshape(-1, num_scales))
        back = back.view(num_local, slots, hidden)
        flat_scales = numerics.scales_to_float(scales.reshape(-1, num_scales)).view(num_local, slots, -1)
        if round_scale:
            assert torch.equal(flat_scales, numerics.exp2_int(numerics.ceil_log2_bits(flat_scales)))
        begin, count = reference.unpack_layout_range(r.handle.packed_recv_layout_range)
        for j in range(num_local):
            for row in range(int(r.packed_recv_count[j])):
                s = next(s for s in range(case.num_ranks) if begin[j, s] <= row < begin[j, s] + count[j, s])
                x = inputs[s].x[int(r.handle.packed_recv_src_info[j, row])].float()
                # Integers in [-8, 8]: E4M3 holds them exactly once scaled (amax 8 -> 448, or 2^k scaling).
                err = (back[j, row].float() - x).abs()
                assert (err <= x.abs() * 2 ** -4 + 2 ** -6).all(), case.describe()


@settings(deadline=None, max_examples=25)
@given(case=strategies.ll_cases(), masked=st.sets(st.integers(0, 3), max_size=1), logfmt=st.booleans())
def test_ll_combine_is_weighted_sum(case, masked, logfmt):
    masked = {m for m in masked if m < case.num_ranks}
    inputs, cap, res = _ll_setup(case, use_fp8=False, masked_ranks=masked)
    num_local = case.num_local_experts
    # "Expert" e multiplies its rows by (e % L + 1) / 16 (keeps values < 1 so LogFMT may encode).
    y = [(r.recv_x.float() * (torch.arange(num_local) + 1).view(-1, 1, 1) / 16).bfloat16() for r in res]
    out = reference.low_latency_combine(y, [i.topk_idx for i in inputs], [i.topk_weights for i in inputs],
                                        [r.handle for r in res], use_logfmt=logfmt, masked_ranks=masked)
    for s, inp in enumerate(inputs):
        expected = torch.zeros(case.num_tokens[s], case.hidden)
        if s not in masked:
            for t in range(case.num_tokens[s]):
                for k in range(case.num_topk):
                    e = int(inp.topk_idx[t, k])
                    if e < 0 or e // num_local in masked:
                        continue
                    row = (inp.x[t].float() * (e % num_local + 1) / 16).bfloat16().unsqueeze(0)
                    if logfmt:
                        row = numerics.logfmt_roundtrip(row)
                    expected[t] += inp.topk_weights[t, k] * row[0].float()
        assert torch.equal(out[s], expected.bfloat16()), case.describe()


def test_ll_zero_copy_strided_view():
    case = strategies.Case(num_ranks=2, num_scaleup_ranks=2, num_tokens=(3, 2), hidden=512, num_topk=2,
                           num_experts=4, seed=5)
    inputs, cap, res = _ll_setup(case, use_fp8=False)
    topk, weights, handles = [i.topk_idx for i in inputs], [i.topk_weights for i in inputs], [r.handle for r in res]
    plain = reference.low_latency_combine([r.recv_x for r in res], topk, weights, handles)
    views = []
    for r in res:
        # Row slots of H + H/64 elements, as the LL combine send buffer lays them out.
        storage = torch.zeros(2, 2 * cap, 512 + 8, dtype=torch.bfloat16)
        view = storage[:, :, :512]
        view.copy_(r.recv_x)
        views.append(view)
    assert not views[0].is_contiguous()
    zero = reference.low_latency_combine(views, topk, weights, handles, zero_copy=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, zero))
    with pytest.raises(ValueError, match="contiguous"):
        reference.low_latency_combine(views, topk, weights, handles)
    with pytest.raises(ValueError, match="zero_copy"):
        reference.low_latency_combine(views, topk, weights, handles, zero_copy=True, use_logfmt=True)


def test_ll_rejects_bad_input():
    x = [torch.zeros(3, 512, dtype=torch.bfloat16)] * 2
    topk = [torch.zeros(3, 1, dtype=torch.int64)] * 2
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        reference.low_latency_dispatch(x, topk, 2, 4)
    with pytest.raises(ValueError, match="round_scale"):
        reference.low_latency_dispatch(x, topk, 4, 4, use_ue8m0=True)
    with pytest.raises(ValueError, match="num_experts"):
        reference.low_latency_dispatch(x, topk, 4, 3)
    with pytest.raises(ValueError, match="masked_ranks"):
        reference.low_latency_dispatch(x, topk, 4, 4, masked_ranks=[5])


# ---------------------------------------------------------------------------------------------------------------
# reference.distributed inside a real (gloo, CPU) process group, on the shared rank-pool harness (tests/dist.py).
# ---------------------------------------------------------------------------------------------------------------

def run_distributed_adapter(ctx, case: strategies.Case) -> None:
    """Worker: this rank's adapter results equal the global reference's entry for this rank."""
    from reference import distributed as rd
    rank, group, topo = ctx.rank, ctx.group, case.topology
    inp = case.make_inputs(rank)
    mask = hd.layout_from_topk(inp.topk_idx, case.num_experts, topo).is_token_in_rank
    mine = rd.dispatch(inp.x, mask, topo, group=group, topk_idx=inp.topk_idx, topk_weights=inp.topk_weights,
                       num_experts=case.num_experts, num_channels=case.num_channels)
    _, _, full = _dispatch_case(case)
    assert torch.equal(mine.recv_x, full[rank].recv_x)
    assert mine.num_recv_tokens_per_expert_list == full[rank].num_recv_tokens_per_expert_list
    cached = rd.dispatch(inp.x, None, topo, group=group, handle=mine.handle)
    assert torch.equal(cached.recv_x, mine.recv_x)
    combined = rd.combine(mine.recv_x, mine.handle, topo, group=group)
    assert torch.equal(combined.combined_x.float(), inp.x.float() * mask.sum(1, keepdim=True).float())
    cap = max(max(case.num_tokens), 1)
    ll = rd.low_latency_dispatch(inp.x, inp.topk_idx, cap, case.num_experts, group=group, use_fp8=False)
    out = rd.low_latency_combine(ll.recv_x, inp.topk_idx, inp.topk_weights, ll.handle, group=group)
    expected = torch.zeros(inp.x.shape)
    for t in range(inp.x.size(0)):
        for k in range(case.num_topk):
            if inp.topk_idx[t, k] >= 0:
                expected[t] += inp.topk_weights[t, k] * inp.x[t].float()
    assert torch.equal(out, expected.bfloat16())


@settings(deadline=None, max_examples=3)
@given(case=strategies.ll_cases(max_ranks=2).filter(lambda c: c.num_ranks == 2))
def test_distributed_adapter_two_ranks(pools, case):
    pools.get(2).check("test_reference", "run_distributed_adapter", case)


def test_align_up_matches_list():
    # Alignment is applied per entry to the raw count (independent of any other entry).
    assert [align_up(c, 4) for c in (0, 1, 4, 5)] == [0, 4, 4, 8]
