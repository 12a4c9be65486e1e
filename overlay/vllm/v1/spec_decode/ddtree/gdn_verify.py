# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree verification through the Gated DeltaNet layers of hybrid targets
(Qwen3.5 / Qwen3.6 / Qwen3-Next).

State memory: ONE committed conv window and ONE committed recurrent state per
request and GDN layer, in the slot upstream calls column 0 of
``spec_state_indices_tensor`` (the mamba groups reserve no per-draft slots
under DDTree, see `vllm.v1.spec_decode.ddtree.config.mamba_num_spec_tokens`).
The committed window sits at conv-state columns ``0 .. W - 2`` (upstream's
``num_accepted_tokens == 1`` offset).

Per step:

1. Verify forward. A GDN layer's speculative rows of a request are its
   verify rows [root, node 1 .. node n]. Instead of upstream's chain kernels
   the layer calls `DDTreeGDN.conv` (`tree_causal_conv1d`: each node's window
   is its ancestors, then the committed window) and `DDTreeGDN.recurrent`
   (`tree_gated_delta_rule`: each node's output after its root -> node
   path from the committed state, all nodes of a request at once in the
   chunked form). Neither writes the committed state. The verify rows'
   inputs (the pre-conv ``mixed_qkv`` rows, ``a`` and ``b``) go into the
   layer's persistent buffers in one launch per layer
   (`save_verify_inputs`, from `recurrent`), with fixed shapes and no host
   synchronisation, so it is captured in CUDA graphs too.
2. After the walk (`DDTreeGDN.commit`, from the verifier's ``compact``): for
   all GDN layers at once (`gdn_commit.commit_accepted_paths`, two
   launches), the accepted path's post-conv rows are recomputed from the
   saved pre-conv rows (the forward's arithmetic on the forward's inputs:
   the same values), the recurrent state after the path is written into the
   committed slot, and so is the conv window. Only the path's rows (at most
   ``draft_depth + 1`` per request) are recomputed, not the whole tree's.

The post-conv q / k / v are recomputed rather than saved: saving them would
double the buffers (a ``conv_dim`` row per verify token and layer) for a
recomputation of at most ``draft_depth + 1`` rows per request and layer.

The verifier binds this object to each GDN layer of a hybrid target
(`DDTreeGDN.bind_layers` sets the layer's ``tree_verifier``); the upstream
layer only gains that attribute and two branches that call `conv` and
`recurrent` when it is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.triton_utils import tl, triton
from vllm.v1.spec_decode.ddtree.config import ddtree_speculative_config
from vllm.v1.spec_decode.ddtree.gdn_commit import (
    GDNCommitTables,
    commit_accepted_paths,
)
from vllm.v1.spec_decode.ddtree.policy import max_spec_rows_per_step
from vllm.v1.spec_decode.ddtree.tree_conv import tree_causal_conv1d
from vllm.v1.spec_decode.ddtree.tree_gdn import tree_gated_delta_rule
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
from vllm.v1.worker.gpu.buffer_utils import UvaBufferPool

logger = init_logger(__name__)


# Features per program of the save (a few programs per verify row).
_SAVE_BLOCK = 1024


@triton.jit
def _save_verify_inputs_kernel(
    x,  # [T, conv_dim] pre-conv mixed_qkv rows (any strides)
    stride_x_row,
    stride_x_col,
    a,  # [T, num_heads] (any strides)
    stride_a_row,
    stride_a_col,
    b,  # [T, num_heads] (any strides)
    stride_b_row,
    stride_b_col,
    x_buf,  # [max_rows, conv_dim] the layer's buffers (contiguous)
    a_buf,  # [max_rows, num_heads]
    b_buf,  # [max_rows, num_heads]
    conv_dim,
    num_heads,
    BLOCK: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    f = blk * BLOCK + tl.arange(0, BLOCK)
    mask = f < conv_dim
    x_row = tl.load(x + row * stride_x_row + f * stride_x_col, mask=mask)
    tl.store(x_buf + row * conv_dim + f, x_row, mask=mask)
    if blk == 0:
        h = tl.arange(0, HEADS_BLOCK)
        mask_h = h < num_heads
        a_row = tl.load(a + row * stride_a_row + h * stride_a_col, mask=mask_h)
        tl.store(a_buf + row * num_heads + h, a_row, mask=mask_h)
        b_row = tl.load(b + row * stride_b_row + h * stride_b_col, mask=mask_h)
        tl.store(b_buf + row * num_heads + h, b_row, mask=mask_h)


def save_verify_inputs(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    x_buf: torch.Tensor,
    a_buf: torch.Tensor,
    b_buf: torch.Tensor,
) -> None:
    """``x_buf[:n] = x[:n]``, and the same for ``a`` and ``b``, ``n`` the
    rows of ``x`` that fit the buffers: one launch instead of three copies."""
    n = min(x.shape[0], x_buf.shape[0])
    assert a.shape[0] >= n and b.shape[0] >= n
    assert x.shape[1] == x_buf.shape[1] and a.shape[1] == a_buf.shape[1]
    assert b.shape[1] == b_buf.shape[1] == a.shape[1]
    assert x_buf.is_contiguous() and a_buf.is_contiguous() and b_buf.is_contiguous()
    if n == 0:
        return
    conv_dim, num_heads = x.shape[1], a.shape[1]
    block = min(_SAVE_BLOCK, triton.next_power_of_2(conv_dim))
    _save_verify_inputs_kernel[(n, triton.cdiv(conv_dim, block))](
        x,
        x.stride(0),
        x.stride(1),
        a,
        a.stride(0),
        a.stride(1),
        b,
        b.stride(0),
        b.stride(1),
        x_buf,
        a_buf,
        b_buf,
        conv_dim,
        num_heads,
        BLOCK=block,
        HEADS_BLOCK=triton.next_power_of_2(num_heads),
        num_warps=4,
    )


def spec_decode_rows(
    num_draft_tokens_per_req: np.ndarray | None,
    num_scheduled_tokens: np.ndarray,
    decode_rows: np.ndarray | None = None,
) -> np.ndarray:
    """Batch rows the GDN metadata treats as speculative (tree) rows, in
    batch order: exactly `MambaHybridModelState.prepare_attn`'s rule.

    ``decode_rows`` None (vLLM 0.26): draft tokens scheduled and nothing
    else but the one decode token. Otherwise (vLLM 0.34, whose model state
    makes every decode row a spec row, drafts or none: `decode_rows_of`):
    the rows it marks."""
    if decode_rows is not None:
        return np.flatnonzero(decode_rows).astype(np.int64)
    if num_draft_tokens_per_req is None:
        return np.zeros(0, dtype=np.int64)
    num_reqs = num_draft_tokens_per_req.shape[0]
    drafts = num_draft_tokens_per_req
    is_decode = num_scheduled_tokens[:num_reqs] == drafts + 1
    return np.flatnonzero((drafts > 0) & is_decode).astype(np.int64)


def decode_rows_of(input_batch: Any, max_decode_tokens: int) -> np.ndarray | None:
    """The GDN spec-decode rows of a batch by the rule of vLLM 0.34's
    `MambaHybridModelState.prepare_attn` (None where the batch has no
    ``prefill_runs_as_decode_np``: vLLM 0.26, whose rule is
    `spec_decode_rows`' own): rows not prefilling (a prompt's one-token tail
    over existing context runs as a decode) with 1 .. ``max_decode_tokens``
    tokens scheduled (1 + the speculative tokens), drafts or none."""
    if not hasattr(input_batch, "prefill_runs_as_decode_np"):
        return None
    num_reqs = input_batch.num_reqs
    prefilling = np.asarray(input_batch.is_prefilling_np[:num_reqs])
    runs_as_decode = input_batch.prefill_runs_as_decode_np
    if runs_as_decode is not None:
        prefilling = prefilling & ~np.asarray(runs_as_decode[:num_reqs])
    scheduled = np.asarray(input_batch.num_scheduled_tokens[:num_reqs])
    return ~prefilling & (scheduled > 0) & (scheduled <= max_decode_tokens)


class DDTreeGDN:
    """Per-layer verify buffers, the step's tree rows, and the GDN hooks."""

    def __init__(
        self,
        parent_idx: torch.Tensor,
        draft_depth: int,
        max_num_reqs: int,
        max_rows: int,
        num_layers: int,
        conv_dim: int,
        num_v_heads: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        # [max_num_reqs, B]: parent verify index of node i + 1, per request
        # state (the verifier's persistent table; captured graphs read it).
        self.parent_idx = parent_idx
        self.draft_depth = draft_depth
        self.max_num_reqs = max_num_reqs
        self.max_rows = max_rows
        self.num_layers = num_layers
        self.conv_dim = conv_dim
        self.num_v_heads = num_v_heads
        self.dtype = dtype
        # Verify-row inputs of every GDN layer, kept until the walk.
        self.x_buf = torch.zeros(
            num_layers, max_rows, conv_dim, dtype=dtype, device=device
        )
        self.a_buf = torch.zeros(
            num_layers, max_rows, num_v_heads, dtype=dtype, device=device
        )
        self.b_buf = torch.zeros_like(self.a_buf)
        # (layer prefix, pre-conv rows) from `conv`, saved by `recurrent`.
        self._pending_x: tuple[str, torch.Tensor] | None = None
        # The step's spec-row tables, one device buffer written by one copy
        # per step (prepare_step) from a host mirror through the runner's
        # round-robin pinned staging buffers (no pinned allocation per step):
        # spec row (GDN metadata order) -> request-state index (row of
        # parent_idx; captured graphs read it, at a fixed address), -> batch
        # row, and the spec rows' first verify-buffer rows (the post-walk
        # update's, outside graphs).
        m = max_num_reqs
        self.spec_rows = torch.zeros(3 * m + 1, dtype=torch.int32, device=device)
        self.tree_rows = self.spec_rows[:m]
        self.spec_batch_rows = self.spec_rows[m : 2 * m]
        self.spec_query_start = self.spec_rows[2 * m :]
        self._spec_rows_np = np.zeros(3 * m + 1, dtype=np.int32)
        self._spec_rows_staging = UvaBufferPool(3 * m + 1, torch.int32)
        self.num_spec = 0
        self.num_spec_tokens = 0
        # True from a step's prepare_step with spec rows until their states
        # are committed (`commit` after a walk, `commit_roots` without one).
        self.commit_pending = False
        self.device = device
        self.layer_index: dict[str, int] = {}
        self.layers: dict[str, Any] = {}
        # Set by bind_layers: the per-layer tables of the one-launch commit,
        # one GDN layer per KV-cache group (whose metadata holds that group's
        # state slots), and room for every group's slots of a step.
        self.tables: GDNCommitTables | None = None
        self.group_layers: list[str] = []
        self._group_of: dict[str, int] = {}
        self.slot_buf = torch.zeros(0, dtype=torch.int32, device=device)
        # The step's GDN metadata, one per KV-cache group (attach).
        self.group_metadata: list[Any] = []
        self._groups_checked = False
        # The step's longest query (attach; None: unknown), then its longest
        # tree (prepare_step), which picks the tree kernels' form and block.
        self.max_query_len: int | None = None

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: Any,
        parent_idx: torch.Tensor,
        draft_depth: int,
        device: torch.device,
    ) -> DDTreeGDN:
        """Buffers sized from the target config, before memory profiling."""
        model_config = vllm_config.model_config
        parallel_config = vllm_config.parallel_config
        scheduler_config = vllm_config.scheduler_config
        hf = model_config.hf_text_config
        tp = parallel_config.tensor_parallel_size
        key_dim = hf.linear_num_key_heads * hf.linear_key_head_dim
        value_dim = hf.linear_num_value_heads * hf.linear_value_head_dim
        conv_dim = (2 * key_dim + value_dim) // tp
        num_v_heads = hf.linear_num_value_heads // tp
        num_layers = model_config.get_num_layers_by_block_type(
            parallel_config, "linear_attention"
        )
        # Spec rows per step: at most every scheduled token, and at most
        # what the budget schedule lets a step verify (`max_spec_rows_per_step`
        # says why); the "measured" policy may move any batch size to any
        # budget at runtime, so it counts the whole tree at every batch size.
        tree_budget = parent_idx.shape[1]
        max_num_seqs = scheduler_config.max_num_seqs
        spec = ddtree_speculative_config(vllm_config.speculative_config)
        schedule = None
        if getattr(spec, "budget_policy", None) not in ("measured", None):
            schedule = getattr(spec, "num_speculative_tokens_per_batch_size", None)
        if schedule:
            # The scheduler's own lookup (index 0 unused).
            budgets = build_dynamic_sd_schedule_lookup(
                schedule, max_num_seqs, tree_budget
            )[1:]
        else:
            budgets = [tree_budget] * max_num_seqs
        max_rows = max_spec_rows_per_step(
            scheduler_config.max_num_batched_tokens, budgets
        )
        dtype = model_config.dtype
        context = cls(
            parent_idx,
            draft_depth,
            scheduler_config.max_num_seqs,
            max_rows,
            num_layers,
            conv_dim,
            num_v_heads,
            dtype,
            device,
        )
        # Their size is in the verifier's startup memory line.
        return context

    def buffer_bytes(self) -> int:
        """Bytes of this object's persistent device buffers (the verify-row
        inputs of every GDN layer and the step's spec-row tables; the parent
        table is the verifier's)."""
        return sum(
            t.nbytes for t in (self.x_buf, self.a_buf, self.b_buf, self.spec_rows)
        )

    # ------------------------------------------------------------ binding
    def bind_layers(
        self,
        forward_context: dict[str, Any],
        kv_cache_groups: Sequence[Sequence[str]] | None = None,
        with_states: bool = True,
    ) -> None:
        """Find the target's GDN layers (once the model and its KV caches
        exist) and make this object their tree verifier: from now on each
        layer's spec-decode rows go through `conv` and `recurrent`.

        ``kv_cache_groups``: the layer names of each KV-cache group (the
        runner's ``kv_cache_config.kv_cache_groups``); GDN layers of
        different groups read their state slots from different metadata.
        None: all GDN layers in one group. ``with_states`` False: the
        layers' states are not allocated yet (the forward's tree path reads
        them from the layer); `bind_states` binds the post-walk commit to
        them once they are, before the first commit."""
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            QwenGatedDeltaNetAttention,
        )

        layers = {
            name: module
            for name, module in forward_context.items()
            if isinstance(module, QwenGatedDeltaNetAttention)
        }
        if len(layers) != self.num_layers:
            raise ValueError(
                f"DDTree: expected {self.num_layers} Gated DeltaNet layers in "
                f"the target, found {len(layers)}."
            )
        for i, (name, layer) in enumerate(layers.items()):
            conv_dim = layer.conv1d.weight.shape[0]
            num_v_heads = layer.num_v_heads // layer.tp_size
            if (conv_dim, num_v_heads) != (self.conv_dim, self.num_v_heads):
                raise ValueError(
                    f"DDTree: GDN layer {name} has conv dim {conv_dim} and "
                    f"{num_v_heads} value heads; the verify buffers were "
                    f"sized for {self.conv_dim} and {self.num_v_heads}."
                )
            self.layer_index[name] = i
            self.layers[name] = layer
        self._group_of = _group_index(list(layers), kv_cache_groups)
        self.group_layers = [
            next(name for name in layers if self._group_of[name] == g)
            for g in range(max(self._group_of.values()) + 1)
        ]
        self.tables = None
        self.slot_buf = torch.zeros(
            len(self.group_layers) * self.max_num_reqs,
            dtype=torch.int32,
            device=self.device,
        )
        self.group_metadata = []
        self._groups_checked = False
        for layer in layers.values():
            layer.tree_verifier = self
        if with_states:
            self.bind_states()

    def bind_states(self) -> None:
        """The post-walk commit's tables of the bound layers' current states
        (their KV caches), compiled once here."""
        layers = self.layers
        states = [gdn_layer_states(layer) for layer in layers.values()]
        self.tables = GDNCommitTables(
            list(layers.values()),
            [conv for conv, _ in states],
            [ssm for _, ssm in states],
            [self._group_of[name] for name in layers],
            self.device,
        )
        self._compile_commit()

    def _compile_commit(self) -> None:
        """Launch the post-walk commit once, at startup, on one row that it
        skips (state slot 0, nothing accepted), so that its two kernels
        compile here: on an H200 the 27B-shaped engine compiled them at its
        first verify steps after warm-up, stalling those steps."""
        assert self.tables is not None
        groups = len(self.group_layers)
        # One group: a 1-D slot column, as `commit` passes it.
        slots = self.slot_buf[:groups]
        if groups > 1:
            slots = slots.view(groups, 1)
        nothing = torch.zeros(2, dtype=torch.int32, device=self.device)
        src_row = torch.zeros(
            1, self.draft_depth + 1, dtype=torch.int64, device=self.device
        )
        self._launch_commit(slots, nothing[:1], nothing, nothing[:1], src_row, nothing)

    def _launch_commit(
        self,
        slots: torch.Tensor,
        spec_batch_rows: torch.Tensor,
        spec_query_start: torch.Tensor,
        num_accepted: torch.Tensor,
        src_row: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> None:
        """The one-launch commit over every GDN layer, on this verifier's
        tables and verify buffers."""
        assert self.tables is not None
        commit_accepted_paths(
            self.tables,
            self.x_buf,
            self.a_buf,
            self.b_buf,
            slots,
            spec_batch_rows,
            spec_query_start,
            num_accepted,
            src_row,
            query_start_loc,
            self.draft_depth,
        )

    def attach(self, attn_metadata: dict[str, Any]) -> None:
        """Keep the step's GDN metadata (state slots), one per KV-cache
        group, and its longest query.

        The attention layers' metadata of the same batch carries the longest
        query on the host: the tree kernel takes the form of the step's trees
        (the batch policy's 15-node trees in a 64-column parent table take
        the 16-row kernel). It is bound at CUDA-graph capture too: a GDN
        target's full graphs are uniform decode batches (GDN builds decode-
        only capture metadata), replayed only for batches of exactly their
        query length, so no replay has longer trees than its capture."""
        # A host int in vLLM's metadata (anything else: the table's width).
        lens = [
            m.max_query_len
            for m in _unique_metadata(attn_metadata)
            if type(getattr(m, "max_query_len", None)) is int
        ]
        self.max_query_len = max(lens) if lens else None
        if not self.group_layers or self.group_layers[0] not in attn_metadata:
            return
        self.group_metadata = [attn_metadata.get(name) for name in self.group_layers]
        if not self._groups_checked:
            # Once: every GDN layer shares its group's metadata object (the
            # groups given at bind are the ones the runner builds).
            for name, idx in self.layer_index.items():
                group = self.tables.layer_group_list[idx] if self.tables else 0
                if attn_metadata.get(name) is not self.group_metadata[group]:
                    raise RuntimeError(
                        f"DDTree: GDN layer {name} does not share the attention "
                        f"metadata of {self.group_layers[group]}, its KV-cache "
                        "group's first layer."
                    )
            self._groups_checked = True

    # ----------------------------------------------------- per step (host)
    def prepare_step(self, input_batch: Any) -> None:
        """The step's spec rows (before the forward; host data only: the
        scheduler's numpy mirrors)."""
        drafts_np = input_batch.num_draft_tokens_per_req
        scheduled_np = np.asarray(input_batch.num_scheduled_tokens)
        # 1 + the speculative tokens (the tree budget): the longest decode.
        decode_rows = decode_rows_of(input_batch, self.parent_idx.shape[1] + 1)
        rows_np = spec_decode_rows(drafts_np, scheduled_np, decode_rows)
        n = rows_np.shape[0]
        drafts = np.zeros(0, np.int32) if drafts_np is None else drafts_np
        row_drafts = drafts[rows_np] if drafts.size else np.zeros(n, np.int32)
        if np.count_nonzero(row_drafts > 0) != np.count_nonzero(drafts > 0) or (
            np.any(scheduled_np[rows_np] != row_drafts + 1)
        ):
            # Such a row would be verified as a tree by the attention layers
            # but run through the GDN layers as a chain (prefill kernels).
            # The scheduler gives drafts with a prefill chunk only to a
            # resumed streaming-input session (stale draft placeholders),
            # refused per request (config.verify_ddtree_streaming_input).
            raise RuntimeError(
                "DDTree: a request with draft tokens also has other tokens "
                "scheduled; the Gated DeltaNet tree path cannot verify it."
            )
        self.num_spec = n
        self.num_spec_tokens = 0
        self.commit_pending = n > 0
        if n == 0:
            return
        assert n <= input_batch.num_reqs
        counts_np = scheduled_np[rows_np]
        # The longest tree bounds the tree kernels' form (attach took the
        # step's longest query, which runs before this in a step): a step
        # that mixes a new request's prefill chunk with trees has a longer
        # query than any tree, and would run the batch policy's 15-node trees
        # in the form of the widest one. Eager steps only read it; a full
        # CUDA graph keeps the form of its capture (uniform trees).
        longest_tree = max(counts_np.tolist())
        if self.max_query_len is None or longest_tree < self.max_query_len:
            self.max_query_len = longest_tree
        query_start_np = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts_np, out=query_start_np[1:])
        self.num_spec_tokens = sum(counts_np.tolist())
        if self.num_spec_tokens > self.max_rows:
            raise ValueError(
                f"DDTree: {self.num_spec_tokens} tree verify rows exceed the "
                f"GDN verify buffers ({self.max_rows} rows)."
            )
        idx_mapping_np = np.asarray(input_batch.idx_mapping_np)
        m = self.max_num_reqs
        host = self._spec_rows_np
        host[:n] = idx_mapping_np[rows_np]
        host[m : m + n] = rows_np
        host[2 * m : 2 * m + n + 1] = query_start_np
        # One copy of the whole table: rows past n are stale, as before the
        # copy (graph padding rows read them; their null slot is skipped).
        self._spec_rows_staging.copy_to_gpu(host, out=self.spec_rows)

    # -------------------------------------------- forward (inside the layer)
    def _spec_rows(self, md: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Eager: the step's spec rows; full CUDA graph: the padded batch
        # (padding rows have the null slot and no tokens: skipped).
        slots = md.spec_state_indices_tensor[:, 0].contiguous()
        num_rows = slots.shape[0]
        return slots, md.spec_query_start_loc[: num_rows + 1], self.tree_rows[:num_rows]

    def _check_dtype(self, t: torch.Tensor, what: str) -> None:
        if t.dtype != self.dtype:
            raise ValueError(
                f"DDTree: GDN {what} is {t.dtype}, the verify buffers {self.dtype}."
            )

    def conv(
        self,
        layer: Any,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        weight: torch.Tensor,
        md: Any,
    ) -> torch.Tensor:
        """The spec rows' causal conv over their trees (upstream:
        `causal_conv1d_update` with ``num_accepted_tokens``); ``x`` is saved
        with ``a`` and ``b`` by the layer's `recurrent`."""
        self._check_dtype(x, "mixed_qkv")
        # Not written in place (the tree conv returns a new tensor): still
        # the layer's input when `recurrent` saves it.
        self._pending_x = (layer.prefix, x)
        slots, query_start, tree_rows = self._spec_rows(md)
        return tree_causal_conv1d(
            x,
            conv_state,
            weight,
            layer.conv1d.bias,
            layer.activation,
            slots,
            query_start,
            self.parent_idx,
            tree_rows,
            max_query_len=self.max_query_len,
        )

    def recurrent(
        self,
        layer: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        ssm_state: torch.Tensor,
        md: Any,
    ) -> torch.Tensor:
        """The spec rows' gated delta rule over their trees (upstream:
        `fused_sigmoid_gating_delta_rule_update` with ``num_accepted_tokens``);
        saves the layer's verify inputs (``conv``'s ``x``, ``a``, ``b``).
        ``q, k [1, T, H, K]``, ``v [1, T, HV, V]``; ``a, b`` all of the
        batch's rows. Returns ``o [1, T, HV, V]``."""
        if md.num_prefills > 0 or md.num_decodes > 0:
            a = a.index_select(0, md.spec_token_indx)
            b = b.index_select(0, md.spec_token_indx)
        num_tokens = q.shape[1]
        a = a[:num_tokens]
        b = b[:num_tokens]
        self._check_dtype(a, "a")
        idx = self.layer_index[layer.prefix]
        pending, self._pending_x = self._pending_x, None
        if pending is None or pending[0] != layer.prefix:
            raise RuntimeError(
                f"DDTree: GDN layer {layer.prefix} ran its recurrent step "
                "without its conv step."
            )
        save_verify_inputs(
            pending[1], a, b, self.x_buf[idx], self.a_buf[idx], self.b_buf[idx]
        )
        slots, query_start, tree_rows = self._spec_rows(md)
        o = tree_gated_delta_rule(
            layer.A_log,
            a,
            b,
            layer.dt_bias,
            q[0],
            k[0],
            v[0],
            ssm_state,
            slots,
            query_start,
            self.parent_idx,
            tree_rows,
            self.draft_depth,
            use_qk_l2norm_in_kernel=True,
            max_query_len=self.max_query_len,
        )
        assert o is not None
        return o.unsqueeze(0)

    # ------------------------------------------------------ after the walk
    def commit(
        self,
        num_accepted: torch.Tensor,
        src_row: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> None:
        """Write every GDN layer's committed state after the accepted path.

        ``num_accepted [R]`` (root included) and ``src_row [R, D + 1]`` (flat
        verify rows of the accepted path, root first) are the walk's, per
        batch row; ``query_start_loc`` the batch's. Two launches for all
        layers (three with several KV-cache groups: their slots are gathered
        into one table first); no host synchronisation, no allocation.
        """
        n = self.num_spec
        self.commit_pending = False
        if n == 0:
            return
        assert self.tables is not None
        if len(self.group_metadata) != len(self.group_layers):
            raise RuntimeError("DDTree: no GDN metadata attached for this step.")
        slot_cols = []
        for name, md in zip(self.group_layers, self.group_metadata):
            # Invariant: the GDN builder counts the same rows as
            # spec_decode_rows, from the same step's metadata.
            if md is None or md.num_spec_decodes != n:
                raise RuntimeError(
                    f"DDTree: GDN layer {name} ran "
                    f"{getattr(md, 'num_spec_decodes', None)} spec rows, the "
                    f"verifier expected {n}."
                )
            slot_cols.append(md.spec_state_indices_tensor[:n, 0])
        if len(slot_cols) == 1:
            slots = slot_cols[0]
        else:
            flat = self.slot_buf[: len(slot_cols) * n]
            torch.cat(slot_cols, out=flat)
            slots = flat.view(len(slot_cols), n)
        self._launch_commit(
            slots,
            self.spec_batch_rows[:n],
            self.spec_query_start[: n + 1],
            num_accepted,
            src_row,
            query_start_loc,
        )

    def commit_roots(
        self,
        query_start_loc: torch.Tensor,
        num_accepted: torch.Tensor,
        src_row: torch.Tensor,
    ) -> None:
        """`commit` for a step without a walk (no request had drafts), whose
        spec rows still ran the tree path (vLLM 0.34 runs every decode row as
        a spec row, see `decode_rows_of`): each row's path is its root.
        ``query_start_loc [R + 1]``, the batch's; ``num_accepted [>= R]`` and
        ``src_row [>= R, D + 1]``, the walk's persistent buffers, get the
        root paths (two small writes, no tensor made). A no-op unless this
        step's `prepare_step` found spec rows that no `commit` has committed
        (a dummy run has no prepare_step)."""
        if not self.commit_pending:
            return
        num_reqs = query_start_loc.shape[0] - 1
        num_accepted[:num_reqs].fill_(1)
        src_row[:num_reqs, 0].copy_(query_start_loc[:num_reqs])
        self.commit(num_accepted[:num_reqs], src_row[:num_reqs], query_start_loc)


def _unique_metadata(attn_metadata: dict[str, Any] | None) -> list[Any]:
    """The distinct metadata objects of a step (layers of a group share
    one)."""
    seen: dict[int, Any] = {}
    for m in (attn_metadata or {}).values():
        seen.setdefault(id(m), m)
    return list(seen.values())


def _group_index(
    names: list[str], kv_cache_groups: Sequence[Sequence[str]] | None
) -> dict[str, int]:
    """Each GDN layer's KV-cache group, numbered 0.. among the groups that
    hold GDN layers."""
    if kv_cache_groups is None:
        return dict.fromkeys(names, 0)
    found: dict[str, int] = {}
    renumber: dict[int, int] = {}
    for g, group in enumerate(kv_cache_groups):
        for name in group:
            if name in names:
                found[name] = renumber.setdefault(g, len(renumber))
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(f"DDTree: GDN layers {missing} are in no KV-cache group.")
    return found


def gdn_layer_states(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv_state [slots, dim, state_len], ssm_state [slots, HV, V, K]) of a
    GDN layer, as its ``_forward_core`` sees them."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        is_conv_state_dim_first,
    )

    kv_cache = layer.kv_cache
    conv_state = (
        kv_cache[0] if is_conv_state_dim_first() else kv_cache[0].transpose(-1, -2)
    )
    return conv_state, kv_cache[1]
