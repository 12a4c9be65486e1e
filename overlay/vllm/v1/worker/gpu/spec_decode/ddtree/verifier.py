# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree verification on the V2 model runner.

Per step, around the target forward:

1. ``prepare_verify`` (before the forward): every tree-verifying request has
   ``1 + n`` query tokens laid out as [root, node 1 .. node n] at sequential
   KV slots. Their positions become ``root position + depth`` (written in
   place in the persistent positions buffer, so CUDA graphs replay them), and
   the per-request ancestor masks are written into the persistent buffer that
   the Triton attention kernel reads (``tree_attn_bias``: one bit per node
   pair, `tree_bias_buffer`). M-RoPE / XD-RoPE
   targets get the same shift in every section of their own positions
   (``prepare_model_positions``, once the model state has written them).
   Hybrid targets: the step's tree rows for the Gated DeltaNet layers
   (`vllm.v1.spec_decode.ddtree.gdn_verify`).
2. ``sample`` (instead of rejection sampling): the target draws a token at
   every node with the request's own sampling parameters (argmax when
   greedy), then the walk follows the draws from the root. Following the
   draws is lossless for any temperature.
3. ``compact`` (before the DFlash pass): the accepted path's KV moves to the
   contiguous slots ``root .. root + n_accepted - 1``, its hidden states move
   to the front of the request's rows (so the DFlash context is exactly the
   accepted path), and the sequential positions come back. Hybrid targets:
   every GDN layer's committed conv / recurrent state advances along the
   accepted path.
4. ``store_trees`` (after the DFlash pass): the new trees move from batch
   order to per-request state for the next step.

Everything is batched tensor work on the device; nothing here reads a device
value on the host.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.ddtree.config import ddtree_speculative_config
from vllm.v1.spec_decode.ddtree.tree_attention import SplitTreeAttentionMetadata
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.spec_decode.ddtree.kernels import (
    KVCompactor,
    WalkBuffers,
    compact_rows,
    ddtree_restore_positions,
    ddtree_shift_model_positions,
    ddtree_store_trees,
    ddtree_tree_bias,
    ddtree_tree_positions,
    ddtree_walk,
    tree_bias_buffer,
)
from vllm.v1.worker.gpu.spec_decode.ddtree.sampling import (
    PENALTIES_ARE_LOGITS_PROCESSOR,
    TreePenaltiesState,
    node_logprobs,
    sample_nodes,
)

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.spec_decode.ddtree.budget import DDTreeBudgetPlanner

logger = init_logger(__name__)


class DDTreeVerifier:
    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        speculator: Any | None = None,
    ):
        spec = ddtree_speculative_config(vllm_config.speculative_config)
        assert spec is not None and spec.use_ddtree()
        assert spec.tree_budget is not None and spec.draft_depth is not None
        self.tree_budget: int = spec.tree_budget
        self.draft_depth: int = spec.draft_depth
        self.device = device
        self.vllm_config = vllm_config
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        num_nodes = self.tree_budget + 1

        # Per-request tree state (indexed by the request-state index), written
        # by store_trees() after each DFlash pass. Node tokens live in the
        # runner's req_states.draft_tokens.
        self.req_parent_idx = torch.zeros(
            max_num_reqs, self.tree_budget, dtype=torch.int64, device=device
        )
        # Column 0 is the root (depth 0).
        self.req_depth = torch.zeros(
            max_num_reqs, num_nodes, dtype=torch.int64, device=device
        )
        self.req_valid = torch.zeros(
            max_num_reqs, self.tree_budget, dtype=torch.bool, device=device
        )
        # Batch-ordered tree masks read by the attention kernel (int32
        # [max_num_reqs, B + 1, ceil((B + 1) / 32)], one bit per node pair).
        # Persistent: the captured CUDA graphs hold its address.
        self.attn_bias = tree_bias_buffer(max_num_reqs, num_nodes, device)
        # Per logits row of the step (at most one per token): its tree
        # position shift (depth - local position, undone in compact), its
        # tree position and input id (the sampler's inputs).
        self.tree_shift = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.logits_pos = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.logits_input_ids = torch.zeros(
            max_num_tokens, dtype=torch.int32, device=device
        )
        self.node_range = torch.arange(num_nodes, dtype=torch.int64, device=device)
        # The walk's path (read by compact), scratch, and its outputs (the
        # emitted tokens and counts), one copy per step that may be in flight
        # while the runner copies them to the host (as upstream's UVA buffer
        # pools: at least 2; WalkBuffers says why).
        self.num_output_slots = max(2, vllm_config.max_concurrent_batches)
        self.walk_buffers = WalkBuffers(
            max_num_reqs,
            self.tree_budget,
            self.draft_depth,
            device,
            self.num_output_slots,
        )

        # Target attention layers whose KV the accepted path is compacted in,
        # and one compactor per KV-cache group (a layer of the group, whose
        # slot mapping the group shares; the compactor of all its layers).
        self.target_kv_caches: dict[str, torch.Tensor] = {}
        self.kv_compactors: list[tuple[str, KVCompactor]] = []
        # (num_accepted, src_row, dst_row) of the current step's walk, kept
        # from sample() for compact().
        self._walk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Tree rows (logits indices) and their position shift (depth - local
        # position) of the step: undone in compact, and applied to the
        # model's own M-RoPE positions.
        self._tree_pos: tuple[torch.Tensor, torch.Tensor] | None = None
        # (positions, logits indices, shifts) of the M-RoPE shift to undo.
        self._model_positions: tuple[torch.Tensor, ...] | None = None
        # The split tree attention's metadata of the step (one per KV-cache
        # group, by the metadata builder that built it), kept from
        # attach_bias() / attach_bias_to() for prepare_verify().
        self._tree_splits: dict[Any, SplitTreeAttentionMetadata] = {}

        # The measured budget policy: counts every walk's acceptance per tree
        # rank on the device and re-plans the budget per batch size.
        self.budget: DDTreeBudgetPlanner | None = None
        if getattr(spec, "budget_policy", None) == "measured":
            # Imported here: the policy's schedule reaches the scheduler
            # through the 0.26.0 line's patched dynamic schedule only.
            from vllm.v1.worker.gpu.spec_decode.ddtree import budget as planning

            self.budget = planning.DDTreeBudgetPlanner(vllm_config, device)

        # Hybrid (Gated DeltaNet) targets: the GDN layers' tree path.
        self.gdn = None
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is not None and model_config.is_hybrid:
            from vllm.v1.spec_decode.ddtree.gdn_verify import DDTreeGDN

            # Bound to the target's GDN layers in bind(), once they exist.
            self.gdn = DDTreeGDN.from_vllm_config(
                vllm_config, self.req_parent_idx, self.draft_depth, device
            )

        # The drafter's batch-ordered trees (DDTreeSpeculator), moved here
        # after each DFlash pass: counted with the verifier's own buffers.
        self._drafter_tree_buffers: list[torch.Tensor] = (
            list(speculator.tree_buffers())
            if speculator is not None and hasattr(speculator, "tree_buffers")
            else []
        )
        self.memory_bytes = self.buffer_bytes()
        self._log_memory(max_num_reqs, max_num_tokens)

    # ----------------------------------------------------------- memory
    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of DDTree's persistent device buffers for the target, by
        kind: ``bias`` (the tree attention masks), ``tree`` (per-request and
        per-batch-row trees, the logits rows' position shifts, tree positions
        and input ids, the node index, the walk's path, scratch and outputs,
        the measured budget policy's counters), ``gdn``
        (hybrid targets: the Gated DeltaNet verify rows; 0 otherwise).
        Allocated at startup, before memory profiling (the walk's outputs
        too: the walk allocates nothing per step)."""
        tree = [
            self.req_parent_idx,
            self.req_depth,
            self.req_valid,
            self.tree_shift,
            self.logits_pos,
            self.logits_input_ids,
            self.node_range,
            *self.walk_buffers.tensors(),
            *self._drafter_tree_buffers,
            # The measured budget policy's per-rank counters.
            *([self.budget.acceptance.counts] if self.budget is not None else []),
        ]
        return {
            "bias": self.attn_bias.nbytes,
            "tree": sum(t.nbytes for t in tree),
            "gdn": self.gdn.buffer_bytes() if self.gdn is not None else 0,
        }

    def _log_memory(self, max_num_reqs: int, max_num_tokens: int) -> None:
        """One startup line: the buffers of `buffer_bytes` in MiB and the
        sizes they come from."""
        sizes = self.memory_bytes
        msg = (
            "DDTree: extra GPU memory for max_num_seqs=%d, tree_budget=%d: "
            "%.1f MiB = tree attention bias %.1f MiB (%d x %d nodes x %d int32 "
            "words, 1 bit per node pair) + tree/walk/compaction buffers %.1f "
            "MiB (parents, depths and valid flags of %d x %d nodes %s; the "
            "walk's paths and scratch, its tokens and counts for %d steps in "
            "flight; tree positions of "
            "max_num_batched_tokens=%d logits rows)"
        )
        args: list[Any] = [
            max_num_reqs,
            self.tree_budget,
            sum(sizes.values()) / 2**20,
            sizes["bias"] / 2**20,
            *self.attn_bias.shape,
            sizes["tree"] / 2**20,
            max_num_reqs,
            self.tree_budget,
            "per request and per batch row"
            if self._drafter_tree_buffers
            else "per request",
            self.num_output_slots,
            max_num_tokens,
        ]
        if self.gdn is not None:
            gdn = self.gdn
            msg += (
                " + Gated DeltaNet verify buffers %.1f MiB (%d layers x %d rows "
                "x (conv dim %d + 2 x %d value heads) %s; rows = "
                "min(max_num_batched_tokens, max_num_seqs + the sum over b = 1 "
                ".. max_num_seqs of the largest tree budget of a batch of b or "
                "more requests: by the budget schedule, tree_budget without a "
                "fixed one))"
            )
            args += [
                sizes["gdn"] / 2**20,
                gdn.num_layers,
                gdn.max_rows,
                gdn.conv_dim,
                gdn.num_v_heads,
                str(gdn.dtype).removeprefix("torch."),
            ]
        logger.info_once(msg + ".", *args)

    # ------------------------------------------------------------------ setup
    def bind_sampler(self, sampler: Sampler) -> None:
        """Give the target's sampler tree-aware penalties (a
        `TreePenaltiesState` in place of its `PenaltiesState`). Called once
        the sampler exists, before any request is added to it."""
        old = sampler.penalties_state
        if PENALTIES_ARE_LOGITS_PROCESSOR:
            # vLLM 0.33+: one of the sampler's logits processors, in order.
            new = TreePenaltiesState(self.vllm_config, old.req_states)
            processors = sampler.logits_processors
            processors[processors.index(old)] = new
        else:
            new = TreePenaltiesState(sampler.req_states)
        sampler.penalties_state = new

    def bind(
        self,
        model_state: Any,
        kv_caches: dict[str, torch.Tensor],
        draft_layer_names: set[str],
        kv_cache_groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        """Hook into the target's attention metadata and KV caches.

        ``kv_cache_groups``: the layer names of each KV-cache group (the
        runner's ``kv_cache_config.kv_cache_groups``); layers of one group
        share a slot mapping. None: one group."""
        if not hasattr(model_state, "attn_metadata_hook"):
            raise ValueError(
                "DDTree supports dense decoder targets only; model state "
                f"{type(model_state).__name__} has no attention metadata hook."
            )
        model_state.attn_metadata_hook = self.attach_bias
        if self.gdn is not None:
            self.gdn.bind_layers(
                self.vllm_config.compilation_config.static_forward_context,
                kv_cache_groups,
            )
        self.bind_kv_caches(kv_caches, draft_layer_names, kv_cache_groups)

    def bind_kv_caches(
        self,
        kv_caches: dict[str, Any],
        draft_layer_names: set[str],
        kv_cache_groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        """One KV compactor per KV-cache group of the target's attention
        layers (one launch each per step). A layout the compactor cannot
        move is refused here, at startup."""
        # Attention layers only: a hybrid's GDN layers hold [conv, ssm] state
        # lists, advanced after the walk by the GDN path instead.
        self.target_kv_caches = {
            name: kv
            for name, kv in kv_caches.items()
            if name not in draft_layer_names and isinstance(kv, torch.Tensor)
        }
        if not self.target_kv_caches:
            raise ValueError("DDTree: no target KV caches found.")
        if kv_cache_groups is None:
            kv_cache_groups = [list(self.target_kv_caches)]
        self.kv_compactors = []
        covered: dict[int, str] = {}  # data pointer -> a layer that moves it
        for g, group in enumerate(kv_cache_groups):
            layers: dict[int, tuple[str, torch.Tensor]] = {}
            for name in group:
                kv = self.target_kv_caches.get(name)
                if kv is not None:
                    # A layer sharing another's KV cache is moved once.
                    layers.setdefault(kv.data_ptr(), (name, kv))
            if not layers:
                continue
            try:
                compactor = KVCompactor([kv for _, kv in layers.values()])
            except ValueError as e:
                raise ValueError(
                    f"DDTree cannot compact the target KV cache of KV-cache "
                    f"group {g}: {e}."
                ) from None
            first = next(iter(layers.values()))[0]
            self.kv_compactors.append((first, compactor))
            for ptr, (name, _) in layers.items():
                covered.setdefault(ptr, name)
        for name, kv in self.target_kv_caches.items():
            if not any(name in group for group in kv_cache_groups) and (
                kv.data_ptr() not in covered
            ):
                raise ValueError(
                    f"DDTree: target attention layer {name} is in no KV-cache "
                    "group and shares no other layer's KV cache."
                )

    def attach_bias(self, attn_metadata: dict[str, Any]) -> None:
        """Point every target Triton attention metadata at the tree bias."""
        attached = False
        self._tree_splits = {}
        for i, metadata in enumerate(_unique(attn_metadata.values())):
            if hasattr(metadata, "tree_attn_bias"):
                self._attach_to(metadata, i)
                attached = True
        if attn_metadata and not attached:
            raise ValueError(
                "DDTree needs the TRITON_ATTN backend for the target model; got "
                f"{sorted({type(m).__name__ for m in attn_metadata.values()})}."
            )
        if self.gdn is not None:
            self.gdn.attach(attn_metadata)

    def attach_bias_to(self, metadata: Any, builder: Any) -> None:
        """The tree bias on one target Triton attention metadata, as its
        metadata builder (``builder``, a key) builds it (the builder's
        ``metadata_hook``: every step and capture). Hybrid targets: the
        step's longest query for the GDN tree kernels (the GDN metadata
        itself reaches the GDN path after the forward, `compact`)."""
        self._attach_to(metadata, builder)
        if self.gdn is not None:
            self.gdn.attach({"": metadata})

    def _attach_to(self, metadata: Any, key: Any) -> None:
        metadata.tree_attn_bias = self.attn_bias
        tree_split = getattr(metadata, "tree_split", None)
        if tree_split is not None:
            self._tree_splits[key] = tree_split
        else:
            self._tree_splits.pop(key, None)

    # ------------------------------------------------------------ per step
    def prepare_verify(self, input_batch: InputBatch) -> None:
        """Tree positions and tree attention bias for this step's batch."""
        num_reqs = input_batch.num_reqs
        self._walk = None
        self._tree_pos = None
        if self.gdn is not None:
            self.gdn.prepare_step(input_batch)
        if input_batch.num_draft_tokens == 0:
            # Prefill or plain decode only: no request sees a tree bias, and
            # the split attention may run a prefill chunk on FA3 causal.
            self.attn_bias[:num_reqs].zero_()
            for tree_split in self._tree_splits.values():
                tree_split.no_tree = True
            return
        logits_indices = input_batch.logits_indices
        num_logits = logits_indices.shape[0]
        shift = self.tree_shift[:num_logits]
        # One launch: the tree positions in place, their shifts, and the
        # rows' positions and input ids for sample().
        ddtree_tree_positions(
            input_batch.positions,
            logits_indices,
            input_batch.expanded_idx_mapping,
            input_batch.expanded_local_pos,
            self.req_depth,
            input_batch.input_ids,
            shift,
            self.logits_pos[:num_logits],
            self.logits_input_ids[:num_logits],
        )
        self._tree_pos = (logits_indices, shift)
        ddtree_tree_bias(
            self.req_parent_idx,
            input_batch.idx_mapping,
            input_batch.cu_num_logits[: num_reqs + 1],
            self.draft_depth,
            self.attn_bias,
        )

    def prepare_model_positions(self, positions: torch.Tensor) -> None:
        """The tree shift in a multi-dimensional RoPE target's own positions.

        M-RoPE / XD-RoPE models read ``[num_dims, num_tokens]`` positions
        that the model state writes after ``prepare_verify``; a text token's
        sections are all ``position (+ delta)``, so each gets the same
        ``depth - local position`` shift as the 1-D positions: one launch,
        and one in ``compact`` that takes the same shifts off. A no-op for
        1-D positions (already shifted: they are ``input_batch.positions``).
        """
        if self._tree_pos is None or positions.dim() != 2:
            return
        logits_indices, shift = self._tree_pos
        ddtree_shift_model_positions(positions, logits_indices, shift)
        self._model_positions = (positions, logits_indices, shift)

    def sample(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        input_batch: InputBatch,
        draft_tokens: torch.Tensor,
        prefill_len: torch.Tensor,
    ) -> SamplerOutput:
        """Draw the target's token at every node and walk the tree."""
        # Target draw at every node (penalties on the node's ancestor path).
        num_logits = logits.shape[0]
        assert self._tree_pos is not None, "prepare_verify did not run"
        target_flat, row_logprobs = sample_nodes(
            sampler,
            logits,
            input_batch,
            self.req_parent_idx,
            self.req_depth,
            self.draft_depth,
            self.logits_pos[:num_logits],
            self.logits_input_ids[:num_logits],
        )
        num_reqs = input_batch.num_reqs
        cu_num_logits = input_batch.cu_num_logits[: num_reqs + 1]
        idx_mapping = input_batch.idx_mapping
        # The step's outputs: the next of the walk buffers' round-robin slots
        # (the runner copies them to the host after this returns).
        output_token_ids, num_sampled, num_rejected = self.walk_buffers.next_outputs(
            num_reqs
        )
        # One launch: the walk over the scheduled nodes (a request may verify
        # fewer than tree_budget nodes near max_model_len; parents precede
        # children, so those form a prefix-closed subtree), the emitted tokens
        # and the compaction rows (in the persistent walk buffers, read by
        # compact), upstream's num_sampled / num_rejected, and the sequential
        # positions back (nothing after the sampler reads the tree ones).
        logits_indices, shift = self._tree_pos
        _, num_accepted, src_row, dst_row = ddtree_walk(
            target_flat,
            cu_num_logits,
            idx_mapping,
            input_batch.query_start_loc[: num_reqs + 1],
            draft_tokens,
            self.req_parent_idx,
            self.req_depth,
            self.req_valid,
            self.draft_depth,
            self.walk_buffers,
            num_sampled,
            output_token_ids,
            counts=(num_rejected, input_batch.seq_lens, prefill_len),
            restore=(input_batch.positions, logits_indices, shift),
        )
        self._tree_pos = None
        self._walk = (num_accepted, src_row, dst_row)
        if self.budget is not None:
            self.budget.observe_walk(
                num_accepted, src_row, input_batch.query_start_loc, cu_num_logits
            )
        logprobs = None
        if row_logprobs is not None:
            logprobs = node_logprobs(
                row_logprobs,
                # Path entries as verify-layout node indices.
                src_row - input_batch.query_start_loc[:num_reqs, None],
                num_accepted,
                cu_num_logits[:num_reqs],
            )
        return SamplerOutput(
            sampled_token_ids=output_token_ids,
            logprobs_tensors=logprobs,
            num_nans=None,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )

    def compact(
        self,
        input_batch: InputBatch,
        slot_mappings_by_layer: dict[str, torch.Tensor] | None,
        aux_hidden_states: list[torch.Tensor] | None,
        attn_metadata: dict[str, Any] | None = None,
    ) -> None:
        """Move the accepted path to the front: KV, hidden states, positions
        (those of a step without a walk; the walk restores its own).

        ``attn_metadata``: the target's of the step, where the verifier saw
        only its attention metadata before the forward (`attach_bias_to`):
        the GDN metadata (state slots) of a hybrid target's commit."""
        if self._tree_pos is not None:
            logits_indices, shift = self._tree_pos
            ddtree_restore_positions(input_batch.positions, logits_indices, shift)
            self._tree_pos = None
        if self._model_positions is not None:
            # Only the target's forward read them since the shift: the same
            # shifts come off (``tree_shift`` holds them until the next
            # prepare_verify).
            ddtree_shift_model_positions(*self._model_positions, restore=True)
            self._model_positions = None
        if self.gdn is not None and attn_metadata is not None:
            self.gdn.attach(attn_metadata)
        if self._walk is None:
            if self.gdn is not None:
                # No walk (no request had drafts), but decode rows may have
                # run the GDN tree path: their roots are their paths.
                num_reqs = input_batch.num_reqs
                self.gdn.commit_roots(
                    input_batch.query_start_loc[: num_reqs + 1],
                    self.walk_buffers.num_accepted,
                    self.walk_buffers.src_row,
                )
            return
        num_accepted, src_row, dst_row = self._walk
        self._walk = None
        if self.gdn is not None:
            # Committed GDN states along the accepted path (before the
            # DFlash pass, which does not read them; the next verify does).
            self.gdn.commit(
                num_accepted,
                src_row,
                input_batch.query_start_loc[: src_row.shape[0] + 1],
            )
        # One launch for the aux hidden states (the DFlash context), one per
        # KV-cache group for the KV; paths are read on the device (entries
        # past num_accepted are never touched): no host sync.
        if aux_hidden_states:
            compact_rows(aux_hidden_states, src_row, dst_row, num_accepted)
        if slot_mappings_by_layer is None:
            return
        for name, compactor in self.kv_compactors:
            compactor(slot_mappings_by_layer[name], src_row, dst_row, num_accepted)

    def store_trees(
        self,
        idx_mapping: torch.Tensor,
        speculator: Any,
        req_draft_tokens: torch.Tensor,
    ) -> None:
        """The drafter's new trees (batch order) to per-request state, their
        node tokens into the runner's ``req_draft_tokens`` (in place of its
        own scatter of the drafts): one launch."""
        ddtree_store_trees(
            idx_mapping,
            speculator.tree_parent_idx,
            speculator.tree_depth,
            speculator.tree_valid,
            speculator.draft_tokens,
            self.req_parent_idx,
            self.req_depth,
            self.req_valid,
            req_draft_tokens,
        )


def _unique(items: Any) -> list[Any]:
    seen: dict[int, Any] = {}
    for item in items:
        seen.setdefault(id(item), item)
    return list(seen.values())
