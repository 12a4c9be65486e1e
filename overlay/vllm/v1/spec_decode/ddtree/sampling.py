# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree sampling at T > 0: per-node context for penalties, and logprobs.

The target draws a token at every tree node with the request's own sampling
parameters, then the walk follows the draws. For that to be lossless, the
distribution at node ``i`` must be the one target-only sampling would use
after the request's history followed by the tokens on the path root -> ``i``.
Temperature, top-k / top-p, min-p, logit bias and min_tokens (keyed by the
tree position ``root + depth``) already are. Repetition / frequency /
presence penalties are not: upstream's penalties kernel treats the rows of a
request as a chain (row ``p`` counts the draft tokens of rows ``1..p``),
whereas for a tree row ``i`` must count the tokens of ``i``'s ancestors and of
``i`` itself (the root, the last sampled token, is already in the history).

The fix (`penalize_path_tokens`) runs the upstream kernel with the history
only (every local position 0), then recomputes, exactly as the kernel does,
the logits of the at most ``D`` tokens on each row's path with the full count
(history + path). Only ``[num_rows, D]`` entries are gathered and scattered:
no dense ``[rows, V]`` count matrix and no host synchronisation.

This module imports only ``torch`` (tests import it without vLLM).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "RowPaths",
    "row_path_tokens",
    "gather_path_logits",
    "path_history_stats",
    "penalize_path_tokens",
    "path_row_order",
]


class RowPaths(NamedTuple):
    """The tokens on the path root -> node of every logits row.

    Attributes:
        tokens: ``[N, D]`` int64, the node's own token first, then its
            parent's, ...; the root is excluded. Entries past the node's
            depth repeat the first entry (the node's own token) or are 0 for
            rows of depth 0, so that every entry is a valid token index and
            scatters of equal values are harmless.
        valid: ``[N, D]`` bool, True for the ``depth`` real entries.
        count: ``[N, D]`` int32, occurrences of ``tokens[n, j]`` among the
            valid entries of row ``n`` (>= 1 wherever the row has a path).
        has_path: ``[N]`` bool, depth >= 1.

    """

    tokens: torch.Tensor
    valid: torch.Tensor
    count: torch.Tensor
    has_path: torch.Tensor


def row_path_tokens(
    row_tokens: torch.Tensor,
    parent_idx: torch.Tensor,
    depth_with_root: torch.Tensor,
    row_req: torch.Tensor,
    row_node: torch.Tensor,
    draft_depth: int,
) -> RowPaths:
    """Path tokens of every logits row.

    Args:
        row_tokens: ``[N]`` the input token of each logits row (a request's
            rows are its verify nodes ``0..n`` in order, so node ``i``'s
            token is at row ``row - row_node + i``).
        parent_idx: ``[S, B]`` verify-layout parent of node ``i`` at column
            ``i - 1`` (0 = root), per request state.
        depth_with_root: ``[S, B + 1]``, column 0 is the root (depth 0).
        row_req: ``[N]`` request-state index of each row.
        row_node: ``[N]`` verify-layout node index of each row (0 = root;
            rows of prefill / plain decode requests are 0).
        draft_depth: ``D``, static.

    """
    req = row_req.long()
    node = row_node.long()
    first_row = torch.arange(node.shape[0], device=node.device) - node
    tokens = []
    valid = []
    for _ in range(draft_depth):
        col = (node - 1).clamp_min(0)
        is_node = (node >= 1) & (depth_with_root[req, node] >= 1)
        tokens.append(torch.where(is_node, row_tokens[first_row + node].long(), 0))
        valid.append(is_node)
        node = torch.where(node >= 1, parent_idx[req, col].long(), 0)
    tok = torch.stack(tokens, dim=1)
    ok = torch.stack(valid, dim=1)
    has_path = ok[:, 0]
    # Padding entries repeat the node's own token (same count => same value).
    tok = torch.where(ok, tok, tok[:, :1])
    same = (tok.unsqueeze(2) == tok.unsqueeze(1)) & ok.unsqueeze(1)
    count = same.sum(dim=2, dtype=torch.int32)
    return RowPaths(tokens=tok, valid=ok, count=count, has_path=has_path)


def gather_path_logits(logits: torch.Tensor, paths: RowPaths) -> torch.Tensor:
    """``[N, D]`` logits of the path tokens (read before any penalty)."""
    return logits.gather(1, paths.tokens)


def path_history_stats(
    output_bin_counts: torch.Tensor,
    prompt_bin_mask: torch.Tensor,
    row_req: torch.Tensor,
    paths: RowPaths,
) -> tuple[torch.Tensor, torch.Tensor]:
    """History count (``[N, D]`` int32) and prompt membership (bool) of the
    path tokens, from upstream's per-request ``output_bin_counts [S, V]``
    and bit-packed ``prompt_bin_mask [S, ceil(V / 32)]``."""
    req = row_req.long().unsqueeze(1)
    tok = paths.tokens
    hist = output_bin_counts[req, tok].to(torch.int32)
    words = prompt_bin_mask[req, tok // 32]
    in_prompt = ((words >> (tok % 32).to(words.dtype)) & 1) != 0
    return hist, in_prompt


def penalize_path_tokens(
    logits: torch.Tensor,
    orig_values: torch.Tensor,
    paths: RowPaths,
    hist_count: torch.Tensor,
    in_prompt: torch.Tensor,
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> None:
    """Fix the path tokens' logits in place after history-only penalties.

    ``logits [N, V]`` already went through the upstream penalties with the
    history only; ``orig_values`` are the path tokens' logits from before
    that (`gather_path_logits`). For each path token ``t`` of row ``n``,
    with ``c = hist + count on the path``, this writes what upstream's kernel
    computes for a context with count ``c``::

        scale = rep if (in_prompt or c > 0) else 1
        x = x * (1 / scale if x > 0 else scale)
        x = x - freq * c
        x = x - pres * (c > 0)

    Rows without a path, or whose request uses no penalty, are rewritten
    with the values they already hold. Penalties are ``[N]`` (per row).
    """
    x = orig_values.float()
    count = hist_count + paths.count
    rep = repetition_penalty.float().unsqueeze(1)
    freq = frequency_penalty.float().unsqueeze(1)
    pres = presence_penalty.float().unsqueeze(1)
    present = count > 0
    scale = torch.where(in_prompt | present, rep, torch.ones_like(rep))
    x = x * torch.where(x > 0, 1.0 / scale, scale)
    x = x - freq * count.float()
    x = x - pres * present.float()
    uses_penalty = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
    keep = ~(paths.has_path.unsqueeze(1) & uses_penalty)
    current = logits.gather(1, paths.tokens)
    values = torch.where(keep, current, x.to(logits.dtype))
    logits.scatter_(1, paths.tokens, values)


def path_row_order(
    accepted_idx: torch.Tensor,
    num_accepted: torch.Tensor,
    row_starts: torch.Tensor,
    num_rows: int,
) -> torch.Tensor:
    """``[num_rows]`` row permutation that puts each request's accepted path
    first: row ``start + k`` takes row ``start + accepted_idx[k]`` for
    ``k < num_accepted`` (emitted token ``k``), every other row stays.

    Used to reorder per-row logprobs so that, as for the chain, the first
    ``num_sampled`` rows of a request describe its emitted tokens.
    """
    num_reqs, path_len = accepted_idx.shape
    device = accepted_idx.device
    order = torch.arange(num_rows, dtype=torch.int64, device=device)
    k = torch.arange(path_len, dtype=torch.int64, device=device)
    starts = row_starts.long().unsqueeze(1)
    on_path = k.unsqueeze(0) < num_accepted.unsqueeze(1)
    dst = torch.where(on_path, starts + k, num_rows)  # num_rows: dropped
    src = starts + accepted_idx.clamp_min(0)
    order = torch.cat([order, order.new_zeros(1)])
    order.scatter_(0, dst.view(-1), src.view(-1))
    return order[:num_rows]
