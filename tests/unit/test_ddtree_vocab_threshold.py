# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests for the threshold filter of the DDTree Triton vocabulary pass
(vllm/v1/spec_decode/ddtree/tree_triton.py; Triton interpreter on CPU).

Every result is compared bit for bit with the torch backend (exact path) and
with the tournament alone (``_vocab_threshold_plan`` -> None: the Triton pass
as it was before the filter), on rows whose threshold candidates fit and
rows that overflow the capacity (the per-row fallback), in the same batch.

Runs from the repository (``pytest tests/unit/test_ddtree_vocab_threshold.py``):
pytest.ini puts ``overlay/`` on ``sys.path``.
"""

from __future__ import annotations

import pytest
import torch

from vllm.v1.spec_decode.ddtree import tree as tree_module

NEG_INF = float("-inf")
NAN = float("nan")

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def T():
    return tree_module


@pytest.fixture
def small_chunks(T, monkeypatch):
    """32-token chunks and merge groups of 2 chunks: many chunks and several
    tournament levels at a vocabulary the interpreter sorts quickly."""

    def chunking(vocab, k):  # a chunk holds at least K tokens
        chunk = max(32, T._next_pow2(k))
        return chunk, -(-vocab // chunk)

    monkeypatch.setattr(T, "_vocab_chunking", chunking)
    monkeypatch.setattr(T, "_merge_fan_in", lambda k: 2)


def canonical(row: torch.Tensor, as_logprobs: bool) -> list[float]:
    x = torch.nan_to_num(row.float(), nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    if as_logprobs:
        x = x.clamp_max(0.0)
    return x.tolist()


def threshold_count(
    T, row: torch.Tensor, k: int, as_logprobs: bool = False
) -> tuple[int, int]:
    """(keys >= t, capacity) of one row, computed independently in Python:
    t is the k-th largest of the sub-blocks' kept keys (each sub-block's
    `_threshold_keep` largest maxima of its groups of `_threshold_group`
    tokens) in (value desc, id asc)."""
    vocab = row.numel()
    chunk, _ = T._vocab_chunking(vocab, k)
    sub, num_sub, capacity = T._vocab_threshold_plan(vocab, k, chunk)
    keep = T._threshold_keep(sub, num_sub)
    group = T._threshold_group(sub, keep)
    values = canonical(row, as_logprobs)
    order = sorted(range(vocab), key=lambda t: (-values[t], t))
    rank = {t: i for i, t in enumerate(order)}

    def group_best(start: int) -> int:
        return min(rank[t] for t in range(start, min(vocab, start + group)))

    kept = sorted(
        r
        for b in range(0, num_sub * sub, sub)
        for r in sorted(group_best(g) for g in range(b, min(vocab, b + sub), group))[
            :keep
        ]
    )
    return kept[k - 1] + 1, capacity


def triton_without_fallback(T, monkeypatch, logits: torch.Tensor, k: int):
    """The Triton vocabulary pass with the fallback tournament writing -1:
    a row that took the fallback shows as garbage, the others are exact."""
    from vllm.v1.spec_decode.ddtree import tree_triton

    class Skipped:
        def __getitem__(self, grid):
            return lambda logits_or_cand, out, *args, **kwargs: out.fill_(-1)

    with monkeypatch.context() as m:
        m.setattr(tree_triton, "_fallback_chunk_kernel", Skipped())
        m.setattr(tree_triton, "_fallback_merge_kernel", Skipped())
        return T.vocab_stage(logits, k, backend="triton")


@pytest.fixture
def keep_one(T, monkeypatch):
    """The filter as first built: one key kept per sub-block and 4 K slots
    (what `crafted_row`'s counts and the boundary cases below assume)."""
    monkeypatch.setattr(T, "_THRESHOLD_KEEP", 1)
    monkeypatch.setattr(T, "_threshold_capacity", lambda k: 4 * k)


def crafted_row(T, vocab: int, k: int, count: int) -> torch.Tensor:
    """With `keep_one`, a row whose threshold filter finds exactly ``count``
    keys >= t: zeros
    in blocks 0..k-2 (the rest -1), zeros everywhere from block k-1 on.
    Ranks follow ids among the zeros, so count = (zeros before block k-1)
    + 1."""
    chunk, _ = T._vocab_chunking(vocab, k)
    sub, _, _ = T._vocab_threshold_plan(vocab, k, chunk)
    row = torch.zeros(vocab)
    row[: (k - 1) * sub] = -1.0
    need = count - 1  # zeros in blocks 0..k-2, each block 1..sub of them
    assert k - 1 <= need <= (k - 1) * sub
    for b in range(k - 1):
        z = min(sub, need - (k - 2 - b))
        row[b * sub : b * sub + z] = 0.0
        need -= z
    assert need == 0
    return row


def tournament_only(T, monkeypatch, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(T, "_vocab_threshold_plan", lambda *a: None)
        return T.vocab_stage(*args, backend="triton", **kwargs)


def assert_bits(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    assert torch.equal(a, b)


def check_all_paths(
    T, monkeypatch, logits, budget, as_logprobs=False, vs_tournament=True
):
    """Triton (threshold filter + fallback) == torch bit for bit, and on the
    fused-logsumexp path (exact_vocab_ties=False) the same tokens and (with
    ``vs_tournament``) the tournament alone's log-probs bit for bit."""
    kw = dict(inputs_are_logprobs=as_logprobs)
    ref_lp, ref_tok = T.vocab_stage(logits, budget, backend="torch", **kw)
    lp, tok = T.vocab_stage(logits, budget, backend="triton", **kw)
    assert torch.equal(tok, ref_tok)
    assert_bits(lp, ref_lp)
    if as_logprobs:  # exact_vocab_ties changes nothing for log-probs
        return
    lp, tok = T.vocab_stage(
        logits, budget, backend="triton", exact_vocab_ties=False, **kw
    )
    assert torch.equal(tok, ref_tok)
    if not vs_tournament:
        return
    old_lp, old_tok = tournament_only(
        T, monkeypatch, logits, budget, exact_vocab_ties=False, **kw
    )
    assert_bits(tok, old_tok)
    assert_bits(lp, old_lp)


# --------------------------------------------------------------------------


def test_plan_shapes(T):
    # production: 149 chunks of 1K = the sub-blocks, 8 keys kept of each,
    # capacity 16K (at least 4K beyond 2048)
    assert T._vocab_threshold_plan(151936, 64, 1024) == (1024, 149, 1024)
    assert T._threshold_keep(1024, 149) == 8
    assert T._vocab_threshold_plan(151936, 256, 1024) == (256, 594, 2048)
    assert T._threshold_keep(256, 594) == 2  # 1188 kept keys: one 2048 sort
    assert T._vocab_threshold_plan(151936, 512, 1024) == (128, 1187, 2048)
    assert T._threshold_keep(128, 1187) == 1
    # the kept keys: maxima of groups of 16 tokens, fewer where a sub-block
    # would hold fewer than `keep` groups
    assert T._threshold_group(1024, 8) == 16
    assert T._threshold_group(128, 1) == 16
    assert T._threshold_group(32, 8) == 4
    assert T._threshold_group(4, 4) == 1
    assert T._vocab_threshold_plan(151936, 1, 1024) == (1024, 149, 16)
    assert T._threshold_keep(1, 300) == 1
    # too large to sort in one program: tournament only
    assert T._vocab_threshold_plan(151936, 2000, 2048) is None
    for vocab in (1, 2, 5, 31, 32, 33, 300, 1000):
        for k in range(1, min(vocab, 70) + 1):
            chunk, _ = T._vocab_chunking(vocab, k)
            sub, num_sub, cap = T._vocab_threshold_plan(vocab, k, chunk)
            assert chunk % sub == 0 and num_sub == -(-vocab // sub)
            assert num_sub >= 2 * k or sub == 1
            assert k <= cap <= T._next_pow2(vocab)
            assert cap & (cap - 1) == 0


def test_crafted_counts(T, small_chunks, keep_one):
    for k in (2, 5, 8):
        _, cap = threshold_count(T, torch.randn(300), k)
        for count in (cap - 1, cap, cap + 1):
            row = crafted_row(T, 300, k, count)
            assert threshold_count(T, row, k) == (count, cap)


@pytest.mark.parametrize(
    "dtype,budget,vs_tournament",
    [
        (torch.float32, 1, False),
        (torch.float32, 8, True),
        (torch.bfloat16, 5, True),
        (torch.float16, 8, False),
        (torch.float32, 24, False),
    ],
)
def test_mixed_overflow_batch(
    T, monkeypatch, small_chunks, keep_one, dtype, budget, vs_tournament
):
    """One batch: rows under, at and over the capacity, and special values;
    the rows that overflow take the tournament, the others the filter."""
    torch.manual_seed(budget)
    V = 160
    k = min(budget, V)
    rows = [
        torch.randn(V) * 3,  # random: a few candidates
        torch.zeros(V),  # all tied: overflows
        torch.randint(-2, 2, (V,)).float(),  # heavy ties
        torch.full((V,), NEG_INF),
    ]  # all -inf: overflows
    spec = torch.randn(V)
    spec[::7] = NAN
    spec[5::11] = NEG_INF
    spec[3::13] = float("inf")
    spec[1::17] = -0.0
    spec[2::19] = 0.0
    rows.append(spec)
    rows.append(torch.full((V,), NAN))
    sub, _, cap = T._vocab_threshold_plan(V, k, 32)
    max_count = (k - 1) * sub + 1  # the first k-1 sub-blocks exhausted
    for count in (cap, cap + 1):
        if k > 1 and count <= max_count:
            rows.append(crafted_row(T, V, k, count))
    logits = torch.stack(rows).to(dtype)
    if len(rows) % 2:
        logits = torch.cat([logits, logits[:1]])
    logits = logits.view(-1, 2, V)  # R requests x D = 2
    counts = [threshold_count(T, r, k)[0] for r in logits.view(-1, V)]
    assert any(c <= cap for c in counts)  # the filter is exercised
    # and the fallback, wherever a row can overflow
    assert any(c > cap for c in counts) == (max_count > cap)
    check_all_paths(T, monkeypatch, logits, budget, vs_tournament=vs_tournament)
    lp_in = torch.log_softmax(logits.float().nan_to_num(0.0), -1).to(dtype)
    lp_in[0, 0, ::3] = 0.0  # ties at the top of log-prob inputs
    check_all_paths(T, monkeypatch, lp_in, budget, as_logprobs=True)


def test_most_rows_overflow(T, monkeypatch, small_chunks, keep_one):
    """Capacity = K: most rows take the fallback."""
    monkeypatch.setattr(T, "_threshold_capacity", lambda k: k)
    torch.manual_seed(7)
    logits = torch.randn(3, 2, 120)
    logits[1] = torch.randint(0, 2, (2, 120)).float()
    for budget in (3, 6):
        counts = [threshold_count(T, r, budget) for r in logits.view(-1, 120)]
        assert sum(c > cap for c, cap in counts) >= 2
        check_all_paths(T, monkeypatch, logits, budget)


@pytest.mark.parametrize(
    "vocab,budget",
    [(1, 1), (1, 4), (2, 5), (7, 7), (7, 100), (33, 32), (33, 40), (31, 3), (97, 20)],
)
def test_small_vocab_and_k_at_least_v(T, monkeypatch, small_chunks, vocab, budget):
    """K >= V (every token kept, sub-blocks of 1), V not a multiple of the
    chunk, a single chunk."""
    torch.manual_seed(vocab + budget)
    logits = torch.randn(2, 2, vocab)
    logits[1, 0] = 0.0
    logits[1, 1, ::2] = NAN
    check_all_paths(T, monkeypatch, logits, budget)
    if vocab < 40:
        check_all_paths(T, monkeypatch, logits.to(torch.bfloat16), budget)


def test_default_chunking(T, monkeypatch, keep_one):
    """The real chunk size (1K), V not a multiple of it, one row
    overflowing."""
    torch.manual_seed(3)
    logits = torch.randn(1, 2, 1100).to(torch.bfloat16)
    logits[0, 1] = 1.0
    assert T._vocab_chunking(1100, 8) == (1024, 2)
    sub, _, cap = T._vocab_threshold_plan(1100, 8, 1024)
    assert threshold_count(T, logits[0, 0], 8)[0] <= cap
    assert threshold_count(T, logits[0, 1], 8)[0] > cap
    check_all_paths(T, monkeypatch, logits, 8, vs_tournament=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clustered_likely_tokens_stay_on_the_filter(
    T, monkeypatch, small_chunks, dtype
):
    """A row whose real tokens fill the first two sub-blocks and whose other
    tokens sit far below (a small vocabulary embedded in a large one, or
    likely tokens numbered first): with one key per sub-block the K-th
    largest maximum is a far-below token and the row overflows; with the
    kept keys it stays on the filter. Triton == torch bit for bit, and the
    tied row (every value equal) also stays on the filter."""
    torch.manual_seed(5)
    vocab, k = 600, 4
    chunk, _ = T._vocab_chunking(vocab, k)
    sub, num_sub, cap = T._vocab_threshold_plan(vocab, k, chunk)
    assert T._threshold_keep(sub, num_sub) == 8
    logits = torch.full((2, 2, vocab), -50.0)
    logits[0, :, : 2 * sub] = torch.randn(2, 2 * sub) * 3
    logits[1, 0, : 2 * sub] = torch.randn(2 * sub)
    logits[1, 1] = 1.0
    logits = logits.to(dtype)
    rows = logits.view(-1, vocab)
    assert all(threshold_count(T, r, k)[0] <= cap for r in rows)
    with monkeypatch.context() as m:
        m.setattr(T, "_THRESHOLD_KEEP", 1)
        assert all(threshold_count(T, r, k)[0] > cap for r in rows)
    check_all_paths(T, monkeypatch, logits, k)
    # With the fallback's tournament writing garbage the result is still
    # exact: no row took it (and with one key kept, rows do).
    ref_lp, ref_tok = T.vocab_stage(logits, k, backend="torch")
    lp, tok = triton_without_fallback(T, monkeypatch, logits, k)
    assert torch.equal(tok, ref_tok)
    assert_bits(lp, ref_lp)
    with monkeypatch.context() as m:
        m.setattr(T, "_THRESHOLD_KEEP", 1)
        assert not torch.equal(triton_without_fallback(T, m, logits, k)[1], ref_tok)


def test_kept_keys_are_group_maxima(T, monkeypatch, small_chunks):
    """The kept keys are the maxima of groups of `_threshold_group` tokens:
    with K slots, a row whose top K tokens fill one group overflows (its
    other groups' maxima rank below them), and a row whose top K lie in K
    groups does not; the kernel's choice matches `threshold_count` (the
    fallback writes garbage, so a row that took it shows)."""
    monkeypatch.setattr(T, "_threshold_capacity", lambda k: k)
    vocab, k = 600, 4
    chunk, _ = T._vocab_chunking(vocab, k)
    sub, num_sub, cap = T._vocab_threshold_plan(vocab, k, chunk)
    group = T._threshold_group(sub, T._threshold_keep(sub, num_sub))
    assert (cap, group) == (k, 4)
    torch.manual_seed(11)
    logits = torch.randn(2, 1, vocab) - 20.0
    logits[0, 0, :k] = torch.arange(k, 0, -1) + 10.0  # one group
    logits[1, 0, : k * group : group] = torch.arange(k, 0, -1) + 10.0
    counts = [threshold_count(T, r, k)[0] for r in logits.view(-1, vocab)]
    assert counts[0] > cap >= counts[1]

    ref_tok = T.vocab_stage(logits, k, backend="torch")[1]
    tok = triton_without_fallback(T, monkeypatch, logits, k)[1]
    assert not torch.equal(tok[0], ref_tok[0])
    assert torch.equal(tok[1], ref_tok[1])
    check_all_paths(T, monkeypatch, logits, k)


def test_build_tree_with_overflow_rows(T, small_chunks):
    """build_tree: Triton == torch bit for bit on a batch with overflowing
    rows, tied rows and random rows."""
    torch.manual_seed(11)
    logits = torch.randn(3, 3, 100) * 2
    logits[1] = 0.0
    logits[2, 1] = torch.randint(0, 3, (100,)).float()
    for budget in (4, 12):
        a = T.build_tree(logits, budget, backend="torch")
        b = T.build_tree(logits, budget, backend="triton")
        for name in ("token_ids", "parent_idx", "depth", "valid"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert_bits(a.score, b.score)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_cuda_production_vocab(T, monkeypatch, dtype, budget):
    """GPU, V = 151936: the threshold filter's atomics and the fallback's
    shared grid on real hardware.  One batch mixes rows that take the filter
    (random) with rows that overflow (all tied, heavy ties, all -inf) and
    special values; Triton == torch bit for bit, eagerly and replayed from a
    CUDA graph."""
    dev = torch.device("cuda")
    V = 151936
    k = min(budget, V)
    gen = torch.Generator(device=dev).manual_seed(budget)
    logits = torch.randn(8, 15, V, device=dev, generator=gen) * 4
    logits[1] = 0.0
    # Half the tokens tied at the top: with 8 keys kept per sub-block the
    # threshold still passes about half of a sub-block per K / 8 (a quarter
    # tied could stay under the capacity at K = 16).
    logits[2] = torch.randint(0, 2, (15, V), device=dev, generator=gen).float()
    logits[3, :5] = NEG_INF
    logits[4, :, ::7] = NAN
    logits[4, :, 3::13] = float("inf")
    logits = logits.to(dtype)
    counts = [
        threshold_count(T, r.cpu(), k)[0]
        for r in (logits[0, 0], logits[1, 0], logits[2, 0])
    ]
    cap = T._vocab_threshold_plan(V, k, T._vocab_chunking(V, k)[0])[2]
    assert counts[0] <= cap < min(counts[1:])  # both paths in one batch
    check_all_paths(T, monkeypatch, logits, budget, vs_tournament=True)

    ref_lp, ref_tok = T.vocab_stage(logits, budget, backend="torch")
    static = logits.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        T.vocab_stage(static, budget, backend="triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_lp, out_tok = T.vocab_stage(static, budget, backend="triton")
    static.copy_(torch.flip(logits, dims=[0]))  # other rows overflow now
    graph.replay()
    flip_lp, flip_tok = T.vocab_stage(static, budget, backend="torch")
    assert torch.equal(out_tok, flip_tok)
    assert_bits(out_lp, flip_lp)
    static.copy_(logits)
    graph.replay()
    assert torch.equal(out_tok, ref_tok)
    assert_bits(out_lp, ref_lp)
