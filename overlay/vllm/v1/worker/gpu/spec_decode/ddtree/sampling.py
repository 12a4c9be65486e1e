# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree target sampling at every tree node on the V2 runner.

`sample_nodes` draws the target's token at every verify row with upstream's
`Sampler.sample` (logit bias, penalties, bad words, temperature, min-p,
top-k / top-p, Gumbel noise keyed by (request seed, tree position)), with
one difference: the penalties of a tree row count the tokens on the row's
root -> node path (see `vllm.v1.spec_decode.ddtree.sampling`) instead of the
rows before it: `TreePenaltiesState`, which the verifier gives the sampler in
place of upstream's `PenaltiesState`, applies that rule while a tree step is
sampled. `node_logprobs` then returns logprobs for the emitted tokens
only: per-row scores with each row's own draw, reordered so that a request's
first ``num_sampled`` rows are its accepted path, as the output processor
expects.
"""

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from vllm.v1.outputs import LogprobsTensors
from vllm.v1.spec_decode.ddtree.sampling import (
    RowPaths,
    gather_path_logits,
    path_history_stats,
    path_row_order,
    penalize_path_tokens,
    row_path_tokens,
)
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
from vllm.v1.worker.gpu.sample.penalties import PenaltiesState
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

PathsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], RowPaths]

# vLLM 0.33 made the penalties one of the sampler's logits processors
# (`PenaltiesState(vllm_config, req_states)`, `apply(logits, ctx)`, listed in
# `Sampler.logits_processors`) and `Sampler.sample` takes the batch's
# `idx_mapping` and sequence-length bounds; vLLM 0.26 has
# `PenaltiesState(req_states)`, `apply_penalties(...)` and the shorter
# `sample`. Both are read off the upstream classes, once.
PENALTIES_ARE_LOGITS_PROCESSOR = hasattr(PenaltiesState, "apply")
SAMPLE_TAKES_IDX_MAPPING = "idx_mapping" in inspect.signature(Sampler.sample).parameters


class TreePenaltiesState(PenaltiesState):
    """Upstream's `PenaltiesState` with the tree rule for DDTree steps.

    Inside `counting_tree_paths` (the sampling of one verify step), the
    repetition / frequency / presence penalties of a logits row count the
    tokens on the row's root -> node path; outside it (prefill and plain
    decode rows, the dummy sampler run) this is upstream's state unchanged.
    `DDTreeVerifier.bind_sampler` puts one in place of the sampler's own,
    before any request is added.
    """

    def __init__(self, *args: Any):
        # Upstream's arguments: (req_states), or (vllm_config, req_states).
        super().__init__(*args)
        self._paths_fn: PathsFn | None = None

    @contextlib.contextmanager
    def counting_tree_paths(self, paths_fn: PathsFn) -> Iterator[None]:
        """Penalties count ``paths_fn(input_ids, expanded_idx_mapping,
        expanded_local_pos)``'s path tokens while the context is open."""
        self._paths_fn = paths_fn
        try:
            yield
        finally:
            self._paths_fn = None

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The logits-processor entry point (vLLM 0.33+)."""
        paths_fn = self._paths_fn
        if paths_fn is None or not np.any(self.use_penalty[ctx.idx_mapping_np]):
            return super().apply(logits, ctx)

        def upstream(local_pos: torch.Tensor) -> None:
            PenaltiesState.apply(
                self, logits, dataclasses.replace(ctx, expanded_local_pos=local_pos)
            )

        self._apply_tree(
            logits,
            ctx.expanded_idx_mapping,
            ctx.input_ids,
            ctx.expanded_local_pos,
            paths_fn,
            upstream,
        )
        return logits

    def apply_penalties(
        self,
        logits: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        idx_mapping_np: np.ndarray,
        input_ids: torch.Tensor,
        expanded_local_pos: torch.Tensor,
    ) -> None:
        """The penalties entry point of the vLLM 0.26 sampler."""
        paths_fn = self._paths_fn
        if paths_fn is None or not np.any(self.use_penalty[idx_mapping_np]):
            super().apply_penalties(
                logits,
                expanded_idx_mapping,
                idx_mapping_np,
                input_ids,
                expanded_local_pos,
            )
            return

        def upstream(local_pos: torch.Tensor) -> None:
            PenaltiesState.apply_penalties(
                self, logits, expanded_idx_mapping, idx_mapping_np, input_ids, local_pos
            )

        self._apply_tree(
            logits,
            expanded_idx_mapping,
            input_ids,
            expanded_local_pos,
            paths_fn,
            upstream,
        )

    def _apply_tree(
        self,
        logits: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        input_ids: torch.Tensor,
        expanded_local_pos: torch.Tensor,
        paths_fn: PathsFn,
        upstream: Callable[[torch.Tensor], None],
    ) -> None:
        """The tree rule; ``upstream(local_pos)`` runs upstream's penalties."""
        paths = paths_fn(input_ids, expanded_idx_mapping, expanded_local_pos)
        orig = gather_path_logits(logits, paths)
        # History only: with every local position 0 the kernel adds no
        # draft tokens; the path tokens are then recomputed exactly.
        upstream(torch.zeros_like(expanded_local_pos))
        hist, in_prompt = path_history_stats(
            self.output_bin_counts,
            self.prompt_bin_mask,
            expanded_idx_mapping,
            paths,
        )
        req = expanded_idx_mapping.long()
        penalize_path_tokens(
            logits,
            orig,
            paths,
            hist,
            in_prompt,
            self.repetition_penalty.gpu[req],
            self.frequency_penalty.gpu[req],
            self.presence_penalty.gpu[req],
        )


def sample_nodes(
    sampler: Sampler,
    logits: torch.Tensor,
    input_batch: InputBatch,
    parent_idx: torch.Tensor,
    depth_with_root: torch.Tensor,
    draft_depth: int,
    pos: torch.Tensor,
    input_ids: torch.Tensor,
) -> tuple[torch.Tensor, LogprobsTensors | None]:
    """The target's draw at every logits row, and (when some request asks
    for logprobs) per-row logprobs of those draws.

    ``parent_idx [S, B]`` and ``depth_with_root [S, B + 1]`` are the
    verifier's per-request-state trees; ``pos`` and ``input_ids`` the logits
    rows' tree positions and input ids (upstream's sampler gathers them as
    ``positions[logits_indices]``, ``input_ids[logits_indices]``; the
    verifier writes them with the tree positions). Tree positions: siblings
    share a position, so a seeded request draws the same Gumbel noise at a
    depth whichever branch the walk is on; along any root-to-leaf path the
    draws stay independent.
    """
    idx_mapping_np = input_batch.idx_mapping_np
    expanded_idx_mapping = input_batch.expanded_idx_mapping
    if SAMPLE_TAKES_IDX_MAPPING:
        return_logprobs = sampler.get_logprobs_dims(idx_mapping_np) is not None
    else:
        return_logprobs = sampler.returns_logprobs(idx_mapping_np)

    def paths_fn(row_tokens, row_req, row_node):
        return row_path_tokens(
            row_tokens,
            parent_idx,
            depth_with_root,
            row_req,
            row_node,
            draft_depth,
        )

    penalties = sampler.penalties_state
    # Invariant: bound once when the runner creates its sampler.
    if not isinstance(penalties, TreePenaltiesState):
        raise RuntimeError(
            "DDTree: the sampler's penalties state is not tree-aware; "
            "DDTreeVerifier.bind_sampler must run before sampling."
        )
    with penalties.counting_tree_paths(paths_fn):
        if SAMPLE_TAKES_IDX_MAPPING:
            sampled, processed_logits = sampler.sample(
                logits,
                expanded_idx_mapping,
                input_batch.idx_mapping,
                idx_mapping_np,
                pos,
                input_ids,
                input_batch.expanded_local_pos,
                input_batch.seq_lens_cpu_upper_bound.numpy(),
                return_logprobs=return_logprobs,
            )
        else:
            sampled, processed_logits = sampler.sample(
                logits,
                expanded_idx_mapping,
                idx_mapping_np,
                pos,
                input_ids,
                input_batch.expanded_local_pos,
                return_logprobs=return_logprobs,
            )
    if not return_logprobs:
        return sampled, None

    # As Sampler.__call__, one row per node with the node's own draw.
    if sampler.logprobs_mode in ("processed_logprobs", "processed_logits"):
        logits = processed_logits
    max_num_logprobs = sampler.sampling_states.max_num_logprobs(idx_mapping_np)
    max_per_req_token_ids = sampler.logprob_token_ids_state.max_num_token_ids(
        idx_mapping_np
    )
    num_logprobs = max_num_logprobs if max_num_logprobs != NO_LOGPROBS else 0
    expanded = logits.shape[0] != idx_mapping_np.shape[0]
    logprobs = compute_topk_scores(
        logits,
        num_logprobs,
        sampled,
        input_batch.cu_num_logits_np.tolist() if expanded else None,
        logprob_token_ids_state=sampler.logprob_token_ids_state,
        expanded_idx_mapping=expanded_idx_mapping,
        max_per_req_token_ids=max_per_req_token_ids,
        logits_mode=sampler.logprobs_mode in ("raw_logits", "processed_logits"),
    )
    return sampled, logprobs


def node_logprobs(
    logprobs: LogprobsTensors | None,
    accepted_idx: torch.Tensor,
    num_accepted: torch.Tensor,
    row_starts: torch.Tensor,
) -> LogprobsTensors | None:
    """Per-row logprobs -> the emitted tokens' logprobs: request ``r``'s row
    ``start + k`` becomes the ``k``-th node of its accepted path
    (``accepted_idx [R, D + 1]``, entries past ``num_accepted`` ignored)."""
    if logprobs is None:
        return None
    num_rows = logprobs.logprobs.shape[0]
    order = path_row_order(accepted_idx, num_accepted, row_starts, num_rows)
    return LogprobsTensors(
        logprob_token_ids=logprobs.logprob_token_ids[order],
        logprobs=logprobs.logprobs[order],
        selected_token_ranks=logprobs.selected_token_ranks[order],
        cu_num_generated_tokens=logprobs.cu_num_generated_tokens,
    )
