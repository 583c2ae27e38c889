"""oneDNN keeps one primitive per (weight shape, batch size), up to about 1.5 MB each; importing
tokenmill caps that cache (tokenmill/__init__.py) so a server's memory stops growing once it has
seen a few hundred batch sizes. Run in a fresh interpreter: the cap is read at oneDNN's first use."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill.layers.linear import onednn_available

SCRIPT = """
import tokenmill, torch
from tokenmill.layers.linear import OneDNNLinear
def rss_mb():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
m = OneDNNLinear(torch.randn(576, 576))
x = torch.randn(400, 576)
m(x[:1])
base = rss_mb()
for rows in range(1, 400):
    m(x[:rows])
print(rss_mb() - base)
"""


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")
def test_onednn_primitive_cache_is_bounded() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120,
                         check=True)
    growth_mb = float(out.stdout.strip().splitlines()[-1])
    # 399 batch sizes: about 270 MB with oneDNN's default cache of 1,024 primitives, about 100 MB capped at 64
    assert growth_mb < 150, f"oneDNN's primitive cache grew RSS by {growth_mb:.0f} MB"
