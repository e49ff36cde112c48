"""Number formats of the expert-parallel path: per-token FP8 casts, UE8M0 scale packing and LogFMT-10.

Torch only (CPU or CUDA tensors, no extension), vectorised over tokens: the one definition used by ``reference``
and the torch backend, also exported to users (DeepEP's test utilities provide the same conversions). FP8 cast,
per token and per 128-channel block ``b``::

    amax[b]   = max(1e-4, max |x_c|)                         float32
    scale_inv = amax / 448                                   (dequant multiplier), or with round_scale
    scale_inv = 2^ceil(log2(amax / 448))                     ceil(log2) taken from the float32 bits
    q_c       = float8_e4m3fn(clamp(x_c / scale_inv, +-448)) round to nearest even, finite
    x_c      ~= float(q_c) * scale_inv

With ``use_ue8m0`` the power-of-two ``scale_inv`` is stored as its biased exponent byte ``e + 127``; four
consecutive blocks share one int32, block ``4p + j`` in byte ``j`` (little-endian).
"""
from __future__ import annotations

import torch

from deep_ep.config import FP8_BLOCK, FP8_E4M3_MAX, ceil_div

# Lower clamp of the per-block absolute maximum (keeps scales finite for all-zero blocks).
AMAX_MIN = 1e-4
# Blocks per packed UE8M0 int32.
UE8M0_PER_INT32 = 4
# LogFMT-10: number of code steps between log2(amin_clip) and log2(amax) (9-bit codes 1..511, 0 = zero).
LOGFMT_STEPS = 510
# LogFMT-10: a block's dynamic range is clipped to this many binades below its amax.
LOGFMT_MAX_RANGE_LOG2 = 32.0


def _check_2d_hidden(name: str, x: object, multiple: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [num_tokens, hidden], got shape {tuple(x.shape)}")
    if x.size(1) % multiple != 0:
        raise ValueError(f"{name}.size(1) (hidden) must be a multiple of {multiple}, got {x.size(1)}")
    return x


def dense_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with standard row-major strides (``contiguous()`` may keep odd strides of size-1 dims,
    which breaks dtype-reinterpreting views)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def ceil_log2_bits(v: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(v))`` of positive normal float32 values, read from the IEEE bits.

    Args:
        v: any shape, float32, positive and normal.
    Returns:
        same shape, int32: ``(biased_exponent - 127) + (mantissa != 0)``.
    """
    bits = v.to(torch.float32).contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return (exponent - 127 + (mantissa != 0).to(torch.int32)).to(torch.int32)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact ``2^e`` as float32 for int exponents in ``[-126, 127]``, built from the bits."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def pack_ue8m0(exponent_bytes: torch.Tensor) -> torch.Tensor:
    """Pack biased exponent bytes four per int32, little-endian.

    Args:
        exponent_bytes: ``[N, B]`` integer tensor with values in ``[0, 255]``, ``B % 4 == 0``.
    Returns:
        ``[N, B/4]`` int32, contiguous; byte ``j`` of element ``[n, p]`` is ``exponent_bytes[n, 4p + j]``.
    """
    if exponent_bytes.dim() != 2 or exponent_bytes.size(1) % UE8M0_PER_INT32 != 0:
        raise ValueError(f"exponent_bytes must be 2-D with a multiple of {UE8M0_PER_INT32} columns, "
                         f"got shape {tuple(exponent_bytes.shape)}")
    if exponent_bytes.numel() and (int(exponent_bytes.min()) < 0 or int(exponent_bytes.max()) > 255):
        raise ValueError("exponent_bytes must lie in [0, 255]")
    # Byte order within an int32 is the host's; torch runs on little-endian hosts (x86-64, aarch64).
    as_bytes = dense_copy(exponent_bytes.to(torch.uint8))
    return as_bytes.view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Expand packed UE8M0 scales to float32 dequant multipliers.

    Args:
        packed: ``[N, P]`` int32, any strides.
    Returns:
        ``[N, 4P]`` float32, contiguous: ``2^(byte - 127)`` per block (byte 0 gives 0.0, as ``byte << 23`` does).
    """
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D int32 tensor, got {packed.dtype} shape {tuple(packed.shape)}")
    as_bytes = dense_copy(packed).view(torch.uint8).to(torch.int32)  # [N, 4P]
    return (as_bytes << 23).view(torch.float32)


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False,
                          use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise every token to FP8 E4M3 with one scale per 128 channels.

    Args:
        x: ``[N, H]`` bfloat16 or float32, ``H % 128 == 0`` (``H % 512 == 0`` with ``use_ue8m0``). Any strides.
        round_scale: round each scale up to a power of two (``2^ceil(log2(amax/448))``).
        use_ue8m0: return the power-of-two scales as packed exponent bytes; requires ``round_scale``.
    Returns:
        ``(q, scales)``: ``q`` ``[N, H]`` float8_e4m3fn; ``scales`` ``[N, H/128]`` float32 dequant multipliers, or
        with ``use_ue8m0`` ``[N, H/512]`` int32 holding 4 biased exponent bytes each (little-endian).
    Raises:
        TypeError / ValueError naming the argument.
    """
    _check_2d_hidden("x", x, FP8_BLOCK)
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True requires round_scale=True (UE8M0 can only hold powers of two)")
    if use_ue8m0 and x.size(1) % (FP8_BLOCK * UE8M0_PER_INT32) != 0:
        raise ValueError(f"x.size(1) (hidden) must be a multiple of {FP8_BLOCK * UE8M0_PER_INT32} with "
                         f"use_ue8m0=True, got {x.size(1)}")
    num_tokens, hidden = x.shape
    blocks = x.to(torch.float32).reshape(num_tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=AMAX_MIN)                       # [N, H/128]
    if round_scale:
        exponent = ceil_log2_bits(amax / FP8_E4M3_MAX)
        scale_inv = exp2_int(exponent)
        scaled = blocks * exp2_int(-exponent).unsqueeze(-1)                    # exact power-of-two multiply
    else:
        scale_inv = amax * (1.0 / FP8_E4M3_MAX)
        scaled = blocks * (FP8_E4M3_MAX / amax).unsqueeze(-1)
    q = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).reshape(num_tokens, hidden)
    if use_ue8m0:
        return q, pack_ue8m0(exponent + 127)
    return q, scale_inv.contiguous()


def scales_to_float(scales: torch.Tensor) -> torch.Tensor:
    """Float32 per-128-block dequant multipliers ``[N, H/128]`` from float32 or packed UE8M0 int32 scales."""
    if scales.dtype == torch.int32:
        return unpack_ue8m0(scales)
    if scales.dtype == torch.float32:
        return scales
    raise TypeError(f"scales must be float32 or int32 (packed UE8M0), got {scales.dtype}")


def per_token_cast_back(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise FP8 tokens: ``float(q) * scale`` of the matching 128-channel block, rounded to BF16.

    Args:
        q: ``[N, H]`` float8_e4m3fn (any float dtype works), ``H % 128 == 0``; any strides.
        scales: ``[N, H/128]`` float32, or ``[N, H/512]`` int32 packed UE8M0; any strides (e.g. the column-major
            views that low-latency dispatch returns).
    Returns:
        ``[N, H]`` bfloat16, contiguous.
    """
    _check_2d_hidden("q", q, FP8_BLOCK)
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        raise ValueError("scales must be a 2-D tensor [num_tokens, num_scales]")
    num_tokens, hidden = q.shape
    scale = scales_to_float(scales)
    if tuple(scale.shape) != (num_tokens, hidden // FP8_BLOCK):
        raise ValueError(f"scales must describe {hidden // FP8_BLOCK} blocks per token for q of shape "
                         f"{tuple(q.shape)}, got scales of shape {tuple(scales.shape)} ({scales.dtype})")
    blocks = q.to(torch.float32).reshape(num_tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    return (blocks * scale.unsqueeze(-1)).reshape(num_tokens, hidden).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# LogFMT-10 (optional low-latency combine payload format).
# ---------------------------------------------------------------------------------------------------------------

def logfmt_chunk_channels(hidden: int) -> int:
    """Channels per LogFMT chunk: ``32 * u * 8`` with ``u = 4`` if ``hidden % 1024 == 0`` else ``u = 2``."""
    return 32 * (4 if hidden % 1024 == 0 else 2) * 8


def logfmt_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What the receiver decodes when a BF16 combine payload is sent in LogFMT-10.

    Chunking rule: a token's channels are split into chunks of ``logfmt_chunk_channels(H)`` (1024 or 512; the
    last chunk may be shorter when ``H`` is not a multiple). Per 128-channel block the sender takes
    ``amax``/``amin`` of ``|x|``, with ``la = log2(amax)`` and ``lm = max(log2(amin), la - 32)``. A chunk is
    encoded only if every one of its blocks has ``la < 0`` and ``lm < la``; otherwise it travels as raw BF16 and
    comes back bit-identical. In an encoded block, with ``s = (la - lm) / 510``, every value gets the 9-bit code
    ``c = floor(max(0, (log2|x| - lm)/s + 2 - log2((1 + 2^s)/2)/s))`` (capped at 511) and its sign; it decodes
    to ``0`` for ``c == 0`` and ``sign * 2^((c-1)*s + lm)`` otherwise, then to BF16.

    Lossy bound: in an encoded block, a value with ``|x| >= 2^lm`` decodes within a relative error of
    ``(2^s - 1)/2`` (the code thresholds are linear midpoints of neighbouring levels, ``s <= 32/510``) plus the
    final BF16 rounding (``2^-9``); a value below ``2^lm`` decodes to 0 or ``2^lm`` (absolute error at most
    ``2^lm <= amax * 2^-32`` when clipped, ``amin`` otherwise). Raw chunks are exact.

    Args:
        x: ``[N, H]`` bfloat16, ``H % 128 == 0``; any strides.
    Returns:
        ``[N, H]`` bfloat16, contiguous.
    """
    _check_2d_hidden("x", x, FP8_BLOCK)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    num_tokens, hidden = x.shape
    num_blocks = hidden // FP8_BLOCK
    blocks = x.to(torch.float32).reshape(num_tokens, num_blocks, FP8_BLOCK)
    magnitude = blocks.abs()
    log_amax = torch.log2(magnitude.amax(dim=-1))                                  # [N, B]
    log_amin = torch.maximum(torch.log2(magnitude.amin(dim=-1)), log_amax - LOGFMT_MAX_RANGE_LOG2)
    block_ok = (log_amax < 0) & (log_amin < log_amax)                              # [N, B]

    # A chunk is encoded only if all its blocks qualify; pad the block axis to whole chunks with "ok".
    blocks_per_chunk = logfmt_chunk_channels(hidden) // FP8_BLOCK
    num_chunks = ceil_div(num_blocks, blocks_per_chunk)
    padded = torch.ones(num_tokens, num_chunks * blocks_per_chunk, dtype=torch.bool, device=x.device)
    padded[:, :num_blocks] = block_ok
    chunk_ok = padded.view(num_tokens, num_chunks, blocks_per_chunk).all(dim=-1)
    encode = chunk_ok.repeat_interleave(blocks_per_chunk, dim=1)[:, :num_blocks]  # [N, B]

    # Codes, computed for every block and used only where the chunk is encoded (keeps the math finite there).
    safe_la = torch.where(encode, log_amax, torch.zeros_like(log_amax))
    safe_lm = torch.where(encode, log_amin, torch.full_like(log_amin, -1.0))
    step = ((safe_la - safe_lm) / LOGFMT_STEPS).unsqueeze(-1)                      # [N, B, 1]
    lm = safe_lm.unsqueeze(-1)
    bias = torch.log2((1 + torch.exp2(step)) / 2) / step
    position = (torch.log2(magnitude) - lm) / step + 2 - bias                      # -inf for zeros
    code = torch.floor(position.clamp(min=0)).clamp(max=LOGFMT_STEPS + 1)
    decoded = torch.where(code == 0, torch.zeros_like(code), torch.exp2((code - 1) * step + lm))
    decoded = torch.copysign(decoded, blocks)
    out = torch.where(encode.unsqueeze(-1), decoded, blocks)
    return out.reshape(num_tokens, hidden).to(torch.bfloat16)
