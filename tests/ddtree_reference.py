# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Torch reference implementations of DDTree's verification (test oracles).

The runtime verifies trees with one Triton launch per step
(``vllm/v1/worker/gpu/spec_decode/ddtree/kernels.py``: walk, tree attention
bias, KV compaction); these plain batched torch functions define what those
kernels must compute, in the verify layout of ``DDTree`` (node ``i`` at column
``i - 1``, the root at index 0). They are not shipped in the wheel.

- `tree_positions`: positions of the verify tokens (root + depth);
- `ancestor_mask` / `tree_attention_bias` / `pack_ancestor_bits`: which
  tree tokens a token may attend to;
- `walk_tree`: the accepted path, emitted tokens and bonus token;
- `compaction_indices`: where the accepted path's KV and hidden states move;
- `paged_prefix_attention`: the prefix pass of the split tree attention
  (``vllm/v1/spec_decode/ddtree/tree_attention.py``), what FA3 computes
  there.

Torch only, like ``tree.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from vllm.v1.spec_decode.ddtree.tree import DDTree

_NEG_INF = float("-inf")


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device)


class WalkResult(NamedTuple):
    """Result of walking the tree with the target's tokens.

    Attributes:
        accepted_idx: ``[R, D + 1]`` int64, verify-layout indices of the
            accepted path, root first (``accepted_idx[:, 0] == 0``); entry
            ``k`` is the accepted node of depth ``k``.  Entries
            ``k >= num_accepted`` are -1.
        num_accepted: ``[R]`` int64, nodes on the path including the root,
            in ``1..D + 1``.  Equals the number of tokens emitted this step.
        output_token_ids: ``[R, D + 1]`` int64, the target's token at each
            accepted node = the emitted tokens (accepted drafts, then the
            bonus token last); -1 for ``k >= num_accepted``.
        bonus_token_ids: ``[R]`` int64, the target's token at the last
            accepted node (the next step's root).
        accepted_mask: ``[R, B + 1]`` bool, True at the accepted nodes.

    """

    accepted_idx: torch.Tensor
    num_accepted: torch.Tensor
    output_token_ids: torch.Tensor
    bonus_token_ids: torch.Tensor
    accepted_mask: torch.Tensor


class CompactionPlan(NamedTuple):
    """Where the accepted path's KV entries / hidden states must move.

    For request ``r`` and ``k in 0..D`` (``k``-th node of the accepted path,
    which has depth ``k``):

    Attributes:
        src_idx: ``[R, D + 1]`` int64, verify-layout index of the ``k``-th
            accepted node; 0 (the root) for ``k >= num_accepted``.
        dst_offset: ``[R, D + 1]`` int64, ``= k``: the node's token belongs
            at sequence position ``root_position + k``, i.e. in the ``k``-th
            slot of the request's verify window.
        needs_move: ``[R, D + 1]`` bool, ``k < num_accepted and
            src_idx != k``.  A chain-shaped prefix of the path is already in
            place.
        src_token_idx: ``[R, D + 1]`` int64 or None, ``query_start_loc[r] +
            src_idx``: row of the ``k``-th accepted node in the flattened
            verify batch (the root's row for ``k >= num_accepted``).
        dst_token_idx: ``[R, D + 1]`` int64 or None, ``query_start_loc[r] +
            k`` where ``needs_move``, else ``src_token_idx`` (a self-copy),
            so that all ``R * (D + 1)`` copies can be issued unconditionally.
        num_accepted: ``[R]`` int64, copied from the walk for convenience.

    Use on the vLLM side (verify window KV slots must be assigned by query
    index, i.e. node ``i`` writes the slot of position ``root_position + i``,
    *not* by its tree position ``root_position + depth``, otherwise siblings
    overwrite each other):

    * KV cache, for every KV-cache group and every layer of the group::

          slots = slot_mapping  # [num_tokens] of the verify pass
          src = slots[src_token_idx.flatten()]
          dst = slots[dst_token_idx.flatten()]
          kv[dst] = kv[src]  # gather all sources first, then scatter

      Torch advanced indexing evaluates the right-hand side into a temporary
      first, which matters: a source slot of one move can be the destination
      of another move.  All real destinations are distinct, and self-copies
      write back the value they read, so the result is well defined.
    * Next DFlash context: ``hidden_states[src_token_idx]`` (``[R, D + 1,
      H]``) are the target hidden states of the accepted path in order;
      entries ``k >= num_accepted`` are padding (the root's state).
    * The request's sequence advances by ``num_accepted`` tokens; the bonus
      token (``WalkResult.bonus_token_ids``) is the next root.

    """

    src_idx: torch.Tensor
    dst_offset: torch.Tensor
    needs_move: torch.Tensor
    src_token_idx: torch.Tensor | None
    dst_token_idx: torch.Tensor | None
    num_accepted: torch.Tensor


@functools.lru_cache(maxsize=16)
def _bit_weights(device: torch.device) -> torch.Tensor:
    # 1 << j for j < 31, and INT32_MIN for bit 31: the bits are disjoint, so
    # an int32 sum equals a bitwise OR and never overflows.
    weights = [1 << j for j in range(31)] + [-(1 << 31)]
    return torch.tensor(weights, dtype=torch.int32, device=device)


def _num_jump_steps(draft_depth: int) -> int:
    """Pointer-jumping rounds so that 2**steps >= draft_depth."""
    return max(0, (draft_depth - 1).bit_length())


# --------------------------------------------------------------------------
# Verification inputs
# --------------------------------------------------------------------------


def tree_positions(root_positions: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Positions of the ``B + 1`` verify tokens: ``[R, B + 1]``.

    Column 0 is ``root_positions`` (``[R]``), column ``i`` is
    ``root_positions + depth[:, i - 1]``.  Keeps ``root_positions``' dtype.
    """
    root = root_positions.unsqueeze(1)
    node = (root + depth).to(root_positions.dtype)
    return torch.cat([root, node], dim=1)


def _with_root(node_values: torch.Tensor, root_value: int | bool = 0) -> torch.Tensor:
    """Prepend the root column: ``[R, B]`` -> ``[R, B + 1]``.

    For parent pointers the root (index 0) is its own parent; for depths the
    root has depth 0.
    """
    return torch.nn.functional.pad(node_values, (1, 0), value=root_value)


def ancestor_mask(parent_idx: torch.Tensor, draft_depth: int) -> torch.Tensor:
    """``[R, B + 1, B + 1]`` bool: ``[r, i, j]`` iff ``j`` is ``i`` or an
    ancestor of ``i``.  The root (0) is everyone's ancestor.

    Row ``i`` is the set of query tokens token ``i`` may attend to inside
    the tree (it always sees the whole committed prefix as well).  Built by
    pointer jumping: after ``s`` rounds each row covers ancestors up to
    distance ``2**s``, so ``ceil(log2(D))`` rounds of batched gathers.
    """
    num_reqs, budget = parent_idx.shape
    n = budget + 1
    jump = _with_root(parent_idx)  # 2**s-th ancestor pointer
    mask = torch.eye(n, dtype=torch.bool, device=parent_idx.device)
    mask = mask.unsqueeze(0).repeat(num_reqs, 1, 1)
    mask.scatter_(2, jump.unsqueeze(2), True)  # self + parent
    for _ in range(_num_jump_steps(draft_depth)):
        # ancestors(i) within 2d = ancestors(i) within d
        #                          | ancestors(d-th ancestor of i) within d
        mask = mask | mask.gather(1, jump.unsqueeze(2).expand(-1, -1, n))
        jump = jump.gather(1, jump)
    mask[:, :, 0] = True
    return mask


def tree_attention_bias(
    mask: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive intra-tree attention bias ``[R, B + 1, B + 1]``: 0 where
    ``mask`` (from `ancestor_mask`) is True, ``-inf`` elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    neg_inf = torch.full((), _NEG_INF, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, neg_inf)


def pack_ancestor_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack ``mask [R, N, N]`` into int32 words ``[R, N, ceil(N / 32)]``.

    Bit ``j % 32`` of word ``j // 32`` is ``mask[..., j]`` (bit 31 is the
    sign bit of the int32).
    """
    num_reqs, n_query, n_key = mask.shape
    num_words = (n_key + 31) // 32
    pad = num_words * 32 - n_key
    if pad:
        mask = torch.nn.functional.pad(mask, (0, pad), value=False)
    bits = mask.view(num_reqs, n_query, num_words, 32).to(torch.int32)
    return (bits * _bit_weights(mask.device)).sum(dim=-1, dtype=torch.int32)


# --------------------------------------------------------------------------
# Verification walk and compaction
# --------------------------------------------------------------------------


def walk_tree(
    tree: DDTree,
    target_token_ids: torch.Tensor,
    ancestors: torch.Tensor | None = None,
) -> WalkResult:
    """Accept the longest tree path that the target agrees with.

    Args:
        tree: from `build_tree` (or any tree in verify layout whose siblings
            have distinct tokens and whose parents precede their children).
        target_token_ids: ``[R, B + 1]`` int64, the target's token at every
            verify position (argmax for greedy, a sample for T > 0; the same
            walk serves both, the result is lossless either way).
        ancestors: optional ``ancestor_mask(tree.parent_idx, D)``; when the
            caller already has it (it is needed for attention anyway) the
            walk uses it instead of pointer jumping (fewer launches).

    Node ``i`` matches iff ``valid`` and ``token[i] == target[parent[i]]``;
    it is accepted iff it and all its ancestors match (pointer jumping,
    ``ceil(log2(D))`` rounds, or one masked reduction over ``ancestors``).
    Siblings are distinct, so the accepted nodes form one path from the
    root, with one node per depth.

    """
    num_reqs, budget = tree.token_ids.shape
    draft_depth = tree.draft_depth
    device = tree.token_ids.device
    target = target_token_ids.long()

    matches = tree.valid & (tree.token_ids == target.gather(1, tree.parent_idx))
    if ancestors is not None:
        # accepted(i) = no ancestor-or-self of i fails to match.
        mismatch = _with_root(~matches, False)
        accepted = ~(ancestors & mismatch.unsqueeze(1)).any(dim=2)
    else:
        accepted = _with_root(matches, True)
        jump = _with_root(tree.parent_idx)
        for _ in range(_num_jump_steps(draft_depth)):
            accepted = accepted & accepted.gather(1, jump)
            jump = jump.gather(1, jump)
    num_accepted = accepted.sum(dim=1)

    # The accepted node of depth k goes to column k; the others go to a
    # scratch column D + 1 that is dropped.
    depth = _with_root(tree.depth)
    dest = torch.where(accepted, depth, draft_depth + 1)
    path = torch.full((num_reqs, draft_depth + 2), -1, dtype=torch.int64, device=device)
    path.scatter_(1, dest, _arange(budget + 1, device).expand(num_reqs, -1))
    accepted_idx = path[:, : draft_depth + 1]

    on_path = accepted_idx >= 0
    output_tokens = target.gather(1, accepted_idx.clamp_min(0))
    output_tokens = torch.where(on_path, output_tokens, -1)
    bonus = output_tokens.gather(1, (num_accepted - 1).unsqueeze(1)).squeeze(1)
    return WalkResult(
        accepted_idx=accepted_idx,
        num_accepted=num_accepted,
        output_token_ids=output_tokens,
        bonus_token_ids=bonus,
        accepted_mask=accepted,
    )


def compaction_indices(
    walk: WalkResult,
    query_start_loc: torch.Tensor | None = None,
) -> CompactionPlan:
    """Source/destination indices that move the accepted path into place.

    Args:
        walk: from `walk_tree`.
        query_start_loc: ``[R + 1]`` start row of each request in the
            flattened verify batch; if given, the flattened
            ``src_token_idx`` / ``dst_token_idx`` are filled in.

    See `CompactionPlan` for the fields and how vLLM uses them.

    """
    num_reqs, path_len = walk.accepted_idx.shape
    k = _arange(path_len, walk.accepted_idx.device).expand(num_reqs, -1)
    on_path = k < walk.num_accepted.unsqueeze(1)
    src_idx = walk.accepted_idx.clamp_min(0)
    needs_move = on_path & (src_idx != k)
    src_token_idx = dst_token_idx = None
    if query_start_loc is not None:
        base = query_start_loc[:-1].long().unsqueeze(1)
        src_token_idx = base + src_idx
        dst_token_idx = base + torch.where(needs_move, k, src_idx)
    return CompactionPlan(
        src_idx=src_idx,
        dst_offset=k,
        needs_move=needs_move,
        src_token_idx=src_token_idx,
        dst_token_idx=dst_token_idx,
        num_accepted=walk.num_accepted,
    )


# --------------------------------------------------------------------------
# Split tree attention: the prefix pass
# --------------------------------------------------------------------------


def paged_prefix_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    prefix_lens: torch.Tensor,
    max_seqlen_k: int,
    block_table: torch.Tensor,
    softmax_scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
    scheduler_metadata: torch.Tensor | None = None,
    num_splits: int = 0,
    causal: bool = False,
    empty_out: float = float("nan"),
    empty_lse: float = _NEG_INF,
) -> torch.Tensor:
    """What FA3 computes for the split's part (a) (`PrefixAttention`), in
    float32: every query token of request ``r`` attends, without a mask, to
    the first ``prefix_lens[r]`` keys of its paged KV (``key_cache``:
    ``[num_blocks, block_size, num_kv_heads, head_size]``). Writes ``out``
    and returns the log-sum-exp ``[num_query_heads, num_tokens]`` (FA's
    layout; 0 past the last request's tokens). A sink is one more logit per
    head with a zero value (FA3's ``s_aux``). The rows of a request with no
    prefix key and no sink are undefined in FA: here ``empty_out`` and
    ``empty_lse`` (FA3 returns -inf, FA2 +inf). ``causal``: query ``i`` of
    a request of ``n`` query tokens sees keys ``0 .. prefix_lens - n + i``
    only (FA's bottom-right alignment)."""
    num_tokens, num_heads, _ = query.shape
    lse = torch.zeros(num_heads, num_tokens, dtype=torch.float32, device=query.device)
    starts = cu_seqlens_q.tolist()
    block_size = key_cache.shape[1]
    for r, n_prefix in enumerate(prefix_lens.tolist()):
        lo, hi = starts[r], starts[r + 1]
        if hi == lo:
            continue
        n_blocks = (n_prefix + block_size - 1) // block_size
        blocks = block_table[r, :n_blocks].long()
        k = key_cache[blocks].flatten(0, 1)[:n_prefix].float()
        v = value_cache[blocks].flatten(0, 1)[:n_prefix].float()
        group = num_heads // key_cache.shape[2]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[lo:hi].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if causal:
            last_key = n_prefix - (hi - lo) + torch.arange(hi - lo)
            hidden = torch.arange(n_prefix)[None, :] > last_key[:, None]
            scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, hi - lo, 1)
            scores = torch.cat([scores, sink], dim=-1)
            v = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
        if scores.shape[-1] == 0:
            out[lo:hi] = empty_out
            lse[:, lo:hi] = empty_lse
            continue
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - row_lse[..., None])
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        lse[:, lo:hi] = row_lse
    return lse
