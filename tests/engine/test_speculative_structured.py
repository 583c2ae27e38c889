"""Constrained (grammar) requests speculate losslessly: drafts are cut at the first token the
grammar rejects, every draft row is masked by the grammar advanced through the drafts before it,
and the output is the one of constrained decoding without speculation."""
from __future__ import annotations

import json
import random
import re
from collections import Counter

import jsonschema
import pytest
import torch

from engine_oracle import random_prompts
from spec_drafters import BadSampledDrafter
from tokenmill import LLM, SamplingParams
from tokenmill.contracts.sampling import StructuredOutputs
from tokenmill.engine.spec.base import Draft, Proposer

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["kind", "n", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{2,4}( [a-z]{1,5})?"


def _allowed(state, vocab: int) -> list[int]:
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(1, vocab)
    state.fill_mask(mask, 0)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, mask)
    return torch.nonzero(logits[0] == 0).flatten().tolist()


class GrammarAwareDrafter(Proposer):
    """Drafts the known continuation, but replaces a share of the drafts by a random token the
    grammar allows at that point (the target mostly rejects these, so draft rows past the first
    are verified under masks that differ from row 0's) and a share by a token the grammar
    forbids (the engine must cut the draft there)."""

    name = "grammar-aware"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int, *, wrong: float,
                 forbidden: float, seed: int = 0) -> None:
        self.continuations = continuations
        self.vocab = vocab
        self.wrong = wrong
        self.forbidden = forbidden
        self.rng = random.Random(seed)

    def propose(self, requests, num_tokens):
        out = []
        for req, k in zip(requests, num_tokens):
            full = self.continuations[tuple(req.prompt_token_ids)]
            done = req.num_output_tokens
            draft = list(full[done:done + k])
            g = req.grammar
            if g is None:   # an unconstrained request: some drafts wrong
                out.append(Draft([t if self.rng.random() > self.wrong else self.rng.randrange(self.vocab)
                                  for t in draft]))
                continue
            walked = 0
            for j in range(len(draft)):
                if g.is_terminated:
                    break
                x = self.rng.random()
                if x < self.forbidden:
                    allowed = set(_allowed(g, self.vocab))
                    draft[j] = next(t for t in iter(lambda: self.rng.randrange(self.vocab), None) if t not in allowed)
                elif x < self.forbidden + self.wrong:
                    draft[j] = self.rng.choice(_allowed(g, self.vocab))
                if not g.accept(draft[j]):
                    break
                walked += 1
            g.rollback(walked)
            out.append(Draft(draft))
        return out


def _llm(lm, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("debug_checks", True)
    kw.setdefault("decode_slowdown", None)   # the step plan (and so the draft counts) must not depend on timing
    return LLM(loaded=lm, **kw)


def _with_drafter(lm, prompts, params, *, wrong: float, forbidden: float, **kw) -> tuple[LLM, list]:
    ref = _llm(lm, enable_prefix_cache=False).generate(prompts, params)
    llm = _llm(lm, speculative_method="ngram", speculative_adaptive=False, num_speculative_tokens=5, **kw)
    llm.engine.spec.proposer = GrammarAwareDrafter(
        {tuple(p): list(o.token_ids) + [5] * 8 for p, o in zip(prompts, ref)}, lm.model.args.vocab_size,
        wrong=wrong, forbidden=forbidden)
    return llm, ref


def _specs() -> list[StructuredOutputs]:
    return [StructuredOutputs.json(SCHEMA), StructuredOutputs("regex", REGEX),
            StructuredOutputs.choice(["yes, certainly", "no, never", "maybe later on"])]


@pytest.mark.parametrize("chunk", [None, 7])
def test_greedy_constrained_identical_with_rejected_and_forbidden_drafts(tiny_llama, chunk) -> None:
    lm, _ = tiny_llama
    prompts = random_prompts([11, 30, 5, 22, 17, 9], seed=21)
    specs = _specs()
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured=specs[i % 3]) for i in range(6)]
    # an unconstrained request in the same batch
    prompts.append(random_prompts([14], seed=22)[0])
    params.append(SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    kw = {"max_batch_tokens": chunk} if chunk else {}
    llm, ref = _with_drafter(lm, prompts, params, wrong=0.35, forbidden=0.15, **kw)
    got = llm.generate(prompts, params)
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in ref]
    st = llm.engine.stats().spec   # (grammar compiles run on a thread: the steps, and so these counts, vary a little)
    assert st.accepted > 20 and st.proposed - st.accepted > 10, st
    for out, p in zip(got[:6], params):
        assert out.finish_reason == "stop", out
        if p.structured.kind == "json_schema":
            jsonschema.validate(json.loads(out.text), SCHEMA)
        elif p.structured.kind == "regex":
            assert re.fullmatch(REGEX, out.text), out.text
    llm.engine.check_pages()


def test_forbidden_drafts_are_cut_before_verification(tiny_llama) -> None:
    lm, _ = tiny_llama
    prompts = random_prompts([13, 8], seed=23)
    params = SamplingParams(max_tokens=30, temperature=0.0, structured=StructuredOutputs.json(SCHEMA))
    llm, ref = _with_drafter(lm, prompts, params, wrong=0.0, forbidden=1.0)
    assert [list(o.token_ids) for o in llm.generate(prompts, params)] == [list(o.token_ids) for o in ref]
    assert llm.engine.stats().spec.proposed == 0       # every draft began with a forbidden token


@pytest.fixture(scope="module")
def peaked(tiny_dir):
    """The tiny model with its final norm scaled up: peaked next-token distributions."""
    from tokenmill.loader import load_model

    lm = load_model(str(tiny_dir("LlamaForCausalLM")))
    lm.model.norm.weight.data *= 12.0
    return lm


def test_seeded_sampled_constrained_equals_no_speculation(peaked) -> None:
    prompts = random_prompts([19, 7, 26, 12, 33, 15], seed=24)
    specs = _specs()
    params = [SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=s, structured=specs[s % 3])
              for s in range(6)]
    llm, ref = _with_drafter(peaked, prompts, params, wrong=0.3, forbidden=0.1)
    got = llm.generate(prompts, params)
    assert llm.engine.stats().spec.accepted > 0
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in ref]


def test_chi_square_sampled_drafter_under_a_grammar_keeps_the_distribution(peaked) -> None:
    from scipy.stats import chi2_contingency

    prompt = random_prompts([10], seed=25)[0]
    spec = StructuredOutputs("regex", r"[a-z]{1,12}")
    params = SamplingParams(max_tokens=3, temperature=1.0, top_p=0.95, structured=spec)
    n = 400
    base = _llm(peaked, kv_cache_tokens=16384, max_running_requests=256)
    ref = [tuple(o.token_ids) for o in base.generate([prompt] * n, params)]
    # q: 3/8 on the target's likeliest token (so the residual max(0, p - q) is far from p) and
    # 5/8 on tokens the grammar forbids (drafted, then rejected by the mask): cutting those
    # drafts instead of rejecting them would skew the output towards the likeliest token
    top = Counter(t for seq in ref for t in seq[1:]).most_common(1)[0][0]
    outside = [t for t in peaked.tokenizer.encode(" 7 X! 42", add_special_tokens=False)][:3]
    assert len(outside) == 3 and not set(outside) & {t for seq in ref for t in seq}
    llm = _llm(peaked, kv_cache_tokens=16384, max_running_requests=256, speculative_method="ngram",
               speculative_adaptive=False, num_speculative_tokens=2)
    llm.engine.spec.proposer = BadSampledDrafter(outside + [top], peaked.model.args.vocab_size)
    got = [tuple(o.token_ids) for o in llm.generate([prompt] * n, params)]
    st = llm.engine.stats().spec
    assert st.proposed > n // 2 and 0 < st.accepted < st.proposed, st
    for pos in (1, 2):     # the positions drafts cover (the first token comes from the prefill)
        a = Counter(s[pos] if len(s) > pos else -1 for s in ref)
        b = Counter(s[pos] if len(s) > pos else -1 for s in got)
        common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
        rest = [t for t in set(a) | set(b) if t not in common]
        table = [[a[t] for t in common] + [sum(a[t] for t in rest)],
                 [b[t] for t in common] + [sum(b[t] for t in rest)]]
        if table[0][-1] + table[1][-1] == 0:
            table = [r[:-1] for r in table]
        assert len(table[0]) >= 2, "the test needs a distribution with more than one token"
        assert chi2_contingency(table)[1] > 1e-3, (pos, table)


# -- the default model: repeat this JSON with one field changed -----------------------------------
AGENT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "version": {"type": "string"},
        "dependencies": {"type": "array", "items": {"type": "string"}},
        "private": {"type": "boolean"}, "port": {"type": "integer"},
    },
    "required": ["name", "version", "dependencies", "private", "port"],
    "additionalProperties": False,
}


def test_default_model_json_agent_turn_identical_valid_and_accepting(smollm) -> None:
    doc = {"name": "billing-service", "version": "2.4.1", "dependencies": ["fastapi", "sqlalchemy", "redis"],
           "private": True, "port": 8080}
    msgs = [{"role": "user", "content": "Here is a config file:\n" + json.dumps(doc, separators=(",", ":"))
             + "\nRepeat this JSON exactly, but change the port to 9090."}]
    params = SamplingParams(max_tokens=80, temperature=0.0, structured=StructuredOutputs.json(AGENT_SCHEMA))
    ref = LLM(loaded=smollm, kv_cache_tokens=2048).chat(msgs, params)[0]
    jsonschema.validate(json.loads(ref.text), AGENT_SCHEMA)
    for method in ("ngram", "suffix"):
        # adaptive k off: with it on, whether drafts go out depends on the step times measured
        # (stage 2 weighs them), so on a loaded host the engine may rightly draft nothing
        llm = LLM(loaded=smollm, kv_cache_tokens=2048, debug_checks=True, speculative_method=method,
                  speculative_adaptive=False)
        out = llm.chat(msgs, params)[0]
        assert list(out.token_ids) == list(ref.token_ids), (method, out.text, ref.text)
        jsonschema.validate(json.loads(out.text), AGENT_SCHEMA)
        st = llm.engine.stats().spec
        assert st.mean_acceptance_length > 1.5, (method, st)   # the answer copies the prompt's JSON


def test_tensor_parallel_constrained_requests_decode_plainly_beside_drafting_ones(tmp_path) -> None:
    """With tensor parallelism rank 0 gets one grammar-mask row per request, so constrained
    requests do not draft there; unconstrained ones in the same batch still do, and both give
    the tokens of one rank without speculation."""
    from tokenmill.loader import load_model
    from tokenmill.loader.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "gqa", seed=1)
    loaded = load_model(str(path))
    kw = dict(kv_cache_tokens=1024, page_size=16, max_batch_tokens=64, num_threads=1, decode_slowdown=None)
    prompts = random_prompts([12, 20], seed=26) * 2
    params = [SamplingParams(max_tokens=20, temperature=0.0, structured=StructuredOutputs("regex", REGEX))] * 2 \
        + [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 2
    ref = LLM(str(path), loaded=loaded, **kw).generate(prompts, params)
    with LLM(str(path), loaded=loaded, tensor_parallel_size=2, speculative_method="ngram",
             speculative_adaptive=False, **kw) as two:
        two.engine.spec.proposer = GrammarAwareDrafter(
            {tuple(p): list(o.token_ids) + [5] * 8 for p, o in zip(prompts, ref)}, loaded.model.args.vocab_size,
            wrong=0.25, forbidden=0.0)
        got = two.generate(prompts, params)
        st = two.engine.stats().spec
        assert st.accepted > 0 and st.proposed > st.accepted
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in ref]
    for out in got[:2]:
        assert re.fullmatch(REGEX, out.text), out.text
