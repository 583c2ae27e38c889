"""Batched token sampling from fp32 logits.

One :class:`Sampler` call handles a whole batch with tensor ops; only the random draws of
seeded requests loop over rows (each seeded request owns a ``torch.Generator``, which is what
makes its tokens independent of the batch it lands in). A draw is an exponential race: token
``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` drawn per vocabulary entry, which picks ``i`` with
probability exactly ``p_i``. Unlike an inverse-CDF lookup, whose answer moves when a rounding
change shifts the cumulative sum across a bucket edge, the race only changes when two
near-tied candidates swap. So a seeded request gives the same tokens when its logits differ in
the last bits: prefilled after a prefix-cache hit, or in a batch of another shape.

Processing order (see :mod:`tokenmill.contracts.sampling` for the user-facing semantics):
penalties -> temperature (0: greedy) -> [logprobs taken here] -> top-k -> top-p -> min-p -> draw.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from tokenmill._native import sampling as native_sampling
from tokenmill.contracts.sampling import SamplingParams


class PenaltyState:
    """Token counts a request's penalties need, kept up to date one token at a time.

    ``counts[v]``: times token ``v`` occurs in the output; ``seen[v]``: it occurs in prompt or
    output (for ``repetition_penalty``). Built once from the token lists (at a request's first
    sample, or again after it was preempted), then :meth:`add` costs O(1) per token.
    """

    __slots__ = ("counts", "seen", "num_output")

    def __init__(self, vocab_size: int, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                 device: torch.device | str = "cpu") -> None:
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        out = torch.as_tensor(list(output_token_ids), dtype=torch.long, device=device)
        self.counts.index_add_(0, out, torch.ones(out.shape[0], device=device))
        self.seen[torch.as_tensor(list(prompt_token_ids), dtype=torch.long, device=device)] = True
        self.seen[out] = True
        self.num_output = len(output_token_ids)

    def add(self, token_id: int) -> None:
        self.counts[token_id] += 1.0
        self.seen[token_id] = True
        self.num_output += 1


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the first index of each row's largest value (a NaN counts as the
    largest, as in torch), as int64. CPU float32 / float64 tensors go through numpy's vectorised
    argmax (a view, no copy): torch's CPU argmax reduces a row with scalar code, 150 us for one
    49,152-entry vocabulary row on one core against numpy's 10 us, and 2.4 ms against 0.2 ms for
    16 rows (``benchmarks/sampler_draw.py``). Other tensors keep torch's argmax."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return torch.from_numpy(np.asarray(x.numpy().argmax(axis=-1), dtype=np.int64))
    return x.argmax(dim=-1)


class SamplingInputs(NamedTuple):
    """Per-row inputs; all sequences have one entry per row of the logits."""

    params: Sequence[SamplingParams]
    prompt_token_ids: Sequence[Sequence[int]]   # used by repetition_penalty only
    output_token_ids: Sequence[Sequence[int]]   # used by all penalties
    generators: Sequence[torch.Generator | None]  # None: the sampler's shared stream
    # Incremental counts for rows with penalties (None: count from the token lists above).
    penalty_states: Sequence[PenaltyState | None] | None = None


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    # per row: None, or (chosen logprob, [(token_id, logprob)] top-N); rows without logprobs: None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    if width == 0:
        return torch.full((len(rows), 1), pad, dtype=torch.long, device=device)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]],
                    penalty_states: Sequence[PenaltyState | None] | None = None) -> torch.Tensor:
    """Return logits with repetition, then presence/frequency penalties applied (rows that ask).

    With ``penalty_states`` the counts come from them (O(vocab) per row, whatever the output
    length); otherwise they are counted from the token lists.
    """
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    b, vocab = len(rows), logits.shape[1]
    dev = logits.device
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    sub = logits[idx]
    states = [penalty_states[i] for i in rows] if penalty_states is not None else None
    if states is not None and all(st is not None for st in states):
        counts = torch.stack([st.counts for st in states]).to(logits.dtype)
        seen_rows = torch.stack([st.seen for st in states])
    else:
        out_ids = _padded([output_token_ids[i] for i in rows], vocab, dev)
        counts = torch.zeros(b, vocab + 1, dtype=logits.dtype, device=dev)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
        counts = counts[:, :vocab]
        seen_rows = None
    rep = torch.tensor([params[i].repetition_penalty for i in rows], dtype=logits.dtype, device=dev)
    if bool((rep != 1.0).any()):
        if seen_rows is not None:
            seen = seen_rows
        else:
            all_ids = _padded([list(prompt_token_ids[i]) + list(output_token_ids[i]) for i in rows], vocab, dev)
            seen = torch.zeros(b, vocab + 1, dtype=torch.bool, device=dev)
            seen.scatter_(1, all_ids, True)
            seen = seen[:, :vocab]
        r = rep[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=logits.dtype, device=dev)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=logits.dtype, device=dev)
    sub = sub - pres[:, None] * (counts > 0).to(logits.dtype) - freq[:, None] * counts
    logits[idx] = sub
    return logits


def truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p / min-p set to -inf (k=0, p=1, min_p=0: off).

    Ties at the k-th value are kept (as HF's TopKLogitsWarper does). top-p keeps the smallest set
    of most likely tokens whose mass reaches ``top_p`` (a token is kept while the mass of the
    tokens before it is at most ``top_p``), computed after top-k. No full-vocabulary sort: the
    nucleus is found among the top candidates, widening the candidate set only when needed.
    """
    vocab = logits.shape[1]
    if bool((top_k > 0).any()):
        kmax = min(int(top_k.max()), vocab)
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), kmax)
        kth = logits.topk(kmax, dim=-1).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill((logits < kth) & (top_k > 0)[:, None], float("-inf"))
    if bool((top_p < 1.0).any()):
        probs = torch.softmax(logits, dim=-1)
        active = top_p < 1.0
        cand = min(vocab, 128)
        while True:
            vals = probs.topk(cand, dim=-1).values                  # sorted, descending
            kept = ((vals.cumsum(dim=-1) - vals) <= top_p[:, None]).sum(dim=-1)
            if cand == vocab or not bool((active & (kept >= cand)).any()):
                break
            cand = min(vocab, cand * 8)
        threshold = vals.gather(1, (kept - 1).clamp(min=0)[:, None])
        logits = logits.masked_fill((probs < threshold) & active[:, None], float("-inf"))
    if bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


# splitmix64 (Steele, Lea, Flood 2014): a counter run through this mix is a good 64-bit stream
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_COUNTERS: dict[int, np.ndarray] = {}


def race_keys(generator: torch.Generator, n: int) -> list[int]:
    """``n`` 62-bit keys from ``generator``: one per exponential race (one per sampled token)."""
    return torch.randint(0, 1 << 62, (n,), generator=generator, dtype=torch.int64).tolist()


def exp1(keys: Sequence[int], vocab: int) -> torch.Tensor:
    """Exp(1) values ``[len(keys), vocab]`` (float64): row r is -log(u) of the splitmix64 stream
    of ``keys[r]`` at counters 0..vocab-1, u the top 53 bits plus a half (never 0 or 1).

    The draw ``argmax(p / E)`` (the exponential race) picks token i with probability p_i, and
    unlike an inverse-CDF draw it keeps a seeded draw when logits change in their last bits (see
    tests/engine/test_sampling.py). torch's ``exponential_`` made the 49,152 values one at a time
    from its Mersenne twister, 1.8 ms per sampled token on the default model here (a decode step
    is about 14 ms); this takes about a quarter of that, and with the native kernel for the
    uniforms (``tokenmill/_native/sampling.c``) about a tenth. A key comes from the request's own
    generator, so seeded requests repeat, and the speculative verifier draws the same way."""
    out = np.empty((len(keys), vocab), dtype=np.float64)
    if native_sampling.available() and len(keys):
        # the uniforms in one native pass (the same bits as race_uniforms_numpy), -log in numpy
        k = np.asarray(keys, dtype=np.uint64)
        native_sampling.race_uniforms(k.ctypes.data, len(keys), vocab, out.ctypes.data)
    else:
        race_uniforms_numpy(keys, vocab, out)
    np.log(out, out=out)
    np.negative(out, out=out)
    return torch.from_numpy(out)


def race_uniforms_numpy(keys: Sequence[int], vocab: int, out: np.ndarray) -> None:
    """The uniforms behind :func:`exp1` in numpy (the path without the native kernel, and its
    reference): ``out[r, i]`` = the top 53 bits of splitmix64 of ``keys[r] + i * golden``, plus a
    half, times 2^-53. numpy runs the mix in eleven passes over the row; the native kernel
    (``tokenmill/_native/sampling.c``) in one."""
    counters = _COUNTERS.get(vocab)
    if counters is None:
        counters = _COUNTERS[vocab] = np.arange(vocab, dtype=np.uint64) * _GOLDEN
    x, t = np.empty(vocab, dtype=np.uint64), np.empty(vocab, dtype=np.uint64)
    for r, key in enumerate(keys):   # a row at a time, in place: the buffers stay in cache
        np.add(counters, np.uint64(key), out=x)
        for shift, mul in ((30, _MIX1), (27, _MIX2), (31, None)):
            np.right_shift(x, np.uint64(shift), out=t)
            np.bitwise_xor(x, t, out=x)
            if mul is not None:
                np.multiply(x, mul, out=x)
        np.right_shift(x, np.uint64(11), out=x)
        u = out[r]
        u[:] = x
        u += 0.5
        u *= 2.0 ** -53


class Sampler:
    """Chooses one token per row of ``logits`` ([B, vocab], fp32)."""

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, inputs: SamplingInputs,
                 argmax: torch.Tensor | None = None) -> SamplerOutput:
        """One token per row. ``argmax`` (optional): each row's first largest index of these
        ``logits`` as given, where the model found it with them (``ForwardContext.logits_argmax``);
        greedy steps then never read the logits."""
        params = inputs.params
        b = logits.shape[0]
        if len(params) != b:
            raise ValueError(f"{b} rows of logits but {len(params)} sampling params")
        want_lp = [p.logprobs for p in params]
        if all(p.greedy and not p.uses_penalties for p in params) and all(n is None for n in want_lp):
            return SamplerOutput((argmax if argmax is not None else row_argmax(logits)).tolist(), [None] * b)

        logits = apply_penalties(logits, params, inputs.prompt_token_ids, inputs.output_token_ids,
                                 inputs.penalty_states)
        temps = [p.temperature for p in params]
        if any(t not in (0.0, 1.0) for t in temps):
            scale = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=logits.dtype, device=logits.device)
            logits = logits / scale[:, None]
        tokens = row_argmax(logits)
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sample_rows:
            tokens[sample_rows] = self._draw(logits, sample_rows, params, inputs.generators)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(logits, token_list, want_lp))

    def _draw(self, logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        dev = logits.device
        sub = logits[rows] if len(rows) != logits.shape[0] else logits
        ps = [params[i] for i in rows]
        sub = truncate(sub,
                       torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev),
                       torch.tensor([p.top_p for p in ps], dtype=sub.dtype, device=dev),
                       torch.tensor([p.min_p for p in ps], dtype=sub.dtype, device=dev))
        probs = torch.softmax(sub, dim=-1).double()
        # Exponential race (see exp1): one key per row, seeded rows from their own stream, the
        # others from the sampler's
        keys = race_keys(self.generator, len(rows))
        for j, i in enumerate(rows):
            g = generators[i]
            if g is not None:
                keys[j] = race_keys(g, 1)[0]
        return row_argmax(probs / exp1(keys, probs.shape[1]).to(dev)).to(dev)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int],
                  want: list[int | None]) -> list[tuple[float, list[tuple[int, float]]] | None]:
        rows = [i for i, n in enumerate(want) if n is not None]
        result: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(want)
        if not rows:
            return result
        lp = torch.log_softmax(logits[rows], dim=-1)
        chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=lp.device)[:, None])[:, 0].tolist()
        top_n = max(want[i] or 0 for i in rows)
        top_vals = top_ids = None
        if top_n > 0:
            top = lp.topk(top_n, dim=-1)
            top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        for j, i in enumerate(rows):
            n = want[i] or 0
            tops = list(zip(top_ids[j][:n], top_vals[j][:n])) if n and top_ids is not None and top_vals is not None else []
            result[i] = (chosen[j], tops)
        return result
