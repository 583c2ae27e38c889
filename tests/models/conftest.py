"""Fixtures for model tests: tiny checkpoints loaded through tokenmill's loader and their HF twins
(helpers that drive paged KV live in paged_driver.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from tokenmill.loader import LoadedModel, build_hf_reference, load_model
from tokenmill.loader.tiny import TINY_ARCHS, build_tiny_checkpoint


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """These models are small: one intra-op thread is as fast and avoids OpenMP spin contention
    when the CI machine's cores are shared with other jobs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_checkpoint(root / arch, arch, seed=1) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_pairs(tiny_dirs: dict[str, Path]) -> dict[str, tuple[LoadedModel, Any]]:
    """arch -> (tokenmill LoadedModel, HF reference with the same weights)."""
    out = {}
    for arch, path in tiny_dirs.items():
        loaded = load_model(str(path))
        out[arch] = (loaded, build_hf_reference(loaded))
    return out


@pytest.fixture(scope="session")
def smollm2() -> tuple[LoadedModel, Any]:
    """The default model through the GGUF loader, and its HF twin on the dequantized weights."""
    loaded = load_model("smollm2-135m-instruct")
    return loaded, build_hf_reference(loaded)
