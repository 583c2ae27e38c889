"""A GGUF file's metadata, tensor table and tensor bytes, read without parsing what is not used.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value, so opening the
default model's file (a 49,152-entry vocabulary and 48,900 merges) takes 3.6 s on a 2-core
machine: a third of ``tokenmill serve``'s start-up. The loader needs only the scalar metadata,
the lengths of the vocabulary arrays (the tokenizer itself is built once and cached, see
``gguf.gguf_tokenizer_dir``) and the tensor table. This reader walks the header once with
``struct`` and skips the large arrays (a string array by its length prefixes, a numeric one by
arithmetic); the tensors are views of one read-only memory map, typed and shaped exactly as
``GGUFReader`` types them (``tests/loader/test_gguf_file.py`` checks both against it).

Layout (GGUF v2 and v3; v1 used 32-bit counts and is refused): magic ``GGUF``, version (uint32),
tensor count and metadata count (uint64); each metadata entry is a string key, a uint32 value
type and the value; each tensor entry is a string name, a uint32 dimension count, that many
uint64 dimensions (innermost first), a uint32 ggml type and a uint64 offset from the start of
the data section, which begins at the next multiple of ``general.alignment`` (default 32) after
the tables. Strings are a uint64 byte length and UTF-8 bytes. A file written on a big-endian
machine is read with the byte order swapped, as ``GGUFReader`` does.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tokenmill.contracts.errors import ModelLoadError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# metadata value types: struct code of the scalar ones; 8 is a string, 9 an array
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# tensors GGUFReader shows as elements (not bytes): ggml type name -> numpy dtype
_ELEMENT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: Any        # gguf.GGMLQuantizationType
    shape: np.ndarray       # dims as stored (innermost first), uint64
    n_elements: int
    n_bytes: int
    data_offset: int        # from the start of the file
    data: np.ndarray        # read-only view: elements for float/int types, [rows, row bytes] for block types


class GGUFFile:
    """``fields`` (key -> value, with ``<key>.len`` in place of each skipped array) and ``tensors``
    of a GGUF file. ``skip`` names the arrays whose values are not read (only their length)."""

    def __init__(self, path: str | Path, skip: tuple[str, ...] = ()) -> None:
        self.path = Path(path)
        try:
            self._mm = np.memmap(self.path, mode="r")
        except ValueError as e:   # numpy refuses to map an empty file
            raise ValueError(f"cannot map the file: {e}") from e
        self._buf = memoryview(self._mm)   # slices of a memoryview copy nothing
        self._pos = 0
        if bytes(self._take(4)) != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version = struct.unpack_from("<I", self._buf, 4)[0]
        self._e = "<"
        if version & 0xFFFF == 0:   # written on the other byte order
            self._e = ">"
            version = struct.unpack_from(">I", self._buf, 4)[0]
        self._pos = 8
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        self.version = version
        n_tensors, n_kv = self._unpack("QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            vtype = self._unpack("I")[0]
            if vtype == _ARRAY and key in skip:
                self.fields[key + ".len"] = self._skip_array()
            else:
                self.fields[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("I")[0]
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = self._unpack("Q" * n_dims)
            ttype, offset = self._unpack("IQ")
            infos.append((name, dims, ttype, offset))
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a power of two")
        self.data_start = -(-self._pos // align) * align
        self.tensors = [self._tensor(*info) for info in infos]
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ValueError(f"tensor {t.name!r} appears twice")
            seen.add(t.name)

    # -- the header walk ------------------------------------------------------------------------

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._buf):
            raise ValueError(f"the file ends inside its header (at byte {self._pos}, {n} more needed)")
        out = self._buf[self._pos:end]
        self._pos = end
        return out

    def _unpack(self, codes: str) -> tuple[Any, ...]:
        fmt = self._e + codes
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))

    def _string(self) -> str:
        n = self._unpack("Q")[0]
        return str(self._take(n), "utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self._unpack(_SCALAR[vtype])[0]
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("IQ")
            if etype in _SCALAR:
                code = _SCALAR[etype]
                return list(struct.unpack(f"{self._e}{count}{code}", self._take(count * struct.calcsize(code))))
            return [self._value(etype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")

    def _skip_array(self) -> int:
        etype, count = self._unpack("IQ")
        if etype in _SCALAR:
            self._take(count * struct.calcsize(_SCALAR[etype]))
        elif etype == _STRING:
            buf, pos, fmt, end = self._buf, self._pos, self._e + "Q", len(self._buf)
            for _ in range(count):   # each string: its 8-byte length, then the bytes
                if pos + 8 > end:
                    raise ValueError("the file ends inside a string array")
                pos += 8 + struct.unpack_from(fmt, buf, pos)[0]
            if pos > end:
                raise ValueError("the file ends inside a string array")
            self._pos = pos
        else:
            for _ in range(count):
                self._value(etype)
        return count

    def _tensor(self, name: str, dims: tuple[int, ...], ttype: int, offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown ggml type {ttype}") from None
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block
        np_dims = tuple(reversed(dims))
        start = self.data_start + offset
        if start + n_bytes > len(self._buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        if qtype.name in _ELEMENT_TYPES:
            dtype = np.dtype(_ELEMENT_TYPES[qtype.name]).newbyteorder(self._e)
            data = np.ndarray(np_dims, dtype=dtype, buffer=self._mm, offset=start)
        else:
            byte_dims = quant_shape_to_byte_shape(np_dims, qtype)
            data = np.ndarray(byte_dims, dtype=np.uint8, buffer=self._mm, offset=start)
        return GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), n_elems, n_bytes, start, data)
