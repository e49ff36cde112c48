"""deep_ep.backends.cuda_tuning (the CUDA kernels' selection rules) and deep_ep.testing (their test-only overrides)."""
from __future__ import annotations

import re

import pytest

from deep_ep import testing
from deep_ep.backends import cuda_tuning as tuning

# ---------------------------------------------------------------------------------------------------------------
# deep_ep.testing
# ---------------------------------------------------------------------------------------------------------------


def test_overrides_nest_merge_and_restore():
    assert testing.current() == testing.Overrides()
    with testing.overrides(combine_send="rings", dispatch_warps=8) as outer:
        assert testing.current() is outer and outer.combine_send == "rings"
        with testing.overrides(combine_send=None, uncapped_channels=True):
            now = testing.current()
            assert (now.combine_send, now.dispatch_warps, now.uncapped_channels) == (None, 8, True)
        assert testing.current() == outer
        with pytest.raises(RuntimeError), testing.overrides(internode="torch"):
            raise RuntimeError("leaves the block")
        assert testing.current() == outer
    assert testing.current() == testing.Overrides()


@pytest.mark.parametrize("fields, exc, words", [
    (dict(combine_copy="rings"), TypeError, ("unknown field", "combine_copy")),
    (dict(dispatch_receive="auto"), ValueError, ("dispatch_receive", "'rings', 'direct'", "'auto'")),
    (dict(combine_send="sideways"), ValueError, ("combine_send", "'sideways'")),
    (dict(internode="auto"), ValueError, ("internode", "'auto'")),
    (dict(combine_copy_chunk_rows=0), ValueError, ("combine_copy_chunk_rows", ">= 1", "0")),
    (dict(dispatch_warps=-1), ValueError, ("dispatch_warps", ">= 0", "-1")),
    (dict(combine_warps=2.0), ValueError, ("combine_warps", "2.0")),
    (dict(ll_put_only=1), ValueError, ("ll_put_only", "bool", "1")),
])
def test_overrides_reject_bad_fields(fields, exc, words):
    with pytest.raises(exc) as info, testing.overrides(**fields):
        pass
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert testing.current() == testing.Overrides()


# ---------------------------------------------------------------------------------------------------------------
# Channels and warps
# ---------------------------------------------------------------------------------------------------------------

def test_intranode_channels_cap_by_rank_count():
    cap = tuning.INTRANODE_CHANNEL_CAP[2]
    assert tuning.intranode_channels(8, 2) == min(8, cap)
    assert tuning.intranode_channels(24, 2) == cap < 24  # the budget is an upper bound
    assert tuning.intranode_channels(24, 8) == 24  # no measured cap for EP8: the budget
    assert all(tuning.intranode_channels(s, r) <= s for s in range(1, 65) for r in range(1, 9))
    with testing.overrides(uncapped_channels=True):
        assert tuning.intranode_channels(24, 2) == 24
    for bad in (0, 161):
        with pytest.raises(ValueError, match=re.escape(f"config.num_sms must be in [1, 160] (one channel per SM), "
                                                       f"got {bad}")):
            tuning.intranode_channels(bad, 2)
    with pytest.raises(TypeError):
        tuning.INTRANODE_CHANNEL_CAP[2] = 24  # read-only: overrides go through deep_ep.testing


def test_send_warps_fit_every_ring_group():
    """Copy warps per channel stay where each kernel accepts them for every group size up to NUM_MAX_RING_RANKS
    (24), whatever the override: dispatch [2, 32 - R] (the receivers keep a warp per source), combine [R - 1, 30]."""
    from deep_ep.config import NUM_MAX_RING_RANKS

    for override in (None, 1, 16, 31):
        with testing.overrides(dispatch_warps=override, combine_warps=override):
            for num_ranks in range(2, NUM_MAX_RING_RANKS + 1):
                for channels, fp8 in ((8, False), (16, True), (24, False)):
                    for puts in (False, True):
                        d = tuning.intranode_send_warps("dispatch", num_ranks, channels, fp8, puts)
                        c = tuning.intranode_send_warps("combine", num_ranks, channels, puts=puts)
                        assert 2 <= d <= 32 - num_ranks and num_ranks - 1 <= c <= 30, (override, num_ranks, d, c)


def test_send_warps_follow_the_table():
    assert tuning.intranode_send_warps("dispatch", 2, 12) == 24
    assert tuning.intranode_send_warps("dispatch", 2, 16) == 12
    assert tuning.intranode_send_warps("dispatch", 2, 16, fp8=True) == 24
    assert tuning.intranode_send_warps("combine", 2, 24) == 6
    assert tuning.intranode_send_warps("combine", 2, 48) == 6  # beyond the last bound: the last row
    with testing.overrides(dispatch_warps=10):
        assert tuning.intranode_send_warps("dispatch", 2, 16) == 10
        assert tuning.intranode_send_warps("combine", 2, 16) == 8  # the other kernel keeps its row


def test_send_warps_with_put_peers():
    """A rank with NVSHMEM put peers gives most warps to the senders (they also issue the puts), clamped per rank
    count; an override still wins."""
    for kernel in ("dispatch", "combine"):
        assert tuning.intranode_send_warps(kernel, 2, 16, puts=True) == tuning.PUT_SEND_WARPS[kernel]
    assert tuning.intranode_send_warps("dispatch", 2, 16, fp8=False, puts=True) == 24  # the table's row: 12
    assert tuning.intranode_send_warps("combine", 2, 24, puts=True) == 22  # the table's row: 6
    assert tuning.intranode_send_warps("dispatch", 12, 16, puts=True) == 20  # 32 - R: a receiver per source
    with testing.overrides(dispatch_warps=10, combine_warps=9):
        assert tuning.intranode_send_warps("dispatch", 2, 16, puts=True) == 10
        assert tuning.intranode_send_warps("combine", 2, 16, puts=True) == 9


# ---------------------------------------------------------------------------------------------------------------
# Combine send path, zone senders, copy chunks, receive path
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, num_sms, want", [
    (None, 1, "copy"), (None, 8, "copy"), (None, 12, "copy"), (None, 13, "rings"), (None, 19, "rings"),
    (None, 20, "zone"), (None, 24, "zone"), ("zone", 8, "zone"), ("zone", 24, "zone"), ("rings", 4, "rings"),
    ("rings", 24, "rings"), ("copy", 24, "copy"), ("copy", 160, "copy")])
def test_combine_send_path(monkeypatch, mode, num_sms, want):
    monkeypatch.setattr(tuning, "COMBINE_COPY_MAX_SMS", 12)
    monkeypatch.setattr(tuning, "COMBINE_ZONE_MIN_SMS", 20)
    with testing.overrides(combine_send=mode):
        assert tuning.combine_send_path(num_sms) == want


@pytest.mark.parametrize("override, want", [(None, 4), (1, 1), (0, 1), (7, 7), (18, 18), (30, 18)])
def test_zone_send_warps_default_override_and_clamp(monkeypatch, override, want):
    monkeypatch.setattr(tuning, "COMBINE_ZONE_SEND_WARPS", 4)
    monkeypatch.setattr(tuning, "COMBINE_ZONE_WARPS", 20)
    with testing.overrides(combine_warps=override):
        assert tuning.zone_send_warps() == want


@pytest.mark.parametrize("num_sms, want", [(1, 1), (20, 20), (24, 24), (32, 24), (160, 24)])
def test_zone_ctas_capped(monkeypatch, num_sms, want):
    monkeypatch.setattr(tuning, "COMBINE_ZONE_MAX_CTAS", 24)
    assert tuning.zone_ctas(num_sms) == want


def test_copy_chunk_rows_and_receive_mode_follow_the_overrides():
    assert tuning.combine_copy_chunk_rows() == tuning.COMBINE_COPY_CHUNK_ROWS == 512
    assert tuning.dispatch_receive_mode() == "auto"
    with testing.overrides(combine_copy_chunk_rows=96, dispatch_receive="rings"):
        assert tuning.combine_copy_chunk_rows() == 96 and tuning.dispatch_receive_mode() == "rings"
    with testing.overrides(dispatch_receive="direct"):
        assert tuning.dispatch_receive_mode() == "direct"


# ---------------------------------------------------------------------------------------------------------------
# NVSHMEM put peers and the composed path's rail
# ---------------------------------------------------------------------------------------------------------------

def test_put_peers_are_symmetric():
    """A pair is a put pair when either side cannot reach the other; put_only (internode_put_only) makes every pair
    one."""
    unreachable = [[2], [], [], [0, 1]]  # rank 0 cannot reach 2; rank 3 cannot reach 0 and 1
    peers = [tuning.put_peers(r, unreachable, False) for r in range(4)]
    assert peers == [[2, 3], [3], [0], [0, 1]]
    assert all(r in peers[d] for r in range(4) for d in peers[r])
    assert tuning.put_peers(1, [[], [], []], True) == [0, 2]
    assert tuning.put_peers(0, [[], []], False) == []
    # The fused kernels' span: put_only makes only the pairs of different nodes (2 GPUs each) put pairs.
    assert tuning.put_peers(1, [[]] * 6, True, 2) == [2, 3, 4, 5]
    assert tuning.put_peers(3, [[]] * 6, True, 2) == [0, 1, 4, 5]
    assert tuning.put_peers(1, [[1], [], [], []], False, 2) == [0]  # unreachable inside a node: still a put pair
