"""The signature of a collective call: what the ranks must agree on before any row moves.

``Buffer`` describes each communicating call (method, shapes, dtypes, expert count, top-k, config, mode flags,
which optional tensors are passed, the handle's dispatch number) and its own validation verdict as one fixed-size
int64 vector; the torch backend exchanges it among the ranks of the call (``TorchBackend.agree``) and
:func:`check_agreement` compares the vectors. A rank whose validation failed sends a refusal that names the
argument, then raises its own ``TypeError``/``ValueError``; every other rank raises
:class:`deep_ep.errors.ArgumentMismatchError` (a ``ValueError``) naming that rank and argument. Ranks that disagree
all raise ``ArgumentMismatchError`` naming the first argument that differs and which ranks hold which value. Every
rank took part in the same exchanges, so the next call works.
"""
from __future__ import annotations

import struct
import zlib
from typing import Any, Optional, Sequence

import torch

from deep_ep.errors import ArgumentMismatchError

# Words of a signature: magic, method, verdict, 3 words of the refused argument's name, then the fields.
SIGNATURE_WORDS = 32
_HEADER_WORDS = 6
MAX_FIELDS = SIGNATURE_WORDS - _HEADER_WORDS
_MAGIC = 0x44454550  # "DEEP"
_METHODS = ("dispatch", "combine", "low_latency_dispatch", "low_latency_combine", "clean_low_latency_buffer")
_NAME_BYTES = 8 * 3
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)


def _encode(value: Any) -> int:
    if value is None:
        return -1
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)  # values that compare equal encode equally (signature_hash's cache relies on it)
    if isinstance(value, torch.dtype):
        return _DTYPES.index(value) if value in _DTYPES else 1000 + zlib.crc32(str(value).encode())
    return zlib.crc32(repr(value).encode())  # a Config: equal configs have equal reprs


def _decode(template: Any, word: int) -> str:
    if isinstance(template, torch.dtype):
        return str(_DTYPES[word]) if 0 <= word < len(_DTYPES) else f"dtype #{word}"
    if isinstance(template, bool):
        return str(bool(word))
    if isinstance(template, int) or template is None:
        return "None" if word == -1 and template is None else str(word)
    return f"#{word:08x}"


class Signature:
    """One rank's description of a call: ``fields`` (name, value) pairs, or ``refused`` (the name of the argument
    the local validation rejected)."""

    __slots__ = ("method", "fields", "refused")

    def __init__(self, method: str, fields: Sequence[tuple[str, Any]] = (), refused: Optional[str] = None) -> None:
        assert method in _METHODS and len(fields) <= MAX_FIELDS
        self.method, self.fields, self.refused = method, tuple(fields), refused

    def words(self) -> torch.Tensor:
        """``[SIGNATURE_WORDS]`` int64 on the CPU."""
        return torch.tensor(self.values(), dtype=torch.int64, device="cpu")

    def values(self) -> list[int]:
        """The ``SIGNATURE_WORDS`` words as Python ints."""
        name = [0, 0, 0]
        if self.refused is not None:
            raw = self.refused.encode("ascii", "replace")[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
            name = [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, _NAME_BYTES, 8)]
        values = [_MAGIC, _METHODS.index(self.method), int(self.refused is not None), *name]
        values += [_encode(value) & 0x7FFFFFFFFFFFFFFF for _, value in self.fields]
        values += [0] * (SIGNATURE_WORDS - len(values))
        return values


# signature_hash's results by (method, refused, fields): a call site passes the same few signatures again and again,
# and the CRC of 32 packed words costs several microseconds of host time per call.
_HASHES: dict = {}
_HASHES_MAX = 4096


def signature_hash(signature: Optional[Signature]) -> int:
    """32-bit hash of ``signature``'s words (0 for ``None``): what the CUDA low-latency kernels carry in their count
    messages, where a whole signature does not fit."""
    if signature is None:
        return 0
    key = (signature.method, signature.refused, signature.fields)
    try:
        cached = _HASHES.get(key)
    except TypeError:  # a field value that cannot be a dict key
        return _crc(signature)
    if cached is None:
        if len(_HASHES) >= _HASHES_MAX:
            _HASHES.clear()
        cached = _HASHES[key] = _crc(signature)
    return cached


def _crc(signature: Signature) -> int:
    return zlib.crc32(struct.pack(f"<{SIGNATURE_WORDS}q", *signature.values()))


def refused_argument(exc: BaseException) -> str:
    """The argument a validation error names: its message starts with the argument's name."""
    text = str(exc).split(" ", 1)[0].strip(",:;'\"")
    return text or type(exc).__name__


def _argument_name(row: torch.Tensor) -> str:
    raw = b"".join(int(word).to_bytes(8, "little", signed=True) for word in row[3:_HEADER_WORDS])
    return raw.rstrip(b"\0").decode("ascii", "replace")


def _groups(values: Sequence[int], ranks: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for value, rank in zip(values, ranks):
        out.setdefault(value, []).append(rank)
    return out


def check_agreement(mine: Signature, gathered: torch.Tensor, ranks: Sequence[int], me: int) -> None:
    """Compare every rank's signature (``gathered[i]`` from rank ``ranks[i]``; this rank is ``me``). Raises
    :class:`ArgumentMismatchError` on this rank unless all agree or this rank alone refused (it then raises its own
    error). ``ranks`` and ``me`` are the Buffer's rank numbers."""
    gathered = gathered.to("cpu", torch.int64)
    if bool((gathered == mine.words()).all()):  # every rank sent this rank's signature: nothing to report
        return
    method = mine.method
    bad_magic = [r for r, row in zip(ranks, gathered) if int(row[0]) != _MAGIC]
    if bad_magic:
        raise ArgumentMismatchError(f"rank {me}: {method}: ranks {bad_magic} sent no call signature (a different "
                                    "deep_ep version, or a different collective call at this point)")
    methods = _groups([int(row[1]) for row in gathered], ranks)
    if len(methods) > 1:
        calls = "; ".join(f"ranks {rs} call {_METHODS[m] if 0 <= m < len(_METHODS) else m}"
                          for m, rs in methods.items())
        raise ArgumentMismatchError(f"rank {me}: the ranks make different calls ({calls}); every rank must make the "
                                    "same sequence of collective calls")
    refusals = {r: _argument_name(row) for r, row in zip(ranks, gathered) if int(row[2]) != 0}
    if refusals:
        if mine.refused is not None:
            return  # this rank raises its own validation error
        which = ", ".join(f"rank {r} ({name})" for r, name in refusals.items())
        raise ArgumentMismatchError(f"rank {me}: {method} was refused on {which}: that rank's validation error names "
                                    "the argument, rule and value; no rank moved data")
    for i, (name, value) in enumerate(mine.fields):
        column = [int(w) for w in gathered[:, _HEADER_WORDS + i]]
        groups = _groups(column, ranks)
        if len(groups) > 1:
            held = "; ".join(f"ranks {rs}: {name}={_decode(value, v)}" for v, rs in groups.items())
            raise ArgumentMismatchError(f"rank {me}: the ranks disagree on {method} argument {name} ({held}); every "
                                        "rank must pass the same value; no rank moved data")
