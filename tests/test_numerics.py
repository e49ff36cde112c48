"""FP8 per-token casts, UE8M0 packing and LogFMT-10 (deep_ep.numerics)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deep_ep import numerics


def _random_tokens(seed: int, num_tokens: int, hidden: int, log2_range: int = 8) -> torch.Tensor:
    """BF16 ``[N, H]`` with per-block magnitudes spread over ``2^-range .. 2^range`` and some exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(num_tokens, hidden, generator=gen)
    block_scale = torch.exp2(torch.randint(-log2_range, log2_range + 1, (num_tokens, hidden // 128, 1),
                                           generator=gen).float())
    x = (base.view(num_tokens, hidden // 128, 128) * block_scale).view(num_tokens, hidden)
    x[torch.rand(num_tokens, hidden, generator=gen) < 0.05] = 0
    return x.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# Hand-computed examples.
# ---------------------------------------------------------------------------------------------------------------

def test_ceil_log2_bits_literals():
    v = torch.tensor([1.0, 0.5, 0.75, 3.0, 4.0, 2.0 ** -20, 1.0 / 448])
    assert numerics.ceil_log2_bits(v).tolist() == [0, -1, 0, 2, 2, -20, -8]
    assert numerics.exp2_int(torch.tensor([-8, 0, 3])).tolist() == [2.0 ** -8, 1.0, 8.0]


def test_fp8_cast_literal_block():
    # One block with amax = 1: scale_inv = 1/448; values become x * 448.
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1], x[0, 2] = 1.0, -0.5, 0.25
    q, s = numerics.per_token_cast_to_fp8(x)
    assert s.shape == (1, 1) and s.dtype == torch.float32
    assert s.item() == pytest.approx(1 / 448, rel=1e-7)
    assert q.float()[0, :3].tolist() == [448.0, -224.0, 112.0]
    # round_scale: amax/448 = 0.00223 -> 2^-8 (ceil of -8.807); q = x * 256.
    q, s = numerics.per_token_cast_to_fp8(x, round_scale=True)
    assert s.item() == 2.0 ** -8
    assert q.float()[0, :3].tolist() == [256.0, -128.0, 64.0]


def test_ue8m0_literal_bytes():
    # 4 blocks with amax 1, 448, 0 (clamped to 1e-4), 896: exponents -8, 0, -22, 1 -> bytes 119, 127, 105, 128.
    x = torch.zeros(1, 512)
    x[0, 0], x[0, 128], x[0, 384] = 1.0, 448.0, 896.0
    _, packed = numerics.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    assert packed.shape == (1, 1) and packed.dtype == torch.int32
    expected = 119 | (127 << 8) | (105 << 16) | (128 << 24)
    assert packed.item() == expected - (1 << 32)  # as a signed int32
    assert numerics.unpack_ue8m0(packed).tolist() == [[2.0 ** -8, 1.0, 2.0 ** -22, 2.0]]


def test_pack_unpack_roundtrip():
    gen = torch.Generator().manual_seed(3)
    exponents = torch.randint(1, 255, (5, 8), generator=gen)
    packed = numerics.pack_ue8m0(exponents)
    assert packed.shape == (5, 2)
    assert torch.equal(numerics.unpack_ue8m0(packed), numerics.exp2_int(exponents - 127))
    # Strided (column-major) input unpacks the same.
    col_major = packed.t().contiguous().t()
    assert not col_major.is_contiguous()
    assert torch.equal(numerics.unpack_ue8m0(col_major), numerics.unpack_ue8m0(packed))


# ---------------------------------------------------------------------------------------------------------------
# Properties.
# ---------------------------------------------------------------------------------------------------------------

@settings(deadline=None)
@given(seed=st.integers(0, 2**16), num_tokens=st.integers(0, 6), blocks=st.integers(1, 8),
       round_scale=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_fp8_error_bound(seed, num_tokens, blocks, round_scale, dtype):
    x = _random_tokens(seed, num_tokens, blocks * 128).to(dtype)
    q, scales = numerics.per_token_cast_to_fp8(x, round_scale=round_scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scales.shape == (num_tokens, blocks) and scales.dtype == torch.float32
    assert torch.isfinite(q.float()).all()
    assert q.float().abs().max().item() <= 448 if q.numel() else True
    back = numerics.per_token_cast_back(q, scales).float()
    xf = x.float()
    scale_per_elem = scales.repeat_interleave(128, dim=1)
    # E4M3: 3 mantissa bits (relative half-ulp 2^-4), subnormal step 2^-9 in the scaled domain; BF16 output 2^-8.
    bound = xf.abs() * (2.0 ** -4 + 2.0 ** -8) * 1.001 + scale_per_elem * 2.0 ** -10 * 1.001
    assert ((back - xf).abs() <= bound).all()
    amax = xf.view(num_tokens, blocks, 128).abs().amax(-1).clamp(min=1e-4)
    if round_scale:
        assert torch.equal(scales, numerics.exp2_int(numerics.ceil_log2_bits(scales)))  # exact powers of two
        assert (scales * 448 >= amax).all() and (scales * 448 < 2 * amax).all()
    else:
        assert torch.allclose(scales, amax / 448, rtol=1e-6, atol=0)


@settings(deadline=None)
@given(seed=st.integers(0, 2**16), num_tokens=st.integers(0, 5), groups=st.integers(1, 3))
def test_ue8m0_matches_round_scale(seed, num_tokens, groups):
    x = _random_tokens(seed, num_tokens, groups * 512, log2_range=20)
    q_ref, s_ref = numerics.per_token_cast_to_fp8(x, round_scale=True)
    q, packed = numerics.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    assert packed.shape == (num_tokens, groups) and packed.dtype == torch.int32
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(numerics.unpack_ue8m0(packed), s_ref)
    # Byte j of int32 p is block 4p + j's biased exponent.
    raw = packed.contiguous().view(torch.uint8).to(torch.int32)
    assert torch.equal(raw, numerics.ceil_log2_bits(s_ref) + 127)
    assert torch.equal(numerics.per_token_cast_back(q, packed), numerics.per_token_cast_back(q_ref, s_ref))


def test_cast_back_accepts_strided_scales():
    x = _random_tokens(7, 6, 512)
    q, s = numerics.per_token_cast_to_fp8(x)
    col_major = s.t().contiguous().t()
    assert torch.equal(numerics.per_token_cast_back(q, col_major), numerics.per_token_cast_back(q, s))


def test_fp8_saturates_finite():
    # After scaling every |value| <= 448; huge BF16 values stay finite.
    x = torch.tensor([[3.0e38] + [1.0] * 127], dtype=torch.float32)
    q, s = numerics.per_token_cast_to_fp8(x)
    assert torch.isfinite(q.float()).all() and q.float()[0, 0].item() == 448.0


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(x=torch.zeros(2, 100)), ValueError, "x.size\\(1\\)"),
    (dict(x=torch.zeros(2, 128), use_ue8m0=True), ValueError, "round_scale"),
    (dict(x=torch.zeros(2, 256), round_scale=True, use_ue8m0=True), ValueError, "multiple of 512"),
    (dict(x=torch.zeros(128)), ValueError, "2-D"),
    (dict(x=torch.zeros(2, 128, dtype=torch.float16)), TypeError, "x must be bfloat16 or float32"),
    (dict(x=[[0.0] * 128]), TypeError, "x must be a torch.Tensor"),
])
def test_fp8_cast_rejects_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        numerics.per_token_cast_to_fp8(**kwargs)


def test_cast_back_rejects_mismatched_scales():
    q, s = numerics.per_token_cast_to_fp8(torch.ones(2, 256))
    with pytest.raises(ValueError, match="scales"):
        numerics.per_token_cast_back(q, s[:, :1])


# ---------------------------------------------------------------------------------------------------------------
# LogFMT-10.
# ---------------------------------------------------------------------------------------------------------------

def test_logfmt_chunk_channels():
    assert numerics.logfmt_chunk_channels(7168) == 1024
    assert numerics.logfmt_chunk_channels(2560) == 512
    assert numerics.logfmt_chunk_channels(128) == 512


def test_logfmt_literal_endpoints_exact():
    # One 512-channel chunk (4 blocks). Block 0 holds +-0.5 and 2^-11: la = -1, lm = -11, s = 10/510; code 511
    # decodes to 2^(510 s + lm) = 0.5 and code 1 to 2^lm, so both ends come back exactly.
    x = torch.full((1, 512), 0.25)
    x[0, :128] = 0.5
    x[0, 1] = -0.5
    x[0, 2] = 2.0 ** -11
    x[0, 128:] = torch.linspace(0.01, 0.2, 384)
    x[0, 300] = 0.0  # amin = 0: lm clipped to la - 32 in that block; 0 decodes to 0
    x = x.to(torch.bfloat16)
    out = numerics.logfmt_roundtrip(x)
    assert out[0, 0].item() == 0.5 and out[0, 1].item() == -0.5 and out[0, 2].item() == 2.0 ** -11
    assert out[0, 300].item() == 0.0
    assert not torch.equal(out, x)  # the chunk was encoded (lossy somewhere)
    # A constant block (lm == la) makes its whole chunk travel raw.
    x[0, 256:384] = 0.25
    assert torch.equal(numerics.logfmt_roundtrip(x), x)


def test_logfmt_zero_and_large_chunks_raw():
    x = torch.zeros(2, 1024, dtype=torch.bfloat16)
    assert torch.equal(numerics.logfmt_roundtrip(x), x)        # amax = 0 -> raw
    y = (torch.randn(2, 1024) * 4).to(torch.bfloat16)           # amax >= 1 -> raw
    assert torch.equal(numerics.logfmt_roundtrip(y), y)


def test_logfmt_chunk_decision_is_per_chunk():
    # H = 2048 -> 1024-channel chunks. Chunk 0 small values (encoded, lossy), chunk 1 has one value >= 1 (raw).
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(1, 2048, generator=gen) * 0.5 + 0.01).to(torch.bfloat16)
    x[0, 1500] = 3.0
    out = numerics.logfmt_roundtrip(x)
    assert torch.equal(out[:, 1024:], x[:, 1024:])
    assert not torch.equal(out[:, :1024], x[:, :1024])


@settings(deadline=None)
@given(seed=st.integers(0, 2**16), num_tokens=st.integers(1, 4), blocks=st.sampled_from([1, 4, 8, 16]),
       log2_range=st.integers(0, 12))
def test_logfmt_error_bound(seed, num_tokens, blocks, log2_range):
    hidden = blocks * 128
    x = (_random_tokens(seed, num_tokens, hidden, log2_range).float() * 2.0 ** (-log2_range - 4)).to(torch.bfloat16)
    out = numerics.logfmt_roundtrip(x).float()
    xf = x.float()
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert torch.equal(torch.sign(out)[out != 0], torch.sign(xf)[out != 0])
    blk = xf.abs().view(num_tokens, blocks, 128)
    la, amin = torch.log2(blk.amax(-1)), blk.amin(-1)
    lm = torch.maximum(torch.log2(amin), la - 32)
    step = (la - lm) / 510
    rel = ((torch.exp2(step) - 1) / 2).nan_to_num(0.0, posinf=0.0).clamp(min=0)
    floor = torch.exp2(lm).nan_to_num(0.0)
    rel_e = rel.repeat_interleave(128, dim=1)
    floor_e = floor.repeat_interleave(128, dim=1)
    bound = xf.abs() * (rel_e + 2.0 ** -8) * 1.001 + floor_e
    assert ((out - xf).abs() <= bound).all()
    # The element holding a block's amax decodes exactly (code 511), encoded or raw.
    at_max = blk.argmax(-1, keepdim=True)
    assert torch.equal(out.abs().view(num_tokens, blocks, 128).gather(2, at_max), blk.gather(2, at_max))
    # Worst case over any block: relative error at most (2^(32/510) - 1)/2 + BF16 rounding.
    big = xf.abs() >= floor_e
    assert ((out - xf).abs()[big] <= xf.abs()[big] * ((2 ** (32 / 510) - 1) / 2 + 2 ** -8) * 1.001).all()


def test_logfmt_rejects_bad_input():
    with pytest.raises(TypeError, match="bfloat16"):
        numerics.logfmt_roundtrip(torch.zeros(1, 128))
    with pytest.raises(ValueError, match="multiple of 128"):
        numerics.logfmt_roundtrip(torch.zeros(1, 100, dtype=torch.bfloat16))


def test_logfmt_bound_constant():
    assert (2 ** (32 / 510) - 1) / 2 < 0.023 and math.isclose(numerics.LOGFMT_STEPS, 510)
