"""Output pool of direct-to-output dispatch: allocator bookkeeping (deep_ep/pool.py) and the pool / output-block
layout (deep_ep/layout.py) against its C++ mirror (csrc/kernels/layout.cuh, compiled on the host when g++ is here)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deep_ep import layout
from deep_ep.config import BUFFER_ALIGNMENT
from deep_ep.pool import OutputPool

REPO_ROOT = Path(__file__).resolve().parent.parent


def _check_invariants(pool: OutputPool, live: dict[int, int]) -> None:
    """Free ranges and live blocks tile the pool exactly, free ranges never touch."""
    pieces = sorted([(o, s, "free") for o, s in pool.free_ranges()] + [(o, s, "live") for o, s in live.items()])
    cursor = pool.offset
    for offset, size, kind in pieces:
        assert offset == cursor, (offset, cursor, kind)
        assert size > 0 and size % BUFFER_ALIGNMENT == 0
        cursor += size
    assert cursor == pool.offset + pool.num_bytes
    ranges = pool.free_ranges()
    for (a, sa), (b, _) in zip(ranges, ranges[1:]):
        assert a + sa < b, "adjacent free ranges were not merged"


def test_first_fit_and_merge():
    pool = OutputPool(1024, 10 * 128)
    a, b, c = pool.allocate(100), pool.allocate(256), pool.allocate(128)
    assert (a, b, c) == (1024, 1152, 1408)
    assert pool.allocate(10 * 128) is None  # only 6 units left
    pool.free(b)
    assert pool.allocate(128) == 1152  # first fit reuses the hole
    pool.free(a)
    pool.free(1152)
    assert pool.free_ranges() == [(1024, 384), (1536, 768)]
    pool.free(c)
    assert pool.free_ranges() == [(1024, 1280)] and pool.num_live == 0


def test_long_lived_block_only_fragments():
    """A block kept alive across many calls (saved for backward) never blocks the space around it."""
    pool = OutputPool(0, 100 * 128)
    kept = pool.allocate(128)
    for _ in range(50):
        x = pool.allocate(60 * 128)
        assert x is not None
        pool.free(x)
    assert pool.largest_free() == 99 * 128 and kept == 0


def test_empty_pool_and_bad_input():
    pool = OutputPool(256, 0)
    assert pool.allocate(1) is None and pool.free_bytes == 0
    with pytest.raises(ValueError, match="num_bytes must be > 0"):
        pool.allocate(0)
    with pytest.raises(ValueError, match="not a live block"):
        OutputPool(0, 1024).free(0)
    with pytest.raises(ValueError, match="multiple of 128"):
        OutputPool(100, 1024)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 2000), st.integers(0, 1000)), max_size=60))
def test_random_sequences_keep_invariants(ops):
    pool = OutputPool(4096, 64 * 128)
    live: dict[int, int] = {}
    for allocate, size, pick in ops:
        if allocate or not live:
            offset = pool.allocate(size)
            if offset is None:
                assert pool.largest_free() < -(-size // 128) * 128
            else:
                live[offset] = -(-size // 128) * 128
        else:
            offset = sorted(live)[pick % len(live)]
            pool.free(offset)
            del live[offset]
        _check_invariants(pool, live)
    assert pool.free_bytes + sum(live.values()) == pool.num_bytes


def test_pool_region_follows_the_rings():
    control = layout.intranode_control_bytes()
    # A DeepEP-sized buffer: rings only (at most the rounding remainder of the two halves is left).
    assert layout.intranode_pool_region(256 << 20).num_bytes < 2 * BUFFER_ALIGNMENT
    big = 2_000_000_000 // 128 * 128
    region = layout.intranode_pool_region(big)
    assert region.offset == control + 2 * layout.INTRANODE_MAX_RING_HALF_BYTES and region.end == big
    assert region.offset % BUFFER_ALIGNMENT == 0


def test_output_layout_sections():
    lay = layout.intranode_dispatch_output_layout(10, 7168, 56, 8, 8)
    assert [r.name for r in lay.regions] == ["recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights"]
    assert lay["recv_x_scales"].offset == 71680 and all(r.offset % 128 == 0 for r in lay.regions)


_MIRROR_PROGRAM = r"""
#include <cstdio>
#include "layout.cuh"
using namespace deep_ep::kernels;
int main() {
    std::printf("%lld %lld %lld\n", (long long)kControlBytes, (long long)kDispatchOutputOffset,
                (long long)kWsUsedBytes);
    const long long sizes[] = {256LL << 20, 768LL << 20, 2000000000LL / 128 * 128};
    for (long long n : sizes) std::printf("%lld %lld\n", (long long)pool_offset(n), (long long)pool_bytes(n));
    auto l = dispatch_output_layout(10, 7168, 56, 8, 8);
    std::printf("%lld %lld %lld\n", (long long)l.scales, (long long)l.topk_idx, (long long)l.topk_weights);
    auto m = dispatch_output_layout(333, 2048, 0, 0, 4);
    std::printf("%lld %lld %lld\n", (long long)m.scales, (long long)m.topk_idx, (long long)m.topk_weights);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_layout_mirror_matches_cpp(tmp_path):
    source = tmp_path / "mirror.cpp"
    source.write_text(_MIRROR_PROGRAM)
    binary = tmp_path / "mirror"
    subprocess.run(["g++", "-std=c++17", "-I", str(REPO_ROOT / "csrc" / "kernels"), str(source), "-o", str(binary)],
                   check=True)
    lines = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split("\n")
    control, output_word, ws_used = map(int, lines[0].split())
    assert control == layout.intranode_control_bytes()
    assert output_word == layout.intranode_control_layout()["dispatch_output"].offset
    assert ws_used == layout.intranode_workspace_layout().total_bytes
    for line, n in zip(lines[1:4], (256 << 20, 768 << 20, 2_000_000_000 // 128 * 128)):
        region = layout.intranode_pool_region(n)
        assert tuple(map(int, line.split())) == (region.offset, region.num_bytes)
    for line, args in zip(lines[4:6], ((10, 7168, 56, 8, 8), (333, 2048, 0, 0, 4))):
        lay = layout.intranode_dispatch_output_layout(*args)
        expected = (lay["recv_x_scales"].offset, lay["recv_topk_idx"].offset, lay["recv_topk_weights"].offset)
        assert tuple(map(int, line.split())) == expected
