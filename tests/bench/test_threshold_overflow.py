# SPDX-License-Identifier: Apache-2.0
"""bench/pairs/threshold_overflow.py: its count of keys above the build's
threshold against a brute force over (value desc, id asc), and its layouts."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from bench.pairs import threshold_overflow as tov  # noqa: E402


def brute_count(row: list[float], k: int, sub: int, keep: int, group: int = 1) -> int:
    """Keys >= t, t the k-th best of each sub-block's `keep` best maxima of
    its groups of `group` tokens."""
    order = sorted(range(len(row)), key=lambda t: (-row[t], t))
    rank = {t: i for i, t in enumerate(order)}
    kept = sorted(
        r
        for b in range(0, len(row), sub)
        for r in sorted(
            min(rank[t] for t in range(g, min(len(row), g + group)))
            for g in range(b, min(len(row), b + sub), group)
        )[:keep]
    )
    return kept[k - 1] + 1


def test_counts_match_the_brute_force():
    torch.manual_seed(0)
    x = torch.randn(6, 100)
    x[1] = 0.0  # all tied: ids decide
    x[2, 40:] = -50.0  # likely tokens in the first sub-blocks
    x[3] = torch.randint(0, 3, (100,)).float()
    for k, sub, keep in ((3, 8, 1), (3, 8, 4), (10, 16, 2), (5, 7, 8)):
        got = tov.counts(x, k, sub, keep).tolist()
        assert got == [brute_count(r, k, sub, keep) for r in x.tolist()]
    x = torch.cat([x, torch.randn(6, 28)], 1)  # 128: whole groups
    for k, sub, keep, group in ((3, 8, 2, 4), (10, 16, 2, 4), (5, 32, 4, 8)):
        got = tov.counts(x, k, sub, keep, group).tolist()
        want = [brute_count(r, k, sub, keep, group) for r in x.tolist()]
        assert got == want
        # Group maxima are keys of the row: t is never above the key-wise t.
        assert all(g >= b for g, b in zip(got, tov.counts(x, k, sub, keep).tolist()))


def test_layouts_place_the_small_vocabulary():
    small = torch.randn(2, 8192)
    own, spread, contiguous = (x for _, x in tov.layouts(small))
    assert torch.equal(own, small)
    assert torch.equal(spread[:, ::18][:, :8192], small)
    assert torch.equal(contiguous[:, :8192], small)
    assert (contiguous[:, 8192:] == tov.FAR_BELOW).all()
    assert spread.shape[1] == contiguous.shape[1] == tov.PROD_VOCAB
