# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree drafting on the V2 model runner.

One DFlash pass predicts ``draft_depth`` positions; instead of taking the
argmax chain, the per-depth distributions are turned into the optimal draft
tree of ``tree_budget`` nodes (DDTree, arXiv 2604.12989, Prop. 2). The tree is
built with batched top-k steps inside the drafter's CUDA graph, so drafting
adds no host synchronisation.
"""

import copy
import inspect
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.triton_utils import triton
from vllm.v1.spec_decode.ddtree.config import verify_ddtree_target_layers
from vllm.v1.spec_decode.ddtree.tree import build_tree
from vllm.v1.spec_decode.ddtree.tree_attention import verify_tree_attention_layers
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import (
    DFlashSpeculator,
    prepare_dflash_inputs,
)

# vLLM 0.33's DFlashSpeculator.propose takes the next step's draft count and
# with 0 stores the step's context K/V only (what DDTree's no-speculation step
# needs), and takes the DP sync state instead of num_tokens_across_dp; vLLM
# 0.26's does neither, and DDTree stores the context itself there.
PROPOSE_TAKES_NUM_SPECULATIVE_TOKENS = (
    "num_speculative_tokens" in inspect.signature(DFlashSpeculator.propose).parameters
)


# Upstream's `prepare_dflash_inputs` launches its Triton kernel with a block
# of next_power_of_2(longest query of the step + the drafter's query tokens)
# lanes, at most this many: a kernel variant, compiled the first time a step
# needs it.
DFLASH_INPUTS_MAX_BLOCK = 256


def dflash_input_block_batches(
    input_batch: InputBatch, num_query_per_req: int
) -> Iterator[InputBatch]:
    """Copies of ``input_batch`` that make upstream's `prepare_dflash_inputs`
    take each of its kernel's block widths but the batch's own: only the
    longest query length (``num_scheduled_tokens``, a host array) differs,
    and the kernel's work does not depend on the width."""
    num_reqs = input_batch.num_reqs
    own_query_len = int(input_batch.num_scheduled_tokens[:num_reqs].max())

    def block_of(query_len: int) -> int:
        return min(
            DFLASH_INPUTS_MAX_BLOCK,
            triton.next_power_of_2(max(1, query_len + num_query_per_req)),
        )

    own_block = block_of(own_query_len)
    block = block_of(1)
    while block <= DFLASH_INPUTS_MAX_BLOCK:
        if block != own_block:
            batch = copy.copy(input_batch)
            batch.num_scheduled_tokens = np.full_like(
                input_batch.num_scheduled_tokens, max(1, block - num_query_per_req)
            )
            yield batch
        block *= 2


def drafter_vllm_config(vllm_config: VllmConfig) -> VllmConfig:
    """The config the DDTree drafter runs with: the target's, except that its
    speculative config has no per-batch-size budget schedule.

    The schedule (``num_speculative_tokens_per_batch_size``, set by the
    "batch" budget policy) says how many tree nodes the target verifies per
    request at each batch size, and the target's CUDA graphs follow it. The
    DFlash pass has 1 + draft_depth query tokens per request at every batch
    size, so the drafter's graphs must not. Shallow copies: every other
    sub-config is the target's own object.
    """
    speculative_config = copy.copy(vllm_config.speculative_config)
    assert speculative_config is not None
    speculative_config.num_speculative_tokens_per_batch_size = None
    drafter_config = copy.copy(vllm_config)
    drafter_config.speculative_config = speculative_config
    return drafter_config


class DDTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DDTree"

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        # The base class sizes draft_tokens by num_speculative_tokens, which
        # DDTree sets to the tree budget: one column per tree node.
        super().__init__(drafter_vllm_config(vllm_config), device)
        spec = self.speculative_config
        assert spec.tree_budget is not None and spec.draft_depth is not None
        self.tree_budget: int = spec.tree_budget
        self.draft_depth: int = spec.draft_depth

        # The DFlash pass itself predicts draft_depth positions (more or fewer
        # than the budget the base class sized its sampling buffers by).
        self.num_speculative_steps = self.draft_depth
        self.num_query_per_req = 1 + self.draft_depth
        max_num_sampled_tokens = self.max_num_reqs * self.draft_depth
        self.sample_indices = torch.zeros(
            max_num_sampled_tokens, dtype=torch.int64, device=device
        )
        self.sample_pos = torch.zeros(
            max_num_sampled_tokens, dtype=torch.int64, device=device
        )
        # Upstream's dtype and initial value for inert rows (vLLM 0.26: int32
        # zeros; 0.33: int64 -1, which the capture's scatter skips).
        inert = self.sample_idx_mapping[:1]
        self.sample_idx_mapping = inert.expand(max_num_sampled_tokens).clone()
        self.sample_col = torch.arange(
            self.draft_depth, dtype=torch.int32, device=device
        ).repeat(self.max_num_reqs)

        # The tree of the last proposal, one row per batch position. The
        # runner moves them to per-request state after propose(); the
        # verifier builds the attention bias from the parents.
        self.tree_parent_idx = torch.zeros(
            self.max_num_reqs, self.tree_budget, dtype=torch.int64, device=device
        )
        self.tree_depth = torch.zeros(
            self.max_num_reqs, self.tree_budget, dtype=torch.int64, device=device
        )
        self.tree_valid = torch.zeros(
            self.max_num_reqs, self.tree_budget, dtype=torch.bool, device=device
        )
        # False when the next step verifies none of this step's drafts (the
        # measured budget policy chose no speculation for this batch size;
        # set by the runner each step): `propose` then only stores the
        # step's context K/V.
        self.draft_next_step = True
        # Set once the drafter's input kernel is compiled at every block width
        # (`propose`, at the first warm-up run).
        self.dflash_input_blocks_compiled = False

    def load_model(self, target_model: nn.Module) -> None:
        # The target's attention layers are built (the drafter's not yet):
        # refuse a window, chunk or ALiBi bias its config did not show.
        verify_ddtree_target_layers(self.vllm_config)
        super().load_model(target_model)
        # Every attention layer is built: the tree attention's sinks check,
        # and its one startup line.
        verify_tree_attention_layers(self.vllm_config)

    def tree_buffers(self) -> tuple[torch.Tensor, ...]:
        """The persistent buffers DDTree adds to the DFlash drafter's (the
        batch's trees); the verifier's startup memory line counts them."""
        return (self.tree_parent_idx, self.tree_depth, self.tree_valid)

    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        last_hidden_states = self._run_model(
            num_tokens_padded,
            attn_metadata,
            slot_mappings,
            num_tokens_across_dp,
            cudagraph_runtime_mode,
        )
        num_sample = num_reqs * self.draft_depth
        sample_hidden_states = last_hidden_states[self.sample_indices[:num_sample]]
        # Per-depth draft distributions q_d: [num_reqs, draft_depth, vocab].
        draft_logits = self.model.compute_logits(sample_hidden_states)
        # Ties at the vocabulary top-B boundary are left to torch.topk: any
        # of the tied trees is optimal, and the exact pass costs a second
        # sweep over the vocabulary.
        tree = build_tree(
            draft_logits.view(num_reqs, self.draft_depth, -1),
            self.tree_budget,
            exact_vocab_ties=False,
        )
        self.draft_tokens[:num_reqs] = tree.token_ids
        self.tree_parent_idx[:num_reqs] = tree.parent_idx
        self.tree_depth[:num_reqs] = tree.depth
        self.tree_valid[:num_reqs] = tree.valid

    def propose(
        self,
        input_batch: InputBatch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        *,
        dummy_run: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Upstream's propose; ``kwargs`` are the upstream keyword arguments
        (0.26: num_tokens_across_dp, ...; 0.33: dp_sync_state,
        num_speculative_tokens, ...)."""

        def upstream_propose(batch: InputBatch, **extra: Any) -> torch.Tensor:
            return super(DDTreeSpeculator, self).propose(
                batch,
                attn_metadata,
                slot_mappings,
                last_hidden_states,
                aux_hidden_states,
                num_sampled,
                num_rejected,
                last_sampled,
                next_prefill_tokens,
                temperature,
                seeds,
                dummy_run=dummy_run,
                **{**kwargs, **extra},
            )

        if not self.dflash_input_blocks_compiled and not kwargs.get(
            "skip_attn_for_dummy_run", False
        ):
            # A DFlash chain's steps take two of the input kernel's block
            # widths (decode, prefill), which warm-up compiles; DDTree's take
            # one more per tree budget (1 + budget query tokens, one budget
            # per batch size under the measured policy), first seen while
            # serving: each stalled its step for a compile. One run per width
            # at the first propose that runs attention: a dummy run of the
            # warm-up (FlashInfer's autotuning) or, where none runs one, the
            # V2 runner's warm-up steps (`warmup_kernels`, real requests),
            # both before serving. The kernel's outputs do not depend on the
            # width, so the runs write what the run below writes again.
            self.dflash_input_blocks_compiled = True
            for batch in dflash_input_block_batches(
                input_batch, self.num_query_per_req
            ):
                upstream_propose(batch)
        draft = self.draft_next_step or dummy_run
        if draft:
            return upstream_propose(input_batch)
        if PROPOSE_TAKES_NUM_SPECULATIVE_TOKENS:
            # Not verified: the next step schedules no drafts for these
            # requests. Upstream stores the context K/V and skips the rest.
            return upstream_propose(input_batch, num_speculative_tokens=0)
        self._store_context(
            input_batch,
            last_hidden_states,
            aux_hidden_states,
            num_sampled,
            num_rejected,
            last_sampled,
            next_prefill_tokens,
        )
        # Not verified: the next step schedules no drafts for these requests.
        return self.draft_tokens[: input_batch.num_reqs]

    def _store_context(
        self,
        input_batch: InputBatch,
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
    ) -> None:
        """The part of the DFlash pass a later draft needs: this step's
        tokens as context K/V in the drafter's cache (its attention reads
        every earlier token there). The query forward and the tree build,
        whose drafts nobody would verify, are skipped: a step of no
        speculation costs the target's decode and this precompute."""
        num_target_tokens = input_batch.num_tokens
        if aux_hidden_states:
            hidden_states = self.model.combine_hidden_states(
                torch.cat(aux_hidden_states, dim=-1)
            )
        else:
            hidden_states = last_hidden_states
        self.hidden_states[:num_target_tokens].copy_(hidden_states[:num_target_tokens])
        for i, gid in enumerate(self.draft_kv_cache_group_ids):
            prepare_dflash_inputs(
                self.input_buffers,
                self.block_tables.slot_mappings[gid],
                self.context_positions,
                self._context_slot_mappings[i],
                self.sample_indices,
                self.sample_pos,
                self.sample_idx_mapping,
                input_batch,
                num_sampled,
                num_rejected,
                last_sampled,
                next_prefill_tokens,
                self.block_tables.input_block_tables[gid],
                self.block_tables.kernel_block_sizes[gid],
                self.parallel_drafting_token_id,
                self.num_query_per_req,
                self.num_speculative_steps,
                self.max_num_reqs,
                self.max_num_tokens,
                self.max_model_len,
                self.sample_from_anchor,
            )
        if self._layer_group_idx is not None:
            context_slots: torch.Tensor | list[torch.Tensor | None] = [
                self._context_slot_mappings[g][:num_target_tokens]
                for g in self._layer_group_idx
            ]
        else:
            context_slots = self._context_slot_mappings[0][:num_target_tokens]
        self.model.precompute_and_store_context_kv(
            self.hidden_states[:num_target_tokens],
            self.context_positions[:num_target_tokens],
            context_slots,
        )
