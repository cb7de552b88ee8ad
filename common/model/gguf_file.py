"""Read a GGUF file's metadata and tensors.

`gguf.GGUFReader` builds a numpy view per array element, which makes a tokenizer's 49k tokens
and merges take over 5 s to read (most of a daemon's start). This reader walks the header once
with `struct` over a memory map (well under a second) and gives each tensor as the same numpy
view `gguf.quants.dequantize` expects. The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count, before its bytes
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# Scalar value types: struct format, numpy dtype.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "u1"), 1: ("b", "i1"), 2: ("H", "<u2"), 3: ("h", "<i2"), 4: ("I", "<u4"), 5: ("i", "<i4"),
    6: ("f", "<f4"), 7: ("?", "?"), 10: ("Q", "<u8"), 11: ("q", "<i8"), 12: ("d", "<f8"),
}
# Tensor types stored as plain elements; every other type is blocks of bytes.
_ELEMENTS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # of the tensor's values, slowest-varying dimension first (as numpy's)
    data: np.ndarray  # read-only view into the file: elements, or bytes of quantized blocks


class GgufFile:
    """`fields`: metadata key -> Python value (arrays as lists); `tensors` in file order."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offset = 0
        if self._buf[:4] != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        try:
            version, tensor_count, kv_count = self._unpack("<4xIQQ")
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version}")
            self.fields: dict[str, Any] = {}
            for _ in range(kv_count):
                key = self._string()
                self.fields[key] = self._value(self._unpack("<I")[0])
            infos = [self._tensor_info() for _ in range(tensor_count)]
            alignment = self.fields.get("general.alignment", 32)
            if type(alignment) is not int or alignment < 1:
                raise ValueError(f"general.alignment must be a positive integer, got {alignment!r}")
            data_start = -(-self._offset // alignment) * alignment
            self.tensors = [self._tensor(data_start, *info) for info in infos]
        except (struct.error, ValueError, KeyError, OverflowError) as exc:  # sizes and offsets past the file's end
            raise ValueError(f"{path}: not a readable GGUF file: {exc}") from None

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row, each its byte count then its bytes; a vocabulary and its merges
        (most of the metadata) in one tight loop, not a call per string."""
        buf, at, out = self._buf, self._offset, []
        length_at = _LENGTH.unpack_from
        for _ in range(count):
            (length,) = length_at(buf, at)
            at += 8
            out.append(buf[at:at + length].decode("utf-8"))
            at += length
        self._offset = at
        return out

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._unpack("<IQ")
            if item_kind in _SCALARS:
                dtype = np.dtype(_SCALARS[item_kind][1])
                items = np.frombuffer(self._buf, dtype, count, self._offset)
                self._offset += count * dtype.itemsize
                return items.tolist()
            if item_kind == _STRING:
                return self._strings(count)
            return [self._value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self._offset}")
        return self._unpack("<" + _SCALARS[kind][0])[0]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {_MAX_DIMS})")
        dims = self._unpack(f"<{n_dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, dims, GGMLQuantizationType(kind), offset

    def _tensor(self, data_start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
                offset: int) -> GgufTensor:
        shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
        elements = int(np.prod(dims))
        if kind in _ELEMENTS:
            data = np.frombuffer(self._buf, _ELEMENTS[kind], elements, data_start + offset).reshape(shape)
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            data = np.frombuffer(self._buf, np.uint8, elements // block_size * type_size,
                                 data_start + offset).reshape(quant_shape_to_byte_shape(shape, kind))
        return GgufTensor(name, kind, shape, data)
