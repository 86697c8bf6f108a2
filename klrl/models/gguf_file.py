"""A GGUF file's metadata and tensors, read from a memory map (GGUF v2/v3, as ``gguf.GGUFReader``
reads it: the same values, the same tensor arrays for ``gguf.quants.dequantize``).

``gguf.GGUFReader`` builds one NumPy view per element of every metadata array: 21 s for Gemma 3's
262144-token vocabulary (three such arrays) on a shared 2-core machine, 2.5 s for SmolLM2's 49152.
Here an array of numbers is one ``np.frombuffer`` and an array of strings one pass of
``struct.unpack_from`` over the map (about 0.3 s for Gemma 3). Tensor data stay views of the map, in
``GGUFReader``'s layout: plain types (F32, F16, ...) typed, row-major ``[..., in]``; quantised types
``uint8`` of the byte shape ``gguf.quant_shape_to_byte_shape`` gives.

Any malformed or truncated file raises ``ValueError`` (its message one line).
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quant_shape_to_byte_shape

_V = GGUFValueType
_SCALARS = {_V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I",
            _V.INT32: "<i", _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q",
            _V.FLOAT64: "<d"}  # fmt: skip
_ARRAYS = {k: np.dtype(v) for k, v in _SCALARS.items()}  # struct's "<f" is NumPy's little-endian float32
_Q = GGMLQuantizationType
_PLAIN = {_Q.F16: np.float16, _Q.F32: np.float32, _Q.F64: np.float64, _Q.I8: np.int8, _Q.I16: np.int16,
          _Q.I32: np.int32, _Q.I64: np.int64}  # fmt: skip


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major (HF order): GGUF's dims reversed
    data: np.ndarray  # a view of the file (module docstring)


class _Cursor:
    def __init__(self, buf):
        self.buf, self.off = buf, 0

    def take(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.off)[0]
        self.off += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        end = self.off + n
        if end > len(self.buf):
            raise ValueError("truncated string")
        s = self.buf[self.off : end].decode("utf-8")
        self.off = end
        return s

    def value(self, kind: int) -> Any:
        if kind == _V.STRING:
            return self.string()
        if kind == _V.ARRAY:
            sub, n = self.take("<I"), self.take("<Q")
            if sub in _ARRAYS:
                a = np.frombuffer(self.buf, _ARRAYS[sub], n, self.off)
                self.off += a.nbytes
                return a.tolist()
            return [self.value(sub) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def _tensor(buf, name: str, dims: list[int], kind: int, offset: int) -> GGUFTensor:
    qt = GGMLQuantizationType(kind)
    shape = tuple(reversed(dims))
    n = math.prod(dims)
    if qt in _PLAIN:
        data = np.frombuffer(buf, _PLAIN[qt], n, offset).reshape(shape)
    else:
        block, size = GGML_QUANT_SIZES[qt]
        data = np.frombuffer(buf, np.uint8, n * size // block, offset)
        data = data.reshape(quant_shape_to_byte_shape(shape, qt))
    return GGUFTensor(name, qt, shape, data)


def read_gguf(path: str | Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """``(metadata key -> value, tensors)`` of the GGUF file ``path`` (``ValueError`` if malformed)."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise ValueError("empty file") from None
    try:
        c = _Cursor(buf)
        if buf[:4] != b"GGUF":
            raise ValueError("GGUF magic invalid")
        c.off = 4
        version = c.take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            if key in fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            fields[key] = c.value(c.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name, dims = c.string(), []
            for _ in range(c.take("<I")):
                dims.append(c.take("<Q"))
            infos.append((name, dims, c.take("<I"), c.take("<Q")))
        align = int(fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align} is not a power of two")
        start = -(-c.off // align) * align
        tensors, seen = [], set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"duplicate tensor {name!r}")
            seen.add(name)
            tensors.append(_tensor(buf, name, dims, kind, start + offset))
    except (struct.error, UnicodeDecodeError, OverflowError, KeyError) as e:
        raise ValueError(f"malformed header ({type(e).__name__}: {e})") from None
    return fields, tensors
