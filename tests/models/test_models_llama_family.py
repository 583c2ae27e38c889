"""Tiny Llama / Qwen2 / Qwen3 models over paged KV against HF transformers on the same weights."""
from __future__ import annotations

import math
import random

import pytest
import torch
from paged_driver import PagedDriver, hf_logits

from tokenmill.loader import build_hf_reference, load_model
from tokenmill.loader.tiny import TINY_ARCHS, build_tiny_checkpoint

ARCHS = list(TINY_ARCHS)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_hf(tiny_pairs, arch):
    loaded, ref = tiny_pairs[arch]
    toks = _tokens(45, seed=3)
    ours = PagedDriver(loaded.model).step([("a", toks)], all_rows=True)
    theirs = hf_logits(ref, toks)
    assert ours.shape == theirs.shape == (45, 49152)
    assert ours.dtype == torch.float32
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_with_cached_context_matches_hf(tiny_pairs, arch):
    """Three sequences of different lengths in one batch: A prefills whole, B in two chunks (the
    second after cached context, beside decodes), C leaves its last prompt token for a decode."""
    loaded, ref = tiny_pairs[arch]
    a, b, c = _tokens(29, 10), _tokens(41, 11), _tokens(12, 12)
    drv = PagedDriver(loaded.model, page_size=4)
    full = {"a": hf_logits(ref, a), "b": hf_logits(ref, b), "c": hf_logits(ref, c)}
    got: list[tuple[str, int, torch.Tensor]] = []

    def run(chunks):
        out = drv.step(chunks)
        for (seq, _), row in zip(chunks, out):
            got.append((seq, drv.lens[seq] - 1, row))

    run([("a", a[:26]), ("b", b[:17]), ("c", c[:9])])      # three prefills (C's is partial)
    run([("a", a[26:27]), ("b", b[17:35]), ("c", c[9:10])])  # decodes beside a chunk with cached context
    run([("c", c[10:11]), ("a", a[27:28]), ("b", b[35:36])])  # pure decode, other order
    run([("b", b[36:41]), ("a", a[28:29]), ("c", c[11:12])])  # last chunk of B + decodes
    assert len(got) == 12
    for seq, pos, row in got:
        diff = (row - full[seq][pos]).abs().max().item()
        assert diff < 1e-4, f"{arch} seq {seq} position {pos}: max abs diff {diff}"
        assert int(row.argmax()) == int(full[seq][pos].argmax())


def test_llama3_rope_scaling_and_untied_head(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    path = build_tiny_checkpoint(tmp_path / "llama3", "LlamaForCausalLM", seed=2, rope_parameters=rope,
                                 tie_word_embeddings=False)
    loaded = load_model(str(path))
    assert loaded.model.args.rope_scaling is not None
    assert loaded.model.lm_head is not loaded.model.embed_tokens
    ref = build_hf_reference(loaded)
    toks = _tokens(80, seed=4)  # past original_max_position_embeddings
    drv = PagedDriver(loaded.model, page_size=16)
    ours = torch.cat([drv.step([("s", toks[:50])], all_rows=True), drv.step([("s", toks[50:])], all_rows=True)])
    assert (ours - hf_logits(ref, toks)).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_yarn_rope_scaling_matches_hf(tmp_path, arch):
    """YaRN's interpolated frequencies and its attention factor on cos/sin, past the original length."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    path = build_tiny_checkpoint(tmp_path / "yarn", arch, seed=3, rope_parameters=rope)
    loaded = load_model(str(path))
    assert loaded.model.rotary.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    toks = _tokens(70, seed=8)
    ours = PagedDriver(loaded.model, page_size=16).step([("s", toks)], all_rows=True)
    assert (ours - hf_logits(build_hf_reference(loaded), toks)).abs().max().item() < 1e-4


def test_kv_cache_spec_and_write_location(tiny_pairs):
    loaded, _ = tiny_pairs["Qwen3ForCausalLM"]
    spec = loaded.model.kv_cache_spec()
    assert (spec.num_layers, spec.layers[0].num_kv_heads, spec.layers[0].head_dim, spec.dtype) == (2, 2, 16, "float32")
    assert spec.bytes_per_token() == 2 * 2 * 2 * 16 * 4
    drv = PagedDriver(loaded.model, num_pages=8, page_size=4)
    drv.step([("s", _tokens(6, 5))])
    used = set(drv.pages["s"])
    for layer in drv.kv:
        for page in range(8):
            written = bool(layer[:, page].abs().sum() > 0)
            assert written == (page in used)
        # second page holds only 2 of its 4 slots
        assert layer[:, drv.pages["s"][1], 2:].abs().sum() == 0
