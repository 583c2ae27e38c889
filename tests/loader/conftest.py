"""Fixtures for loader tests: one tiny Llama checkpoint per session, copied before a test damages it."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from tokenmill.loader.tiny import build_tiny_checkpoint


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Small tensors only: one intra-op thread avoids OpenMP spin contention on shared CI cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "LlamaForCausalLM", seed=0)


@pytest.fixture
def tiny_copy(tiny_llama_dir: Path, tmp_path: Path) -> Callable[[], Path]:
    """Returns a fresh writable copy of the tiny checkpoint each call."""
    count = [0]

    def make() -> Path:
        count[0] += 1
        dst = tmp_path / f"copy{count[0]}"
        shutil.copytree(tiny_llama_dir, dst)
        return dst

    return make
