"""The elementwise work around a decoder layer's matmuls, fused by ``torch.compile`` where it pays.

Three groups of elementwise ops sit between the matmuls of a Llama-style layer:

- the rotary embedding of queries and keys (:func:`rotary`: a slice, a negation, a concatenation,
  two products and a sum);
- the residual add and the post-attention RMSNorm (:func:`add_rms_norm`);
- SwiGLU, ``silu(gate) * up`` on the two halves of the fused gate/up output (:func:`swiglu`).

Eager torch runs each op as its own pass over memory, with a temporary for each result. Compiled
(TorchInductor, one C++ loop per group), each group reads its inputs once and writes its outputs
once. For a few rows (a decode step) the work is tiny and the compiled function's call overhead
costs more than it saves, so the compiled form runs only for steps of at least
:data:`MIN_TOKENS` rows; smaller steps, and everything while fusion is off, run the eager ops,
which are the reference. The two agree to float rounding (a different summation order in the
norm's mean).

Fusion is off until :func:`enable` turns it on (``--compile``). :func:`enable` compiles all three
functions at once for a symbolic number of rows (one graph for every step size) and returns the
seconds it took, so the start-up cost is measured and logged. TorchInductor's graph and kernel
caches persist in ``TORCHINDUCTOR_CACHE_DIR``, which defaults here to
``$XDG_CACHE_HOME/tokenmill/inductor`` (``~/.cache/tokenmill/inductor``) so that a restart
reuses the compiled kernels instead of compiling again.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tokenmill.layers.rotary import CosSin, apply_rotary

__all__ = ["MIN_TOKENS", "add_rms_norm", "compile_cache_dir", "enable", "enabled", "rotary", "swiglu"]

log = logging.getLogger(__name__)

MIN_TOKENS = 64   # steps with fewer rows run the eager ops (measured: benchmarks/profile_step.py)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _add_rms_norm(h: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    h = h + o
    return h, _norm_only(h, weight, eps)


def _norm_only(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(h.dtype)


class _State:
    compiled: dict[str, Callable[..., Any]] | None = None
    min_tokens: int = MIN_TOKENS


_state = _State()


def enabled() -> bool:
    return _state.compiled is not None


def compile_cache_dir() -> Path:
    """Where TorchInductor keeps compiled graphs and kernels (set before the first compile)."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tokenmill" / "inductor"


def enable(on: bool, *, hidden_size: int = 64, head_dim: int = 16, dtype: torch.dtype = torch.float32,
           min_tokens: int = MIN_TOKENS) -> float:
    """Turn fusion on (compiling now) or off; returns the seconds the compile took (0 when off).

    The sizes only shape the warm-up inputs: the graphs are compiled for symbolic sizes, so one
    compile serves every model and step size (a new dtype compiles once more on first use).
    """
    if not on:
        _state.compiled = None
        return 0.0
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    _state.min_tokens = min_tokens
    if _state.compiled is not None:
        return 0.0
    cache = compile_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
    t0 = time.perf_counter()
    fns = {name: torch.compile(fn, dynamic=True, fullgraph=True)
           for name, fn in (("rotary", apply_rotary), ("swiglu", _swiglu), ("add_rms_norm", _add_rms_norm))}
    n = max(min_tokens, 2)
    with torch.inference_mode():
        for rows in (n, n + 1):   # two sizes: the second proves the graph is shape-generic
            x = torch.randn(rows, 2, head_dim, dtype=dtype)
            cs = torch.randn(rows, 1, head_dim, dtype=dtype)
            fns["rotary"](x, CosSin(cs, cs))
            fns["swiglu"](torch.randn(rows, 2 * hidden_size, dtype=dtype))
            h = torch.randn(rows, hidden_size, dtype=dtype)
            fns["add_rms_norm"](h, h, torch.ones(hidden_size, dtype=dtype), 1e-6)
    seconds = time.perf_counter() - t0
    _state.compiled = fns
    log.info("compiled the fused elementwise kernels in %.1f s (cache: %s; rows >= %d use them)",
             seconds, os.environ["TORCHINDUCTOR_CACHE_DIR"], min_tokens)
    return seconds


def _use(rows: int) -> dict[str, Callable[..., Any]] | None:
    c = _state.compiled
    return c if c is not None and rows >= _state.min_tokens else None


def rotary(x: torch.Tensor, cs: CosSin) -> torch.Tensor:
    """:func:`~tokenmill.layers.rotary.apply_rotary`: ``x`` [T, heads, head_dim] rotated per token."""
    c = _use(x.shape[0])
    return c["rotary"](x, cs) if c is not None else apply_rotary(x, cs)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` = [gate | up] along the last dimension."""
    c = _use(gate_up.shape[0])
    return c["swiglu"](gate_up) if c is not None else _swiglu(gate_up)


def add_rms_norm(h: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + o, RMSNorm(h + o))``: the residual stream and the next sublayer's input."""
    c = _use(h.shape[0])
    if c is not None:
        return c["add_rms_norm"](h, o, weight, eps)
    h = h + o
    if h.dtype == torch.float32:   # one fused eager kernel, the same maths
        return h, F.rms_norm(h, weight.shape, weight, eps)
    return h, _norm_only(h, weight, eps)
