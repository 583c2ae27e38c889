"""Engine configuration: one frozen dataclass, validated on construction.

Every field has a default that works on a small CPU machine. The KV pool is sized from
``kv_cache_tokens`` or ``kv_cache_memory_gib`` (at most one of them); with neither, the engine
picks :data:`DEFAULT_KV_SESSIONS` full-length sequences, bounded by a share of free memory
(see :func:`default_kv_cache_tokens`).
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.contracts.kv import FP8_SCALE_SCHEMES, KV_DTYPE_NAMES, kv_storage_dtype

DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # weight formats (tokenmill.layers.quant.methods)
# auto: the model's dtype (fp16 for packed weights: resolve_kv_dtype); fp8_e4m3 / int8 / bf16 / fp16 /
# fp32, with the long torch names as aliases
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8", "bf16", "fp16", "fp32", "fp8", "float8_e4m3fn", "bfloat16", "float16",
                   "float32")
assert set(KV_CACHE_DTYPES) == {"auto", *KV_DTYPE_NAMES}
ATTENTION_BACKENDS = ("auto", "torch", "native")
LINEAR_BACKENDS = ("auto", "torch", "onednn")  # tokenmill.layers.linear.select_linear_backend
SPECULATIVE_METHODS = ("ngram", "suffix", "dflash")
MOE_PARALLEL = ("tp", "ep")       # MoE under tensor parallelism: TP inside experts, or expert parallelism
HOST_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: the KV pool's dtype
CACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
DEFAULT_KV_SESSIONS = 4          # full-length sequences the default pool holds
DEFAULT_KV_MEMORY_SHARE = 0.25   # at most this share of available memory by default
DEFAULT_KV_MEMORY_CAP_GIB = 4.0  # and never more than this by default
DEFAULT_SNAPSHOTS_PER_REQUEST = 4     # hybrid models: default state snapshots per request slot
DEFAULT_SNAPSHOT_MEMORY_CAP_GIB = 1.0  # and never more memory than this by default


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine (one model replica).

    ``max_batch_tokens`` is the per-step token budget, shared by decodes first and then prefill
    chunks; a prompt longer than the budget is prefilled in chunks. ``max_model_len`` may lower the
    model's own context limit, never raise it. ``debug_checks`` verifies page accounting whenever
    the engine becomes idle (cheap, but it walks the cache). ``num_threads`` sets torch's intra-op
thread count for the whole process (on a shared, oversubscribed CPU one thread is often fastest).
    """

    model: str = "smollm2-135m-instruct"
    page_size: int = 16
    kv_cache_memory_gib: float | None = None
    kv_cache_tokens: int | None = None
    max_batch_tokens: int = 512
    max_running_requests: int = 64
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    session_retention_s: float = 60.0
    dtype: str = "float32"
    debug_checks: bool = False
    num_threads: int | None = None   # torch intra-op threads (process-wide); None: torch's default
    max_waiting_requests: int | None = None  # bounded waiting queue (engine/admission.py); None: unbounded
    device: str = "cpu"              # torch device the model runner owns ("cpu", "cuda", "cuda:1")
    kv_cache_dtype: str = "auto"     # KV storage: auto (resolve_kv_dtype), fp8_e4m3, int8, bf16, fp16, fp32
    kv_cache_fp8_scales: str = "static"   # fp8 KV scales: static (per layer and head, calibrated at
                                          # start-up, 4x fp32's tokens) or token (per token and head)
    attention_backend: str = "auto"  # see tokenmill.layers.attention.select_attention_backend
    linear_backend: str = "auto"     # fp32 matmuls: auto (oneDNN prepacked on CPU), torch, onednn
    fused_decode: bool = True        # small decode steps in one native call per step where the model
                                     # has a fused stack (layers/quant/fused_decode.py; fp32 models
                                     # then keep a plain copy of their layer weights beside oneDNN's)
    compile: bool = False            # fuse the elementwise ops around the matmuls (layers/fused.py;
                                     # process-wide, compiled at start-up, cached on disk)
    # Lower cache tiers (docs/kv-tiers.md): L2 host memory, L3 shared storage.
    host_cache_memory_gib: float = 0.0   # L2 size; 0 = no host tier
    host_cache_dtype: str = "auto"       # storage dtype of L2 pages (auto = the KV pool's dtype)
    host_cache_snapshot_share: float = 0.25   # hybrid models: share of L2 for state snapshots
    cache_storage: str = "none"          # L3: none, file:DIR or redis://HOST:PORT/DB
    cache_write_policy: str = "write_through"
    cache_write_min_hits: int = 2        # write_through_selective: hits before a page is written
    cache_prefetch_timeout_s: float = 1.0   # longest an admission waits for L3 pages
    cache_prefetch_min_pages: int = 1    # shortest L3 run worth fetching
    cache_storage_timeout_s: float = 1.0  # socket timeout of one storage call
    decode_slowdown: float | None = 1.75  # bound on a decode step's time while prefill shares it
                                          # (x the decodes-only step; None: prefill fills the step)
    prefill_finish_slowdown: float | None = 12.0  # ... or this many x, for a step that does a short
                                          # whole prefill at once (None: always the bound)
    decode_slowdown_lone: float | None = None  # with the bound: a step with several decodes also keeps
                                          # within this many x a lone decode step (0: off; None:
                                          # 2 on packed weights, else off; StepCost.lone_slowdown)
    prefill_hold_below: int | None = None  # with the bound: a long prompt (more than 128 uncached
                                          # tokens) whose chunk beside streamed decodes would be
                                          # below this waits for them instead (0: off; None: 16 on
                                          # packed weights, else off; StepCost.hold_below) ...
    prefill_hold_steps: int = 32          # ... for at most this many steps in all
    prefill_stagger_tokens: int = 0       # with the bound: a step without streamed decodes completes
                                          # one streamed prefill; others stop this many short (0: off;
                                          # Scheduler.prefill_stagger_tokens)
    num_continuous_decode_steps: int = 8   # most greedy decode steps chained in one forward (1: off;
                                           # see Engine._decode_steps)
    quantization: str = "auto"       # weight format, see tokenmill.layers.quant.methods.QuantConfig
    quant_group_size: int = 128      # int4: inputs per scale group (a multiple of 32)
    quant_symmetric: bool = False    # int4: symmetric (scale only) instead of scale + min
    # speculative decoding (docs/speculative.md); None: off
    speculative_method: str | None = None
    num_speculative_tokens: int = 8      # most draft tokens per request per step (k)
    speculative_model: str | None = None  # drafter checkpoint directory (dflash)
    speculative_adaptive: bool = True    # shrink k per request when acceptance is poor
    # adaptive k cuts confidence-scored drafts (ngram, suffix) by their calibrated per-token
    # confidence (the draft gate); False: by the pooled acceptance of their match length
    speculative_gate: bool = True
    speculative_max_draft_tokens: int = 64  # most draft tokens in one step (compute-bound cap)
    prompt_lookup_min: int = 2           # ngram: shortest suffix to match
    prompt_lookup_max: int = 5           # ngram: longest suffix to match
    suffix_max_depth: int = 16           # suffix: longest indexed pattern + continuation
    suffix_cache_tokens: int = 20_000    # suffix: output tokens kept in the global index
    suffix_min_prob: float = 0.1         # suffix: stop a draft when its estimated probability drops below
    tensor_parallel_size: int = 1    # worker ranks, each holding a shard of weights and KV (1: in process)
    # Hybrid (linear-attention) models: memory for prefix-cache state snapshots, in slots of the
    # state pool beside the max_running_requests request slots (docs/prefix_cache.md); 0: none
    # (no prefix hits), None: DEFAULT_SNAPSHOTS_PER_REQUEST per request slot, at most
    # DEFAULT_SNAPSHOT_MEMORY_CAP_GIB. state_snapshot_slots, when given, is the count instead.
    state_snapshot_memory_gib: float | None = None
    state_snapshot_slots: int | None = None
    # ... and a snapshot every this many tokens of a long prefill (rounded up to whole pages; 0:
    # only the snapshots at request ends and branch points)
    state_snapshot_interval: int = 512
    tp_pin_cores: bool = False       # CPU tensor parallelism: pin rank r to one core (r mod cores)
    # how a mixture of experts splits over the ranks: "tp" (each expert's intermediate split) or
    # "ep" (expert parallelism: whole experts per rank); see models/tensor_parallel.py
    moe_parallel: str = "tp"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a model name or a path")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_tokens is not None:
            raise ValueError("give at most one of kv_cache_memory_gib and kv_cache_tokens")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens must hold at least one page ({self.page_size} tokens), "
                             f"got {self.kv_cache_tokens}")
        if self.max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {self.max_batch_tokens}")
        if self.max_running_requests <= 0:
            raise ValueError(f"max_running_requests must be positive, got {self.max_running_requests}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.session_retention_s < 0:
            raise ValueError(f"session_retention_s must be >= 0, got {self.session_retention_s}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.decode_slowdown is not None and not self.decode_slowdown > 1.0:
            raise ValueError(f"decode_slowdown must be > 1 (or None to turn the bound off), got {self.decode_slowdown}")
        if self.decode_slowdown_lone not in (None, 0) and not self.decode_slowdown_lone > 1.0:
            raise ValueError(f"decode_slowdown_lone must be > 1 (0: off, None: auto), got {self.decode_slowdown_lone}")
        if (self.prefill_hold_below is not None and self.prefill_hold_below < 0) or self.prefill_hold_steps < 0:
            raise ValueError(f"prefill_hold_below and prefill_hold_steps must be >= 0, got "
                             f"{self.prefill_hold_below}, {self.prefill_hold_steps}")
        if self.prefill_stagger_tokens < 0:
            raise ValueError(f"prefill_stagger_tokens must be >= 0, got {self.prefill_stagger_tokens}")
        if (self.prefill_finish_slowdown is not None and self.decode_slowdown is not None
                and not self.prefill_finish_slowdown >= self.decode_slowdown):
            raise ValueError(f"prefill_finish_slowdown must be >= decode_slowdown ({self.decode_slowdown}) "
                             f"(or None to keep every chunk within the bound), got {self.prefill_finish_slowdown}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}")
        if self.kv_cache_fp8_scales not in FP8_SCALE_SCHEMES:
            raise ValueError(f"kv_cache_fp8_scales must be one of {FP8_SCALE_SCHEMES}, got {self.kv_cache_fp8_scales!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quant_group_size <= 0 or self.quant_group_size % 32:
            raise ValueError(f"quant_group_size must be a positive multiple of 32, got {self.quant_group_size}")
        if not self.num_continuous_decode_steps >= 1:
            raise ValueError(f"num_continuous_decode_steps must be >= 1, got {self.num_continuous_decode_steps}")
        if self.speculative_method is not None:
            if self.speculative_method not in SPECULATIVE_METHODS:
                raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}, "
                                 f"got {self.speculative_method!r}")
            if self.speculative_method == "dflash" and not self.speculative_model:
                raise ValueError("speculative_method 'dflash' needs speculative_model (a drafter directory)")
        if self.speculative_model and self.speculative_method not in (None, "dflash"):
            raise ValueError(f"speculative_model is used by the dflash method only, not {self.speculative_method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 32], got {self.num_speculative_tokens!r}")
        if self.speculative_max_draft_tokens < 1:
            raise ValueError(f"speculative_max_draft_tokens must be >= 1, got {self.speculative_max_draft_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.suffix_max_depth < 2:
            raise ValueError(f"suffix_max_depth must be >= 2, got {self.suffix_max_depth}")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be >= 0, got {self.suffix_cache_tokens}")
        if not 0.0 <= self.suffix_min_prob < 1.0:
            raise ValueError(f"suffix_min_prob must be in [0, 1), got {self.suffix_min_prob}")
        if self.host_cache_memory_gib < 0:
            raise ValueError(f"host_cache_memory_gib must be >= 0, got {self.host_cache_memory_gib}")
        if not 0 <= self.host_cache_snapshot_share < 1:
            raise ValueError(f"host_cache_snapshot_share must be in [0, 1), got {self.host_cache_snapshot_share}")
        if self.host_cache_dtype not in HOST_CACHE_DTYPES:
            raise ValueError(f"host_cache_dtype must be one of {HOST_CACHE_DTYPES}, got {self.host_cache_dtype!r}")
        if not (self.cache_storage in ("", "none") or self.cache_storage.startswith(("file:", "redis://", "rediss://", "unix://"))):
            raise ValueError(f"cache_storage must be none, file:DIR or redis://HOST:PORT/DB, got {self.cache_storage!r}")
        if self.cache_storage == "file:":
            raise ValueError("cache_storage file: needs a folder, as in file:/var/cache/tokenmill")
        if self.cache_write_policy not in CACHE_WRITE_POLICIES:
            raise ValueError(f"cache_write_policy must be one of {CACHE_WRITE_POLICIES}, got {self.cache_write_policy!r}")
        if self.cache_write_min_hits < 1:
            raise ValueError(f"cache_write_min_hits must be >= 1, got {self.cache_write_min_hits}")
        if self.cache_prefetch_timeout_s < 0 or self.cache_storage_timeout_s <= 0:
            raise ValueError("cache_prefetch_timeout_s must be >= 0 and cache_storage_timeout_s > 0")
        if self.cache_prefetch_min_pages < 1:
            raise ValueError(f"cache_prefetch_min_pages must be >= 1, got {self.cache_prefetch_min_pages}")
        if not self.enable_prefix_cache and (self.host_cache_memory_gib > 0 or self.cache_storage not in ("", "none")):
            raise ValueError("the host and storage cache tiers need the prefix cache (drop --no-prefix-cache)")
        if self.state_snapshot_memory_gib is not None and self.state_snapshot_memory_gib < 0:
            raise ValueError(f"state_snapshot_memory_gib must be >= 0, got {self.state_snapshot_memory_gib}")
        if self.state_snapshot_slots is not None and self.state_snapshot_slots < 0:
            raise ValueError(f"state_snapshot_slots must be >= 0, got {self.state_snapshot_slots}")
        if self.state_snapshot_slots is not None and self.state_snapshot_memory_gib is not None:
            raise ValueError("give at most one of state_snapshot_memory_gib and state_snapshot_slots")
        if self.state_snapshot_interval < 0:
            raise ValueError(f"state_snapshot_interval must be >= 0, got {self.state_snapshot_interval}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.moe_parallel not in MOE_PARALLEL:
            raise ValueError(f"moe_parallel must be one of {MOE_PARALLEL}, got {self.moe_parallel!r}")
        if not self.device or not (self.device == "cpu" or self.device.startswith(("cuda", "mps", "xpu"))):
            raise ValueError(f"device must be cpu or a torch accelerator such as cuda or cuda:1, got {self.device!r}")


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str, packed_weights: bool = False) -> str:
    """The KV storage dtype (``float32``, ``bfloat16``, ``float16``, ``float8_e4m3fn``).

    ``auto`` is the model's dtype, except for a float32 model with standard attention layers
    whose weights are served packed (``packed_weights``: GGUF blocks, ``--quantization
    int8/int4``): float16. Its 10-bit mantissa adds far less error than 4- or 8-bit weights
    already carry (the default model, teacher-forced over 2,000 tokens: top-1 agreement 0.999
    with an fp32 pool, mean KL 9e-7), and it halves the bytes a decode step reads per token of
    context and the pool's memory per token (as llama.cpp's f16 default). Values beyond +-65504
    are stored saturated (``layers.attention.base.to_kv_dtype``)."""
    if kv_cache_dtype == "auto":
        return "float16" if packed_weights and model_dtype == "float32" else kv_storage_dtype(model_dtype)
    return kv_storage_dtype(kv_cache_dtype)


def default_kv_cache_tokens(max_model_len: int, bytes_per_token: int, available_bytes: int) -> int:
    """KV pool size when the user gave none: a few full-length sequences, bounded by memory."""
    budget = min(available_bytes * DEFAULT_KV_MEMORY_SHARE, DEFAULT_KV_MEMORY_CAP_GIB * 2**30)
    by_memory = int(budget // max(bytes_per_token, 1))
    return max(min(DEFAULT_KV_SESSIONS * max_model_len, by_memory), 1)
