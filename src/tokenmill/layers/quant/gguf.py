"""GGUF block types served natively: each is repacked, without changing a value, into one of the
kernel layouts of ``packed.py``.

| GGUF type | block | served as | how |
|---|---|---|---|
| Q8_0 | 32 values: fp16 d, 32 x int8 | :class:`Int8Linear`, group 32, fp16 scales | bytes copied |
| Q4_0 | 32 values: fp16 d, 16 bytes of nibbles | :class:`Int4Linear`, group 32, fp16 | ``scale = d``, ``min = -8d`` |
| Q4_1 | 32 values: fp16 d, fp16 m, 16 bytes | :class:`Int4Linear`, group 32, fp16 | bytes copied |
| Q4_K | 256 values: fp16 d, dmin, 12 bytes of 6-bit sub-scales, 128 bytes | :class:`Int4Linear`, group 32, fp32 | ``scale = d*sc_j``, ``min = -dmin*m_j`` (exact in fp32); nibbles reordered |
| Q6_K | 256 values of 6 bits | :class:`Int8Linear`, group 32, fp32 | dequantized, then requantized to 8 bits (the nearest served format; error at most half an 8-bit step) |

Every other block type is refused with a message naming the tensor and its type. Adding a type is
one entry in :data:`GGUF_FORMATS` (a function from the raw bytes to a linear method).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tokenmill.contracts.errors import ModelLoadError
from tokenmill.layers.linear import LinearMethod
from tokenmill.layers.quant.packed import Int4Linear, Int8Linear, pack_nibbles

# type name -> (values per block, bytes per block)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def _blocks(raw: np.ndarray, rows: int, cols: int, qtype: str, name: str) -> np.ndarray:
    """The tensor's bytes as ``[rows, blocks_per_row, block_bytes]``; refuses a bad shape."""
    per, nbytes = BLOCKS[qtype]
    if cols % per:
        raise ModelLoadError(f"GGUF tensor {name} of type {qtype} has rows of {cols} values, not a multiple "
                             f"of its block size {per}")
    want = rows * (cols // per) * nbytes
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if flat.size != want:
        raise ModelLoadError(f"GGUF tensor {name} of type {qtype}: {flat.size} bytes, its shape [{rows}, {cols}] "
                             f"needs {want}")
    return flat.reshape(rows, cols // per, nbytes)


def _f16(b: np.ndarray) -> torch.Tensor:
    """fp16 values from ``[..., 2]`` bytes."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].copy())


def _q8_0(raw: np.ndarray, rows: int, cols: int, name: str) -> LinearMethod:
    b = _blocks(raw, rows, cols, "Q8_0", name)
    qs = torch.from_numpy(np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(rows, cols).copy())
    return Int8Linear(qs, _f16(b[:, :, 0:2]), cols, 32)


def _q4_0(raw: np.ndarray, rows: int, cols: int, name: str) -> LinearMethod:
    b = _blocks(raw, rows, cols, "Q4_0", name)
    d = _f16(b[:, :, 0:2])
    qs = torch.from_numpy(np.ascontiguousarray(b[:, :, 2:]).reshape(rows, cols // 2).copy())
    return Int4Linear(qs, d, d * -8, cols, 32)  # -8d is exact in fp16 (a power-of-two multiple)


def _q4_1(raw: np.ndarray, rows: int, cols: int, name: str) -> LinearMethod:
    b = _blocks(raw, rows, cols, "Q4_1", name)
    qs = torch.from_numpy(np.ascontiguousarray(b[:, :, 4:]).reshape(rows, cols // 2).copy())
    return Int4Linear(qs, _f16(b[:, :, 0:2]), _f16(b[:, :, 2:4]), cols, 32)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of Q4_K blocks from their 12 bytes ``s [..., 12]``."""
    s = s.astype(np.int32)
    sc = np.empty(s.shape[:-1] + (8,), dtype=np.int32)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _q4_k(raw: np.ndarray, rows: int, cols: int, name: str) -> LinearMethod:
    b = _blocks(raw, rows, cols, "Q4_K", name)
    nsb = cols // 256
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
    sc, mn = _k_scales(b[:, :, 4:16])
    scales = (d[..., None] * sc).reshape(rows, nsb * 8)
    mins = (-dmin[..., None] * mn).reshape(rows, nsb * 8)
    # 128 bytes per super-block: 4 chunks of 32 bytes; chunk j's low nibbles are values 64j..64j+31,
    # its high nibbles values 64j+32..64j+63.
    q = b[:, :, 16:].reshape(rows, nsb, 4, 32)
    vals = np.stack([q & 0x0F, q >> 4], axis=3).reshape(rows, cols)
    return Int4Linear(pack_nibbles(torch.from_numpy(vals)), torch.from_numpy(scales.astype(np.float32)),
                      torch.from_numpy(mins.astype(np.float32)), cols, 32)


def _q6_k(raw: np.ndarray, rows: int, cols: int, name: str) -> LinearMethod:
    from gguf import GGMLQuantizationType, quants

    b = _blocks(raw, rows, cols, "Q6_K", name)
    w = quants.dequantize(b.reshape(rows, -1), GGMLQuantizationType.Q6_K).reshape(rows, cols)
    return Int8Linear.from_float(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), group_size=32)


GGUF_FORMATS: dict[str, Callable[[np.ndarray, int, int, str], LinearMethod]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k,
}
DENSE_TYPES = ("F32", "F16", "BF16")


def served_types() -> list[str]:
    return list(DENSE_TYPES) + list(GGUF_FORMATS)


def gguf_linear(raw: np.ndarray, qtype: str, rows: int, cols: int, name: str) -> LinearMethod:
    """The linear method serving GGUF tensor ``name`` of block type ``qtype`` and shape ``[rows, cols]``."""
    if qtype not in GGUF_FORMATS:
        raise ModelLoadError(f"GGUF tensor {name} has type {qtype}, which tokenmill does not serve natively "
                             f"(served: {', '.join(served_types())}); load it with quantization 'none' to "
                             f"dequantize every tensor to fp32")
    return GGUF_FORMATS[qtype](raw, rows, cols, name)
