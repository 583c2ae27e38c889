"""The layering contract (pyproject.toml, [tool.importlinter]; drawn in docs/architecture.md).

``lint-imports`` must keep every contract on the source tree, and must break them on a copy of
the tree with an upward import, a torch import in the scheduler and a cycle put in.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _lint(src: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(src))
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_source_tree_keeps_the_layering_contract():
    r = _lint(SRC, ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "broken" in r.stdout and "0 broken" in r.stdout


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")


def test_the_contract_catches_upward_imports_torch_and_cycles(tmp_path: Path):
    src = tmp_path / "src"
    shutil.copytree(SRC / "tokenmill", src / "tokenmill", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    pkg = src / "tokenmill"
    _append(pkg / "cache" / "radix.py", "from tokenmill.engine import request as _up  # noqa")
    _append(pkg / "engine" / "scheduler.py", "import torch as _torch  # noqa")
    _append(pkg / "router" / "base.py", "from tokenmill.router import policies as _cycle  # noqa")
    r = _lint(src, tmp_path)
    assert r.returncode != 0
    out = r.stdout
    assert "tokenmill.cache.radix -> tokenmill.engine.request" in out
    assert "tokenmill.engine.scheduler -> torch" in out
    assert "No import cycles between sibling modules BROKEN" in out
