"""Engine test fixtures: real models through the real loader, and HF oracles on the same weights."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.loader import LoadedModel, build_hf_reference, load_model
from tokenmill.loader.tiny import build_tiny_checkpoint

# The test machine's cores are shared by many processes; one intra-op thread avoids the
# spin-wait collapse of oversubscribed thread pools (results do not depend on it).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_dir(arch)`` -> a tiny random HF checkpoint directory (built once per session)."""
    built: dict[str, Path] = {}

    def get(arch: str = "LlamaForCausalLM") -> Path:
        if arch not in built:
            built[arch] = build_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch=arch, seed=0)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """``tiny_model(arch)`` -> (LoadedModel, HF reference model), loaded once per session."""
    loaded: dict[str, tuple[LoadedModel, torch.nn.Module]] = {}

    def get(arch: str = "LlamaForCausalLM") -> tuple[LoadedModel, torch.nn.Module]:
        if arch not in loaded:
            lm = load_model(str(tiny_dir(arch)))
            loaded[arch] = (lm, build_hf_reference(lm).eval())
        return loaded[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model) -> tuple[LoadedModel, torch.nn.Module]:
    return tiny_model("LlamaForCausalLM")


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model("smollm2-135m-instruct")
