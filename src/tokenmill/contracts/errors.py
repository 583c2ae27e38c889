"""Errors shared across layers: model loading, and a replica that can no longer run."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """A model could not be loaded; the message names the file, tensor or setting at fault."""


class ReplicaFailedError(RuntimeError):
    """A tensor-parallel worker rank died or failed: the replica cannot continue and must be restarted."""
