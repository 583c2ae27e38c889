"""``tokenmill generate``: run one prompt through the offline engine and print the completion."""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from tokenmill.engine.config import (ATTENTION_BACKENDS, CACHE_WRITE_POLICIES, FP8_SCALE_SCHEMES, HOST_CACHE_DTYPES,
                                     KV_CACHE_DTYPES, LINEAR_BACKENDS, QUANTIZATIONS, SPECULATIVE_METHODS, EngineConfig)
from tokenmill.loader.resolve import DEFAULT_MODEL


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags mirroring :class:`EngineConfig` (shared with ``tokenmill serve``)."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model name, HF directory or .gguf file (default: {DEFAULT_MODEL})")
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", dest="kv_cache_memory_gib", type=float, default=None,
                    metavar="GIB", help="KV cache size in GiB")
    kv.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache size in tokens")
    g.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help="token budget of one step (decodes + prefill chunks)")
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument("--max-model-len", type=int, default=None, help="lower the context length")
    g.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_false",
                   help="disable the radix prefix cache")
    g.add_argument("--session-retention-s", "--session-retention", dest="session_retention_s",
                   type=float,
                   default=d.session_retention_s, help="seconds a finished session's KV is favoured")
    g.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16"])
    g.add_argument("--debug-checks", action="store_true", help="check page accounting when idle")
    g.add_argument("--threads", dest="num_threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    g.add_argument("--decode-slowdown", type=float, default=d.decode_slowdown,
                   help="while decodes run, prefill chunks get only the tokens that keep a step within "
                        "this many times the decodes-only step time (learned online); 0 turns it off")
    g.add_argument("--prefill-finish-slowdown", type=float, default=d.prefill_finish_slowdown,
                   help="a prefill that keeps the step within this many times the "
                        "decodes-only step time whole is prefilled at once instead of in bounded chunks (an agent "
                        "turn after a cache hit); 0: every chunk keeps --decode-slowdown")
    g.add_argument("--decode-slowdown-lone", type=float, default=d.decode_slowdown_lone,
                   help="with --decode-slowdown: a step that carries several decodes also keeps within this many "
                        "times a lone decode step (one stream's TPOT alone), so prefill waits while the decodes "
                        "alone come near it; 0: off; default: 2 on packed int4/int8 weights, off at fp32")
    g.add_argument("--prefill-hold-below", type=int, default=d.prefill_hold_below,
                   help="with --decode-slowdown: a long prompt (more than 128 uncached tokens) whose bounded chunk "
                        "beside streamed decodes would be smaller than this waits for them instead (short answers "
                        "end in a few steps; a token or two of prefill costs a decode much of its step); 0: off; "
                        "default: 16 on packed int4/int8 weights, off at fp32")
    g.add_argument("--prefill-hold-steps", type=int, default=d.prefill_hold_steps,
                   help="with --prefill-hold-below: the most steps one prompt waits in all, so that long answers "
                        "do not starve it")
    g.add_argument("--prefill-stagger-tokens", type=int, default=d.prefill_stagger_tokens,
                   help="with --decode-slowdown: a step without streamed decodes completes one streamed prompt; "
                        "another that would complete there stops this many tokens short and finishes beside the "
                        "first one's decodes, so that they do not all decode together; 0 turns it off")
    g.add_argument("--num-continuous-decode-steps", type=int, default=d.num_continuous_decode_steps,
                   help="greedy decode steps run back to back in one native call while every running request "
                        "decodes greedily and nothing waits (fewer trips through Python per token; tokens "
                        "stream in bursts of this many); 1 turns it off")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="worker ranks sharing the model (torch.distributed: gloo on cpu, NCCL on cuda)")
    g.add_argument("--tp-pin-cores", action="store_true",
                   help="CPU tensor parallelism: pin each rank to one core")
    g.add_argument("--moe-parallel", default=d.moe_parallel, choices=["tp", "ep"],
                   help="how MoE experts split over the tensor-parallel ranks: tp = every expert's intermediate "
                        "dimension split (default), ep = expert parallelism, whole experts per rank")
    g.add_argument("--enable-expert-parallel", dest="moe_parallel", action="store_const", const="ep",
                   help="the same as --moe-parallel ep")
    g.add_argument("--device", default=d.device, help="torch device of the model runner (default: cpu)")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="KV pool storage: auto (the model's dtype; fp16 for an fp32 model served from packed weights, "
                        "such as the default GGUF), fp8_e4m3 (float8_e4m3fn with fp32 scales, "
                        "see --kv-cache-fp8-scales), int8 (per-vector fp32 scales; integer decode kernels on AVX-512 "
                        "VNNI CPUs), bf16, fp16, fp32; the long torch names are aliases")
    g.add_argument("--kv-cache-fp8-scales", default=d.kv_cache_fp8_scales, choices=FP8_SCALE_SCHEMES,
                   help="fp8 KV scales: static = one per layer and KV head, calibrated by a short prefill at "
                        "start-up (nothing stored per token: 4x the tokens of fp32); token = one per token and "
                        "head, computed on write (a little more accurate, 4 B per vector)")
    g.add_argument("--quantization", default=d.quantization, choices=QUANTIZATIONS,
                   help="weight format: auto = a GGUF file in its own block types (Q4_1 for the default "
                        "model), an HF checkpoint unquantized; none = everything in --dtype (the oracle); "
                        "int8 (per channel) / int4 (group-wise) = quantize at load")
    g.add_argument("--quant-group-size", type=int, default=d.quant_group_size,
                   help="int4: inputs per scale group, a multiple of 32 (default %(default)s)")
    g.add_argument("--quant-symmetric", action="store_true",
                   help="int4: symmetric groups (scale only, zero exact) instead of scale + min")
    g.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS,
                   help="paged-attention implementation (auto: the fastest that supports the model here)")
    g.add_argument("--linear-backend", default=d.linear_backend, choices=LINEAR_BACKENDS,
                   help="fp32 weight matmuls: auto = oneDNN on weights prepacked at start-up when on CPU, "
                        "torch = F.linear, onednn = oneDNN or refuse")
    g.add_argument("--fused-decode", action=argparse.BooleanOptionalAction, default=d.fused_decode,
                   help="run decode steps of a few rows as one native call through every layer (Llama-family "
                        "models with packed int4/int8 or fp32 weights; fp32 keeps a plain copy of the layer "
                        "weights beside oneDNN's, e.g. +425 MB for the default model; default: %(default)s)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=d.compile,
                   help="fuse the elementwise work around the matmuls with torch.compile for steps of 64+ "
                        "tokens (compiled at start-up, cached in TORCHINDUCTOR_CACHE_DIR, default "
                        "~/.cache/tokenmill/inductor; default: %(default)s)")
    g.add_argument("--state-snapshot-memory", dest="state_snapshot_memory_gib", type=float,
                   default=d.state_snapshot_memory_gib, metavar="GIB",
                   help="hybrid (linear-attention) models: state-pool memory for prefix-cache state "
                        "snapshots, beside one state slot per running request (default: 4 snapshots per "
                        "request slot, at most 1 GiB; 0: no prefix hits)")
    g.add_argument("--state-snapshot-slots", type=int, default=d.state_snapshot_slots, metavar="N",
                   help="hybrid models: the snapshot budget as a count of slots (instead of "
                        "--state-snapshot-memory)")
    g.add_argument("--state-snapshot-interval", type=int, default=d.state_snapshot_interval, metavar="TOKENS",
                   help="hybrid models: also snapshot the state every TOKENS tokens of a long prefill, a "
                        "rounded up to whole pages (default %(default)s; 0: only at request ends and branch points)")
    add_speculative_arguments(parser)
    add_cache_tier_arguments(parser)


SPECULATIVE_FIELDS = ("speculative_method", "num_speculative_tokens", "speculative_model",
                      "speculative_adaptive", "speculative_gate", "speculative_max_draft_tokens", "prompt_lookup_min",
                      "prompt_lookup_max", "suffix_max_depth", "suffix_cache_tokens", "suffix_min_prob")


def speculative_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the speculative flags."""
    return {name: getattr(args, name) for name in SPECULATIVE_FIELDS}


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of speculative decoding (shared by generate and serve)."""
    d = EngineConfig()
    sp = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    sp.add_argument("--speculative-method", default=None, choices=SPECULATIVE_METHODS,
                    help="draft tokens with n-gram prompt lookup, suffix speculation, or a DFlash drafter "
                         "(default: off)")
    sp.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                    help="most draft tokens per request per step")
    sp.add_argument("--speculative-model", default=None, metavar="PATH",
                    help="drafter directory for --speculative-method dflash (from tokenmill train-drafter)")
    sp.add_argument("--no-speculative-adaptive", dest="speculative_adaptive", action="store_false",
                    help="always draft the full number of tokens (no per-request adaptive k)")
    sp.add_argument("--no-speculative-gate", dest="speculative_gate", action="store_false",
                    help="ngram/suffix: cut drafts by the acceptance of their match length instead of the "
                         "draft gate's calibrated per-token confidence")
    sp.add_argument("--speculative-max-draft-tokens", type=int, default=d.speculative_max_draft_tokens,
                    help="most draft tokens in one step over all requests (compute-bound cap)")
    sp.add_argument("--prompt-lookup-min", type=int, default=d.prompt_lookup_min, help="ngram: shortest match")
    sp.add_argument("--prompt-lookup-max", type=int, default=d.prompt_lookup_max, help="ngram: longest match")
    sp.add_argument("--suffix-max-depth", type=int, default=d.suffix_max_depth,
                    help="suffix: longest indexed window (pattern + continuation)")
    sp.add_argument("--suffix-cache-tokens", type=int, default=d.suffix_cache_tokens,
                    help="suffix: output tokens kept in the global index of recent requests")
    sp.add_argument("--suffix-min-prob", type=float, default=d.suffix_min_prob,
                    help="suffix: stop a draft when its estimated probability drops below this")


def add_cache_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the L2 host and L3 storage cache tiers (docs/kv-tiers.md)."""
    d = EngineConfig()
    g = parser.add_argument_group("cache tiers")
    g.add_argument("--host-cache-memory", dest="host_cache_memory_gib", type=float,
                   default=d.host_cache_memory_gib, metavar="GIB",
                   help="L2: host-memory page pool that L1 evictions demote to (default: 0, off)")
    g.add_argument("--host-cache-dtype", default=d.host_cache_dtype, choices=HOST_CACHE_DTYPES,
                   help="storage dtype of L2 pages; bfloat16 halves a float32 pool's host memory "
                        "at bf16 precision on reload (default: auto, the KV pool's dtype)")
    g.add_argument("--host-cache-snapshot-share", type=float, default=d.host_cache_snapshot_share,
                   metavar="FRACTION",
                   help="hybrid models: share of --host-cache-memory that holds state snapshots, the rest "
                        "holds pages (default: 0.25; 0: snapshots skip L2)")
    g.add_argument("--cache-storage", default=d.cache_storage, metavar="{none,file:DIR,redis://HOST:PORT/DB}",
                   help="L3: shared page store keyed by chained page hashes (default: none)")
    g.add_argument("--cache-write-policy", default=d.cache_write_policy, choices=CACHE_WRITE_POLICIES,
                   help="when pages go to L3 (default: write_through)")
    g.add_argument("--cache-write-min-hits", type=int, default=d.cache_write_min_hits,
                   help="write_through_selective: hits before a page is written (default: 2)")
    g.add_argument("--cache-prefetch-timeout", dest="cache_prefetch_timeout_s", type=float,
                   default=d.cache_prefetch_timeout_s, metavar="S",
                   help="longest wait for L3 pages after a request arrives; the rest is computed")
    g.add_argument("--cache-prefetch-min-pages", type=int, default=d.cache_prefetch_min_pages,
                   help="shortest run of L3 pages worth fetching (default: 1)")
    g.add_argument("--cache-storage-timeout", dest="cache_storage_timeout_s", type=float,
                   default=d.cache_storage_timeout_s, metavar="S",
                   help="socket timeout of one storage call (default: 1)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if not values.get("decode_slowdown", 1):   # 0 on the command line: no bound
        values["decode_slowdown"] = None
    if not values.get("prefill_finish_slowdown", 1):
        values["prefill_finish_slowdown"] = None
    return EngineConfig(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message in the model's chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from tokenmill.engine.llm import LLM
    from tokenmill.contracts.sampling import SamplingParams
    from tokenmill.contracts.errors import ModelLoadError
    from tokenmill.contracts.errors import ReplicaFailedError

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
        config = engine_config_from_args(args)
        with LLM(loaded=None, **{f.name: getattr(config, f.name) for f in fields(EngineConfig)}) as llm:
            if args.chat:
                messages = ([{"role": "system", "content": args.system}] if args.system else [])
                messages.append({"role": "user", "content": args.prompt})
                out = llm.chat(messages, params)[0]
            else:
                out = llm.generate([args.prompt], params)[0]
    except (ValueError, ModelLoadError, ReplicaFailedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.text)
    return 0
