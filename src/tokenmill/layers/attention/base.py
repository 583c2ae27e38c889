"""The attention-backend interface and the per-step context a model's forward receives.

The model runner owns the backend. Once per step it builds the backend's metadata from the
scheduler's integers (:meth:`AttentionBackend.build_metadata`); every attention layer then calls
:meth:`AttentionBackend.forward` with that metadata and its own slice of the KV pool. Models
never build metadata, never allocate KV and never look at the device: they read all of it from
:class:`ForwardContext`.

A backend is chosen for a KV spec and a device (:func:`tokenmill.layers.attention.select_attention_backend`).
``graph_capture_sizes`` is the hook for a CUDA-graph runner: the batch sizes whose metadata the
backend can rebuild into static buffers (``()`` for backends that run eagerly only, which is all
of today's CPU backends, so the runner never captures).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from tokenmill.contracts.batch import ForwardBatch
from tokenmill.contracts.kv import KVCacheSpec, LinearState


def attention_kinds(spec: KVCacheSpec) -> set[Any]:
    """The distinct KV entries of the spec's attention layers (a hybrid model's LinearState
    layers keep their state in the state pool, not in pages, and are left out)."""
    return {layer for layer in spec.layers if not isinstance(layer, LinearState)}


def per_layer(spec: KVCacheSpec, make: Any) -> list[Any]:
    """``make()`` for every attention layer and ``None`` for every LinearState layer, in order."""
    return [None if isinstance(layer, LinearState) else make() for layer in spec.layers]


F16_MAX = 65504.0   # the largest finite float16


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a KV pool of ``dtype`` stores it: a float16 pool saturates at +-65504 (a K or V
    element beyond float16's range is stored as its largest finite value, never as an infinity
    that would turn the softmax into NaN; the native writer in ``_native/decoder.c`` does the
    same). Other dtypes: a plain cast."""
    if dtype == torch.float16 and x.dtype != torch.float16:
        x = x.clamp(-F16_MAX, F16_MAX)
    return x.to(dtype)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class AttentionBackend(abc.ABC):
    """Paged attention over one model's KV pool."""

    name: str = "abstract"
    graph_capture_sizes: tuple[int, ...] = ()
    # static fp8 scales with one value per feature: the feature ranges calibrated together
    # (MLA: latent, rope key); None: one scale per head vector
    fp8_scale_segments: tuple[int, ...] | None = None

    def __init__(self, spec: KVCacheSpec, device: torch.device, compute_dtype: torch.dtype) -> None:
        self.spec = spec
        self.device = device
        self.compute_dtype = compute_dtype
        self.cache_dtype = torch_dtype(spec.dtype)

    @abc.abstractmethod
    def allocate(self, num_pages: int, page_size: int) -> list[Any]:
        """One zeroed KV entry per layer of the spec, on the backend's device (``None`` for a
        hybrid model's LinearState layers, whose state lives in the state pool)."""

    def calibration_backend(self) -> AttentionBackend:
        """The backend the start-up calibration of static fp8 scales runs its prefill on (same
        pool layout). It must attend a fresh prefill with the chunk's own full-precision K/V, as
        the torch reference does, so that the scales are the same whichever backend serves."""
        return self

    @abc.abstractmethod
    def build_metadata(self, batch: ForwardBatch) -> Any:
        """Everything the layers share in this step, computed once from ``batch``."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, meta: Any,
                scale: float) -> torch.Tensor:
        """Write ``k``/``v`` [T, Hkv, D] at the step's slots and attend with ``q`` [T, Hq, D].

        Returns ``[T, Hq * D]`` in ``q``'s dtype.
        """


@dataclass
class ForwardContext:
    """What a model's forward gets each step (prepared by the model runner).

    ``capture_layers`` asks the model to keep the hidden states after those decoder layers
    (index ``-1`` is the embedding output); they appear in ``captured`` keyed by layer index.
    Learned draft models read them, at no extra forward pass.
    """

    batch: ForwardBatch
    attn: AttentionBackend
    meta: Any
    kv_caches: Sequence[Any]
    capture_layers: frozenset[int] = frozenset()
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: torch.Tensor | None = None   # set by the runner after the forward
    # Each logits row's first largest index (``logits.argmax(-1)``), where the model found it
    # with the logits (the native fused head); None: not known. The sampler's greedy rows read it
    # instead of the logits.
    logits_argmax: torch.Tensor | None = None
    # Hybrid models: the state pool (tokenmill.layers.state_pool.StatePool); each sequence's
    # slot is ``batch.state_slots[i]``. None for pure attention models.
    states: Any = None
    # called once when the step's long computation starts (compute_starts); set by the runner
    on_compute: Callable[[], None] | None = None
    # Continuous decode steps (set by the runner, only where the model's
    # ``chains_decode_steps`` allowed it): a batch of one decode row per sequence runs this many
    # greedy steps in one forward, each step's input the previous one's argmax; the model puts
    # the tokens in ``step_tokens`` ([decode_steps, rows] int64) and returns the last step's logits.
    decode_steps: int = 1
    step_tokens: torch.Tensor | None = None
    # an int32 [1] flag the engine sets from another thread when work arrives: the chain then
    # ends after its current step (``step_tokens`` holds the steps that ran)
    chain_stop: torch.Tensor | None = None

    @classmethod
    def prepare(cls, attn: AttentionBackend, batch: ForwardBatch, kv_caches: Sequence[Any],
                capture_layers: frozenset[int] = frozenset(), states: Any = None) -> ForwardContext:
        return cls(batch, attn, attn.build_metadata(batch), kv_caches, capture_layers, states=states)

    def compute_starts(self) -> None:
        """The step's long computation starts now (on the CPU: the native call that releases the
        GIL for the whole stack). Runs the runner's hook once, if any: a server hands the
        previous step's outputs to its HTTP thread here, so that their Python runs beside the
        model's computation instead of between steps. A model that calls this sets
        ``calls_compute_hook = True``; for any other the runner calls it before the forward."""
        hook, self.on_compute = self.on_compute, None
        if hook is not None:
            hook()

    def capture(self, layer: int, hidden: torch.Tensor) -> None:
        if layer in self.capture_layers:
            self.captured[layer] = hidden
