"""Native CPU kernels (C, built by ``pip install`` through setup.py) and their Python wrappers.

Each wrapper module imports its compiled extension if it was built and exposes ``available()``
and ``unavailable_reason()``; callers fall back to pure-torch code when a kernel is missing.
"""
from __future__ import annotations
