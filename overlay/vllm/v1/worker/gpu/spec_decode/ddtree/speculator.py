# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree drafting on the V2 model runner.

One DFlash pass predicts ``draft_depth`` positions; instead of taking the
argmax chain, the per-depth distributions are turned into the optimal draft
tree of ``tree_budget`` nodes (DDTree, arXiv 2604.12989, Prop. 2). The tree is
built with batched top-k steps inside the drafter's CUDA graph, so drafting
adds no host synchronisation.

Where the V2 runner asks its speculator for a verifier (vLLM 0.34's
`BaseSpeculator.custom_sampler` and `prepare_verify`, and the TRITON_ATTN
metadata builder's ``metadata_hook``), the speculator owns DDTree's verifier
and runs it through those hooks: tree positions before the target forward
(`prepare_verify`), the tree attention bias on every target metadata (set on
the target's builders in `set_attn`; hybrid targets: the Gated DeltaNet
layers' tree path too), the walk as the rejection sampler
(`custom_sampler`), and the accepted path's compaction (hybrid targets: the
GDN states along it) and the per-request tree store around the DFlash pass
(`propose`). On the 0.26.0 line the patched runner holds the verifier
itself.
"""

import copy
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.triton_utils import triton
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.spec_decode.ddtree.config import (
    ddtree_speculative_config,
    verify_ddtree_target_layers,
)
from vllm.v1.spec_decode.ddtree.tree import build_tree
from vllm.v1.spec_decode.ddtree.tree_attention import verify_tree_attention_layers
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.spec_decode.ddtree.verifier import DDTreeVerifier
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import (
    DFlashSpeculator,
    prepare_dflash_inputs,
)
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

# vLLM 0.33's DFlashSpeculator.propose takes the next step's draft count and
# with 0 stores the step's context K/V only (what DDTree's no-speculation step
# needs), and takes the DP sync state instead of num_tokens_across_dp; vLLM
# 0.26's does neither, and DDTree stores the context itself there.
PROPOSE_TAKES_NUM_SPECULATIVE_TOKENS = (
    "num_speculative_tokens" in inspect.signature(DFlashSpeculator.propose).parameters
)


# vLLM 0.34's runner asks its speculator for a verifier (its own rejection
# sampler, the verify inputs before the target forward); vLLM 0.26's patched
# runner builds DDTree's verifier itself.
SPECULATOR_VERIFIES = hasattr(BaseSpeculator, "prepare_verify")


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
    # DDTree's verifier, where the runner asks its speculator to verify
    # (set in __init__); None: the runner verifies (the 0.26.0 line).
    verifier: DDTreeVerifier | None = None

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        req_states: Any | None = None,
    ):
        # The base class sizes draft_tokens by num_speculative_tokens, which
        # DDTree sets to the tree budget: one column per tree node. Where the
        # runner asks its speculator to verify (vLLM 0.34.0), the drafter's
        # CUDA graphs are sized by request counts, not by the target's
        # schedule, and the DFlash loader re-resolves the config it is given:
        # the schedule must stay the one the sizes were resolved with.
        super().__init__(
            vllm_config if SPECULATOR_VERIFIES else drafter_vllm_config(vllm_config),
            device,
        )
        spec = ddtree_speculative_config(self.speculative_config)
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

        # The runner's request states (node tokens per request: its
        # draft_tokens; prefill lengths) and DDTree's verifier, where the
        # runner asks the speculator to verify.
        self.req_states = req_states
        if SPECULATOR_VERIFIES:
            assert req_states is not None
            self.verifier = DDTreeVerifier(vllm_config, device, self)
        # False until the verifier holds the target's KV caches of the latest
        # `set_attn` (they are allocated after it; bound at the next propose).
        self.target_kv_caches_bound = False

    def load_model(self, target_model: nn.Module) -> None:
        # The target's attention layers are built (the drafter's not yet):
        # refuse a window, chunk or ALiBi bias its config did not show.
        verify_ddtree_target_layers(self.vllm_config)
        super().load_model(target_model)
        # Every attention layer is built: the tree attention's sinks check,
        # and its one startup line.
        verify_tree_attention_layers(self.vllm_config)

    # ------------------------------------------ the runner's verifier hooks
    def custom_sampler(self, sampler: Any) -> tuple[Any, Any] | None:
        """The target's sampler, with tree-aware penalties, and DDTree's walk
        in place of chain rejection sampling."""
        if self.verifier is None:
            return None
        self.verifier.bind_sampler(sampler)
        return sampler, TreeWalkSampler(self.verifier, sampler, self.req_states)

    def set_attn(self, model_state: Any, kv_cache_config: Any, *args: Any) -> None:
        super().set_attn(model_state, kv_cache_config, *args)
        if self.verifier is None:
            return
        # vLLM 0.34's: block_tables, target_input_buffers, target_attn_groups.
        target_attn_groups = args[-1]
        self.hook_target_builders(target_attn_groups)
        if self.verifier.gdn is not None:
            # The GDN layers' spec rows take the tree path from the first
            # forward (captures included); the post-walk commit binds to
            # their states, allocated after this, at the next propose.
            self.verifier.gdn.bind_layers(
                self.vllm_config.compilation_config.static_forward_context,
                [group.layer_names for group in kv_cache_config.kv_cache_groups],
                with_states=False,
            )
        self.target_kv_caches_bound = False

    def hook_target_builders(self, target_attn_groups: Any) -> None:
        """The tree bias through the ``metadata_hook`` of each of the
        target's attention metadata builders (TRITON_ATTN's: every step and
        capture, whichever model state builds them). The drafter builds its
        metadata with builders of its own, which keep none; the runner's
        groups of drafter layers only (another backend where the target's and
        the drafter's KV layouts differ, as on Qwen3.5 hybrids) verify no tree
        and are skipped. A target attention group whose builder has no such
        hook is refused here, at startup; linear-attention (mamba) groups are
        the GDN path's."""
        assert self.verifier is not None
        for groups in target_attn_groups:
            for group in groups:
                if set(group.layer_names) <= self.draft_attn_layer_names:
                    continue
                for builder in group.metadata_builders:
                    if hasattr(builder, "metadata_hook"):
                        builder.metadata_hook = functools.partial(
                            self.verifier.attach_bias_to, builder=builder
                        )
                    elif not isinstance(group.kv_cache_spec, MambaSpec):
                        raise ValueError(
                            "DDTree needs the TRITON_ATTN backend for the "
                            "target model's attention layers; got "
                            f"{group.backend.get_name()} (its metadata "
                            "builder has no metadata hook)."
                        )

    def prepare_verify(self, input_batch: InputBatch, positions: torch.Tensor) -> None:
        """Tree positions and tree attention bias before the target forward
        (``positions``: the model's, shifted too where they are M-RoPE's)."""
        if self.verifier is None:
            return
        self.verifier.prepare_verify(input_batch)
        self.verifier.prepare_model_positions(positions)

    def _bind_target_kv_caches(self) -> None:
        """The target's KV caches (bound to its attention layers once
        allocated) for the compaction of the accepted path, one compactor per
        KV-cache group; a layout it cannot move is refused here, at the
        first warm-up step."""
        assert self.verifier is not None
        forward_context = self.vllm_config.compilation_config.static_forward_context
        kv_caches = {
            name: layer.kv_cache
            for name, layer in forward_context.items()
            if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)
        }
        self.verifier.bind_kv_caches(
            kv_caches,
            self.draft_attn_layer_names,
            [group.layer_names for group in self.kv_cache_config.kv_cache_groups],
        )
        if self.verifier.gdn is not None:
            self.verifier.gdn.bind_states()
        self.target_kv_caches_bound = True

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
        verifier = self.verifier
        if verifier is not None and not (
            dummy_run and kwargs.get("skip_attn_for_dummy_run", False)
        ):
            if not self.target_kv_caches_bound:
                self._bind_target_kv_caches()
            # The accepted path to contiguous KV slots and to the front of the
            # hidden states the DFlash pass reads; a hybrid target's GDN
            # states along it (their state slots: the step's GDN metadata).
            verifier.compact(
                input_batch, slot_mappings, aux_hidden_states, attn_metadata
            )

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
        if verifier is not None:
            draft_tokens = upstream_propose(input_batch)
            if not dummy_run:
                # The new trees to per-request state, their node tokens into
                # the runner's draft tokens (which it scatters again).
                verifier.store_trees(
                    input_batch.idx_mapping, self, self.req_states.draft_tokens
                )
            return draft_tokens
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


class TreeWalkSampler:
    """DDTree's rejection sampler for the V2 runner (called as upstream's:
    ``(logits, input_batch, draft_logits)``): the target's draw at every
    tree node, then the walk from the root (`DDTreeVerifier.sample`)."""

    # Read by the runner's warm-up like upstream's rejection sampler's: the
    # tree walk verifies whole trees, never an adaptive number of drafts.
    enable_adaptive_verification = False

    def __init__(self, verifier: DDTreeVerifier, sampler: Any, req_states: Any):
        self.verifier = verifier
        self.sampler = sampler
        self.req_states = req_states

    def __call__(
        self, logits: torch.Tensor, input_batch: InputBatch, draft_logits: Any = None
    ) -> SamplerOutput:
        return self.verifier.sample(
            self.sampler,
            logits,
            input_batch,
            self.req_states.draft_tokens,
            self.req_states.prefill_len.gpu,
        )
