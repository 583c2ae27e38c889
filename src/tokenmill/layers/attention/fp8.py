"""8-bit KV pages and their scales: FP8 (``float8_e4m3fn``), and int8.

Layout: an fp8 KV entry is :class:`FP8Pages` ``(data, scale, per_token)``. ``data`` holds the
e4m3 bytes (stored as ``uint8``, because CPU torch has no scatter kernels for float8 tensors; the
bytes are reinterpreted with ``.view(torch.float8_e4m3fn)``) in exactly the shape a
full-precision pool would have. The value of an element is ``fp8(data) * scale``, with one of two
scale schemes (``--kv-cache-fp8-scales``, :data:`tokenmill.contracts.kv.FP8_SCALE_SCHEMES`):

* ``static`` (default): one fp32 scale per layer and KV head, for K and for V (dense attention),
  and one for the latent and one for the rope key of an MLA layer. ``scale`` is a small tensor
  broadcast over the pool (``[2, 1, 1, kv_heads, 1]`` dense, ``[1, 1, latent + rope]`` MLA) that
  the model runner calibrates once at start-up (:func:`calibrate_static_scales`): one prefill of
  a built-in text records each head's largest ``|K|`` / ``|V|`` (latent, rope key), and the scale
  maps :data:`STATIC_HEADROOM` times that to e4m3's 448, so a later value may be that much
  larger before it saturates; a larger one is clamped to +-448 (never NaN). e4m3 is a float
  format, so the headroom costs almost nothing: the relative rounding error is the same at every
  magnitude down to 2^-6 of the scale. No byte is stored per token, so an fp8 pool holds exactly
  4x the tokens of an fp32 one (2x bf16).
* ``token``: one fp32 scale per stored vector (token and KV head; token for an MLA latent),
  ``scale`` has the data's shape minus the feature dimension and is computed from the vector
  being written (``amax / 448``). Slightly more accurate (the largest element of each vector is
  exact), at 4 bytes per vector in the bytes-per-token formula.

int8 pages (``--kv-cache-dtype int8``) are the same :class:`FP8Pages` with ``data`` of dtype
``int8`` (that dtype is what tells the two codes apart) and always per-token scales: a vector
stores ``round(x / scale)`` clamped to +-127 with ``scale = amax / 127``, so its largest element
is exact and every other one is within half a step (``amax / 254``) of its value. Against e4m3's
3 mantissa bits (a relative step of 1/8 at every magnitude) that is finer for elements above
about 1/16 of the vector's largest and coarser below; its point is the integer dot-product
instructions the native decode kernel runs it on (AVX-512 VNNI).

Tiled int8 pages (``tiled=True``) hold the same codes and scales in another order within each page,
the one the native kernel's int8 decode body on AVX-512 VNNI reads without widening or shuffling
(``TM_KV_INT8T`` in ``_native/attention.h``): per page and KV head one tile of ``page_size x D``
bytes, K as ``[D / 4][page_size][4]`` with each byte the code + 128, V as ``[page_size / 4][D][4]``,
and the scales as ``[KV heads][page_size]``. A page is the same region of the tensors either way,
so page copies (the KV tiers) do not depend on the order; the native backend picks it
(:meth:`~tokenmill.layers.attention.native.NativePagedAttention.allocate`), and
:func:`write_fp8` / :func:`untile_pages` let the torch reference write and read such pages too.

Either way a quantized entry is final on write (its scale does not depend on later tokens), so
the same tokens store the same bytes whether prefilled whole, in chunks or found in the prefix
cache.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)   # 448
_TINY = 1e-12                           # scale floor for all-zero vectors
STATIC_HEADROOM = 4.0                   # calibrated amax maps to 448 / STATIC_HEADROOM
INT8_MAX = 127.0                        # int8 pages: codes in [-127, 127]


class FP8Pages(NamedTuple):
    data: torch.Tensor    # uint8 bytes of float8_e4m3fn values (int8: int8 codes), [..., D]
    scale: torch.Tensor   # fp32: data.shape[:-1] (per token), or a broadcastable static scale
    per_token: bool = True
    tiled: bool = False   # int8 codes in the tiled order (module docstring)
    v_half: bool = False  # a tiled entry's V half (its tile order is not K's)

    def page_tensors(self) -> list[torch.Tensor]:
        """The tensors with a page dimension (what a KV tier copies): static scales are not."""
        return [self.data, self.scale] if self.per_token else [self.data]

    @property
    def is_int8(self) -> bool:
        return self.data.dtype == torch.int8

    def half(self, i: int) -> FP8Pages:
        """K (``i = 0``) or V (``i = 1``) of a dense ``[2, N, P, H, D]`` entry."""
        return FP8Pages(self.data[i], self.scale[i], self.per_token, self.tiled, i == 1)


def fp8_supported(device: torch.device) -> bool:
    """Whether this torch build converts to and from float8_e4m3fn on ``device``."""
    try:
        x = torch.ones(2, device=device).to(FP8)
        return bool(x.view(torch.uint8).view(FP8).float().sum().item() == 2.0)
    except (RuntimeError, TypeError):
        return False


def allocate_fp8(shape: tuple[int, ...], device: torch.device, static_scale_shape: tuple[int, ...] | None = None,
                 int8: bool = False) -> FP8Pages:
    """Zeroed fp8 pages; ``static_scale_shape``: a static scale of that (broadcastable) shape,
    initialised to 1 until calibrated, else one scale per vector. ``int8``: int8 pages (per-vector
    scales only)."""
    if int8 and static_scale_shape is not None:
        raise ValueError("int8 KV pages have a scale per vector, not static ones")
    data = torch.zeros(shape, dtype=torch.int8 if int8 else torch.uint8, device=device)
    if static_scale_shape is not None:
        return FP8Pages(data, torch.ones(static_scale_shape, dtype=torch.float32, device=device), False)
    return FP8Pages(data, torch.zeros(shape[:-1], dtype=torch.float32, device=device), True)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bytes uint8, scale fp32)`` of ``x`` with one scale per vector over the last dimension."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(_TINY)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(torch.uint8), scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8, scale fp32)`` of ``x``: one scale per vector (``amax / 127``), codes rounded to
    nearest even and clamped to +-127 (the native ``tm_i8_write_vec`` stores the same)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp_min(_TINY)
    q = (xf / scale.unsqueeze(-1)).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Bytes of ``x / scale`` in e4m3, saturated at +-448 (``scale`` broadcasts over ``x``)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-token scales: ``scale`` has ``data``'s shape minus the last dimension (int8 codes or
    e4m3 bytes, by ``data``'s dtype)."""
    codes = data.float() if data.dtype == torch.int8 else data.view(FP8).float()
    return (codes * scale.unsqueeze(-1)).to(dtype)


def dequantize_static(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Static scales: ``scale`` broadcasts over ``data`` as it is."""
    return (data.view(FP8).float() * scale).to(dtype)


class _Calibration:
    """Running per-element amax of what each layer writes during the calibration prefill."""

    def __init__(self) -> None:
        self.amax: dict[int, torch.Tensor] = {}   # scale's data_ptr -> amax [*inner, D]

    def record(self, pages: FP8Pages, x: torch.Tensor) -> None:
        a = x.detach().abs().float().amax(dim=0)
        key = pages.scale.data_ptr()
        self.amax[key] = torch.maximum(self.amax[key], a) if key in self.amax else a


_CALIBRATING: list[_Calibration] = []


def _tiled_index(page_size: int, hkv: int, d: int, slots: torch.Tensor, v_half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat byte offsets ``[T, H, D]`` of the elements of ``slots`` in a tiled int8 half, and
    flat scale offsets ``[T, H]``."""
    page, s = (slots // page_size)[:, None, None], (slots % page_size)[:, None, None]
    h = torch.arange(hkv, device=slots.device)[None, :, None]
    dim = torch.arange(d, device=slots.device)[None, None, :]
    tile = (page * hkv + h) * page_size * d
    at = tile + ((s // 4) * d + dim) * 4 + s % 4 if v_half else tile + ((dim // 4) * page_size + s) * 4 + dim % 4
    return at, ((page * hkv + h) * page_size + s)[..., 0]


def untile_pages(data: torch.Tensor, scale: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled int8 pages ``data [2, N, P, H, D]`` and ``scale [2, N, P, H]`` (any N, e.g. a
    gather of pages) in the row order: the same codes and scales as an untiled pool."""
    two, n, ps, hkv, d = data.shape
    k = data[0].reshape(n, hkv, d // 4, ps, 4).permute(0, 3, 1, 2, 4).reshape(n, ps, hkv, d)
    k = torch.bitwise_xor(k, torch.tensor(-128, dtype=torch.int8, device=data.device))   # code + 128 -> code
    v = data[1].reshape(n, hkv, ps // 4, d, 4).permute(0, 2, 4, 1, 3).reshape(n, ps, hkv, d)
    sc = scale.reshape(two, n, hkv, ps).transpose(2, 3)
    return torch.stack((k, v)), sc.contiguous()


def write_fp8(pages: FP8Pages, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store ``x`` [T, ..., D] at flat slots (the first two dims of the pool are pages x offsets)."""
    d = pages.data.shape[-1]
    inner = tuple(pages.data.shape[2:-1])
    if pages.tiled:   # the codes and scales of the row order, at their tiled places
        q, scale = quantize_int8(x)
        at, sat = _tiled_index(pages.data.shape[1], inner[0], d, slots.to(torch.int64), pages.v_half)
        if not pages.v_half:
            q = torch.bitwise_xor(q, torch.tensor(-128, dtype=torch.int8, device=q.device))
        pages.data.view(-1).index_put_((at.reshape(-1),), q.reshape(-1))
        pages.scale.view(-1).index_put_((sat.reshape(-1),), scale.reshape(-1))
        return
    if pages.per_token:
        q, scale = quantize_int8(x) if pages.is_int8 else quantize(x)
        pages.data.view(-1, *inner, d).index_copy_(0, slots, q)
        pages.scale.view(-1, *inner).index_copy_(0, slots, scale)
        return
    if _CALIBRATING:
        _CALIBRATING[-1].record(pages, x)
    # the static scale is [1, 1, *inner, D or 1] over [N, P, *inner, D]: drop the page dim
    pages.data.view(-1, *inner, d).index_copy_(0, slots, quantize_static(x, pages.scale[0]))


def static_scale_tensors(kv_caches: list[Any]) -> list[torch.Tensor]:
    """The static scales of a pool as written: per layer, K's and V's (dense ``[2, N, P, H, D]``
    entries; views into the layer's ``[2, 1, 1, H, 1]``) or the latent's, in layer order."""
    out = []
    for entry in kv_caches:
        if isinstance(entry, FP8Pages) and not entry.per_token:
            out += [entry.scale[0], entry.scale[1]] if entry.data.dim() == 5 else [entry.scale]
    return out


@torch.inference_mode()
def calibrate_static_scales(kv_caches: list[Any], prefill: Callable[[], None],
                            segments: tuple[int, ...] | None = None, headroom: float = STATIC_HEADROOM) -> int:
    """Set every static scale of ``kv_caches`` from one calibration pass.

    ``prefill()`` runs the model over the calibration tokens as one fresh prefill into
    ``kv_caches`` (a single chunk, so attention reads the chunk's own full-precision K/V, never
    the pool; the model runner uses a scratch pool and copies the scales over); every fp8
    write on the way records its head's amax. Each scale becomes ``headroom * amax / 448``
    (a head that wrote only zeros keeps a scale of 1). The pages written are zeroed afterwards.
    The scales are a function of the model and the tokens only, not of the pool's size.
    Returns the number of static scale tensors set.
    """
    scales = static_scale_tensors(kv_caches)
    if not scales:
        return 0
    cal = _Calibration()
    _CALIBRATING.append(cal)
    try:
        prefill()
    finally:
        _CALIBRATING.remove(cal)
    for s in scales:
        amax = cal.amax.get(s.data_ptr())
        if amax is None:
            continue
        if s.shape[-1] == 1:
            amax = amax.amax(dim=-1, keepdim=True)
        elif segments is not None:
            amax = torch.cat([part.amax(dim=-1, keepdim=True).expand(part.shape)
                              for part in amax.split([n for n in segments if n], dim=-1)], dim=-1)
        s.copy_(torch.where(amax > 0, amax * headroom / FP8_MAX, torch.ones_like(amax)).view(s.shape))
    for entry in kv_caches:
        if isinstance(entry, FP8Pages):
            entry.data.zero_()
    return len(scales)
