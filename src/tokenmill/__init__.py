"""tokenmill: an LLM serving stack for coding agents."""
from __future__ import annotations

__version__ = "0.1.0"
