"""deep_ep.config: Config construction and validation, the default tables, Topology, num_local_experts."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deep_ep import config as cfg
from deep_ep.config import Config, Topology, get_combine_config, get_dispatch_config, num_local_experts

FIELDS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
          "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")

# DeepEP's tuned tables: (Sn, Nn, Sr, Nr) of dispatch and combine per rank count, before Nr rounding.
SPEC_TABLE = {
    2: ((24, 256, 6, 128), (10, 256, 6, 128)),
    4: ((6, 256, 6, 128), (9, 256, 6, 128)),
    8: ((6, 256, 6, 128), (4, 256, 6, 128)),
    16: ((36, 288, 20, 128), (4, 288, 12, 128)),
    24: ((32, 288, 8, 128), (1, 288, 8, 128)),
    32: ((32, 288, 8, 128), (1, 288, 8, 128)),
    48: ((32, 288, 8, 128), (1, 288, 8, 128)),
    64: ((32, 288, 8, 128), (1, 288, 8, 128)),
    96: ((20, 480, 12, 128), (1, 480, 8, 128)),
    128: ((20, 560, 12, 128), (1, 560, 8, 128)),
    144: ((32, 720, 12, 128), (2, 720, 8, 128)),
    160: ((28, 720, 12, 128), (2, 720, 8, 128)),
}


def as_tuple(config: Config) -> tuple[int, ...]:
    return tuple(getattr(config, name) for name in FIELDS)


# ---------------------------------------------------------------------------------------------------------------
# Construction
# ---------------------------------------------------------------------------------------------------------------

def test_defaults_match_deepep():
    # Nr=256 is rounded up to a multiple of Sr=6, as DeepEP's constructor does.
    assert as_tuple(Config()) == (20, 6, 256, 6, 258)


def test_positional_and_keyword_construction_agree():
    positional = Config(24, 8, 288, 12, 128)
    keyword = Config(num_sms=24, num_max_nvl_chunked_send_tokens=8, num_max_nvl_chunked_recv_tokens=288,
                     num_max_rdma_chunked_send_tokens=12, num_max_rdma_chunked_recv_tokens=128)
    assert positional == keyword
    assert as_tuple(positional) == (24, 8, 288, 12, 132)  # 128 rounded up to a multiple of 12


def test_mixed_positional_and_keyword():
    assert Config(16, num_max_nvl_chunked_recv_tokens=64) == Config(16, 6, 64, 6, 256)


def test_config_is_frozen_and_hashable():
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_sms = 4  # type: ignore[misc]
    assert hash(config) == hash(Config())


def test_describe_mentions_every_value():
    text = Config(22, 7, 100, 5, 50).describe()
    for value in ("22", "7", "100", "5", "50"):
        assert value in text


# ---------------------------------------------------------------------------------------------------------------
# Validation: each rule raises and names the field
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("bad", [1.0, "8", None, True])
def test_non_int_fields_raise_type_error(field, bad):
    with pytest.raises(TypeError, match=field):
        Config(**{field: bad})


def test_negative_sms_rejected():
    with pytest.raises(ValueError, match=r"num_sms must be >= 0, got -2"):
        Config(num_sms=-2)


@pytest.mark.parametrize("field", FIELDS[1:])
def test_zero_chunk_or_capacity_rejected(field):
    with pytest.raises(ValueError, match=rf"{field} must be >= 1, got 0"):
        Config(**{field: 0})


@pytest.mark.parametrize("send, recv", [(256, 256), (300, 256), (8, 8), (255, 256)])
def test_nvl_send_must_be_below_recv(send, recv):
    if send < recv:
        assert Config(num_max_nvl_chunked_send_tokens=send, num_max_nvl_chunked_recv_tokens=recv).num_sms == 20
        return
    with pytest.raises(ValueError, match=rf"num_max_nvl_chunked_send_tokens must be < "
                                         rf"num_max_nvl_chunked_recv_tokens, got {send} >= {recv}"):
        Config(num_max_nvl_chunked_send_tokens=send, num_max_nvl_chunked_recv_tokens=recv)


# Nr is rounded up to a multiple of Sr; then Sr <= rounded Nr // 2 can only fail when Nr <= Sr (rounded Nr == Sr).
# rounded None: refused.
@pytest.mark.parametrize("send, recv, rounded", [(6, 128, 132), (20, 128, 140), (8, 128, 128), (12, 128, 132),
                                                 (7, 1, None), (1, 5, 5), (6, 6, None), (6, 1, None),
                                                 (64, 64, None), (5, 3, None), (6, 12, 12), (6, 11, 12),
                                                 (64, 100, 128), (3, 5, 6)])
def test_rdma_recv_is_rounded_up_and_send_at_most_half_of_it(send, recv, rounded):
    if rounded is None:
        with pytest.raises(ValueError, match=r"num_max_rdma_chunked_send_tokens must be <= "
                                             r"num_max_rdma_chunked_recv_tokens // 2"):
            Config(num_max_rdma_chunked_send_tokens=send, num_max_rdma_chunked_recv_tokens=recv)
    else:
        config = Config(num_max_rdma_chunked_send_tokens=send, num_max_rdma_chunked_recv_tokens=recv)
        assert config.num_max_rdma_chunked_recv_tokens == rounded


def _oracle(num_sms, sn, nn, sr, nr):
    """Independent statement of DeepEP's Config rules: the stored tuple, or None if invalid."""
    if num_sms < 0 or sn <= 0 or nn <= 0 or sr <= 0 or nr <= 0 or sn >= nn:
        return None
    nr = (nr + sr - 1) // sr * sr
    if not (sr < nr and sr <= nr // 2):
        return None
    return (num_sms, sn, nn, sr, nr)


@given(st.tuples(st.integers(-3, 200), st.integers(-2, 600), st.integers(-2, 600), st.integers(-2, 200),
                 st.integers(-2, 600)))
def test_validation_matches_an_independent_oracle(values):
    expected = _oracle(*values)
    if expected is None:
        with pytest.raises(ValueError) as info:
            Config(*values)
        # The message names at least one field.
        assert any(name in str(info.value) for name in FIELDS)
    else:
        config = Config(*values)
        assert as_tuple(config) == expected
        # Re-constructing from the stored values is a fixed point (rounding is idempotent).
        assert Config(*as_tuple(config)) == config


# ---------------------------------------------------------------------------------------------------------------
# Default tables
# ---------------------------------------------------------------------------------------------------------------

def _expected(row, num_sms):
    sn, nn, sr, nr = row
    return (num_sms, sn, nn, sr, -(-nr // sr) * sr)


@pytest.mark.parametrize("num_ranks", sorted(SPEC_TABLE))
def test_default_tables_match_spec(num_ranks):
    dispatch_row, combine_row = SPEC_TABLE[num_ranks]
    assert as_tuple(get_dispatch_config(num_ranks)) == _expected(dispatch_row, 20)
    assert as_tuple(get_combine_config(num_ranks)) == _expected(combine_row, 20)
    assert as_tuple(get_dispatch_config(num_ranks, num_sms=24)) == _expected(dispatch_row, 24)


def test_nr_rounding_in_tables():
    # EP16 dispatch has Sr=20, so Nr 128 becomes 140.
    assert get_dispatch_config(16).num_max_rdma_chunked_recv_tokens == 140
    assert get_combine_config(16).num_max_rdma_chunked_recv_tokens == 132


@pytest.mark.parametrize("num_ranks, row", [(1, 2), (2, 2), (3, 4), (4, 4), (5, 8), (6, 8), (7, 8), (8, 8)])
def test_small_rank_counts_take_next_listed_row(num_ranks, row):
    assert get_dispatch_config(num_ranks) == get_dispatch_config(row)
    assert get_combine_config(num_ranks) == get_combine_config(row)


@pytest.mark.parametrize("num_ranks", [9, 12, 40, 72, 256, 1000])
def test_unsupported_rank_counts_rejected(num_ranks):
    with pytest.raises(ValueError, match=rf"Unsupported number of EP ranks: {num_ranks}"):
        get_dispatch_config(num_ranks)
    with pytest.raises(ValueError, match=rf"Unsupported number of EP ranks: {num_ranks}"):
        get_combine_config(num_ranks)


def test_supported_rank_list_is_exactly_the_table():
    assert cfg.SUPPORTED_NORMAL_RANKS == tuple(range(1, 9)) + tuple(r for r in sorted(SPEC_TABLE) if r > 8)


@pytest.mark.parametrize("num_ranks, exc", [(0, ValueError), (-8, ValueError), (8.0, TypeError), (True, TypeError)])
def test_bad_rank_counts_rejected(num_ranks, exc):
    with pytest.raises(exc, match="num_ranks"):
        get_dispatch_config(num_ranks)


def test_odd_num_sms_is_passed_through_to_config():
    # Config itself accepts odd SM counts (as DeepEP's does); Buffer.set_num_sms enforces evenness.
    assert get_dispatch_config(8, num_sms=3).num_sms == 3


# ---------------------------------------------------------------------------------------------------------------
# Topology
# ---------------------------------------------------------------------------------------------------------------

def test_topology_default_is_deepep_mapping():
    topo = Topology(32)
    assert topo.num_scaleup_ranks == 8 and topo.num_scaleout_ranks == 4 and topo.is_internode
    assert [topo.node_of(r) for r in (0, 7, 8, 31)] == [0, 0, 1, 3]
    assert [topo.local_of(r) for r in (0, 7, 8, 31)] == [0, 7, 0, 7]


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 5, 8])
def test_topology_within_one_node(num_ranks):
    topo = Topology(num_ranks)
    assert topo.num_scaleup_ranks == num_ranks  # clamped to the group size
    assert topo.num_scaleout_ranks == 1 and not topo.is_internode


def test_topology_virtual_nodes():
    topo = Topology(8, num_scaleup_ranks=2)
    assert topo.num_scaleout_ranks == 4 and topo.is_internode
    assert [topo.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@given(st.integers(1, 8), st.integers(1, 20))
def test_topology_mapping_is_a_bijection(per_node, num_nodes):
    topo = Topology(per_node * num_nodes, per_node)
    pairs = {(topo.node_of(r), topo.local_of(r)) for r in range(topo.num_ranks)}
    assert len(pairs) == topo.num_ranks
    assert all(n * topo.num_scaleup_ranks + i == r for r, (n, i) in
               zip(range(topo.num_ranks), sorted(pairs)))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_ranks=0), ValueError, "num_ranks must be >= 1"),
    (dict(num_ranks=12), ValueError, r"num_ranks \(12\) must be a multiple"),
    (dict(num_ranks=16, num_scaleup_ranks=9), ValueError, "num_scaleup_ranks must be <= 8, got 9"),
    (dict(num_ranks=16, num_scaleup_ranks=0), ValueError, "num_scaleup_ranks must be >= 1"),
    (dict(num_ranks=6, num_scaleup_ranks=4), ValueError, r"num_ranks \(6\)"),
    (dict(num_ranks="8"), TypeError, "num_ranks must be an int"),
])
def test_topology_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Topology(**kwargs)


def test_topology_from_env(monkeypatch):
    monkeypatch.setenv("DEEP_EP_GPUS_PER_NODE", "4")
    assert Topology.from_env(16).num_scaleout_ranks == 4
    monkeypatch.delenv("DEEP_EP_GPUS_PER_NODE")
    assert Topology.from_env(16).num_scaleout_ranks == 2
    monkeypatch.setenv("DEEP_EP_GPUS_PER_NODE", "four")
    with pytest.raises(ValueError, match="DEEP_EP_GPUS_PER_NODE"):
        Topology.from_env(16)


# ---------------------------------------------------------------------------------------------------------------
# num_local_experts
# ---------------------------------------------------------------------------------------------------------------

def test_num_local_experts():
    assert num_local_experts(256, 8) == 32
    assert num_local_experts(288, 2) == 144
    with pytest.raises(ValueError, match=r"num_experts \(10\) must be divisible by the number of ranks \(4\)"):
        num_local_experts(10, 4)
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        num_local_experts(0, 4)
