"""Tensor parallelism (gloo on CPU): N worker ranks give the tokens and logprobs of one process.

Each engine with ``tensor_parallel_size > 1`` starts real worker processes; they are built once per
module (fixtures) and always closed, so no rank outlives the tests.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.contracts.errors import ReplicaFailedError
from tokenmill.loader import load_model
from tokenmill.loader.tiny import build_tiny_checkpoint
from tokenmill.models.tensor_parallel import check_tensor_parallel, shard_args

# a mixed batch: a long prompt (prefilled in chunks of max_batch_tokens), short ones that decode
# while it prefills, and one that shares its first 40 tokens with the long one
LONG = [(7 * i + 3) % 5000 + 10 for i in range(90)]
PROMPTS = [LONG, [5, 6, 7, 8, 9], [300, 301] * 6, LONG[:40] + [11, 12, 13]]
# decode_slowdown off: the step plan must not depend on measured step times
KW = dict(kv_cache_tokens=1024, page_size=16, max_batch_tokens=32, num_threads=1, decode_slowdown=None)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=20)


def _run(llm: LLM, prompts=PROMPTS, params=GREEDY):
    return llm.generate(prompts, params)


def _assert_same(ref, got, tol: float = 1e-5) -> None:
    for r, g in zip(ref, got):
        assert list(g.token_ids) == list(r.token_ids)
        for lr, lg in zip(r.logprobs, g.logprobs):
            assert lg.token_id == lr.token_id
            assert abs(lg.logprob - lr.logprob) <= tol
            top_r = dict(lr.top_logprobs)
            top_g = dict(lg.top_logprobs)
            shared = top_r.keys() & top_g.keys()
            assert len(shared) >= 18   # ties at the edge of the top 20 may swap
            for t in shared:
                assert abs(top_r[t] - top_g[t]) <= tol, (t, top_r[t], top_g[t])


def _assert_turn2_hits(one: LLM, two: LLM) -> None:
    """A session's second turn on the sharded engine hits the first turn's pages and decodes
    what one rank decodes."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    turn1 = two.generate([LONG[:70]], params)[0]
    turn2 = LONG[:70] + list(turn1.token_ids) + [9, 8, 7]
    second = two.generate([turn2], params)[0]
    assert second.cached_tokens >= 64
    assert list(second.token_ids) == list(one.generate([turn2], params)[0].token_ids)


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 query / 2 KV heads: at N=2 each rank holds 2 query heads and 1 KV head."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tp-gqa"), seed=1)


@pytest.fixture(scope="module")
def tiny_mqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 query heads / 1 KV head, vocab not divisible by 3: at N=3 the KV head is replicated and
    the last vocabulary slice is padded."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tp-mqa"), seed=2, hidden_size=96,
                                 intermediate_size=192, num_attention_heads=6, num_key_value_heads=1,
                                 vocab_size=49153)


@pytest.fixture(scope="module")
def gqa_pair(tiny_gqa: Path) -> Iterator[tuple[LLM, LLM]]:
    loaded = load_model(str(tiny_gqa))
    one = LLM(str(tiny_gqa), loaded=loaded, **KW)
    with LLM(str(tiny_gqa), loaded=loaded, tensor_parallel_size=2, **KW) as two:
        yield one, two


def test_tp2_greedy_and_logprobs_match_one_rank(gqa_pair) -> None:
    one, two = gqa_pair
    ref = _run(one)
    got = _run(two)
    _assert_same(ref, got)
    assert two.engine.scheduler.num_preemptions == one.engine.scheduler.num_preemptions


def test_tp2_prefix_cache_hit_on_turn_two(gqa_pair) -> None:
    one, two = gqa_pair
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    convo = LONG[:70]
    first = two.generate([convo], params)[0]
    turn2 = convo + list(first.token_ids) + [42, 43, 44]
    second = two.generate([turn2], params)[0]
    assert second.cached_tokens >= 64          # whole pages of turn 1 came from the cache
    ref = one.generate([turn2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert list(second.token_ids) == list(ref.token_ids)


def test_tp2_seeded_sampling_matches_one_rank(gqa_pair) -> None:
    one, two = gqa_pair
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True,
                             repetition_penalty=1.2) for s in (1, 2, 3, 4)]
    ref = one.generate(PROMPTS, params)
    got = two.generate(PROMPTS, params)
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in ref]


def test_tp2_structured_output_and_prompt_logprobs(gqa_pair) -> None:
    """Grammar masks (grammars advance in the scheduler process) and prompt logprobs (computed by
    rank 0, chunked by max_batch_tokens) give what one process gives."""
    import json
    import re

    from tokenmill.contracts.sampling import StructuredOutputs

    one, two = gqa_pair
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured=StructuredOutputs.json(schema))
              for i in range(2)] + [SamplingParams(max_tokens=20, temperature=0,
                                                   structured=StructuredOutputs("regex", r"[a-z]{2,5}-[0-9]{3}"))]
    prompts = PROMPTS[1:]
    ref = one.generate(prompts, params)
    got = two.generate(prompts, params)
    assert [o.text for o in got] == [o.text for o in ref]
    for o in got[:2]:
        assert set(json.loads(o.text)) == {"n"}
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", got[2].text)

    plp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    ref = one.generate(PROMPTS[:2], plp)
    got = two.generate(PROMPTS[:2], plp)
    for r, g, ids in zip(ref, got, PROMPTS[:2]):
        assert g.prompt_logprobs is not None and len(g.prompt_logprobs) == len(ids) and g.prompt_logprobs[0] is None
        for er, eg in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert eg.token_id == er.token_id and abs(eg.logprob - er.logprob) <= 1e-5
            assert [t.token_id for t in eg.top_logprobs] == [t.token_id for t in er.top_logprobs]


def test_tp2_preemption_matches_one_rank(tiny_gqa: Path) -> None:
    """A pool too small for the batch: requests are preempted and recomputed, tokens unchanged."""
    loaded = load_model(str(tiny_gqa))
    kw = dict(KW, kv_cache_tokens=160)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = [[i + 20] * 40 for i in range(4)]
    one = LLM(str(tiny_gqa), loaded=loaded, **kw)
    ref = one.generate(prompts, params)
    assert one.engine.num_preemptions > 0
    with LLM(str(tiny_gqa), loaded=loaded, tensor_parallel_size=2, **kw) as two:
        got = two.generate(prompts, params)
        assert two.engine.num_preemptions > 0
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in ref]


def test_tp3_replicated_kv_head_and_padded_vocab(tiny_mqa: Path) -> None:
    loaded = load_model(str(tiny_mqa))
    ref = _run(LLM(str(tiny_mqa), loaded=loaded, **KW))
    with LLM(str(tiny_mqa), loaded=loaded, tensor_parallel_size=3, **KW) as three:
        info = three.engine.runner.rank_info
        assert [(i["num_heads"], i["num_kv_heads"]) for i in info] == [(2, 1)] * 3
        got = _run(three)
    # the sharded matmuls and the all-reduce sum in another order than one rank: the largest
    # top-20 logprob difference is 7.6e-6 with the per-row decode bodies and 1.1e-5 with the
    # decode bodies (whose attention output is bit-identical for 2 and 6 heads per KV head)
    _assert_same(ref, got, tol=2e-5)


def test_default_model_tp3_greedy_matches_one_rank(smollm) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=20)
    kw = dict(kv_cache_tokens=512, num_threads=1)
    ref = LLM("smollm2-135m-instruct", loaded=smollm, **kw).generate(prompts, params)

    def tensors() -> dict[str, tuple[int, bool]]:
        return {k: (v.data_ptr(), v.is_shared()) for k, v in smollm.model.hf_state_dict().items()}

    before = tensors()
    views = [k for k in before if k.endswith("norm.weight")]   # the others may be per-call copies (oneDNN)
    assert len(views) == 2 * smollm.model.args.num_layers + 1
    with LLM("smollm2-135m-instruct", loaded=smollm, tensor_parallel_size=3, **kw) as three:
        got = three.generate(prompts, params)
    _assert_same(ref, got, tol=1e-4)   # 30 layers of fp32 all-reduce reordering
    # the ranks got copies: the loaded model's own storages did not move into shared memory (the
    # fused decode stack holds raw pointers into them), so a one-process engine still runs on it
    after = tensors()
    assert {k: after[k] for k in views} == {k: before[k] for k in views}
    assert not any(shared for _, shared in after.values())
    again = LLM("smollm2-135m-instruct", loaded=smollm, **kw).generate(prompts, params)
    assert [list(o.token_ids) for o in again] == [list(o.token_ids) for o in ref]


def test_kv_capacity_per_rank_matches_plan(tiny_gqa: Path) -> None:
    """The per-rank KV layout and the pool size agree with ``tokenmill plan`` at the same TP."""
    from tokenmill.engine.engine import Engine
    from tokenmill.engine.config import EngineConfig
    from tokenmill.plan.capacity import Deployment, kv_cache_spec
    from tokenmill.plan.models import load_model as plan_model

    loaded = load_model(str(tiny_gqa))
    gib = 0.001
    for tp in (1, 2):
        plan_spec = kv_cache_spec(plan_model(str(tiny_gqa)), Deployment(tp=tp, kv_dtype="fp32"))
        cfg = EngineConfig(model=str(tiny_gqa), kv_cache_memory_gib=gib, tensor_parallel_size=tp)
        eng = Engine.__new__(Engine)   # the sizing steps only: no ranks are started here
        eng.config, eng.loaded, eng.max_model_len = cfg, loaded, 1024
        eng._init_kv()
        assert eng.kv_spec == plan_spec
        assert eng.kv_capacity_tokens == plan_spec.capacity_tokens(gib * 2**30, cfg.page_size)
    one_rank = kv_cache_spec(plan_model(str(tiny_gqa)), Deployment(tp=1, kv_dtype="fp32"))
    assert plan_spec.bytes_per_token() * 2 == one_rank.bytes_per_token()


def test_bad_settings_are_refused_at_startup(tiny_gqa: Path, smollm) -> None:
    from tokenmill.engine.parallel import check_tensor_parallel_devices

    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        LLM("smollm2-135m-instruct", loaded=smollm, kv_cache_tokens=256, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(str(tiny_gqa), kv_cache_tokens=256, tensor_parallel_size=0)
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"needs {too_many} CUDA devices"):
        check_tensor_parallel_devices(too_many, "cuda")


def test_sharding_arithmetic() -> None:
    import dataclasses

    from tokenmill.models.base import ModelArgs

    a = ModelArgs(vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64)
    s = shard_args(a, 4)   # 2 KV heads over 4 ranks: one (replicated) KV head each; vocab 10 -> 3 x 4
    assert (s.num_heads, s.num_kv_heads, s.intermediate_size, s.vocab_size) == (1, 1, 3, 3)
    with pytest.raises(ValueError, match="does not divide the MLP intermediate size"):
        check_tensor_parallel(dataclasses.replace(a, num_heads=8, num_kv_heads=8), 8)
    with pytest.raises(ValueError, match="does not divide the model's 3 KV heads"):
        check_tensor_parallel(dataclasses.replace(a, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="is not a multiple of the model's 2 KV heads"):
        check_tensor_parallel(dataclasses.replace(a, num_heads=6, num_kv_heads=2, intermediate_size=6), 3)


def test_dead_rank_fails_the_step_quickly(tiny_gqa: Path) -> None:
    """SIGKILL one rank while a request decodes: the step raises within seconds, all ranks stop."""
    import os
    import signal
    import threading
    import time

    loaded = load_model(str(tiny_gqa))
    llm = LLM(str(tiny_gqa), loaded=loaded, tensor_parallel_size=2, **KW)
    try:
        procs = llm.engine.runner._procs
        killed: list[float] = []

        def kill() -> None:
            killed.append(time.monotonic())
            os.kill(procs[1].pid, signal.SIGKILL)

        threading.Timer(1.0, kill).start()
        with pytest.raises(ReplicaFailedError, match="rank 1 exited with code -9"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1000, ignore_eos=True))
        assert killed and time.monotonic() - killed[0] < 10
        assert all(not p.is_alive() for p in procs)     # the surviving rank was stopped too
        with pytest.raises(ReplicaFailedError, match="shut down"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5))
    finally:
        llm.close()


def test_tp2_deepseek_v3_mla_moe_matches_one_rank(tiny_dir) -> None:
    """MLA (latent replicated, heads split) + MoE (TP inside the experts, shared expert split)."""
    path = str(tiny_dir("DeepseekV3ForCausalLM"))
    loaded = load_model(path)
    one = LLM(path, loaded=loaded, **KW)
    ref = _run(one)
    with LLM(path, loaded=loaded, tensor_parallel_size=2, **KW) as two:
        info = two.engine.runner.rank_info
        assert [i["num_heads"] for i in info] == [loaded.model.args.num_heads // 2] * 2
        assert two.engine.kv_spec == loaded.model.kv_cache_spec()     # the full latent on every rank
        got = _run(two)
        _assert_turn2_hits(one, two)
    _assert_same(ref, got)


def test_tp2_fp8_static_scales_match_one_rank(tiny_gqa: Path) -> None:
    """Static fp8 KV scales under TP: every rank runs the start-up calibration prefill together
    (the all-reduces line up) and calibrates its own KV head, so the ranks' pools hold what one
    process's pool holds: greedy tokens equal one rank's with the same fp8 pool."""
    loaded = load_model(str(tiny_gqa))
    one = LLM(str(tiny_gqa), loaded=loaded, kv_cache_dtype="fp8_e4m3", **KW)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = one.generate(PROMPTS, params)
    with LLM(str(tiny_gqa), loaded=loaded, tensor_parallel_size=2, kv_cache_dtype="fp8_e4m3", **KW) as two:
        assert two.engine.kv_spec.fp8_scales == "static"
        got = two.generate(PROMPTS, params)
    assert [list(g.token_ids) for g in got] == [list(r.token_ids) for r in ref]


def test_tp2_int8_pages_match_one_rank(tiny_gqa: Path) -> None:
    """int8 KV pages under TP: a vector's scale is its own (token, KV head), so each rank stores
    the bytes one process stores for its head, and greedy tokens equal one rank's."""
    loaded = load_model(str(tiny_gqa))
    one = LLM(str(tiny_gqa), loaded=loaded, kv_cache_dtype="int8", **KW)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = one.generate(PROMPTS, params)
    with LLM(str(tiny_gqa), loaded=loaded, tensor_parallel_size=2, kv_cache_dtype="int8", **KW) as two:
        assert two.engine.kv_spec.is_int8 and two.engine.kv_spec.per_token_scales
        got = two.generate(PROMPTS, params)
    assert [list(g.token_ids) for g in got] == [list(r.token_ids) for r in ref]


def test_a_rank_failing_to_start_is_reported(tiny_dir) -> None:
    """The native backend has no MLA: each rank fails building its runner; the error says so."""
    path = str(tiny_dir("DeepseekV3ForCausalLM"))
    with pytest.raises(ReplicaFailedError, match=r"rank \d failed to start: .*(MLA|native|latent)"):
        LLM(path, tensor_parallel_size=2, attention_backend="native", **{k: v for k, v in KW.items()})


# ---------------------------------------------------------------------------------- expert parallelism
def test_ep2_deepseek_v3_matches_one_rank(tiny_dir) -> None:
    """moe_parallel='ep' at N=2: each rank holds 4 of the 8 routed experts whole (the router and the
    activations are replicated, tokens go to the owner's experts, partial sums all-reduced);
    greedy tokens identical to N=1, logprobs within 1e-5, a cache hit on turn 2."""
    path = str(tiny_dir("DeepseekV3ForCausalLM"))
    loaded = load_model(path)
    one = LLM(path, loaded=loaded, **KW)
    ref = _run(one)
    with LLM(path, loaded=loaded, tensor_parallel_size=2, moe_parallel="ep", **KW) as two:
        info = two.engine.runner.rank_info
        assert [tuple(i["experts"]) for i in info] == [(0, 4), (4, 8)]
        # each rank's routed-expert weights are what `tokenmill plan --tp 2 --ep 2` puts on a device
        from tokenmill.plan.capacity import Deployment
        from tokenmill.plan.hardware import get_hardware
        from tokenmill.plan.models import load_model as plan_model
        from tokenmill.plan.moe import MoEBoundsInput, moe_bounds

        a = loaded.model.args
        planned = moe_bounds(plan_model(path), get_hardware("h200"), Deployment(tp=2, ep=2, weight_bits={"experts": 32}),
                             MoEBoundsInput(tokens=1)).expert_weight_bytes
        assert [i["expert_weight_bytes"] for i in info] == [(a.num_layers - a.first_k_dense_replace) * planned] * 2
        got = _run(two)
        _assert_turn2_hits(one, two)
    _assert_same(ref, got)


def test_ep3_uneven_experts_match_one_rank_and_the_planner(tmp_path: Path) -> None:
    """8 experts over 3 ranks (3 + 3 + 2, the first E % N ranks hold one more); 6 query heads so
    N=3 divides them. Each rank's expert weight bytes are its experts' share of the planner's
    per-device figure for the same --ep (the planner itself refuses an uneven split)."""
    from tokenmill.plan.capacity import Deployment
    from tokenmill.plan.hardware import get_hardware
    from tokenmill.plan.models import load_model as plan_model
    from tokenmill.plan.moe import MoEBoundsInput, moe_bounds

    path = str(build_tiny_checkpoint(tmp_path, arch="DeepseekV3ForCausalLM", seed=3, num_attention_heads=6,
                                     num_key_value_heads=6, moe_intermediate_size=48))
    loaded = load_model(path)
    ref = _run(LLM(path, loaded=loaded, **KW))
    with LLM(path, loaded=loaded, tensor_parallel_size=3, moe_parallel="ep", **KW) as three:
        info = three.engine.runner.rank_info
        got = _run(three)
    assert [tuple(i["experts"]) for i in info] == [(0, 3), (3, 6), (6, 8)]
    _assert_same(ref, got)
    a = loaded.model.args
    moe_layers = a.num_layers - a.first_k_dense_replace
    spec = plan_model(path)
    for ep, per_rank in ((1, 8), (2, 4), (4, 2)):   # the planner's even splits of the same 8 experts
        b = moe_bounds(spec, get_hardware("h200"), Deployment(tp=ep, ep=ep, weight_bits={"experts": 32}),
                       MoEBoundsInput(tokens=1))
        assert b.local_experts == per_rank
        per_expert = b.expert_weight_bytes / per_rank
    assert [i["expert_weight_bytes"] for i in info] == [moe_layers * n * per_expert for n in (3, 3, 2)]


def test_expert_parallel_settings_are_checked() -> None:
    import dataclasses

    from tokenmill.engine.config import EngineConfig
    from tokenmill.models.deepseek_v3 import DeepseekV3Args
    from tokenmill.models.tensor_parallel import check_deepseek_tensor_parallel, expert_range

    import argparse

    from tokenmill.engine.cli import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["-tp", "2"])).moe_parallel == "tp"
    for flags in (["--moe-parallel", "ep"], ["--enable-expert-parallel"]):
        assert engine_config_from_args(parser.parse_args(["-tp", "2", *flags])).moe_parallel == "ep"
    assert [expert_range(8, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert [expert_range(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="moe_parallel must be one of"):
        EngineConfig(model="x", moe_parallel="dp")
    args = DeepseekV3Args(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          num_layers=2, num_heads=16, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=8, v_head_dim=8, rope_interleave=True, rms_norm_eps=1e-6,
                          rope_theta=1e4, max_position_embeddings=256, rope_scaling=None, n_routed_experts=8,
                          num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                          first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0)
    check_deepseek_tensor_parallel(args, 8, "ep")
    with pytest.raises(ValueError, match="needs at least 16 routed experts; the model has 8"):
        check_deepseek_tensor_parallel(args, 16, "ep")
    odd = dataclasses.replace(args, moe_intermediate_size=36)
    with pytest.raises(ValueError, match="shared experts' intermediate size 36"):
        check_deepseek_tensor_parallel(odd, 8, "ep")
    with pytest.raises(ValueError, match="does not divide moe_intermediate_size=36.*moe_parallel='ep'"):
        check_deepseek_tensor_parallel(odd, 8, "tp")
    check_deepseek_tensor_parallel(dataclasses.replace(odd, n_shared_experts=2), 8, "ep")   # 72 splits


def test_expert_parallel_refused_for_a_dense_model(tiny_gqa: Path) -> None:
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(str(tiny_gqa), kv_cache_tokens=256, tensor_parallel_size=2, moe_parallel="ep")


# ---------------------------------------------------------------------------------- speculative decoding
SPEC_PROMPTS = [p + p[:9] + p for p in ([(11 * i + 5) % 900 + 20 for i in range(30)], [401, 402, 403, 404] * 3,
                                        LONG[:50])]   # repeats give the model-free proposers matches


def test_tp2_speculative_decoding_matches_one_rank(tiny_gqa: Path) -> None:
    """Suffix speculation and a scripted proposer (70% right drafts: accepts and rejects in one
    step) at N=2: greedy tokens and logprobs of N=1 without speculation (suffix drafts learnt from
    the first run's outputs are accepted on the second); rank 0 verifies, every rank's K/V follows
    the scheduler's rollback. Seeded sampling with the same drafts equals N=1's."""
    import random

    from tokenmill.engine.spec.base import Draft, Proposer

    class Scripted(Proposer):
        name = "scripted"

        def __init__(self, continuations: dict, seed: int = 0) -> None:
            self.continuations, self.rng = continuations, random.Random(seed)

        def propose(self, requests, num_tokens):
            out = []
            for req, k in zip(requests, num_tokens):
                draft = self.continuations[tuple(req.prompt_token_ids)][req.num_output_tokens:req.num_output_tokens + k]
                out.append(Draft([t if self.rng.random() < 0.7 else (t + 1) % 49152 for t in draft]))
            return out

    loaded = load_model(str(tiny_gqa))
    kw = dict(KW, max_batch_tokens=64, speculative_method="suffix", speculative_adaptive=False)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=20)
    ref = _run(LLM(str(tiny_gqa), loaded=loaded, **KW), SPEC_PROMPTS, params)
    script = {tuple(p): list(o.token_ids) + [5] * 8 for p, o in zip(SPEC_PROMPTS, ref)}
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in (5, 6, 7)]
    one_spec = LLM(str(tiny_gqa), loaded=loaded, **kw)
    one_spec.engine.spec.proposer = Scripted(script, seed=3)
    ref_sampled = one_spec.generate(SPEC_PROMPTS, sampled)
    with LLM(str(tiny_gqa), loaded=loaded, tensor_parallel_size=2, **kw) as two:
        spec = two.engine.spec
        for run in range(3):
            if run == 2:
                spec.proposer = Scripted(script)
            before = (spec.stats.proposed, spec.stats.accepted)
            _assert_same(ref, _run(two, SPEC_PROMPTS, params))
            proposed, accepted = spec.stats.proposed - before[0], spec.stats.accepted - before[1]
            if run:
                assert accepted > 0 and proposed > 0, spec.proposer.name
        assert proposed > accepted              # the scripted run rejected drafts, rolled back
        spec.proposer = Scripted(script, seed=3)
        got_sampled = two.generate(SPEC_PROMPTS, sampled)
    assert [list(o.token_ids) for o in got_sampled] == [list(o.token_ids) for o in ref_sampled]


def test_tp2_dflash_drafter_reads_the_same_hidden_states(tiny_gqa: Path, tmp_path: Path) -> None:
    """DFlash at N=2: rank 0 returns the hidden states of the target layers (whole after the
    all-reduces) and the drafter proposes what it proposes at N=1; greedy tokens unchanged."""
    from tokenmill.models.dflash import DrafterConfig, init_drafter, save_drafter

    loaded = load_model(str(tiny_gqa))
    a = loaded.model.args
    cfg = DrafterConfig(target_hidden_size=a.hidden_size, vocab_size=a.vocab_size, target_layers=[0, a.num_layers - 1],
                        hidden_size=a.hidden_size, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                        head_dim=a.head_dim, intermediate_size=64, block_size=5, context_window=16)
    save_drafter(init_drafter(cfg, seed=1), tmp_path)
    kw = dict(KW, speculative_method="dflash", speculative_model=str(tmp_path), speculative_adaptive=False)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def recorded(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
        proposer, drafts = llm.engine.spec.proposer, []
        inner = proposer.propose

        def propose(requests, num_tokens):
            out = inner(requests, num_tokens)
            drafts.extend(list(d.token_ids) for d in out)
            return out

        proposer.propose = propose
        return [list(o.token_ids) for o in llm.generate(SPEC_PROMPTS, params)], drafts

    plain = [list(o.token_ids) for o in LLM(str(tiny_gqa), loaded=loaded, **KW).generate(SPEC_PROMPTS, params)]
    ref_tokens, ref_drafts = recorded(LLM(str(tiny_gqa), loaded=loaded, **kw))
    with LLM(str(tiny_gqa), loaded=loaded, tensor_parallel_size=2, **kw) as two:
        tokens, drafts = recorded(two)
        assert two.engine.stats().spec.proposed > 0
    assert tokens == ref_tokens == plain
    assert sum(map(len, drafts)) > 0 and drafts == ref_drafts


# ---------------------------------------------------------------------------------- KV tiers
def test_tp2_kv_tiers_host_and_file_hits_match_one_rank(tiny_gqa: Path, tmp_path: Path) -> None:
    """L2 and the file L3 at N=2: the scheduler decides, every rank demotes / reloads its own
    shard (its own host slots, its own L3 namespace). Turn 2 of sessions that fell out of a small
    L1 comes back from host memory; after a restart turn 1 comes back from the files; greedy
    tokens equal N=1 without any cache."""
    import random

    P, K = 8, 4
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(6 * P)] for _ in range(4)]
    params = SamplingParams(max_tokens=K, temperature=0, ignore_eos=True)
    loaded = load_model(str(tiny_gqa))
    kw = dict(page_size=P, kv_cache_tokens=20 * P, max_batch_tokens=64, num_threads=1, decode_slowdown=None,
              session_retention_s=0.0, debug_checks=True)
    store = f"file:{tmp_path / 'kv'}"

    def turns(llm: LLM, n: int) -> list[list]:
        hist, outs = [list(p) for p in prompts], [[] for _ in prompts]
        for t in range(n):
            for i in range(len(hist)):
                o = llm.generate([hist[i]], params, session_ids=[f"s{i}"])[0]
                outs[i].append(o)
                hist[i] = hist[i] + list(o.token_ids) + [1000 + 7 * i + t, 2000 + i, 3000 + t]
        return outs

    base = turns(LLM(str(tiny_gqa), loaded=loaded, **dict(kw, enable_prefix_cache=False)), 2)
    with LLM(str(tiny_gqa), loaded=loaded, tensor_parallel_size=2, host_cache_memory_gib=0.001,
             cache_storage=store, **kw) as two:
        got = turns(two, 2)
        assert [[list(o.token_ids) for o in s] for s in got] == [[list(o.token_ids) for o in s] for s in base]
        from_l2 = sum(o.cached_tokens_by_tier["l2"] for s in got for o in s)
        assert from_l2 > 0
        assert two.engine.tiers.drain()
        st = two.engine.stats().tiers
        assert st.hit_tokens["l2"] == from_l2 and st.pages_written["l2"] > 0
        assert st.pages_written["l3"] >= 4 * 5           # every session's computed pages, each rank's shard
    shards = sorted((tmp_path / "kv").iterdir())
    assert len(shards) == 2 and all(sum(1 for _ in d.glob("*/*.kvpage")) >= 20 for d in shards)
    with LLM(str(tiny_gqa), loaded=loaded, tensor_parallel_size=2, cache_storage=store, **kw) as again:
        got = turns(again, 1)
        for s, b, p in zip(got, base, prompts):
            assert list(s[0].token_ids) == list(b[0].token_ids)
            assert s[0].cached_tokens_by_tier["l3"] == (len(p) - 1) // P * P
        assert again.engine.stats().tiers.bytes_read["l3"] > 0
        assert again.engine.flush_storage_cache() >= 20      # every rank's namespace emptied
    assert all(not any(d.glob("*/*.kvpage")) for d in shards)


def test_tp2_mla_latent_is_stored_once_in_l3(tiny_dir, tmp_path: Path) -> None:
    """DeepSeek-V3 at N=2: both ranks hold the whole latent, so rank 0 alone writes it (one
    namespace in the store); after a restart both ranks load it and the tokens are N=1's."""
    path = str(tiny_dir("DeepseekV3ForCausalLM"))
    loaded = load_model(path)
    P = 8
    prompts = [LONG[:41], [(13 * i + 7) % 3000 + 40 for i in range(33)]]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    kw = dict(page_size=P, kv_cache_tokens=256, num_threads=1, decode_slowdown=None)
    ref = LLM(path, loaded=loaded, enable_prefix_cache=False, **kw).generate(prompts, params)
    store = f"file:{tmp_path / 'kv'}"
    with LLM(path, loaded=loaded, tensor_parallel_size=2, cache_storage=store, **kw) as first:
        first.generate(prompts, params)
        assert first.engine.tiers.drain()
        assert first.engine.stats().tiers.pages_written["l3"] >= 5 + 4
    assert len(list((tmp_path / "kv").iterdir())) == 1
    with LLM(path, loaded=loaded, tensor_parallel_size=2, cache_storage=store, **kw) as again:
        got = again.generate(prompts, params)
    for r, g, p in zip(ref, got, prompts):
        assert list(g.token_ids) == list(r.token_ids)
        assert g.cached_tokens_by_tier["l3"] == (len(p) - 1) // P * P
