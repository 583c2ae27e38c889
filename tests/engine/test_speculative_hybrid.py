"""Speculative decoding with hybrid models (Qwen3-Next, Ling): greedy output with n-gram, suffix
and scripted drafts equals greedy output without speculation, alone and in mixed batches with
chunked prefill, because each verify step leaves the linear layers' state slot exactly at the
last accepted token; prefix-cache snapshots taken while speculating hit exactly on a follow-up
turn; pages and state slots are all accounted for after."""
from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.spec.base import Draft, Proposer
from tokenmill.loader import load_model
from tokenmill.loader.tiny import build_tiny_checkpoint

ARCHS = ["Qwen3NextForCausalLM", "BailingHybridForCausalLM"]
VOCAB = 64
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    """Prompts with repeated runs (so prompt lookup finds matches) and one without."""
    rng = random.Random(seed)

    def run(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    a, b, c = run(12), run(5), run(20)
    return [a * 3, b * 4 + [7, 8, 9], c * 2, run(9)]


PROMPTS = _prompts(3)


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request, tmp_path_factory):
    """(LoadedModel, greedy outputs of PROMPTS without speculation) for a tiny hybrid model with
    a small vocabulary (tied where the class allows), so its greedy output repeats itself often
    enough for n-gram drafts to be accepted."""
    tie = {"tie_word_embeddings": True} if request.param == "Qwen3NextForCausalLM" else {}  # Ling never ties
    path = build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, seed=0,
                                 vocab_size=VOCAB, **tie)
    lm = load_model(str(path))
    ref = LLM(loaded=lm, kv_cache_tokens=4096, enable_prefix_cache=False, debug_checks=True)
    return lm, [list(o.token_ids) for o in ref.generate(PROMPTS, GREEDY)]


class CorruptedReplay(Proposer):
    """Drafts the known greedy continuation with some tokens replaced: accepted runs of every
    length, cut by rejections at every draft position."""

    name = "replay"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong: float, seed: int = 0) -> None:
        self.continuations = continuations
        self.wrong = wrong
        self.rng = random.Random(seed)

    def propose(self, requests, num_tokens):
        out = []
        for req, k in zip(requests, num_tokens):
            full = self.continuations[tuple(req.prompt_token_ids)] + [5] * 8
            done = req.num_output_tokens
            draft = list(full[done:done + k])
            for j in range(len(draft)):
                if self.rng.random() < self.wrong:
                    draft[j] = (draft[j] + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB
            out.append(Draft(draft))
        return out


def _spec_llm(lm, method: str, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    return LLM(loaded=lm, speculative_method=method, num_speculative_tokens=4, speculative_adaptive=False,
               debug_checks=True, **kw)


def _check_clean(llm: LLM) -> None:
    llm.engine.check_pages()
    stats = llm.engine.stats()
    assert stats.state_slots_free == stats.state_slots_total


def _accepts_and_rejects(llm: LLM, need_accepts: bool = True) -> None:
    st = llm.engine.spec.stats
    assert st.accepted < st.proposed, (st.accepted, st.proposed)
    assert st.accepted > 0 or not need_accepts, (st.accepted, st.proposed)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_drafts_mixed_batch_chunked_prefill_match(hybrid, method) -> None:
    """A mixed batch prefilled 7 tokens a step beside verify steps; the suffix proposer also sees
    the first round's outputs, so the second round's drafts are mostly right. (Tiny Ling's
    greedy output hardly repeats itself, so its n-gram drafts are nearly all rejected; the
    replay tests below accept and reject at every position on both models.)"""
    lm, want = hybrid
    llm = _spec_llm(lm, method, max_batch_tokens=7)
    assert [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)] == want
    again = [PROMPTS[2], PROMPTS[0], PROMPTS[3]]
    assert [list(o.token_ids) for o in llm.generate(again, GREEDY)] == [want[2], want[0], want[3]]
    _accepts_and_rejects(llm, need_accepts=method == "suffix" or type(lm.model).__name__ == "Qwen3NextForCausalLM")
    _check_clean(llm)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_partial_acceptance_alone_and_batched_match(hybrid, prefix_cache: bool) -> None:
    """Drafts right and wrong at every position: each request alone, then all together; with
    the prefix cache the verify steps stop at page boundaries, where snapshots are taken."""
    lm, want = hybrid
    llm = _spec_llm(lm, "ngram", enable_prefix_cache=prefix_cache)
    llm.engine.spec.proposer = CorruptedReplay({tuple(p): w for p, w in zip(PROMPTS, want)}, wrong=0.3)
    for p, w in zip(PROMPTS, want):
        assert list(llm.generate([p], GREEDY)[0].token_ids) == w
    assert [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)] == want
    st = llm.engine.spec.stats
    assert st.accepted > 20 and st.proposed - st.accepted > 20, (st.accepted, st.proposed)
    assert all(a > 0 for a in st.position_accepted), st.position_accepted
    _check_clean(llm)


def test_seeded_sampling_equals_no_speculation(hybrid) -> None:
    """Sampled rows (temperature, top-p, a seed each): model-free drafts consume the request's
    own random stream one draw per emitted token, so the tokens equal those without
    speculation, provided every rejection rolled the state back exactly."""
    lm, _ = hybrid
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True)
              for s in range(len(PROMPTS))]
    ref = LLM(loaded=lm, kv_cache_tokens=4096, enable_prefix_cache=False, debug_checks=True)
    want = [list(o.token_ids) for o in ref.generate(PROMPTS, params)]
    llm = _spec_llm(lm, "ngram", max_batch_tokens=7)
    llm.engine.spec.proposer = CorruptedReplay({tuple(p): w for p, w in zip(PROMPTS, want)}, wrong=0.3, seed=2)
    assert [list(o.token_ids) for o in llm.generate(PROMPTS, params)] == want
    _accepts_and_rejects(llm)
    _check_clean(llm)


def test_follow_up_turn_hits_snapshots_taken_while_speculating(hybrid) -> None:
    """Turn 2 (turn 1's prompt + output + more) hits the state snapshots turn 1 took during its
    verify steps, and its output equals a run with neither speculation nor caching."""
    lm, want = hybrid
    turn2 = [p + w + p[:6] for p, w in zip(PROMPTS, want)]
    ref = LLM(loaded=lm, kv_cache_tokens=4096, enable_prefix_cache=False, debug_checks=True)
    want2 = [list(o.token_ids) for o in ref.generate(turn2, GREEDY)]
    llm = _spec_llm(lm, "ngram")
    llm.engine.spec.proposer = CorruptedReplay({tuple(p): w for p, w in zip(PROMPTS + turn2, want + want2)},
                                               wrong=0.3, seed=1)
    assert [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)] == want
    outs = llm.generate(turn2, GREEDY)
    assert [list(o.token_ids) for o in outs] == want2
    # each hit reaches turn 1's last page boundary (its last token was never computed): the
    # tail snapshot taken there by a verify step whose accepted drafts ended on it
    ps = llm.engine.config.page_size
    assert [o.cached_tokens for o in outs] == [(len(p) + len(w) - 1) // ps * ps for p, w in zip(PROMPTS, want)]
    _check_clean(llm)


def test_dflash_drafts_with_preemption_match(hybrid, tmp_path) -> None:
    """A (random-weight) DFlash drafter reading the hybrid target's hidden states, alone then
    batched with forced preemption (which frees and refills both the pages and the slot)."""
    from tokenmill.models.dflash import DrafterConfig, init_drafter, save_drafter

    lm, want = hybrid
    a = lm.model.args
    cfg = DrafterConfig(target_hidden_size=a.hidden_size, vocab_size=a.vocab_size, target_layers=[0, a.num_layers - 1],
                        hidden_size=a.hidden_size, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                        block_size=5, context_window=16)
    save_drafter(init_drafter(cfg, seed=1), tmp_path)
    for kw in ({}, {"kv_cache_tokens": 160, "page_size": 8}):
        llm = _spec_llm(lm, "dflash", speculative_model=str(tmp_path), **kw)
        assert [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)] == want, kw
        assert llm.engine.spec.stats.proposed > 0
        _check_clean(llm)
    assert llm.engine.num_preemptions > 0
