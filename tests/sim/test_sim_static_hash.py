"""Must reproduce 1: 250 sessions hashed onto 50 replicas by the router's session_hash policy.

The seed: ~4.0% of replicas get <= 1 session (Poisson(5): 4.04%) and ~0.5% get >= 12, whatever
the scale. The Monte-Carlo fractions must lie within their sampling error of the exact
Binomial(250, 1/50) values, computed here with scipy (independently of tokenmill.sim.static).
"""
from __future__ import annotations

import math

from scipy import stats

from tokenmill.sim.static import binomial_tails, hash_counts, poisson_tails, static_hash_analysis

SESSIONS, REPLICAS, SEEDS = 250, 50, 200


def test_static_hashing_matches_the_binomial_tails():
    res = static_hash_analysis(SESSIONS, REPLICAS, range(SEEDS))
    binom = stats.binom(SESSIONS, 1 / REPLICAS)
    p_le1 = binom.cdf(1)
    p_ge12 = binom.sf(11)
    cells = SEEDS * REPLICAS
    for observed, p in ((res.frac_le_1, p_le1), (res.frac_ge_12, p_ge12)):
        sigma = math.sqrt(p * (1 - p) / cells)
        assert abs(observed - p) < 4 * sigma, (observed, p, sigma)
    # the seed's round numbers
    assert abs(res.frac_le_1 - 0.040) < 0.008
    assert 0.0020 < res.frac_ge_12 < 0.0090
    assert abs(res.poisson_le_1 - 0.0404) < 5e-4 and abs(res.poisson_ge_12 - 0.00545) < 5e-5
    # Binomial dispersion: variance/mean = 1 - 1/R (each seed's counts sum to 250 exactly)
    assert res.mean == SESSIONS / REPLICAS
    assert abs(res.var_over_mean - (1 - 1 / REPLICAS)) < 0.05


def test_library_tails_agree_with_scipy():
    le, ge = binomial_tails(SESSIONS, 1 / REPLICAS)
    assert abs(le - stats.binom(SESSIONS, 1 / REPLICAS).cdf(1)) < 1e-12
    assert abs(ge - stats.binom(SESSIONS, 1 / REPLICAS).sf(11)) < 1e-12
    le, ge = poisson_tails(5.0)
    assert abs(le - stats.poisson(5).cdf(1)) < 1e-12 and abs(ge - stats.poisson(5).sf(11)) < 1e-12


def test_hash_counts_are_deterministic_and_complete():
    a = hash_counts(SESSIONS, REPLICAS, seed=3)
    assert a.sum() == SESSIONS and len(a) == REPLICAS
    assert (hash_counts(SESSIONS, REPLICAS, seed=3) == a).all()
    assert not (hash_counts(SESSIONS, REPLICAS, seed=4) == a).all()
