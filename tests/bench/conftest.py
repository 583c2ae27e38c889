"""Fixtures for the benchmark tests: a tiny random-weight model served by a real `tokenmill serve`."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.utils.proc import ServiceProcess


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenmill.loader.tiny import build_tiny_checkpoint

    d = tmp_path_factory.mktemp("bench-tiny")
    build_tiny_checkpoint(d)
    return d


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    log = tmp_path_factory.mktemp("bench-server") / "serve.log"
    with ServiceProcess(["serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny"],
                        log_path=log) as proc:
        yield proc


@pytest.fixture(scope="session")
def tokenizer():  # the default model's tokenizer (same as the tiny model's)
    from tokenmill.bench.prompts import load_tokenizer

    return load_tokenizer(None)
