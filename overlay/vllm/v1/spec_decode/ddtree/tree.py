# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree core: the tree build (the optimal B-node draft tree per request).

Everything here is a pure function of tensors with shapes fixed by
``(R, D, V, B)`` (requests, draft depth, vocabulary, tree budget): no
``.item()``, ``.tolist()``, ``.cpu()`` or data-dependent shapes, so the
functions can run inside CUDA graphs.  Python loops only run over the static
draft depth ``D`` (or ``log2(D)``).  This module imports only ``torch`` (and
Triton for its Triton backend), so that tests import it without vLLM.

The per-step verification that follows the build (tree positions and
attention bias, walk, KV compaction) runs as Triton kernels on the V2 runner
(``vllm/v1/worker/gpu/spec_decode/ddtree/kernels.py``); their torch
reference implementations are the tests' (``tests/ddtree_reference.py``).

Layout convention ("verify layout"): each request verifies ``B + 1`` query
tokens.  Index 0 is the root (the bonus token of the previous step, already
known); indices ``1..B`` are the draft nodes, node ``i`` is stored at column
``i - 1`` of the ``[R, B]`` tree tensors.  The root has depth 0, nodes have
depth ``1..D``.  A parent always precedes its child (``parent_idx < own
index``).

Cost of the build, rows = ``R * D``, ``K = min(B, V)``: the vocabulary
pass dominates.  Torch backend: ``torch.topk`` over ``[rows, V]`` (plus a
second pass for exact ties).  Triton backend (tree_triton.py): one read of
the logits without sorting, a re-read of ``K * SUB`` tokens per row
(``SUB``-token sub-blocks, ``V / SUB >= 2K``), and two sorts of ``O(K)``
keys per row (``~4K`` keys: 256 for K = 64, V = 151936): ``O(rows * (V + K
* SUB + K log^2 K))`` work instead of the tournament's ``O(rows * V log^2
1K)`` sorting network.  Rows with long runs of tied values (more than
``4K`` candidates) fall back to the tournament, at its cost.  The tree
stage is ``O(R * (D * B log B) log^2(B log B))`` (bitonic sorts of the
``~B ln B`` candidate pairs per depth), independent of ``V``.

CUDA graphs: the first call for a given ``(B, V, D, device)`` builds small
static index tables on the device (a host-to-device copy).  Run every function
once eagerly (warm-up) before capturing; later calls, including the captured
ones, only read the cached tables.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import NamedTuple

import torch

__all__ = [
    "DDTree",
    "build_tree",
    "tree_stage",
    "triton_available",
    "vocab_stage",
]

_NEG_INF = float("-inf")


class DDTree(NamedTuple):
    """A batch of draft trees, one per request, in verify layout.

    Column ``c`` of every ``[R, B]`` tensor describes node ``c + 1``.

    Attributes:
        token_ids: ``[R, B]`` int64, draft token of each node.
        parent_idx: ``[R, B]`` int64, verify-layout index of the parent
            (0 = root); always smaller than the node's own index ``c + 1``.
        depth: ``[R, B]`` int64, ``1..D``.
        score: ``[R, B]`` float32, summed draft log-prob of the node's prefix
            (the path root -> node), ``-inf`` allowed.
        valid: ``[R, B]`` bool, False only for padding when ``B`` exceeds the
            number of distinct prefixes (``sum_d V**d``).  Padding nodes have
            token 0, parent 0, depth 1, score ``-inf`` and are never accepted
            by the verification walk.  Padding only ever occupies the last columns.
        draft_depth: ``D`` (static Python int).

    """

    token_ids: torch.Tensor
    parent_idx: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor
    valid: torch.Tensor
    draft_depth: int


# --------------------------------------------------------------------------
# Static index tables
# --------------------------------------------------------------------------


class _BuildPlan(NamedTuple):
    """Static (shape-only) tables for `build_tree`, cached per device.

    Per depth ``d`` the surviving prefixes form a list of ``n_d =
    min(B, V**d)`` entries, sorted by the tree order.  Depth-``d`` candidates
    are pairs ``(a, b)``: prefix ``a`` of depth ``d - 1``, token slot ``b``
    (``b``-th best token at depth ``d``).  The lists of all depths are
    concatenated into ``N = sum_d n_d`` "columns".
    """

    num_tokens: int  # K = min(B, V): token slots kept per depth
    prefix_counts: tuple[int, ...]  # n_d for d = 1..D
    # Depth d >= 2: flat index a * K + b of each kept candidate into the
    # [n_{d-1}, K] outer sum, or None when every pair is kept.
    cand_flat_idx: tuple[torch.Tensor | None, ...]
    num_selected: int  # min(B, N): real nodes; the rest is padding
    col_depth: torch.Tensor  # [N] depth of each column
    col_cand_offset: torch.Tensor  # [N] start of the column's depth in cand
    # Indexed by (depth offset + candidate index), all depths concatenated:
    cand_token_slot: torch.Tensor  # (d - 1) * K + b: slot in [D * K]
    cand_parent_col: torch.Tensor  # column of the parent prefix, N = root
    node_positions: torch.Tensor  # [num_selected] = 1..num_selected


def _depth_pairs(budget: int, num_tokens: int, n_prev: int):
    """Candidate pairs ``(a, b)`` of one depth in list order (see below)."""
    return [
        (a, b) for a in range(n_prev) for b in range(min(num_tokens, budget // (a + 1)))
    ]


@functools.lru_cache(maxsize=64)
def _build_plan(
    budget: int, vocab: int, depth: int, device: torch.device
) -> _BuildPlan:
    num_tokens = min(budget, vocab)
    prefix_counts: list[int] = []
    count = 1
    for _ in range(depth):
        count = min(budget, count * vocab)  # capped, so no huge V**d
        prefix_counts.append(count)

    cand_flat_idx: list[torch.Tensor | None] = []
    cand_token_slot: list[int] = []
    cand_parent_col: list[int] = []
    col_depth: list[int] = []
    col_cand_offset: list[int] = []
    total_cols = sum(prefix_counts)
    col_start = 0
    prev_col_start = 0
    cand_offset = 0
    for d in range(1, depth + 1):
        n_prev = 1 if d == 1 else prefix_counts[d - 2]
        # Candidate (a, b) has at least (a+1)(b+1) - 1 candidates ranked
        # strictly before it (all (a', b') with a' <= a, b' <= b), so only
        # pairs with (a+1)(b+1) <= B can be among the top B.  This keeps
        # ~B ln B of the B*B candidates.  Lexicographic (a, b) order makes
        # "earlier in the list" equal the tie-break (parent rank, token rank).
        pairs = _depth_pairs(budget, num_tokens, n_prev)
        if d >= 2:
            if len(pairs) < n_prev * num_tokens:
                cand_flat_idx.append(
                    torch.tensor(
                        [a * num_tokens + b for a, b in pairs],
                        dtype=torch.int64,
                        device=device,
                    )
                )
            else:
                cand_flat_idx.append(None)
        for a, b in pairs:
            cand_token_slot.append((d - 1) * num_tokens + b)
            cand_parent_col.append(total_cols if d == 1 else prev_col_start + a)
        n_d = prefix_counts[d - 1]
        col_depth.extend([d] * n_d)
        col_cand_offset.extend([cand_offset] * n_d)
        cand_offset += len(pairs)
        prev_col_start = col_start
        col_start += n_d

    num_selected = min(budget, total_cols)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return _BuildPlan(
        num_tokens=num_tokens,
        prefix_counts=tuple(prefix_counts),
        cand_flat_idx=tuple(cand_flat_idx),
        num_selected=num_selected,
        col_depth=as_tensor(col_depth),
        col_cand_offset=as_tensor(col_cand_offset),
        cand_token_slot=as_tensor(cand_token_slot),
        cand_parent_col=as_tensor(cand_parent_col),
        node_positions=torch.arange(
            1, num_selected + 1, dtype=torch.int64, device=device
        ),
    )


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=16)
def _reversed_ids(vocab: int, device: torch.device) -> torch.Tensor:
    """int32 ``vocab - token_id``: larger for smaller ids, always > 0."""
    return torch.arange(vocab, 0, -1, dtype=torch.int32, device=device)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _top_size(k: int, block: int, has_topk: bool) -> int:
    """Output size of the Triton `_top_desc` for the first `k` keys of
    `block`: a bitonic top-k (tl.topk) of next_pow2(k) where this Triton has
    it (k >= 2: older releases lack the k = 1 case), else the full sort.
    Keys are distinct, so both give the same first k in the same order."""
    top = _next_pow2(k)
    return top if has_topk and 2 <= top < block else block


class _TritonPlan(NamedTuple):
    """Extra static tables for the Triton build (see tree_triton.py)."""

    cand_a: torch.Tensor  # [D, CP] int32, row d: depth d + 1 (row 0 unused)
    cand_b: torch.Tensor  # [D, CP] int32
    cand_count: torch.Tensor  # [D] int32
    col_start: torch.Tensor  # [D] int32
    prefix_count: torch.Tensor  # [D] int32
    cand_block: int  # CP
    num_cols: int  # N


@functools.lru_cache(maxsize=64)
def _triton_plan(
    budget: int, vocab: int, depth: int, device: torch.device
) -> _TritonPlan:
    plan = _build_plan(budget, vocab, depth, device)
    counts = plan.prefix_counts
    per_depth = [[]] + [
        _depth_pairs(budget, plan.num_tokens, counts[d - 1]) for d in range(1, depth)
    ]
    cand_block = _next_pow2(max([1] + [len(p) for p in per_depth]))
    cand_a = torch.zeros(depth, cand_block, dtype=torch.int32)
    cand_b = torch.zeros(depth, cand_block, dtype=torch.int32)
    for d, pairs in enumerate(per_depth):
        if pairs:
            ab = torch.tensor(pairs, dtype=torch.int32)
            cand_a[d, : len(pairs)] = ab[:, 0]
            cand_b[d, : len(pairs)] = ab[:, 1]
    col_start = [sum(counts[:d]) for d in range(depth)]

    def as_int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return _TritonPlan(
        cand_a=cand_a.to(device),
        cand_b=cand_b.to(device),
        cand_count=as_int32([len(p) for p in per_depth]),
        col_start=as_int32(col_start),
        prefix_count=as_int32(list(counts)),
        cand_block=cand_block,
        num_cols=sum(counts),
    )


@functools.lru_cache(maxsize=1)
def _triton_kernels() -> ModuleType | None:
    """The Triton backend's kernels (`tree_triton`), or None when Triton is
    not importable (the torch backend still works)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from vllm.v1.spec_decode.ddtree import tree_triton

    return tree_triton


def triton_available() -> bool:
    return _triton_kernels() is not None


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        import os

        backend = os.environ.get("VLLM_DDTREE_BACKEND", "auto")
    if backend == "auto":
        # Triton on CUDA: a few launches instead of ~100 small torch kernels
        # (H200, R=1, B=64, D=15: tree stage 66 us against 381 us).  The
        # torch backend is the reference and the CPU path.
        if device.type == "cuda" and triton_available():
            return "triton"
        return "torch"
    # VLLM_DDTREE_BACKEND is checked at startup too
    # (config._verify_tree_build_backend); these guard direct callers.
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown DDTree build backend {backend!r}")
    if backend == "triton" and not triton_available():
        raise RuntimeError(
            "DDTree triton backend requested but triton is not importable"
        )
    return backend


# --------------------------------------------------------------------------
# Tree build
# --------------------------------------------------------------------------


def _top_tokens(
    scores: torch.Tensor, k: int, exact_vocab_ties: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` entries of each row of ``scores [rows, V]`` (float32).

    Returns ``(values, token_ids)``, both ``[rows, k]``, ordered by
    (value desc, token id asc).  With ``exact_vocab_ties`` the selected set
    is exactly the first ``k`` in that order even when values tie at the
    k-th place (``torch.topk`` does not promise which tied entries it keeps).
    """
    vocab = scores.shape[-1]
    if k >= vocab:
        token_ids = _arange(vocab, scores.device).expand(scores.shape[0], -1)
    else:
        values, token_ids = torch.topk(scores, k, dim=-1, sorted=False)
        if exact_vocab_ties:
            # Only entries equal to the k-th value are ambiguous.  Re-select
            # with an integer key: everything strictly above the threshold
            # (fewer than k entries, all kept) gets 2V, entries at the
            # threshold get V - token_id (smaller ids win), the rest 0.
            threshold = values.amin(dim=-1, keepdim=True)
            key = torch.where(
                scores == threshold, _reversed_ids(vocab, scores.device), 0
            )
            key = key.masked_fill_(scores > threshold, 2 * vocab)
            token_ids = torch.topk(key, k, dim=-1, sorted=False).indices
        # Order by (value desc, id asc): sort by id, then stable by value.
        token_ids = torch.sort(token_ids, dim=-1).values
    values = scores.gather(-1, token_ids)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    token_ids = token_ids.gather(-1, order)
    return values, token_ids


def build_tree(
    draft_logits: torch.Tensor,
    tree_budget: int,
    *,
    inputs_are_logprobs: bool = False,
    exact_vocab_ties: bool = True,
    backend: str = "auto",
) -> DDTree:
    """Build the optimal DDTree for each request.

    Args:
        draft_logits: ``[R, D, V]`` (any float dtype) draft logits, depth
            ``d`` at index ``d - 1``.  Log-probs are ``log_softmax`` in
            float32 without temperature (as the reference).  NaN logits are
            treated as ``-inf`` (zero probability).
        tree_budget: ``B >= 1``, number of draft nodes per request.
        inputs_are_logprobs: ``draft_logits`` already holds log-probs; they
            are used as given (NaN -> ``-inf``, clamped to ``<= 0``).
        exact_vocab_ties: resolve ties at the per-depth top-B boundary over
            the vocabulary exactly (costs a second pass over ``[R*D, V]``).
            With False, which of several exactly tied boundary tokens enters
            the tree is left to ``torch.topk`` (deterministic per device).
            The Triton backend always resolves these ties exactly; with
            False it also fuses the logsumexp into its single pass over the
            logits, whose float32 rounding may then differ from
            ``torch.logsumexp`` by a few ulp (scores shift accordingly).
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (default: the
            ``VLLM_DDTREE_BACKEND`` environment variable if set, else Triton
            on CUDA and torch elsewhere).  Both give the documented result;
            with ``exact_vocab_ties=True`` they are bit-identical.

    Returns:
        `DDTree` with the ``B`` prefixes (lengths ``1..D``) of highest summed
        log-prob.  This is exact and prefix-closed.  Nodes are ordered by the
        total order::

            key(node) = (score desc, depth asc, rank of parent asc,
                         token rank asc)

        where the token rank orders the vocabulary at the node's depth by
        (draft logit desc, token id asc), or log-prob for
        ``inputs_are_logprobs``.  Scores are summed in float32 from depth 1
        down: ``((lp_1 + lp_2) + lp_3) + ...``.  The key is total (siblings
        differ in token).  A parent ranks before its children because
        ``score(child) <= score(parent)`` and ties go to the smaller depth.
        Padding (``valid == False``) only appears when ``B > sum_d V**d``.

    Algorithm (O(D) batched steps, no host synchronisation): one top-``B``
    over the vocabulary for all ``R * D`` rows; for ``d = 2..D`` the top-``B``
    prefixes of depth ``d`` are among {top-``B`` prefixes of depth ``d-1``}
    x {top-``B`` tokens at depth ``d``}, and only pairs of ranks ``(a, b)``
    with ``(a+1)(b+1) <= B`` can qualify; a stable sort keeps the tie order.
    Finally one stable sort picks the global top-``B`` over all depths.

    """
    if draft_logits.dim() != 3:
        raise ValueError("draft_logits must be [R, D, V]")
    if tree_budget < 1:
        raise ValueError("tree_budget must be >= 1")
    backend = _resolve_backend(backend, draft_logits.device)
    token_logprobs, top_tokens = vocab_stage(
        draft_logits,
        tree_budget,
        inputs_are_logprobs=inputs_are_logprobs,
        exact_vocab_ties=exact_vocab_ties,
        backend=backend,
    )
    return tree_stage(token_logprobs, top_tokens, tree_budget, backend=backend)


def _vocab_chunking(vocab: int, num_tokens: int) -> tuple[int, int]:
    """(chunk, num_chunks) for the Triton vocabulary pass: chunks of 1K
    tokens (at least the next power of two of ``num_tokens``, at most the
    vocabulary's), one program each; in the tournament each is sorted by its
    program.  Small sorts in many programs: on the H200 one program sorting
    4K keys costs ~10x one sorting 1K."""
    chunk = max(1024, _next_pow2(num_tokens))
    chunk = min(chunk, max(_next_pow2(vocab), _next_pow2(num_tokens)))
    return chunk, -(-vocab // chunk)


def _merge_fan_in(num_tokens: int) -> int:
    """Chunks whose top-``K`` candidates one merge program sorts together
    (about 1K keys per sort, at least 2 chunks)."""
    return max(2, 1024 // num_tokens)


# Programs of the fallback launches: about what an H200 keeps resident, so
# that overflowed rows get the tournament's parallelism while a batch without
# overflow costs only these programs' one load each.
_FALLBACK_PROGRAMS = 1024


def _threshold_capacity(num_tokens: int) -> int:
    """Threshold candidates kept per row before the row falls back to the
    tournament: ``16 K``, or at least ``4 K`` where that exceeds the 2048
    keys one program sorts. A trained drafter's likely tokens cluster in
    the vocabulary (byte-pair ids number frequent tokens first), so the
    count is well above the ``1.3 K`` of independent positions (see
    `_vocab_threshold_plan`)."""
    return min(16 * num_tokens, max(4 * num_tokens, 2048))


# Keys of each sub-block the threshold is taken over (its largest few, not
# only its maximum): where the likely tokens sit in few sub-blocks, the K-th
# largest sub-block maximum falls far down the row and most of those
# sub-blocks' tokens pass it. Measured offline on the dense benchmark
# pair's drafter (bench/results/archive/2026-12-03-threshold-overflow-*.json:
# 1440 rows of held-out prompts, its own BPE-ordered vocabulary): with one key
# per sub-block 85% (K = 15) and 40% (K = 64) of rows overflowed 4 K slots;
# with 8 keys and 16 K slots none did, also with its 8192 tokens as the first
# ids of a 151936-token vocabulary.
_THRESHOLD_KEEP = 8
# The kept keys are the largest maxima of groups of this many consecutive
# tokens, not the sub-block's largest keys: still keys of the row (so the
# threshold stays a lower bound of its K-th largest key) at a sixteenth of
# the work of the keep rounds. Offline (the archived -groups-dense-8b.json,
# 1440 rows of the dense pair, three layouts, K = 15 and 64) no row
# overflowed either way; the largest counts grew from 536 to 561 (median)
# and from 982 to 1003 (maximum) of 1024 slots (K = 64, its tokens the
# first ids of the vocabulary).
_THRESHOLD_GROUP = 16


def _threshold_keep(sub: int, num_sub: int) -> int:
    """Keys per sub-block for the threshold (a power of 2, at most
    `_THRESHOLD_KEEP` and ``sub``), fewer where the row's kept keys would
    exceed the 2048 one program sorts."""
    keep = min(_THRESHOLD_KEEP, sub)
    while keep > 1 and _next_pow2(num_sub * keep) > 2048:
        keep //= 2
    return keep


def _threshold_group(sub: int, keep: int) -> int:
    """Tokens per group whose maxima a sub-block's kept keys are taken from
    (a power of 2: `_THRESHOLD_GROUP`, fewer where a sub-block would hold
    fewer than ``keep`` groups)."""
    return max(1, min(_THRESHOLD_GROUP, sub // keep))


def _vocab_threshold_plan(
    vocab: int, num_tokens: int, chunk: int
) -> tuple[int, int, int] | None:
    """``(sub, num_sub, capacity)`` of the Triton threshold filter, or None
    where its sorts would be too large (``K`` above ~512): then only the
    tournament runs.

    Sub-blocks of ``sub`` tokens (a power of 2 dividing ``chunk``, the
    largest with ``num_sub = ceil(V / sub) >= 2 K``, or 1), each keeping the
    `_threshold_keep` largest maxima of its groups of `_threshold_group`
    tokens, keys of the row all: the row's top ``K`` are >= ``t``, the
    ``K``-th largest kept key (at least ``K`` keys are).  The keys >= t lie
    in the sub-blocks whose maximum is >= t, at most ``K`` of them (each
    puts its maximum among the ``K`` kept keys >= t); with the top tokens at
    independent positions and one key kept per sub-block their expected
    number is about ``num_sub * ln(num_sub / (num_sub - K))`` (coupon
    collector), ``<= 1.39 K`` for ``num_sub >= 2 K``; more kept keys lower
    it where the top tokens cluster.  ``capacity``: power of 2, at least
    ``K``, at most needed for all of ``V``.
    """
    sub = chunk
    while sub > 1 and -(-vocab // sub) < 2 * num_tokens:
        sub //= 2
    num_sub = -(-vocab // sub)
    capacity = _next_pow2(max(num_tokens, min(_threshold_capacity(num_tokens), vocab)))
    if _next_pow2(num_sub) > 2048 or capacity > 2048:
        return None
    return sub, num_sub, capacity


def vocab_stage(
    draft_logits: torch.Tensor,
    tree_budget: int,
    *,
    inputs_are_logprobs: bool = False,
    exact_vocab_ties: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """First stage of `build_tree`: per (request, depth) row the top
    ``K = min(B, V)`` tokens and their log-probs.

    Returns ``(token_logprobs [R, D, K] float32, top_tokens [R, D * K]
    int64)``, each row ordered by (draft logit desc, token id asc).
    """
    num_reqs, draft_depth, vocab = draft_logits.shape
    device = draft_logits.device
    num_tokens = min(tree_budget, vocab)
    backend = _resolve_backend(backend, device)
    rows = num_reqs * draft_depth
    logits2d = draft_logits.reshape(rows, vocab)

    lse = None
    if backend == "triton":
        if logits2d.stride(1) != 1:
            logits2d = logits2d.contiguous()
        if exact_vocab_ties and not inputs_are_logprobs:
            # Reference numerics for the logsumexp (bit-identical to the
            # torch backend); the top-K itself is always exact here.
            lse = _reference_lse(logits2d)
        return _triton_vocab(
            logits2d, num_reqs, draft_depth, num_tokens, inputs_are_logprobs, lse
        )

    # float32 working copy with NaN -> -inf.  The caller's logits are never
    # modified: NaN replacement is in place only on our own float32 copy.
    scores = _float_copy(logits2d)
    if inputs_are_logprobs:
        scores = scores.clamp_max_(0.0)

    top_values, top_tokens = _top_tokens(scores, num_tokens, exact_vocab_ties)
    if inputs_are_logprobs:
        token_logprobs = top_values
    else:
        # log_softmax(x)[top] = x[top] - logsumexp(x): no full-size float32
        # log-prob tensor.  -inf - -inf = NaN -> -inf; the clamp keeps
        # "child score <= parent score" even if rounding made lp > 0.
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        token_logprobs = torch.nan_to_num(
            top_values - lse, nan=_NEG_INF, posinf=_NEG_INF
        )
        token_logprobs = token_logprobs.clamp_max_(0.0)
    token_logprobs = token_logprobs.view(num_reqs, draft_depth, num_tokens)
    top_tokens = top_tokens.reshape(num_reqs, draft_depth * num_tokens)
    return token_logprobs, top_tokens


def _float_copy(logits2d: torch.Tensor) -> torch.Tensor:
    nan_kwargs = dict(nan=_NEG_INF, posinf=float("inf"), neginf=_NEG_INF)
    if logits2d.dtype != torch.float32:
        return logits2d.float().nan_to_num_(**nan_kwargs)
    return torch.nan_to_num(logits2d, **nan_kwargs)


def _reference_lse(logits2d: torch.Tensor) -> torch.Tensor:
    """``[rows]`` float32 logsumexp exactly as the torch backend computes
    it (float32 copy, NaN -> -inf, torch.logsumexp)."""
    return torch.logsumexp(_float_copy(logits2d), dim=-1)


def _triton_vocab(
    logits2d: torch.Tensor,
    num_reqs: int,
    draft_depth: int,
    num_tokens: int,
    inputs_are_logprobs: bool,
    lse: torch.Tensor | None,
):
    """Triton vocabulary pass (see tree_triton.py's docstring): threshold
    filter, with the exact tournament as the per-row fallback (all of it
    always launched, fixed shapes, no host synchronisation)."""
    kernels = _triton_kernels()
    rows, vocab = logits2d.shape
    device = logits2d.device
    chunk, num_chunks = _vocab_chunking(vocab, num_tokens)
    plan = _vocab_threshold_plan(vocab, num_tokens, chunk)
    compute_lse = lse is None and not inputs_are_logprobs
    key16 = logits2d.dtype == torch.bfloat16 and chunk <= 65536
    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    if compute_lse:
        part_max = torch.empty(rows, num_chunks, **f32)
        part_sum = torch.empty(rows, num_chunks, **f32)
    else:
        part_max = part_sum = torch.empty(1, **f32)
    cand = torch.empty(rows, num_chunks * num_tokens, **i64)

    gated = plan is not None
    if gated:
        sub, num_sub, capacity = plan
        keep = _threshold_keep(sub, num_sub)
        submax = torch.empty(rows, num_sub * keep, **i64)
        thresh = torch.empty(rows, **i64)
        blocks = torch.empty(rows, num_tokens, dtype=torch.int32, device=device)
        count = torch.empty(rows, dtype=torch.int32, device=device)
        small = torch.empty(rows, capacity, **i64)
        num_over = torch.empty(1, dtype=torch.int32, device=device)
        over_rows = torch.empty(rows, dtype=torch.int32, device=device)
        # 1. Partial logsumexps and sub-block maxima (no sort).
        kernels._vocab_stats_kernel[(rows, num_chunks)](
            logits2d,
            part_max,
            part_sum,
            cand,
            submax,
            vocab,
            logits2d.stride(0),
            num_chunks,
            num_sub,
            -1,
            K=num_tokens,
            CHUNK=chunk,
            SUB=sub,
            KEEP=keep,
            GROUP=_threshold_group(sub, keep),
            IS_LOGPROBS=inputs_are_logprobs,
            COMPUTE_LSE=compute_lse,
            num_warps=4 if chunk <= 2048 else 8,
        )
        # 2. Threshold t = K-th largest of the sub-blocks' kept keys, and the
        # (at most K) sub-blocks that hold every key >= t.
        kept_block = _next_pow2(num_sub * keep)
        kernels._vocab_threshold_kernel[(rows,)](
            submax,
            thresh,
            blocks,
            count,
            num_over,
            num_sub,
            K=num_tokens,
            KEEP=keep,
            MP=kept_block,
            MB=_next_pow2(num_sub),
            TOP=_top_size(num_tokens, kept_block, kernels.HAS_TOPK),
            num_warps=4,
        )
        # 3. Append the keys >= t to the row's candidates (atomic count).
        # ~2K tokens per program
        per_prog = min(_next_pow2(num_tokens), max(1, 2048 // sub))
        kernels._vocab_filter_kernel[(rows, -(-num_tokens // per_prog))](
            logits2d,
            thresh,
            blocks,
            count,
            small,
            num_over,
            over_rows,
            vocab,
            logits2d.stride(0),
            K=num_tokens,
            SUB=sub,
            G=per_prog,
            CAP=capacity,
            IS_LOGPROBS=inputs_are_logprobs,
            num_warps=4,
        )
    # The tournament: the exact answer for the rows whose threshold
    # candidates overflowed (a fixed grid of programs shares out their
    # (row, chunk) pairs), or for every row without a plan.
    token_logprobs = torch.empty(num_reqs, draft_depth, num_tokens, **f32)
    top_tokens = torch.empty(num_reqs, draft_depth * num_tokens, **i64)
    if gated:
        kernels._fallback_chunk_kernel[(min(rows * num_chunks, _FALLBACK_PROGRAMS),)](
            logits2d,
            cand,
            num_over,
            over_rows,
            vocab,
            logits2d.stride(0),
            num_chunks,
            K=num_tokens,
            CHUNK=chunk,
            IS_LOGPROBS=inputs_are_logprobs,
            KEY16=key16,
            num_warps=4 if chunk <= 2048 else 8,
        )
    else:
        count = small = None
        capacity = 1
        kernels._vocab_chunk_kernel[(rows, num_chunks)](
            logits2d,
            part_max,
            part_sum,
            cand,
            vocab,
            logits2d.stride(0),
            num_chunks,
            K=num_tokens,
            CHUNK=chunk,
            IS_LOGPROBS=inputs_are_logprobs,
            COMPUTE_LSE=compute_lse,
            KEY16=key16,
            num_warps=4 if chunk <= 2048 else 8,
        )
    # Tournament: the top-K of a row are among the top-K of each group of
    # chunks, so groups of fan_in chunks shrink to K candidates per level
    # (static shapes: the level count depends on V and K only).
    num_cand = num_chunks * num_tokens
    group = _merge_fan_in(num_tokens) * num_tokens
    while num_cand > group:
        num_groups = -(-num_cand // group)
        merged = torch.empty(rows, num_groups * num_tokens, **i64)
        if gated:
            kernels._fallback_merge_kernel[
                (min(rows * num_groups, _FALLBACK_PROGRAMS),)
            ](
                cand,
                merged,
                num_over,
                over_rows,
                num_cand,
                num_groups,
                K=num_tokens,
                GROUP=group,
                BLOCK=_next_pow2(group),
                num_warps=4 if group <= 2048 else 8,
            )
        else:
            kernels._topk_merge_kernel[(rows, num_groups)](
                cand,
                merged,
                num_cand,
                num_groups,
                K=num_tokens,
                GROUP=group,
                BLOCK=_next_pow2(group),
                num_warps=4 if group <= 2048 else 8,
            )
        cand, num_cand = merged, num_groups * num_tokens
    cand_block = _next_pow2(num_cand)
    # 4. Per row the top K of the threshold candidates or of the tournament,
    # and the log-probs.
    kernels._vocab_merge_kernel[(rows,)](
        part_max,
        part_sum,
        cand,
        token_logprobs,
        top_tokens,
        lse if lse is not None else part_max,
        small if gated else cand,
        count if gated else cand,
        num_chunks,
        num_cand,
        K=num_tokens,
        NC_BLOCK=_next_pow2(num_chunks),
        CAND_BLOCK=cand_block,
        IS_LOGPROBS=inputs_are_logprobs,
        HAS_LSE=lse is not None and not inputs_are_logprobs,
        THRESHOLD=gated,
        CAP=capacity,
        CAP_TOP=_top_size(num_tokens, capacity, kernels.HAS_TOPK),
        # as before the threshold filter: _combine_lse's reduction order
        # depends on num_warps
        num_warps=4 if cand_block <= 2048 else 8,
    )
    return token_logprobs, top_tokens


def tree_stage(
    token_logprobs: torch.Tensor,
    top_tokens: torch.Tensor,
    tree_budget: int,
    *,
    backend: str = "auto",
) -> DDTree:
    """Second stage of `build_tree`: the tree from `vocab_stage`'s output
    (``token_logprobs [R, D, K]``, ``top_tokens [R, D * K]``)."""
    num_reqs, draft_depth, num_tokens = token_logprobs.shape
    device = token_logprobs.device
    backend = _resolve_backend(backend, device)
    # The plan depends on V only through K = min(B, V) and V**d >= B
    # checks; K < B means V = K.
    vocab = num_tokens if num_tokens < tree_budget else tree_budget
    plan = _build_plan(tree_budget, vocab, draft_depth, device)
    if backend == "triton":
        return _triton_tree(
            token_logprobs,
            top_tokens,
            tree_budget,
            plan,
            _triton_plan(tree_budget, vocab, draft_depth, device),
        )
    return _torch_tree(token_logprobs, top_tokens, tree_budget, plan)


def _triton_tree(token_logprobs, top_tokens, tree_budget, plan, tplan):
    kernels = _triton_kernels()
    num_reqs, draft_depth, num_tokens = token_logprobs.shape
    device = token_logprobs.device
    n_cols = tplan.num_cols
    i64 = dict(dtype=torch.int64, device=device)
    all_scores = torch.empty(num_reqs, n_cols, dtype=torch.float32, device=device)
    all_cands = torch.empty(num_reqs, n_cols, dtype=torch.int32, device=device)
    col_position = torch.empty(num_reqs, n_cols + 1, **i64)
    tokens = torch.empty(num_reqs, tree_budget, **i64)
    parent = torch.empty(num_reqs, tree_budget, **i64)
    depth = torch.empty(num_reqs, tree_budget, **i64)
    score = torch.empty(num_reqs, tree_budget, dtype=torch.float32, device=device)
    valid = torch.empty(num_reqs, tree_budget, dtype=torch.int8, device=device)
    n_block = _next_pow2(max(n_cols, tree_budget))
    kernels._tree_kernel[(num_reqs,)](
        token_logprobs.contiguous(),
        top_tokens.contiguous(),
        tplan.cand_a,
        tplan.cand_b,
        tplan.cand_count,
        tplan.col_start,
        tplan.prefix_count,
        plan.col_depth,
        plan.col_cand_offset,
        plan.cand_token_slot,
        plan.cand_parent_col,
        all_scores,
        all_cands,
        col_position,
        tokens,
        parent,
        depth,
        score,
        valid,
        n_cols,
        plan.num_selected,
        D=draft_depth,
        K=num_tokens,
        B=tree_budget,
        CP=tplan.cand_block,
        KP=_next_pow2(num_tokens),
        NB=n_block,
        TN=_top_size(max(plan.prefix_counts), tplan.cand_block, kernels.HAS_TOPK),
        TB=_top_size(tree_budget, n_block, kernels.HAS_TOPK),
        # One program per request runs every depth's sort in sequence: more
        # warps shorten each bitonic stage once the blocks reach 1024 keys
        # (H200, R=1: B=64 tree 64 -> 41 us at 8 warps; B=16 the same).
        num_warps=4 if max(n_block, tplan.cand_block) <= 512 else 8,
    )
    return DDTree(
        token_ids=tokens,
        parent_idx=parent,
        depth=depth,
        score=score,
        valid=valid.view(torch.bool),
        draft_depth=draft_depth,
    )


def _torch_tree(token_logprobs, top_tokens, tree_budget, plan) -> DDTree:
    num_reqs, draft_depth, num_tokens = token_logprobs.shape
    device = token_logprobs.device

    # Per-depth top-n_d prefixes, as (score, index into that depth's
    # candidate list).  Depth 1: the tokens, already in order.
    depth_scores = [token_logprobs[:, 0, : plan.prefix_counts[0]]]
    depth_cands = [_arange(plan.prefix_counts[0], device).expand(num_reqs, -1)]
    prev_scores = depth_scores[0]
    for d in range(2, draft_depth + 1):
        outer = prev_scores.unsqueeze(2) + token_logprobs[:, d - 1, None, :]
        cand_scores = outer.view(num_reqs, -1)
        flat_idx = plan.cand_flat_idx[d - 2]
        if flat_idx is not None:
            cand_scores = cand_scores.index_select(1, flat_idx)
        # Stable: among equal scores the earlier candidate, i.e. smaller
        # (parent rank, token rank), wins, as the documented key requires.
        sorted_scores, order = torch.sort(
            cand_scores, dim=1, descending=True, stable=True
        )
        n_d = plan.prefix_counts[d - 1]
        prev_scores = sorted_scores[:, :n_d]
        depth_scores.append(prev_scores)
        depth_cands.append(order[:, :n_d])

    # Global top-B: columns are depth-major and rank-ordered within a depth,
    # so a stable sort on score gives (score desc, depth asc, rank asc).
    all_scores = torch.cat(depth_scores, dim=1)
    all_cands = torch.cat(depth_cands, dim=1)
    sorted_scores, order = torch.sort(all_scores, dim=1, descending=True, stable=True)
    num_sel = plan.num_selected
    node_cols = order[:, :num_sel]
    node_score = sorted_scores[:, :num_sel]
    node_depth = plan.col_depth[node_cols]
    node_cand = all_cands.gather(1, node_cols) + plan.col_cand_offset[node_cols]
    node_tokens = top_tokens.gather(1, plan.cand_token_slot[node_cand])

    # Parent index: verify position of the parent's column.  Column N (extra)
    # is the root with position 0; unselected columns are never referenced
    # because the selection is prefix-closed.
    total_cols = all_scores.shape[1]
    col_position = torch.zeros(
        num_reqs, total_cols + 1, dtype=torch.int64, device=device
    )
    col_position.scatter_(1, node_cols, plan.node_positions.expand(num_reqs, -1))
    node_parent = col_position.gather(1, plan.cand_parent_col[node_cand])

    valid = torch.ones(num_reqs, tree_budget, dtype=torch.bool, device=device)
    num_pad = tree_budget - num_sel
    if num_pad > 0:  # static: only when B > sum_d V**d

        def pad(x: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, num_pad), value=value)

        node_tokens = pad(node_tokens, 0)
        node_parent = pad(node_parent, 0)
        node_depth = pad(node_depth, 1)
        node_score = pad(node_score, _NEG_INF)
        valid[:, num_sel:] = False
    return DDTree(
        token_ids=node_tokens,
        parent_idx=node_parent,
        depth=node_depth,
        score=node_score.contiguous(),
        valid=valid,
        draft_depth=draft_depth,
    )
