"""The one error type of model loading; defined in :mod:`tokenmill.contracts.errors`."""
from __future__ import annotations

from tokenmill.contracts.errors import ModelLoadError

__all__ = ["ModelLoadError"]
