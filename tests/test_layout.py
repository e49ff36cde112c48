"""deep_ep.layout: region tables (disjoint, ordered, aligned), size hints (DeepEP's worked numbers, independent
re-derivations, the fused internode kernels' buffer, monotonicity) and channel_token_range."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deep_ep import layout
from deep_ep.config import (
    BUFFER_ALIGNMENT,
    NUM_MAX_FUSED_RANKS,
    NUM_MAX_TOPK,
    Config,
    deepep_rdma_buffer_size_hint,
    fused_buffer_bytes,
    get_combine_config,
    get_dispatch_config,
    nvl_buffer_size_hint,
)

H_BF16 = 7168 * 2  # hidden_bytes of the worked examples (BF16, H=7168)
LL_HIDDENS = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)


def normal_hints(num_ranks: int, num_sms: int = 20) -> tuple[int, int]:
    """(NVL, RDMA) bytes: the max over the default dispatch and combine configs, as in the worked examples."""
    configs = (get_dispatch_config(num_ranks, num_sms), get_combine_config(num_ranks, num_sms))
    return (max(c.get_nvl_buffer_size_hint(H_BF16, num_ranks) for c in configs),
            max(c.get_rdma_buffer_size_hint(H_BF16, num_ranks) for c in configs))


def assert_well_formed(lay: layout.Layout, alignment: int) -> None:
    """Regions are in order, disjoint, each starts at a multiple of ``alignment`` right after its predecessor
    (padding < alignment), and names are unique."""
    names = [r.name for r in lay.regions]
    assert len(names) == len(set(names)), names
    position = 0
    for region in lay.regions:
        assert region.num_bytes >= 0
        assert region.offset % alignment == 0, (region, alignment)
        assert position <= region.offset < position + alignment or region.offset == position, (region, position)
        position = region.end
    assert lay.total_bytes == position
    for a, b in zip(lay.regions, lay.regions[1:]):
        assert a.end <= b.offset


# ---------------------------------------------------------------------------------------------------------------
# Worked numbers: the hints for the default configs, H=7168 BF16, in MB
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_ranks, nvl_mb, deepep_rdma_mb, rdma_mb", [
    (8, 335.7, 0.0, 0.0), (16, 377.7, 91.9, 462.9), (32, 377.7, 168.0, 598.5), (64, 377.7, 336.0, 897.7),
    (128, 734.4, 693.1, 693.1)])
def test_normal_hints_match_spec_worked_numbers(num_ranks, nvl_mb, deepep_rdma_mb, rdma_mb):
    """DeepEP's worked numbers; from 16 to 64 ranks the scale-out hint is the fused kernels' buffer less the
    scale-up hint (the sums: 840.6 MB at 16 ranks, 976.2 at 32, 1275.3 at 64)."""
    nvl, rdma = normal_hints(num_ranks)
    configs = (get_dispatch_config(num_ranks), get_combine_config(num_ranks))
    assert round(nvl / 1e6, 1) == nvl_mb
    assert round(max(spec_rdma_hint(c, H_BF16, num_ranks) for c in configs) / 1e6, 1) == deepep_rdma_mb
    assert round(rdma / 1e6, 1) == rdma_mb
    assert nvl % BUFFER_ALIGNMENT == 0 and rdma % BUFFER_ALIGNMENT == 0


@pytest.mark.parametrize("tokens, hidden, experts, expected", [
    (128, 7168, 288, 2_146_961_792), (128, 7168, 256, 1_908_410_496), (16, 5120, 256, 170_395_776)])
def test_low_latency_hint_matches_spec_examples(tokens, hidden, experts, expected):
    for num_ranks in (1, 8, 64):  # accepted and unused, as in DeepEP
        assert layout.low_latency_rdma_size_hint(tokens, hidden, num_ranks, experts) == expected


def test_low_latency_message_sizes_at_7168():
    dispatch_msg, combine_msg = layout.low_latency_message_bytes(7168)
    assert dispatch_msg == 16 + 7168 * 2  # BF16 payload is the larger one
    assert combine_msg == 56 * 4 + 7168 * 2


# ---------------------------------------------------------------------------------------------------------------
# Independent re-derivations of DeepEP's formulas (not read from deep_ep.config)
# ---------------------------------------------------------------------------------------------------------------

def spec_nvl_hint(c: Config, hidden_bytes: int, num_ranks: int) -> int:
    channels, rn, rr = c.num_sms // 2, min(num_ranks, 8), max(num_ranks // 8, 1)
    slots = channels * rn * c.num_max_nvl_chunked_recv_tokens
    total = channels * rn * (2 * rr + 3) * 4 + slots * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    return -(-total // 128) * 128


def spec_rdma_hint(c: Config, hidden_bytes: int, num_ranks: int) -> int:
    if num_ranks <= 8:
        return 0
    channels, rr = c.num_sms // 2, num_ranks // 8
    record = hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16
    total = channels * rr * 18 * 2 * 4 + 2 * channels * rr * c.num_max_rdma_chunked_recv_tokens * record
    return -(-total // 128) * 128


def spec_ll_hint(tokens: int, hidden: int, experts: int) -> int:
    scales = hidden // 128
    dmsg, cmsg = 16 + max(hidden * 2, hidden + scales * 4), scales * 4 + hidden * 2
    send = max(tokens * dmsg, experts * tokens * cmsg)
    recv = max(experts * tokens * dmsg, experts * tokens * cmsg)
    signal = -(-experts * 4 // 128) * 128
    return (2 * (send + recv + signal) // 128 + 1) * 128


configs = st.builds(
    lambda sms, sn, extra_n, sr, nr: Config(sms, sn, sn + extra_n, sr, max(nr, 2 * sr)),
    st.integers(1, 66).map(lambda x: 2 * x), st.integers(1, 64), st.integers(1, 700), st.integers(1, 32),
    st.integers(1, 1024))
normal_ranks = st.sampled_from((1, 2, 3, 4, 6, 8, 16, 24, 32, 64, 128, 160))
hidden_bytes = st.integers(1, 128).map(lambda x: 128 * x)


def fused_ranks(num_ranks: int) -> bool:
    """Whether the fused internode kernels may serve ``num_ranks`` ranks of 8 per node (the scale-out hint covers
    them there)."""
    return 8 < num_ranks <= NUM_MAX_FUSED_RANKS


@given(configs, hidden_bytes, normal_ranks)
def test_normal_hints_equal_spec_formula(config, hbytes, num_ranks):
    assert nvl_buffer_size_hint(config, hbytes, num_ranks) == spec_nvl_hint(config, hbytes, num_ranks)
    assert config.get_nvl_buffer_size_hint(hbytes, num_ranks) == spec_nvl_hint(config, hbytes, num_ranks)
    assert deepep_rdma_buffer_size_hint(config, hbytes, num_ranks) == spec_rdma_hint(config, hbytes, num_ranks)
    rdma = config.get_rdma_buffer_size_hint(hbytes, num_ranks)
    if fused_ranks(num_ranks):
        assert rdma >= spec_rdma_hint(config, hbytes, num_ranks) and rdma % BUFFER_ALIGNMENT == 0
    else:
        assert rdma == spec_rdma_hint(config, hbytes, num_ranks)


def fused_fits(num_bytes: int, put: bool, num_nodes: int, hidden: int,
               calls: list[tuple[str, Config, int, int]]) -> bool:
    """Whether a fused buffer of ``num_bytes`` (8 GPUs per node, NVSHMEM put peers or not) holds the rings of each
    ``(kind, config, top-k, scales)`` call of ``hidden`` channels, as FusedInternodeCuda.check_rings computes them
    (dispatch rows: BF16, or FP8 with its scales; combine rows: BF16)."""
    half = layout.fused_half_bytes(layout.put_region_bytes(
        num_bytes, layout.PUT_AREA_IN_REGION if put else layout.PUT_AREA_NONE))
    for kind, config, topk, scales in calls:
        if kind == "combine":
            record = layout.intranode_combine_record_bytes(hidden, topk)
        else:
            record = layout.intranode_dispatch_record_bytes(hidden if scales else 2 * hidden, scales, topk)
        node, _ = layout.fused_node_ring(config.num_max_nvl_chunked_send_tokens,
                                         config.num_max_nvl_chunked_recv_tokens, num_nodes)
        used = layout.fused_ring_bytes(num_nodes, 8, max(1, config.num_sms // 2), record,
                                       config.num_max_rdma_chunked_recv_tokens, node, put)
        if used > half:
            return False
    return True


@st.composite
def fused_groups(draw):
    """Ranks 16..64 (8 per node), hidden a multiple of 128, and a (dispatch, combine) pair of configs, each a default
    of the rank count (where the table has it) or any valid Config."""
    num_ranks = 8 * draw(st.integers(2, NUM_MAX_FUSED_RANKS // 8))
    defaults = ((get_dispatch_config(num_ranks), get_combine_config(num_ranks))
                if num_ranks in (16, 24, 32, 48, 64) else ())
    choice = st.one_of(st.sampled_from(defaults), configs) if defaults else configs
    return num_ranks, 128 * draw(st.integers(1, 64)), draw(choice), draw(choice)


@given(fused_groups(), st.integers(0, NUM_MAX_TOPK), st.integers(0, NUM_MAX_TOPK), st.booleans(), st.booleans())
def test_normal_hints_hold_the_fused_kernels_buffer(group, dispatch_topk, combine_topk, fp8, put):
    """A Buffer of the hints' sum (each the max over the dispatch and the combine config, as DeepEP's recipe takes
    them) holds the fused kernels' rings of that dispatch and combine at any top-k <= 32, BF16 or FP8, with or without
    put peers; the scale-out hint is never below DeepEP's formula."""
    num_ranks, hidden, dispatch, combine = group
    pair = (dispatch, combine)
    nvl = max(c.get_nvl_buffer_size_hint(2 * hidden, num_ranks) for c in pair)
    rdma = max(c.get_rdma_buffer_size_hint(2 * hidden, num_ranks) for c in pair)
    calls = [("dispatch", dispatch, dispatch_topk, hidden // 128 if fp8 else 0), ("combine", combine, combine_topk, 0)]
    limit = (2**31 - 1) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT  # the Buffer's num_rdma_bytes limit (normal mode)
    assert rdma <= max(limit, max(spec_rdma_hint(c, 2 * hidden, num_ranks) for c in pair))
    if rdma < limit:
        assert fused_fits(nvl + rdma, put, num_ranks // 8, hidden, calls)
    assert rdma >= max(spec_rdma_hint(c, 2 * hidden, num_ranks) for c in pair)


def test_scale_out_hint_stays_within_the_buffers_limit():
    """48 SMs at 64 ranks: the fused kernels' buffer less the NVL hint passes 2**31 - 1 bytes, which a normal-mode
    Buffer refuses as num_rdma_bytes; the hint stops at the limit (the call then names the num_nvl_bytes it needs)."""
    config = Config(48, 8, 288, 8, 128)
    limit = (2**31 - 1) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT
    assert fused_buffer_bytes(config, H_BF16, 64) - config.get_nvl_buffer_size_hint(H_BF16, 64) > limit
    assert config.get_rdma_buffer_size_hint(H_BF16, 64) == limit


@pytest.mark.parametrize("num_ranks", [16, 32, 64])
def test_fused_buffer_bytes_is_the_least_that_holds_the_largest_record(num_ranks):
    """At the default configs and H=7168 the fused buffer fits the largest record (BF16, top-k 32, put peers) and
    128 bytes less does not: the hint is tight where the fused kernels set it."""
    for config in (get_dispatch_config(num_ranks), get_combine_config(num_ranks)):
        need = config.get_nvl_buffer_size_hint(H_BF16, num_ranks) + config.get_rdma_buffer_size_hint(H_BF16, num_ranks)
        calls = [("dispatch", config, NUM_MAX_TOPK, 0)]
        assert need == fused_buffer_bytes(config, H_BF16, num_ranks)
        assert fused_fits(need, True, num_ranks // 8, 7168, calls)
        assert not fused_fits(need - BUFFER_ALIGNMENT, True, num_ranks // 8, 7168, calls)


@given(st.integers(1, 512), st.sampled_from(LL_HIDDENS), st.integers(1, 64).map(lambda x: 8 * x))
def test_low_latency_hint_equals_spec_formula(tokens, hidden, experts):
    assert layout.low_latency_rdma_size_hint(tokens, hidden, 8, experts) == spec_ll_hint(tokens, hidden, experts)


# ---------------------------------------------------------------------------------------------------------------
# Region tables
# ---------------------------------------------------------------------------------------------------------------

@given(st.sampled_from((1, 2, 4, 8)), st.integers(1, 16), st.integers(1, 300), st.integers(1, 64),
       st.integers(0, 32), st.integers(0, 128), st.sampled_from((4, 8)))
def test_intranode_dispatch_layout(num_ranks, channels, recv_tokens, hidden_units, topk, scales, idx_bytes):
    hbytes = 16 * hidden_units
    lay = layout.intranode_dispatch_layout(num_ranks, channels, recv_tokens, hbytes, topk, scales, idx_bytes)
    assert_well_formed(lay, BUFFER_ALIGNMENT)
    assert [r.name for r in lay.regions] == ["rank_prefix_matrix", "channel_start_offset", "channel_end_offset",
                                             "channel_head", "channel_tail", "token_data", "src_idx", "topk_idx",
                                             "topk_weights", "scales"]
    rings, slots = channels * num_ranks, channels * num_ranks * recv_tokens
    assert lay["rank_prefix_matrix"].num_bytes == num_ranks * num_ranks * 4
    assert lay["channel_tail"].num_bytes == rings * 4
    assert lay["token_data"].num_bytes == slots * hbytes
    assert lay["topk_idx"].num_bytes == slots * topk * idx_bytes
    assert lay["scales"].num_bytes == slots * scales * 4
    # DeepEP's host-side requirement (the unpadded sum) is a lower bound of the padded total.
    need = num_ranks * num_ranks * 4 + 4 * rings * 4 + slots * (hbytes + 4 + topk * idx_bytes + topk * 4 + scales * 4)
    assert need <= lay.total_bytes < need + len(lay.regions) * BUFFER_ALIGNMENT


@given(st.sampled_from((1, 2, 4, 8)), st.integers(1, 16), st.integers(1, 300),
       st.integers(1, 64).map(lambda x: 128 * x), st.integers(0, 32))
def test_intranode_combine_layout(num_ranks, channels, recv_tokens, hidden, topk):
    lay = layout.intranode_combine_layout(num_ranks, channels, recv_tokens, hidden, topk)
    assert_well_formed(lay, BUFFER_ALIGNMENT)
    rings = channels * num_ranks
    need = 2 * rings * 4 + rings * recv_tokens * (hidden * 2 + 4 + topk * 4)
    assert need <= lay.total_bytes < need + len(lay.regions) * BUFFER_ALIGNMENT


@given(st.integers(1, 256), st.sampled_from(LL_HIDDENS), st.integers(1, 48).map(lambda x: 8 * x))
def test_low_latency_layout(tokens, hidden, experts):
    lay = layout.low_latency_layout(tokens, hidden, experts)
    assert [r.name for r in lay.regions] == ["signal_0", "signal_1", "send_0", "send_1", "recv_0", "recv_1"]
    assert_well_formed(lay, 1)  # packed back to back
    assert lay["signal_0"].offset == 0 and lay["signal_0"].num_bytes % BUFFER_ALIGNMENT == 0
    # The two halves are the same size.
    for kind in ("signal", "send", "recv"):
        assert lay[f"{kind}_0"].num_bytes == lay[f"{kind}_1"].num_bytes
    dispatch_msg, combine_msg = layout.low_latency_message_bytes(hidden)
    # recv holds [local_expert][src_rank][slot < T] dispatch messages for every (expert, token) pair, and
    # [global_expert][src_token < T] combine slots.
    assert lay["recv_0"].num_bytes >= experts * tokens * max(dispatch_msg, combine_msg)
    assert lay["send_0"].num_bytes >= tokens * dispatch_msg
    hint = layout.low_latency_rdma_size_hint(tokens, hidden, 8, experts)
    assert hint % BUFFER_ALIGNMENT == 0 and lay.total_bytes < hint <= lay.total_bytes + BUFFER_ALIGNMENT


def test_chain_places_regions_and_rejects_negative_sizes():
    lay = layout.chain(("a", 1), ("b", 200), ("c", 0), ("d", 5))
    assert [(r.offset, r.num_bytes) for r in lay.regions] == [(0, 1), (128, 200), (384, 0), (384, 5)]
    assert lay.total_bytes == 389
    assert "total" in lay.describe() and "b" in lay.describe()
    with pytest.raises(KeyError):
        lay["missing"]
    with pytest.raises(ValueError, match="region bad has negative size -1"):
        layout.chain(("ok", 4), ("bad", -1))
    assert layout.Layout(()).total_bytes == 0


# ---------------------------------------------------------------------------------------------------------------
# Monotonicity: more of anything never needs fewer bytes
# ---------------------------------------------------------------------------------------------------------------

@given(configs, hidden_bytes, normal_ranks, st.integers(0, 8), st.integers(0, 64), st.integers(0, 256))
def test_normal_hints_are_monotone(config, hbytes, num_ranks, more_sms, more_recv, more_hidden):
    """Each hint, and their sum, grows with the config and the hidden size; where the fused kernels set the
    scale-out hint (their buffer less the scale-up hint) only the sum does."""
    nvl = config.get_nvl_buffer_size_hint(hbytes, num_ranks)
    rdma = config.get_rdma_buffer_size_hint(hbytes, num_ranks)
    bigger = Config(config.num_sms + 2 * more_sms, config.num_max_nvl_chunked_send_tokens,
                    config.num_max_nvl_chunked_recv_tokens + more_recv, config.num_max_rdma_chunked_send_tokens,
                    config.num_max_rdma_chunked_recv_tokens + more_recv)
    bigger_nvl = bigger.get_nvl_buffer_size_hint(hbytes + 16 * more_hidden, num_ranks)
    bigger_rdma = bigger.get_rdma_buffer_size_hint(hbytes + 16 * more_hidden, num_ranks)
    assert bigger_nvl >= nvl and bigger_nvl + bigger_rdma >= nvl + rdma
    assert fused_ranks(num_ranks) or bigger_rdma >= rdma


@given(configs, hidden_bytes, st.integers(1, 19), st.integers(1, 4))
def test_hints_grow_with_node_count(config, hbytes, nodes, more_nodes):
    """DeepEP's formulas grow with the node count; the scale-out hint does from one node and past the fused kernels'
    ranks (the fused kernels' buffer need not grow: a forwarder's node ring slots are the nvl recv tokens shared
    by the source nodes, rounded down)."""
    r, bigger = 8 * nodes, 8 * (nodes + more_nodes)
    assert config.get_nvl_buffer_size_hint(hbytes, bigger) >= config.get_nvl_buffer_size_hint(hbytes, r)
    assert spec_rdma_hint(config, hbytes, bigger) > spec_rdma_hint(config, hbytes, r)
    if not fused_ranks(r):
        assert config.get_rdma_buffer_size_hint(hbytes, bigger) > config.get_rdma_buffer_size_hint(hbytes, r)


@given(st.integers(1, 256), st.integers(0, 64), st.sampled_from(LL_HIDDENS), st.sampled_from(LL_HIDDENS),
       st.integers(1, 40), st.integers(0, 8))
def test_low_latency_hint_is_monotone(tokens, more_tokens, h1, h2, experts8, more_experts8):
    hidden, bigger_hidden = min(h1, h2), max(h1, h2)
    experts, bigger_experts = 8 * experts8, 8 * (experts8 + more_experts8)
    base = layout.low_latency_rdma_size_hint(tokens, hidden, 8, experts)
    assert layout.low_latency_rdma_size_hint(tokens + more_tokens, bigger_hidden, 8, bigger_experts) >= base


# ---------------------------------------------------------------------------------------------------------------
# Rejections
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_ranks", [9, 12, 20, 100])
def test_hints_reject_rank_counts_that_are_not_whole_nodes(num_ranks):
    with pytest.raises(ValueError, match=rf"num_ranks must be < 8 or a multiple of 8, got {num_ranks}"):
        Config().get_nvl_buffer_size_hint(H_BF16, num_ranks)
    with pytest.raises(ValueError, match=f"got {num_ranks}"):
        Config().get_rdma_buffer_size_hint(H_BF16, num_ranks)


def test_hints_reject_odd_sms_only_across_nodes():
    odd = Config(num_sms=21)
    assert odd.get_nvl_buffer_size_hint(H_BF16, 8) > 0  # intranode: evenness not asserted, as in DeepEP
    assert odd.get_rdma_buffer_size_hint(H_BF16, 8) == 0
    with pytest.raises(ValueError, match="num_sms must be even, got 21"):
        odd.get_nvl_buffer_size_hint(H_BF16, 16)
    with pytest.raises(ValueError, match="num_sms must be even, got 21"):
        odd.get_rdma_buffer_size_hint(H_BF16, 16)


# ---------------------------------------------------------------------------------------------------------------
# channel_token_range
# ---------------------------------------------------------------------------------------------------------------

@given(st.integers(0, 5000), st.integers(1, 80))
def test_channel_token_ranges_partition_tokens_in_order(num_tokens, num_channels):
    ranges = [layout.channel_token_range(num_tokens, num_channels, c) for c in range(num_channels)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_tokens
    per_channel = -(-num_tokens // num_channels)
    for (_, e0), (b1, _) in zip(ranges, ranges[1:]):
        assert e0 == b1
    for begin, end in ranges:
        assert 0 <= begin <= end <= num_tokens and end - begin <= per_channel
    # Full channels first, then at most one partial one, then empty ones.
    sizes = [end - begin for begin, end in ranges]
    assert sizes == sorted(sizes, reverse=True)
    assert sum(1 for size in sizes if 0 < size < per_channel) <= 1


def test_channel_token_range_examples():
    assert [layout.channel_token_range(10, 4, c) for c in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [layout.channel_token_range(2, 4, c) for c in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert layout.channel_token_range(5, 0, 0) == (0, 0)


# ---------------------------------------------------------------------------------------------------------------
# Carving of the CUDA LL kernels (make_layout in csrc/kernels/low_latency_nvshmem.cu) against DeepEP's size hint
# ---------------------------------------------------------------------------------------------------------------
def _ll_carving(num_ranks: int, tokens: int, hidden: int, experts: int) -> dict:
    """A line-by-line mirror of ``make_layout`` (change both together): offsets relative to a half, and the total."""
    def up(v: int) -> int:
        return (v + 127) // 128 * 128
    R, T, H, E = num_ranks, tokens, hidden, experts
    L, num_scales = E // R, H // 128
    cmsg = num_scales * 4 + 2 * H
    dmsg = (17 * 4 + 15) // 16 * 16 + max(2 * H, H + num_scales * 4)
    # ctrl: count words [R][L+1], dispatch arrivals [R], combine arrivals [T][R] (token, expert owner); all u64
    carrive = R * (L + 1) * 8 + R * 8
    data = up(carrive + T * R * 8)
    crecv = data + up(E * T * cmsg)
    combine_end = crecv + E * T * 2 * H  # the (expert, token) words sit in the csend slots' tails
    dispatch_end = data + R * T * dmsg + (T * dmsg if R > 1 else 0)  # no staging in a one-rank world
    return {"cmsg": cmsg, "carrive": carrive, "data": data, "crecv": crecv,
            "total": 128 + 2 * up(max(combine_end, dispatch_end))}


LL_CARVING_HIDDENS = tuple(range(1024, 2049, 128)) + (2560, 4096, 7168, 8192, 16384)


@pytest.mark.parametrize("hidden", LL_CARVING_HIDDENS)
def test_ll_kernel_carving_fits_the_hint(hidden):
    """Every (T, R, E) the LL kernels accept (T <= 1024, R <= 1024, E = L * R <= 8192, R * T % 4 == 0) fits in
    ``get_low_latency_rdma_size_hint``; the tight corners are one local expert per rank, T = 1..8 and small H."""
    tokens = list(range(1, 33)) + [63, 64, 100, 127, 128, 255, 256, 511, 512, 1000, 1023, 1024]
    ranks = list(range(1, 33)) + [48, 64, 96, 128, 255, 256, 512, 1000, 1024]
    for num_ranks in ranks:
        for num_local in (1, 2, 3, 4, 8, 9, 16, 288):
            experts = num_local * num_ranks
            if experts > 8192:
                continue
            for t in tokens:
                if num_ranks * t % 4:
                    continue
                need = _ll_carving(num_ranks, t, hidden, experts)["total"]
                hint = layout.low_latency_rdma_size_hint(t, hidden, num_ranks, experts)
                assert need <= hint, f"{t=} {hidden=} {num_ranks=} {experts=}: carving {need} > hint {hint}"


@pytest.mark.parametrize("hidden", (1024, 1152, 7168, 16384))
def test_ll_kernel_flag_words_stay_in_the_slot_tails(hidden):
    """The receiver's (expert, token) word sits at byte 2H + 4 of csend slot e * T + t: past the zero-copy view (2H
    bytes), past the sender's staging word at 2H, inside the slot (H / 32 >= 32 tail bytes), and the last slot's word
    ends before the receive slots. The [T][R] arrival words end before the data."""
    for num_ranks, tokens, experts in ((1, 4, 12), (2, 2, 2), (2, 128, 288), (8, 1, 8)):
        c = _ll_carving(num_ranks, tokens, hidden, experts)
        assert 2 * hidden + 8 <= c["cmsg"]
        last_word_end = c["data"] + (experts * tokens - 1) * c["cmsg"] + 2 * hidden + 8
        assert last_word_end <= c["crecv"]
        assert c["carrive"] + tokens * num_ranks * 8 <= c["data"]


def test_ll_kernel_carving_example_ep2():
    # EP2, T=128, H=7168, E=16: ctrl = counts 2*9*8 + dispatch arrivals 2*8 + combine arrivals [128][2]*8 = 2208
    # bytes (2304 aligned) per half, then the combine send and receive areas; the hint keeps ~0.9 MB of slack.
    need = _ll_carving(2, 128, 7168, 16)["total"]
    assert need == 128 + 2 * (2304 + 16 * 128 * (56 * 4 + 7168 * 2) + 16 * 128 * 7168 * 2)
    assert layout.low_latency_rdma_size_hint(128, 7168, 2, 16) - need > 900_000
