"""Sampling: hand-computed processors, seeded reproducibility, chi-square against HF logits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from engine_oracle import hf_logits, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill._native import sampling as native_sampling
from tokenmill.layers.sampling import (Sampler, SamplingInputs, apply_penalties, exp1, race_keys, race_uniforms_numpy,
                                      row_argmax, truncate)

ALPHA = 1e-3  # chi-square tests use fixed seeds, so they are deterministic; this is the bar


def chi_square_p(samples: list[int], probs: np.ndarray) -> float:
    """p-value of ``samples`` under ``probs``; tokens with small expected counts share one bin."""
    n = len(samples)
    counts = np.bincount(np.asarray(samples), minlength=len(probs)).astype(float)
    assert counts[probs == 0].sum() == 0, "sampled a token of probability zero"
    big = np.flatnonzero(probs * n >= 5)
    rest = np.flatnonzero((probs > 0) & (probs * n < 5))
    obs = list(counts[big])
    exp = list(probs[big] * n)
    if len(rest):
        obs.append(counts[rest].sum())
        exp.append(probs[rest].sum() * n)
    exp_arr = np.asarray(exp) * (n / sum(exp))
    return float(stats.chisquare(obs, exp_arr).pvalue)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent numpy implementation of temperature -> top-k -> top-p."""
    x = logits.double().numpy() / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    if top_k:
        kth = p[order[top_k - 1]]
        keep_k = p >= kth
    else:
        keep_k = np.ones_like(p, dtype=bool)
    q = np.where(keep_k, p, 0.0)
    q /= q.sum()
    mass = 0.0
    for i in order:
        if not keep_k[i]:
            continue
        if mass > top_p:
            break
        keep[i] = True
        mass += q[i]
    q = np.where(keep, q, 0.0)
    return q / q.sum()


# -- processors against hand-computed values -----------------------------------------------------
def test_penalties_match_hand_computed_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    out = apply_penalties(logits, params, prompt_token_ids=[[0]], output_token_ids=[[1, 1, 3]])
    # token 0: in prompt, positive -> 2/2; token 1: seen, negative -> -1*2, count 2 -> -0.5 - 0.5;
    # token 2: untouched; token 3: seen -> 3/2, count 1 -> -0.5 - 0.25
    assert out.tolist() == [[1.0, -3.0, 0.5, 0.75]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0]]  # input left alone


def test_min_p_keeps_tokens_above_the_scaled_maximum() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = truncate(probs.log(), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.2]))
    assert torch.isinf(out[0, 3]) and torch.isfinite(out[0, :3]).all()
    assert torch.allclose(out[0, :3], probs.log()[0, :3])


def test_top_k_and_top_p_masks() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    out = truncate(logits, torch.tensor([2, 0, 3]), torch.tensor([1.0, 0.7, 0.95]), torch.tensor([0.0, 0.0, 0.0]))
    finite = torch.isfinite(out).tolist()
    p = torch.softmax(logits[0], -1).tolist()  # 0.636, 0.234, 0.086, ...
    assert p[0] < 0.7 < p[0] + p[1]
    assert finite[0] == [True, True, False, False, False]      # top-2
    assert finite[1] == [True, True, False, False, False]      # smallest set reaching 0.7
    assert finite[2] == [True, True, True, False, False]       # top-3 (0.665, 0.245, 0.090): 0.91 < 0.95 before the third


def test_min_p_draws_follow_the_renormalised_distribution() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = torch.tensor(np.log(probs), dtype=torch.float32).repeat(n, 1)
    params = [SamplingParams(min_p=0.2)] * n
    sampler = Sampler(seed=0)
    out = sampler(logits, SamplingInputs(params, [[]] * n, [[]] * n, [None] * n))
    expected = np.where(probs >= 0.1, probs, 0.0)
    assert chi_square_p(out.token_ids, expected / expected.sum()) > ALPHA


def test_row_argmax_is_torch_argmax() -> None:
    """row_argmax (numpy's argmax for CPU float tensors) picks what torch's argmax picks: the first
    of tied maxima, a NaN before any number, index 0 for a row of -inf, in float32 and float64, on
    1-D, strided and inference tensors; other dtypes go through torch."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 49152, generator=gen)
    x[1, 7] = x[1, 40000] = 100.0                        # a tie: the first index wins
    x[2, 123] = float("nan")                             # NaN counts as the largest
    x[2, 5] = float("nan")
    x[3] = float("-inf")                                 # nothing but -inf: index 0
    x[4, 17] = -0.0
    x[4] = torch.where(x[4] > 0, -x[4], x[4]).clamp(max=0.0)  # zeros of both signs tie at the top
    cases = [x, x.double(), x[0], x[:, ::3], x[1:5], torch.randn(3, 5, generator=gen).t()]
    with torch.inference_mode():
        cases.append(torch.randn(4, 1000, generator=gen))
    for c in cases:
        got = row_argmax(c)
        assert got.dtype == torch.int64 and got.shape == c.shape[:-1]
        assert torch.equal(got, c.argmax(dim=-1)), c.shape
    assert row_argmax(x[:, :2]).tolist() == x[:, :2].argmax(-1).tolist()
    assert torch.equal(row_argmax(x.to(torch.bfloat16)), x.to(torch.bfloat16).argmax(dim=-1))
    assert row_argmax(x).tolist()[1:4] == [7, 5, 0]


@pytest.mark.skipif(not native_sampling.available(), reason=str(native_sampling.unavailable_reason()))
def test_native_race_uniforms_equal_the_numpy_stream_bit_for_bit() -> None:
    """The native kernel's uniforms are numpy's (race_uniforms_numpy), bit for bit, on every path
    this CPU runs (portable loop, AVX2, AVX-512), for vocabularies of odd sizes and keys at the
    edges of their range; so exp1, and every seeded draw, is the same with or without it."""
    keys = race_keys(torch.Generator().manual_seed(5), 4) + [0, 1, (1 << 62) - 1, 2 ** 53 + 12345]
    k = np.asarray(keys, dtype=np.uint64)
    paths = [p for p in (0, 1, 2, 3) if _runs(k, p)]
    assert 0 in paths and 1 in paths
    for vocab in (1, 7, 33, 49152, 151936):
        want = np.empty((len(keys), vocab))
        race_uniforms_numpy(keys, vocab, want)
        assert (want > 0).all() and (want < 1).all()
        for path in paths:
            got = np.full((len(keys), vocab), np.nan)
            native_sampling.race_uniforms(k.ctypes.data, len(keys), vocab, got.ctypes.data, path)
            assert np.array_equal(got, want), (vocab, path)
    e = exp1(keys, 49152).numpy()
    race_uniforms_numpy(keys, 49152, want := np.empty((len(keys), 49152)))
    assert np.array_equal(e, -np.log(want))


def _runs(k: np.ndarray, path: int) -> bool:
    out = np.empty(1)
    try:
        native_sampling.race_uniforms(k.ctypes.data, 1, 1, out.ctypes.data, path)
    except ValueError:
        return False
    return True


def test_race_noise_is_exp1_and_keyed() -> None:
    """exp1: Exp(1) by a Kolmogorov-Smirnov test, no two keys' streams alike, a key repeats, and
    consecutive counters uncorrelated (the splitmix64 stream behind it)."""
    keys = race_keys(torch.Generator().manual_seed(3), 8)
    e = exp1(keys, 49152).numpy()
    assert e.shape == (8, 49152) and np.isfinite(e).all() and (e > 0).all()
    assert stats.kstest(e.ravel(), "expon").pvalue > ALPHA
    assert np.array_equal(exp1(keys[:1], 49152).numpy()[0], e[0])
    assert not any(np.array_equal(e[a], e[b]) for a in range(8) for b in range(a))
    r = np.corrcoef(e[0, :-1], e[0, 1:])[0, 1]
    assert abs(r) < 0.02
    assert race_keys(torch.Generator().manual_seed(3), 8) == keys


def test_seeded_draws_survive_last_bit_changes_in_the_logits() -> None:
    """Logits computed through another path (a prefix-cache hit, another batch shape) differ in the
    last bits; a seeded draw must almost never change. An inverse-CDF draw over a 49k vocabulary
    flipped ~1.5% of draws at this noise level; the exponential race flips ~0."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 500, 49152
    logits = (torch.randn(1, vocab, generator=gen) * 1.5).repeat(n, 1)
    noisy = logits + torch.randn(n, vocab, generator=gen) * 1e-4
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]

    def draw(x: torch.Tensor) -> list[int]:
        gens = [torch.Generator().manual_seed(s) for s in range(n)]
        return Sampler(seed=0)(x, SamplingInputs(params, [[]] * n, [[]] * n, gens)).token_ids

    clean, perturbed = draw(logits), draw(noisy)
    assert len(set(clean)) > n // 2  # the draws really are random
    assert sum(a != b for a, b in zip(clean, perturbed)) <= 1


# -- engine: seeds and distributions against HF --------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    lm, _ = tiny_llama
    return LLM(loaded=lm, kv_cache_tokens=65536, max_batch_tokens=8192, max_running_requests=512)


def test_seeded_runs_repeat_exactly_whatever_the_batch(llm: LLM) -> None:
    prompt, *others = random_prompts([11, 30, 5, 17], seed=5)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].token_ids
    other_params = [SamplingParams(max_tokens=20, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    batched = llm.generate([*others, prompt], [*other_params, params])[-1].token_ids
    assert alone == batched
    different = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95,
                                                      seed=4321, ignore_eos=True))[0].token_ids
    assert different != alone


def test_seeded_runs_repeat_after_a_prefix_cache_hit(llm: LLM) -> None:
    """A hit computes the prompt's last logits through another kernel path (last bits differ);
    the seeded draw must not care. An inverse-CDF draw over 49k near-uniform tokens failed this."""
    assert llm.engine.flush_cache()
    prompts = random_prompts([40, 57, 73, 90, 33, 48, 66, 81], seed=11)
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=100 + k, ignore_eos=True)
              for k in range(len(prompts))]
    cold = llm.generate(prompts, params)
    warm = llm.generate(prompts, params)
    assert all(o.cached_tokens == 0 for o in cold)
    assert all(o.cached_tokens > 0 for o in warm)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 8, 1.0), (0.8, 0, 0.6),
                                                     (1.2, 20, 0.8)])
def test_first_token_distribution_matches_hf_logits(llm: LLM, tiny_llama, temperature: float,
                                                    top_k: int, top_p: float) -> None:
    _, ref = tiny_llama
    prompt = random_prompts([9], seed=7)[0]
    probs = reference_probs(hf_logits(ref, prompt)[-1], temperature, top_k, top_p)
    n = 1500
    params = [SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=s)
              for s in range(n)]
    samples = [o.token_ids[0] for o in llm.generate([prompt] * n, params)]
    support = int((probs > 0).sum())
    assert len(set(samples)) > 1 and support > 1
    assert chi_square_p(samples, probs) > ALPHA


def test_greedy_logprobs_match_hf_log_softmax(llm: LLM, tiny_llama) -> None:
    _, ref = tiny_llama
    prompt = random_prompts([13], seed=8)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True))[0]
    ref_lp = torch.log_softmax(hf_logits(ref, prompt + out.token_ids[:-1]), dim=-1)
    assert out.logprobs is not None and len(out.logprobs) == 6
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref_lp[len(prompt) - 1 + i]
        assert lp.token_id == tok
        assert math.isclose(lp.logprob, float(row[tok]), abs_tol=1e-4)
        top = row.topk(5)
        assert [t.token_id for t in lp.top_logprobs] == top.indices.tolist()
        assert np.allclose([t.logprob for t in lp.top_logprobs], top.values.tolist(), atol=1e-4)
        assert lp.top_logprobs[0].token_id == tok  # greedy picks the most likely token
