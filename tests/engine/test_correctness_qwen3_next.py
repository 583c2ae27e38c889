"""Qwen3-Next (a hybrid model: Gated DeltaNet state slots + paged attention) through the engine:
greedy equals HF, and batching, chunked prefill, preemption and aborts never change it; the
state pool's size and bytes are what the planner computes."""
from __future__ import annotations

import logging

import pytest

from engine_oracle import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.loader import build_hf_reference, load_model
from tokenmill.loader.tiny import build_tiny_checkpoint
from tokenmill.plan.capacity import Deployment, kv_bytes
from tokenmill.plan.models import load_model as plan_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([37, 3, 18, 64, 7, 29], seed=5)
# "moe": 3 GDN layers then attention, dense layer 0 then MoE + shared expert;
# "dense": attention first and last, MoE off through mlp_only_layers, different head counts
CONFIGS = {
    "moe": {},
    "dense": dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                  mlp_only_layers=[0, 1, 2, 3], linear_num_key_heads=4, linear_value_head_dim=8,
                  partial_rotary_factor=0.5, attention_bias=True),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (LoadedModel, HF reference, checkpoint dir, HF greedy tokens of PROMPTS)."""
    out = {}
    for name, over in CONFIGS.items():
        path = build_tiny_checkpoint(tmp_path_factory.mktemp(name), "Qwen3NextForCausalLM", seed=7, **over)
        lm = load_model(str(path))
        ref = build_hf_reference(lm)
        out[name] = (lm, ref, path, [hf_greedy(ref, p, GREEDY.max_tokens) for p in PROMPTS])
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_length_batch_matches_hf(models, name) -> None:
    lm, _, _, want = models[name]
    llm = LLM(loaded=lm, kv_cache_tokens=2048, debug_checks=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    llm.engine.check_pages()


@pytest.mark.parametrize("name, snapshots", [("moe", None), ("dense", None), ("moe", 0)])
def test_chunked_prefill_of_seven_matches_hf(models, name, snapshots) -> None:
    """Prompts prefilled 7 tokens a step, each chunk continuing from the slot's state, beside
    decodes; then the same prompts again: with state snapshots (the default) they hit the prefix
    cache, without (``state_snapshot_memory_gib=0``) their cached pages give no hit; both exact."""
    lm, _, _, want = models[name]
    llm = LLM(loaded=lm, kv_cache_tokens=2048, max_batch_tokens=7, debug_checks=True,
              state_snapshot_memory_gib=snapshots)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    again = llm.generate([PROMPTS[3], PROMPTS[0]], GREEDY)
    assert [o.token_ids for o in again] == [want[3], want[0]]
    hits = [o.cached_tokens for o in again]
    if snapshots == 0:
        assert hits == [0, 0]
    else:   # hits end at snapshots, on page boundaries
        assert sum(hits) > 0 and all(h % 16 == 0 for h in hits), hits


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_forced_preemption_keeps_outputs(models, prefix_cache: bool) -> None:
    lm, _, _, want = models["moe"]
    # 5 pages of 16 tokens: the longest request alone needs all 5, so requests must be preempted
    llm = LLM(loaded=lm, kv_cache_tokens=80, enable_prefix_cache=prefix_cache, debug_checks=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.stats()
    assert stats.state_slots_free == stats.state_slots_total


def test_few_state_slots_limit_the_batch_and_aborts_free_them(models) -> None:
    """Two state slots for six requests: at most two run at once; aborting running and waiting
    requests frees their slots and pages, and the rest still match HF."""
    lm, _, _, want = models["moe"]
    engine = Engine(EngineConfig(model="q3n", kv_cache_tokens=2048, max_running_requests=2, debug_checks=True),
                    loaded=lm)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
        stats = engine.stats()
        assert stats.num_running <= 2 and stats.state_slots_free == 2 - stats.num_running
        engine.check_pages()
        steps += 1
        if steps == 3:   # one running, one waiting
            running = [r.request_id for r in engine.scheduler.running]
            engine.abort_request(running[0])
            engine.abort_request("r5")
            engine.check_pages()
            assert engine.stats().state_slots_free == 2 - len(engine.scheduler.running)
    stats = engine.stats()
    assert stats.state_slots_total == 2 and stats.state_slots_free == 2 and stats.state_pool_usage == 0.0
    assert stats.kv_pages_free + stats.kv_pages_cached == stats.kv_pages_total
    aborted = {running[0], "r5"}
    for i in range(len(PROMPTS)):
        rid = f"r{i}"
        if rid in aborted:
            assert len(done.get(rid, [])) < GREEDY.max_tokens
        else:
            assert done[rid] == want[i]


def test_state_pool_size_and_bytes_equal_the_planner(models, caplog) -> None:
    lm, _, path, _ = models["moe"]
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.engine"):
        engine = Engine(EngineConfig(model="q3n", kv_cache_tokens=1024, max_running_requests=5,
                                     state_snapshot_memory_gib=4 * 16896 / 2**30), loaded=lm)
    states = engine.runner.states
    per_slot = sum(t[0].nbytes for t in states.rec + states.conv if t is not None)
    planned = kv_bytes(plan_model(str(path)), Deployment()).state_per_request_per_device
    assert per_slot == planned == lm.model.kv_cache_spec().bytes_per_request() == 3 * (4 * 16 * 16 + 128 * 3) * 4
    assert states.num_slots == 5 + 4 and engine.kv.slots.num_snapshot_slots == 4
    stats = engine.stats()
    assert (stats.state_slots_total, stats.state_snapshot_slots, stats.state_bytes_per_request) == (5, 4, planned)
    # linear layers get no KV pages: the attention backend allocated None for them
    assert [c is None for c in engine.runner.kv_caches] == [True, True, True, False]
    text = caplog.text
    assert "state pool" in text and "5 request slots" in text and "4 snapshot slots" in text
    assert "KV cache" in text and "= 1024 tokens" in text


@pytest.mark.parametrize("options, flag", [
    (dict(tensor_parallel_size=2), "--tensor-parallel-size"),
])
def test_unsupported_features_refused_at_start_naming_the_flag(models, options, flag) -> None:
    lm = models["moe"][0]
    with pytest.raises(ValueError, match=flag):
        Engine(EngineConfig(model="q3n", kv_cache_tokens=256, **options), loaded=lm)


def test_fp8_kv_pool_holds_only_attention_layers(models) -> None:
    """fp8 pages for the attention layers, nothing for the linear ones (their state stays fp32 in
    the state pool); the batch runs and nearly always agrees with fp32's greedy tokens."""
    from tokenmill.layers.attention import FP8Pages

    lm, _, _, want = models["moe"]
    llm = LLM(loaded=lm, kv_cache_tokens=2048, kv_cache_dtype="fp8_e4m3", debug_checks=True)
    caches = llm.engine.runner.kv_caches
    assert [type(c).__name__ for c in caches] == ["NoneType"] * 3 + [FP8Pages.__name__]
    assert llm.engine.stats().kv_bytes_per_token == 2 * 2 * 16   # fp8 K/V, 1 layer; static scales (calibrated)
    assert not caches[3].per_token and (caches[3].scale != 1).all()
    outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    agree = sum(a == b for o, w in zip(outs, want) for a, b in zip(o, w))
    assert agree >= 0.75 * len(PROMPTS) * GREEDY.max_tokens, (outs, want)


def test_int8_kv_pool_holds_only_attention_layers(models) -> None:
    """int8 pages (per-vector scales) for the attention layers of a hybrid model; the linear
    layers' state stays fp32; greedy tokens nearly always agree with fp32's."""
    from tokenmill.layers.attention import FP8Pages

    lm, _, _, want = models["moe"]
    llm = LLM(loaded=lm, kv_cache_tokens=2048, kv_cache_dtype="int8", debug_checks=True)
    caches = llm.engine.runner.kv_caches
    assert [type(c).__name__ for c in caches] == ["NoneType"] * 3 + [FP8Pages.__name__]
    assert caches[3].is_int8 and caches[3].per_token
    assert llm.engine.stats().kv_bytes_per_token == 2 * 2 * 16 + 2 * 2 * 4   # int8 K/V + a scale per vector
    outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    agree = sum(a == b for o, w in zip(outs, want) for a, b in zip(o, w))
    assert agree >= 0.75 * len(PROMPTS) * GREEDY.max_tokens, (outs, want)
