# SPDX-License-Identifier: Apache-2.0
"""bench/engine/sampling.py's two-sample chi-square (CPU): samples of one
distribution pass it, samples of two distributions fail it, and categories
too rare to test are pooled rather than dropped."""

import random
from collections import Counter

from bench.engine.sampling import DEFAULT_PROMPTS, load_prompts, two_sample_p


def draws(weights: dict, n: int, seed: int) -> Counter:
    rng = random.Random(seed)
    keys = list(weights)
    return Counter(rng.choices(keys, weights=[weights[k] for k in keys], k=n))


def test_same_distribution_passes_and_another_fails():
    p = {"a": 0.5, "b": 0.3, "c": 0.15, "d": 0.05}
    q = {"a": 0.4, "b": 0.3, "c": 0.2, "d": 0.1}
    same = [two_sample_p(draws(p, 4000, s), draws(p, 4000, 100 + s)) for s in range(5)]
    assert min(same) > 1e-3
    assert two_sample_p(draws(p, 4000, 7), draws(q, 4000, 8)) < 1e-6


def test_rare_categories_are_pooled():
    # Each rare key alone has too few counts to test; pooled they carry the
    # difference (a sample that never shows them against one that does).
    a = Counter({"x": 900, "y": 100})
    b = Counter({"x": 900, "y": 40, **{f"r{i}": 3 for i in range(20)}})
    assert two_sample_p(a, b) < 1e-6
    assert two_sample_p(Counter({"x": 5}), Counter({"x": 7})) == 1.0


def test_default_prompts_are_the_pairs_held_out_prompts():
    prompts = load_prompts(DEFAULT_PROMPTS, 4)
    assert len(prompts) == 4 and all(isinstance(p, str) and p for p in prompts)
