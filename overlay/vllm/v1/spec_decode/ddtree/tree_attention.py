# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Split tree attention: FlashAttention 3 over each request's committed
prefix, a small Triton kernel over the step's own keys, merged by their
log-sum-exp.

A request verifying a tree has ``T = 1 + budget`` query tokens (root, then
the nodes) at consecutive KV slots after its committed prefix. Every one of
them sees all prefix keys without a mask, and the tree's own keys under the
ancestor mask. Attention over the union of two key sets is the merge of the
attention over each, weighted by their log-sum-exps ``lse_p`` and ``lse_t``:

    out = (e^lse_p * out_p + e^lse_t * out_t) / (e^lse_p + e^lse_t)

so a step runs

(a) FA3's paged varlen kernel, non-causal, over the prefix
    (``seqused_k = seq_len - query_len``): it writes ``out_p`` into the
    output and returns ``lse_p`` (`fa3_prefix_attention`);
(b) `tree_attention`, one program per (block of a request's query tokens,
    KV head): causal attention over the request's own query tokens, read
    from the paged cache, with the packed ancestor mask (the int32 ``qq_bias``
    of the patched unified kernel, decoded by the same helper), merged with
    (a) in place.

That is what the unified Triton kernel computes with the same mask, for any
request: (b) covers any number of query tokens (a prefill chunk's causal
attention over its own tokens), and the mask covers the first ``T`` query
rows and keys only, as in the unified kernel. The TRITON_ATTN backend takes
the split when DDTree runs it (``VLLM_DDTREE_TREE_ATTENTION``: ``split``, or
``auto``, the default, where FA3 takes the target: `resolve_tree_attention`)
and no request of the batch has more than ``max(T, SPLIT_MAX_CHUNK)`` query
tokens: decode and tree verification steps (the batches the decode CUDA
graphs capture), and those steps with a new prompt's prefill chunk mixed in,
as continuous batching schedules them. A batch with a longer chunk runs FA3
alone, causal, over whole sequences when it verifies no tree; when it does,
its requests split in two: the longer ones (prefill chunks, never trees),
which vLLM's V2 model runner orders last, run FA3 alone, causal, over their
whole sequences, and the others the split. The rule is only about speed: a
graph captured on the split path stays exact whatever batch replays it.

The shapes are fixed per batch (grid from the token and request counts, the
prefix lengths and FA3's scheduler metadata in persistent buffers written
when the metadata is built), so CUDA graphs capture both passes; nothing
here reads a device value on the host.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_attention_helpers import (
    apply_softcap,
    load_qq_bias_tile,
    resolve_seq_and_query_len,
    softmax_step,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# ``VLLM_DDTREE_TREE_ATTENTION``: how the target's attention applies the tree
# mask. ``unified``: the patched Triton unified attention kernel, the mask as
# its per-request ``qq_bias``; ``split``: FA3 over the prefix + `tree_attention`;
# ``auto`` (the default): ``split`` where FA3 takes the target, else ``unified``.
# ``auto`` is a value of its own, as VLLM_DDTREE_BACKEND's, so that a script can
# set the default explicitly.
TREE_ATTENTION_ENV = "VLLM_DDTREE_TREE_ATTENTION"
TREE_ATTENTION_MODES = ("auto", "unified", "split")
# What FA3 takes (vllm_flash_attn's Hopper kernels): 16-bit queries and KV
# caches of the same dtype, head sizes that are multiples of 8 up to 256,
# attention sinks (``s_aux``) in bfloat16.
SPLIT_DTYPES = (torch.float16, torch.bfloat16)
SPLIT_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
SPLIT_MAX_HEAD_SIZE = 256
SPLIT_SINKS_DTYPE = torch.bfloat16
# The longest prefill chunk a batch that verifies trees may carry and still
# take the split. (b) runs a chunk's causal attention over its own tokens in
# small tiles, sized for trees: it wins over the unified kernel, which reads
# every request's prefix in those tiles too, while the chunk is short (the
# prefill a continuous batch mixes into its decode steps), not for a long
# prompt's chunks (`bench/kernels/tree_attention.py --chunks` times both).
SPLIT_MAX_CHUNK = 256
# The remedy of a refused split: the default then resolves to unified.
_UNSET = f"unset {TREE_ATTENTION_ENV}"


@dataclass(frozen=True)
class TreeAttentionChoice:
    """The tree attention an engine runs (`resolve_tree_attention`)."""

    # "unified" or "split".
    mode: str
    # The value of VLLM_DDTREE_TREE_ATTENTION: "auto" (also when unset),
    # "unified" or "split".
    requested: str
    # Under "auto" resolved to "unified": the first condition of the split the
    # engine fails ("which takes ..., got ..."); None otherwise.
    reason: str | None = None


def requested_tree_attention() -> str:
    """The value of ``VLLM_DDTREE_TREE_ATTENTION`` ("auto" when unset); any
    other value is a one-line ``ValueError``."""
    mode = os.environ.get(TREE_ATTENTION_ENV, "auto")
    if mode not in TREE_ATTENTION_MODES:
        raise ValueError(
            f"DDTree: {TREE_ATTENTION_ENV}={mode!r} is not a tree attention "
            "mode; set it to 'auto', 'unified' or 'split', or unset it."
        )
    return mode


def _fa3_unsupported_reason() -> str | None:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return (
            "it needs an NVIDIA GPU of compute capability 9.x, this platform "
            f"is {current_platform.device_name}"
        )
    if not current_platform.is_device_capability_family(90):
        capability = current_platform.get_device_capability()
        found = capability.as_version_str() if capability is not None else "unknown"
        return f"it needs compute capability 9.x, the GPU has {found}"
    try:
        from vllm.vllm_flash_attn import fa_version_unsupported_reason
    except ImportError as e:
        return f"vllm_flash_attn does not load: {e}"
    return fa_version_unsupported_reason(3)


def _sinks_unsupported(
    vllm_config: "VllmConfig", model_dtype: torch.dtype | None
) -> tuple[str, str] | None:
    """Attention sinks FA3 cannot take, on the layers built so far (none at
    config time: a model creates its sinks in code, its config does not say).
    Every attention layer counts, the drafter's too (the forward context does
    not say which model built a layer): a drafter's batches carry no tree mask
    and never take the split, so counting its layers can cost the split's
    speed, never exactness."""
    compilation_config = getattr(vllm_config, "compilation_config", None)
    layers = getattr(compilation_config, "static_forward_context", None) or {}
    for name, layer in layers.items():
        sinks = getattr(getattr(layer, "impl", None), "sinks", None)
        if sinks is not None and sinks.dtype != SPLIT_SINKS_DTYPE:
            dtype = str(sinks.dtype).removeprefix("torch.")
            # Sinks held in the model's dtype follow --dtype.
            remedy = _UNSET
            if sinks.dtype == model_dtype:
                remedy = f"pass --dtype bfloat16 or {_UNSET}"
            return (
                "which takes attention sinks in bfloat16 only, got "
                f"{dtype} sinks on layer {name}",
                remedy,
            )
    return None


def split_unsupported(vllm_config: "VllmConfig") -> tuple[str, str] | None:
    """The first condition of the split that this engine fails, as (why:
    "which takes ..., got ...", the remedy), or None where the split runs.
    Deterministic from the config, its layers once built and the machine, so
    that every process resolves the same."""
    model_config = getattr(vllm_config, "model_config", None)
    model_dtype = ""
    if model_config is not None:
        model_dtype = str(model_config.dtype).removeprefix("torch.")
        if model_config.dtype not in SPLIT_DTYPES:
            return (
                f"which takes float16 or bfloat16, got dtype={model_dtype}",
                f"pass --dtype bfloat16 or {_UNSET}",
            )
        head_size = model_config.get_head_size()
        if head_size % 8 != 0 or head_size > SPLIT_MAX_HEAD_SIZE:
            return (
                "which takes head sizes that are multiples of 8 up to "
                f"{SPLIT_MAX_HEAD_SIZE}, got head_size={head_size}",
                _UNSET,
            )
    cache_config = getattr(vllm_config, "cache_config", None)
    cache_dtype = getattr(cache_config, "cache_dtype", "auto")
    if cache_dtype not in SPLIT_KV_CACHE_DTYPES or (
        cache_dtype != "auto" and model_dtype and cache_dtype != model_dtype
    ):
        return (
            "which reads the KV cache in the model's own dtype, got "
            f"kv_cache_dtype={cache_dtype!r}",
            f"pass --kv-cache-dtype auto or {_UNSET}",
        )
    sinks = _sinks_unsupported(
        vllm_config, model_config.dtype if model_config is not None else None
    )
    if sinks is not None:
        return sinks
    reason = _fa3_unsupported_reason()
    if reason is not None:
        return (
            f"which is not available here ({reason})",
            f"{_UNSET} (the unified Triton kernel runs everywhere)",
        )
    return None


def resolve_tree_attention(vllm_config: "VllmConfig") -> TreeAttentionChoice:
    """The tree attention of this engine: ``split`` where every condition of
    the split holds and ``VLLM_DDTREE_TREE_ATTENTION`` is ``auto`` (or unset)
    or ``split``, else ``unified``. An explicit ``split`` that cannot run is
    refused in one line, never replaced by the unified kernel."""
    requested = requested_tree_attention()
    if requested == "unified":
        return TreeAttentionChoice("unified", requested)
    unsupported = split_unsupported(vllm_config)
    if unsupported is None:
        return TreeAttentionChoice("split", requested)
    reason, remedy = unsupported
    if requested == "split":
        raise ValueError(
            f"DDTree: {TREE_ATTENTION_ENV}=split needs FlashAttention 3, "
            f"{reason}; {remedy}."
        )
    return TreeAttentionChoice("unified", requested, reason)


def tree_attention_mode(vllm_config: "VllmConfig") -> str:
    """``"unified"`` or ``"split"``: the resolved mode (`resolve_tree_attention`)."""
    return resolve_tree_attention(vllm_config).mode


def verify_tree_attention(vllm_config: "VllmConfig") -> None:
    """Startup check of ``VLLM_DDTREE_TREE_ATTENTION`` on the config (one-line
    ``ValueError``s): a known value, and for ``split`` a target that FA3
    takes, on a machine where FA3 runs. ``auto`` and ``unified`` refuse
    nothing; the mode is resolved, its layers' part checked and its log line
    written once the layers are built (`verify_tree_attention_layers`)."""
    if requested_tree_attention() == "split":
        resolve_tree_attention(vllm_config)


def verify_tree_attention_layers(vllm_config: "VllmConfig") -> None:
    """`verify_tree_attention` again once the target's and the drafter's
    layers are built (attention sinks are only known on the layers; an
    explicit ``split`` with sinks FA3 cannot take stops here, in one line),
    and one startup line with the mode in use: the one every TRITON_ATTN
    metadata builder of the process resolves (`SplitTreeAttention.for_builder`),
    from the same config and layers."""
    choice = resolve_tree_attention(vllm_config)
    setting = f"{TREE_ATTENTION_ENV}={choice.requested}"
    if choice.mode == "split":
        logger.info_once(
            "DDTree: split tree attention (%s): FlashAttention 3 over each "
            "request's prefix + a Triton kernel over its tree, merged by LSE, "
            "in batches whose requests have at most max(1 + tree_budget, %d) "
            "query tokens each (trees, with short prefill chunks mixed in); "
            "longer prefill chunks run FlashAttention 3 alone, causal, over "
            "their whole sequences, beside the trees of their batch.",
            setting,
            SPLIT_MAX_CHUNK,
        )
    elif choice.reason is None:
        logger.info_once(
            "DDTree: unified tree attention (%s): the Triton unified "
            "attention kernel with a per-request tree mask.",
            setting,
        )
    else:
        logger.info_once(
            "DDTree: unified tree attention (%s): the Triton unified "
            "attention kernel with a per-request tree mask; split needs "
            "FlashAttention 3, %s.",
            setting,
            choice.reason,
        )


# ---------------------------------------------------------------------------
# (b): attention over each request's own query tokens, merged with (a)
# ---------------------------------------------------------------------------


# Per-batch counts (the requests; the tokens, the row stride of FA's
# [heads, tokens] log-sum-exp) are not specialised on (== 1, % 16), so that
# batch sizes share one compiled kernel and a running server does not stall
# on a variant that the CUDA-graph capture did not compile (vLLM's JIT
# monitor logged such a compile of this kernel in a benchmark's timed window).
@triton.jit(do_not_specialize=["num_seqs", "prefix_lse_stride_0", "out_lse_stride_0"])
def _tree_attention_kernel(
    out_ptr,  # [num_tokens, num_query_heads, head_size]: (a)'s output if MERGE
    out_lse_ptr,  # [num_query_heads, num_tokens] float32, if OUTPUT_LSE
    prefix_lse_ptr,  # [num_query_heads, num_tokens] float32, if MERGE
    query_ptr,  # [num_tokens, num_query_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_num_blocks]
    seq_lens_ptr,  # [num_seqs]
    query_start_len_ptr,  # [num_seqs + 1]
    mask_ptr,  # int32 [>= num_seqs, T, ceil(T / 32)], set bit = masked out
    scale,
    softcap,
    num_seqs: tl.int32,
    block_table_stride: tl.int64,
    query_stride_0: tl.int64,
    query_stride_1: tl.int64,
    out_stride_0: tl.int64,
    out_stride_1: tl.int64,
    prefix_lse_stride_0: tl.int64,
    prefix_lse_stride_1: tl.int64,
    out_lse_stride_0: tl.int64,
    out_lse_stride_1: tl.int64,
    mask_stride_seq: tl.int64,
    mask_stride_row: tl.int64,
    mask_len: tl.int32,  # T
    stride_k_cache_0: tl.int64,
    stride_k_cache_1: tl.int64,
    stride_k_cache_2: tl.int64,
    stride_k_cache_3: tl.constexpr,
    stride_v_cache_0: tl.int64,
    stride_v_cache_1: tl.int64,
    stride_v_cache_2: tl.int64,
    stride_v_cache_3: tl.constexpr,
    NUM_QUERY_HEADS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    MERGE_PREFIX: tl.constexpr,
    OUTPUT_LSE: tl.constexpr,
):
    q_block_global_idx = tl.program_id(0)
    kv_head_idx = tl.program_id(1)
    seq_idx, q_block_local_idx, query_start, query_len, seq_len = (
        resolve_seq_and_query_len(
            query_start_len_ptr, seq_lens_ptr, q_block_global_idx, num_seqs, BLOCK_Q
        )
    )
    if q_block_local_idx * BLOCK_Q >= query_len:
        return
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    offs_t = tl.arange(0, TILE_SIZE)
    # Row m: query token (m // NUM_QUERIES_PER_KV) of the block, query head
    # (m % NUM_QUERIES_PER_KV) of the KV head's group. Rows past
    # BLOCK_Q * NUM_QUERIES_PER_KV are off: with MERGE_PREFIX the output is
    # read and written in place, so no row may belong to two programs.
    query_pos = q_block_local_idx * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV
    head_idx = kv_head_idx * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_mask = (
        (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV)
        & (query_pos < query_len)
        & (head_idx < NUM_QUERY_HEADS)
    )
    dim_mask = offs_d < HEAD_SIZE
    token_idx = (query_start + query_pos).to(tl.int64)

    Q = tl.load(
        query_ptr
        + token_idx[:, None] * query_stride_0
        + head_idx[:, None] * query_stride_1
        + offs_d[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    mask_row_ptrs = (
        mask_ptr + seq_idx * mask_stride_seq + query_pos[:, None] * mask_stride_row
    )
    block_table_offset = seq_idx * block_table_stride

    M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    L = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)

    # Causal within the step's tokens: the block's last query sees keys up to
    # its own index; keys sit at slots context_len + key.
    num_keys = tl.minimum(query_len, (q_block_local_idx + 1) * BLOCK_Q)
    for tile_start in range(0, num_keys, TILE_SIZE):
        key = tile_start + offs_t
        slot = context_len + key
        # slot >= 0: CUDA-graph capture runs with seq_lens of 1 under
        # longer queries; no slot before the request's first may be read.
        key_mask = (key < num_keys) & (slot >= 0)
        physical_block_idx = tl.load(
            block_tables_ptr + block_table_offset + slot // BLOCK_SIZE,
            mask=key_mask,
            other=0,
        ).to(tl.int64)
        slot_in_block = slot % BLOCK_SIZE
        # K : (HEAD_SIZE_PADDED, TILE_SIZE)
        K = tl.load(
            key_cache_ptr
            + physical_block_idx[None, :] * stride_k_cache_0
            + slot_in_block[None, :] * stride_k_cache_1
            + kv_head_idx * stride_k_cache_2
            + offs_d[:, None] * stride_k_cache_3,
            mask=dim_mask[:, None] & key_mask[None, :],
            other=0.0,
        )
        # V : (TILE_SIZE, HEAD_SIZE_PADDED)
        V = tl.load(
            value_cache_ptr
            + physical_block_idx[:, None] * stride_v_cache_0
            + slot_in_block[:, None] * stride_v_cache_1
            + kv_head_idx * stride_v_cache_2
            + offs_d[None, :] * stride_v_cache_3,
            mask=key_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        S = scale * tl.dot(Q, K.to(Q.dtype))
        if USE_SOFTCAP:
            S = apply_softcap(S, softcap)
        visible = (
            row_mask[:, None] & key_mask[None, :] & (key[None, :] <= query_pos[:, None])
        )
        S = tl.where(visible, S, float("-inf"))
        # The packed ancestor mask, decoded as the unified kernel decodes its
        # qq_bias: first T query rows and keys only.
        S += load_qq_bias_tile(mask_row_ptrs, query_pos, key, 0, mask_len, True)
        M, L, P, alpha = softmax_step(S, M, L)
        acc = acc * alpha[:, None] + tl.dot(P.to(V.dtype), V)

    # L == 0: a row that saw no key (only with a mask that hides a query from
    # itself); its part weighs nothing in the merge.
    has_keys = L > 0.0
    lse = tl.where(has_keys, M + tl.log(tl.where(has_keys, L, 1.0)), float("-inf"))
    result = acc / tl.where(has_keys, L, 1.0)[:, None]
    out_ptrs = (
        out_ptr
        + token_idx[:, None] * out_stride_0
        + head_idx[:, None] * out_stride_1
        + offs_d[None, :]
    )
    io_mask = row_mask[:, None] & dim_mask[None, :]
    if MERGE_PREFIX:
        prefix_lse = tl.load(
            prefix_lse_ptr
            + head_idx * prefix_lse_stride_0
            + token_idx * prefix_lse_stride_1,
            mask=row_mask,
            other=float("-inf"),
        )
        # An empty prefix: -inf (FA3) or +inf (FA2); its output rows are
        # undefined and must not reach the result (0 * NaN).
        prefix_lse = tl.where(prefix_lse == float("inf"), float("-inf"), prefix_lse)
        max_lse = tl.maximum(prefix_lse, lse)
        ref_lse = tl.where(max_lse == float("-inf"), 0.0, max_lse)
        prefix_w = tl.exp(prefix_lse - ref_lse)
        tree_w = tl.exp(lse - ref_lse)
        total_w = prefix_w + tree_w
        prefix_out = tl.load(out_ptrs, mask=io_mask, other=0.0).to(tl.float32)
        prefix_out = tl.where(prefix_w[:, None] > 0.0, prefix_out, 0.0)
        safe_w = tl.where(total_w > 0.0, total_w, 1.0)
        result = (
            prefix_out * (prefix_w / safe_w)[:, None]
            + result * (tree_w / safe_w)[:, None]
        )
        lse = tl.where(
            max_lse == float("-inf"), float("-inf"), ref_lse + tl.log(safe_w)
        )
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=io_mask)
    if OUTPUT_LSE:
        tl.store(
            out_lse_ptr + head_idx * out_lse_stride_0 + token_idx * out_lse_stride_1,
            lse,
            mask=row_mask,
        )


def tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    tree_mask: torch.Tensor,
    softmax_scale: float,
    softcap: float = 0.0,
    prefix_lse: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    query_block: int | None = None,
    num_warps: int = 4,
) -> None:
    """Attention of every request's query tokens over themselves (causal)
    under the packed tree mask, keys and values read from the paged cache.

    ``query`` / ``out``: ``[num_tokens, num_query_heads, head_size]``;
    ``key_cache`` / ``value_cache``: ``[num_blocks, block_size,
    num_kv_heads, head_size]`` (any strides, last dim contiguous);
    ``cu_seqlens_q`` ``[num_seqs + 1]``, ``seq_lens`` ``[num_seqs]`` (the
    request's keys end at ``seq_len``; its query tokens are the last
    ``query_len``); ``tree_mask``: int32 ``[>= num_seqs, T, ceil(T / 32)]``,
    bit ``k % 32`` of word ``k // 32`` of row ``q`` set where query ``q``
    may not see key ``q``, for the first ``T`` query tokens and keys (the
    unified kernel's packed ``qq_bias``).

    ``prefix_lse`` (``[num_query_heads, num_tokens]``, FA's layout): ``out``
    already holds the attention over the prefix with that log-sum-exp; the
    result is merged in place. ``out_lse``: also write the log-sum-exp of the
    result (same layout). Tokens past ``cu_seqlens_q[-1]`` are not touched.

    ``query_block``: query tokens per program (each with its KV head's group
    of query heads); by default as many as fill 16 rows. ``query_block`` and
    ``num_warps`` are the launch's tuning knobs (`bench/kernels/tree_attention.py
    --tree-configs` times them); the result does not depend on them.
    """
    num_tokens, num_query_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    assert num_query_heads % num_kv_heads == 0
    assert out.shape == query.shape and out.stride(-1) == 1
    assert query.stride(-1) == 1
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    assert tree_mask.dtype == torch.int32 and tree_mask.ndim == 3, (
        f"tree_mask must be packed int32 [num_seqs, T, ceil(T / 32)], got "
        f"{tuple(tree_mask.shape)} {tree_mask.dtype}"
    )
    mask_len = tree_mask.shape[1]
    assert tree_mask.shape[2] == triton.cdiv(mask_len, 32)
    assert tree_mask.shape[0] >= num_seqs and tree_mask.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return
    num_queries_per_kv = num_query_heads // num_kv_heads
    if query_block is None:
        block_m = max(16, triton.next_power_of_2(num_queries_per_kv))
        block_q = block_m // num_queries_per_kv
    else:
        assert query_block >= 1, query_block
        block_q = query_block
        block_m = max(16, triton.next_power_of_2(block_q * num_queries_per_kv))
    # A tree row has at most T keys. Head size 256 with 32-key tiles spills
    # registers on sm_90 (ptxas); 16-key tiles do not.
    tile_size = 16 if mask_len <= 16 or head_size > 128 else 32
    merge = prefix_lse is not None
    if merge:
        assert prefix_lse.shape == (num_query_heads, num_tokens), prefix_lse.shape
    if out_lse is not None:
        assert out_lse.shape == (num_query_heads, num_tokens), out_lse.shape
    # As the unified kernel: enough q-blocks for any split of the tokens
    # among the requests (fixed per token and request count).
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _tree_attention_kernel[grid](
        out,
        out_lse,
        prefix_lse,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        cu_seqlens_q,
        tree_mask,
        softmax_scale,
        softcap,
        num_seqs,
        block_table.stride(0),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        prefix_lse.stride(0) if merge else 0,
        prefix_lse.stride(1) if merge else 0,
        out_lse.stride(0) if out_lse is not None else 0,
        out_lse.stride(1) if out_lse is not None else 0,
        tree_mask.stride(0),
        tree_mask.stride(1),
        mask_len,
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.stride(3),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        value_cache.stride(3),
        NUM_QUERY_HEADS=num_query_heads,
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        BLOCK_SIZE=block_size,
        TILE_SIZE=tile_size,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        USE_SOFTCAP=softcap > 0,
        MERGE_PREFIX=merge,
        OUTPUT_LSE=out_lse is not None,
        num_warps=num_warps,
    )


# ---------------------------------------------------------------------------
# (a): attention over the committed prefix, and the split
# ---------------------------------------------------------------------------

# (query, key_cache, value_cache, out, cu_seqlens_q, max_seqlen_q,
#  prefix_lens, max_seqlen_k, block_table, softmax_scale, softcap, sinks,
#  scheduler_metadata, num_splits, causal=False) -> lse [num_query_heads,
# num_tokens]: writes the attention of every query over its request's first
# prefix_lens keys into ``out`` (non-causal, or causal with ``causal=True``).
PrefixAttention = Callable[..., torch.Tensor]


def fa3_prefix_attention(
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
    scheduler_metadata: torch.Tensor | None,
    num_splits: int,
    causal: bool = False,
) -> torch.Tensor:
    """(a) on FlashAttention 3 (vllm_flash_attn's paged varlen kernel, as
    the FLASH_ATTN backend calls it). Sinks enter through FA3's ``s_aux``,
    which adds them to the returned log-sum-exp, so the merge counts them
    once. ``causal``: query ``i`` of a request of ``n`` query tokens sees the
    keys up to ``prefix_lens - n + i`` (FA's bottom-right alignment), the
    whole attention of a batch without trees (`SplitTreeAttentionMetadata`
    ``no_tree``)."""
    from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    _, lse = flash_attn_varlen_func(
        q=query,
        k=canonicalize_singleton_dim_strides(key_cache),
        v=canonicalize_singleton_dim_strides(value_cache),
        out=out,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        seqused_k=prefix_lens,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal,
        block_table=block_table,
        softcap=softcap,
        return_softmax_lse=True,
        scheduler_metadata=scheduler_metadata,
        fa_version=3,
        num_splits=num_splits,
        s_aux=sinks,
    )
    return lse


def split_tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_seqlen_k: int,
    block_table: torch.Tensor,
    tree_mask: torch.Tensor | None,
    softmax_scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    prefix_attention: PrefixAttention = fa3_prefix_attention,
    scheduler_metadata: torch.Tensor | None = None,
    num_splits: int = 0,
    causal: bool = False,
) -> None:
    """(a) then (b): the unified kernel's result with the same packed mask
    (``qq_bias``), causal, written into ``out``. ``prefix_lens`` must be
    ``seq_lens - query_lens`` (`SplitTreeAttention.build` keeps it). Without
    ``tree_mask`` (``prefix_lens`` the whole sequences): (a) alone, the whole
    attention of a batch without trees: of one-token queries, or of any
    queries with ``causal``."""
    prefix_lse = prefix_attention(
        query,
        key_cache,
        value_cache,
        out,
        cu_seqlens_q,
        max_seqlen_q,
        prefix_lens,
        max_seqlen_k,
        block_table,
        softmax_scale,
        softcap,
        sinks,
        scheduler_metadata,
        num_splits,
        causal=causal,
    )
    if tree_mask is None:
        return
    tree_attention(
        query,
        key_cache,
        value_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_table,
        tree_mask,
        softmax_scale,
        softcap,
        prefix_lse=prefix_lse,
    )


# ---------------------------------------------------------------------------
# The TRITON_ATTN backend's side
# ---------------------------------------------------------------------------


@dataclass
class SplitTreeAttentionMetadata:
    """One step's split pass, on ``TritonAttentionMetadata.tree_split``."""

    # [num_reqs] int32, seq_len - query_len (a persistent buffer's rows);
    # seq_len itself in a plain decode step (`whole_sequence`).
    prefix_lens: torch.Tensor
    prefix_attention: PrefixAttention = fa3_prefix_attention
    # FA3's ahead-of-time schedule of (a) (a persistent buffer's rows).
    scheduler_metadata: torch.Tensor | None = None
    num_splits: int = 0
    # Every request decodes one token and none verifies a tree (a step of
    # no speculation: the measured budget policy's choice at large batch
    # sizes): (a) covers the whole sequence, the step's own key included,
    # which is the whole attention of a one-token query, and (b) is skipped,
    # so such a step attends as an engine without speculation does.
    whole_sequence: bool = False
    # No request of the step verifies a tree (prefill chunks and one-token
    # decodes only: the step after a preemption, a new request's prefill in
    # a batch the measured budget policy runs without speculation). Set by
    # the verifier once the step's drafts are known (`prepare_verify`), after
    # the metadata is built. Such a batch with a request longer than ``T``
    # (a prefill chunk) runs FA3, causal, over each whole sequence, as the
    # FLASH_ATTN backend runs it without speculation, instead of the unified
    # Triton kernel. Eager steps only: a captured graph replays what it
    # captured (captures run no verifier, so never this route), and such a
    # batch is a mixed one, which full decode graphs do not take.
    no_tree: bool = False
    # A batch with requests of more than ``max(T, SPLIT_MAX_CHUNK)`` query
    # tokens (prefill chunks: a tree has at most T), all after the others, as
    # vLLM's V2 model runner orders a batch (by query length, uniform decodes
    # first): (the first of them, its first query token); their query start
    # locations from 0 (``long_query_start``, a persistent buffer's rows; its
    # last entry, their tokens, on the host); and each part's longest query.
    # The shorter requests take the split, the longer ones FA3 alone, causal,
    # over their whole sequences, as the FLASH_ATTN backend attends without
    # speculation. Eager steps only, as ``no_tree``. None: no longer request
    # (or not all last, which takes the unified kernel).
    long_from: tuple[int, int] | None = None
    long_query_start: torch.Tensor | None = None
    long_num_tokens: int = 0
    short_max_query_len: int = 0
    long_max_query_len: int = 0

    def applies(self, attn_metadata: Any, output_scale: torch.Tensor | None) -> bool:
        """Host-side rule: a tree mask is attached and no request has more
        than ``max(T, SPLIT_MAX_CHUNK)`` query tokens (decode and tree
        verification steps, with short prefill chunks mixed in), or those
        that have are the batch's last (`long_from`), or the batch verifies
        no tree (`no_tree`); otherwise the unified kernel runs, as without
        the split."""
        tree_mask = attn_metadata.tree_attn_bias
        if tree_mask is None:
            return False
        max_query_len = max(tree_mask.shape[1], SPLIT_MAX_CHUNK)
        if (
            attn_metadata.max_query_len > max_query_len
            and not self.no_tree
            and self.long_from is None
        ):
            return False
        if attn_metadata.causal is not True:
            # A per-request causal flag (bidirectional drafter batches).
            return False
        if output_scale is not None or attn_metadata.mm_prefix_range_tensor is not None:
            # FA3 writes (a) in the query dtype and has no PrefixLM ranges.
            logger.warning_once(
                "DDTree: split tree attention skips layers with a fused FP8 "
                "output scale or multimodal prefix ranges; they run the "
                "unified Triton kernel."
            )
            return False
        return True

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: Any,
        softmax_scale: float,
        softcap: float,
        sinks: torch.Tensor | None,
    ) -> None:
        if self.long_from is not None and not self.no_tree:
            self._forward_in_two(
                query,
                key_cache,
                value_cache,
                output,
                attn_metadata,
                softmax_scale,
                softcap,
                sinks,
            )
            return
        # A batch without trees and with a longer query than one token: every
        # key of a query's own request up to its position, no mask. FA3
        # schedules itself (the schedule built with the metadata is the
        # prefix pass's, non-causal, over the prefixes).
        causal = self.no_tree and attn_metadata.max_query_len > 1
        split_tree_attention(
            query,
            key_cache,
            value_cache,
            output,
            attn_metadata.query_start_loc,
            attn_metadata.max_query_len,
            attn_metadata.seq_lens,
            attn_metadata.seq_lens if causal else self.prefix_lens,
            attn_metadata.max_seq_len,
            attn_metadata.block_table,
            None if self.whole_sequence or causal else attn_metadata.tree_attn_bias,
            softmax_scale,
            softcap,
            sinks,
            self.prefix_attention,
            None if causal else self.scheduler_metadata,
            0 if causal else self.num_splits,
            causal=causal,
        )

    def _forward_in_two(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: Any,
        softmax_scale: float,
        softcap: float,
        sinks: torch.Tensor | None,
    ) -> None:
        """`long_from`'s batch: the split over the requests before it, FA3
        alone, causal, over the whole sequences of the longer ones. Each part
        reads its own rows of the batch's tensors; FA3 schedules both."""
        assert self.long_from is not None and self.long_query_start is not None
        first_long, first_row = self.long_from
        num_reqs = self.prefix_lens.shape[0]
        seq_lens = attn_metadata.seq_lens
        block_table = attn_metadata.block_table
        if first_long > 0:
            split_tree_attention(
                query[:first_row],
                key_cache,
                value_cache,
                output[:first_row],
                attn_metadata.query_start_loc[: first_long + 1],
                self.short_max_query_len,
                seq_lens[:first_long],
                self.prefix_lens[:first_long],
                attn_metadata.max_seq_len,
                block_table[:first_long],
                attn_metadata.tree_attn_bias,
                softmax_scale,
                softcap,
                sinks,
                self.prefix_attention,
            )
        last_row = first_row + self.long_num_tokens
        self.prefix_attention(
            query[first_row:last_row],
            key_cache,
            value_cache,
            output[first_row:last_row],
            self.long_query_start,
            self.long_max_query_len,
            seq_lens[first_long:num_reqs],
            attn_metadata.max_seq_len,
            block_table[first_long:num_reqs],
            softmax_scale,
            softcap,
            sinks,
            None,
            0,
            causal=True,
        )


class SplitTreeAttention:
    """Per TRITON_ATTN metadata builder, under DDTree with the split tree
    attention (`resolve_tree_attention`): the persistent buffers of the
    prefix pass (prefix lengths; FA3's scheduler metadata when CUDA graphs
    are full), filled each step when the metadata is built, outside any
    graph, as the FLASH_ATTN backend fills its own."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        num_heads_q: int,
        num_heads_kv: int,
        head_size: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        prefix_attention: PrefixAttention | None = None,
    ):
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.prefix_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        # The query start locations of a batch's longer requests, from 0
        # (`SplitTreeAttentionMetadata.long_from`).
        self.long_query_start = torch.zeros(
            max_num_reqs + 1, dtype=torch.int32, device=device
        )
        # Requests with more query tokens are prefill chunks: a tree has at
        # most 1 + tree_budget.
        from vllm.v1.spec_decode.ddtree.config import ddtree_speculative_config

        spec = ddtree_speculative_config(vllm_config.speculative_config)
        tree_tokens = 1 + spec.tree_budget
        self.max_split_query_len = max(tree_tokens, SPLIT_MAX_CHUNK)
        self.num_heads_q = num_heads_q
        self.num_heads_kv = num_heads_kv
        self.head_size = head_size
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        # A reference implementation of (a) in tests; FA3 otherwise, with
        # its ahead-of-time schedule.
        self.prefix_attention = prefix_attention or fa3_prefix_attention
        self.aot_schedule = prefix_attention is None
        compilation_config = vllm_config.compilation_config
        self.use_full_cuda_graph = (
            compilation_config.cudagraph_mode.has_full_cudagraphs()
        )
        self.max_cudagraph_size = compilation_config.max_cudagraph_capture_size
        self.max_num_splits = 0
        self.scheduler_metadata: torch.Tensor | None = None
        if self.aot_schedule and self.use_full_cuda_graph:
            from vllm.utils.math_utils import round_up

            # FA3's scheduler metadata: 1 + round_up(batch, 4) * 4 int32
            # (sized as the FLASH_ATTN builder sizes it), and an upper bound
            # on the splits so that capture allocates large enough buffers.
            max_batch_size = max(max_num_reqs, self.max_cudagraph_size or 0)
            self.scheduler_metadata = torch.zeros(
                1 + round_up(max_batch_size, 4) * 4, dtype=torch.int32, device=device
            )
            self.max_num_splits = (
                vllm_config.attention_config.flash_attn_max_num_splits_for_cuda_graph
            )

    @classmethod
    def for_builder(
        cls,
        vllm_config: "VllmConfig",
        num_heads_q: int,
        num_heads_kv: int,
        head_size: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
    ) -> "SplitTreeAttention | None":
        """The split for a TRITON_ATTN metadata builder, or None (no DDTree,
        or the unified mode). The mode is resolved here from the config and
        its built layers, as at startup (`verify_tree_attention_layers`, which
        logged it), so every builder of every process takes the same."""
        from vllm.v1.spec_decode.ddtree.config import is_ddtree

        # Also reached through the neutral tree hook (vllm.v1.spec_decode.
        # tree_hooks), for every engine of a process where DDTree's plugin is
        # loaded: is_ddtree reads the configs of both release lines.
        if not is_ddtree(vllm_config.speculative_config):
            return None
        if tree_attention_mode(vllm_config) != "split":
            return None
        return cls(
            vllm_config,
            num_heads_q,
            num_heads_kv,
            head_size,
            block_size,
            kv_cache_dtype,
            device,
        )

    def build(self, common_attn_metadata: Any) -> SplitTreeAttentionMetadata | None:
        """This step's split pass, or None for a batch that is not causal
        (the DFlash drafter's bidirectional blocks), which never takes it."""
        if common_attn_metadata.causal is not True:
            return None
        num_reqs = common_attn_metadata.num_reqs
        query_start_loc = common_attn_metadata.query_start_loc
        prefix_lens = self.prefix_lens[:num_reqs]
        # A host bound, fixed per captured graph: a one-token decode graph
        # always runs FA3 alone (SplitTreeAttentionMetadata.whole_sequence).
        whole_sequence = common_attn_metadata.max_query_len == 1
        if whole_sequence:
            prefix_lens.copy_(common_attn_metadata.seq_lens[:num_reqs])
        else:
            torch.sub(
                common_attn_metadata.seq_lens[:num_reqs],
                query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs],
                out=prefix_lens,
            )
        longer = self._longer_requests(common_attn_metadata)
        if longer is not None:
            # FA3 schedules both parts itself (eager steps: such a batch has a
            # prefill chunk, which full decode graphs do not take).
            return SplitTreeAttentionMetadata(
                prefix_lens=prefix_lens,
                prefix_attention=self.prefix_attention,
                **longer,
            )
        num_splits = 0  # FA3's own heuristics outside full CUDA graphs
        if (
            self.use_full_cuda_graph
            and self.max_cudagraph_size is not None
            and common_attn_metadata.num_actual_tokens <= self.max_cudagraph_size
        ):
            num_splits = self.max_num_splits
        scheduler_metadata = None
        if self.aot_schedule:
            from vllm.vllm_flash_attn import get_scheduler_metadata

            scheduler_metadata = get_scheduler_metadata(
                batch_size=num_reqs,
                max_seqlen_q=common_attn_metadata.max_query_len,
                max_seqlen_k=common_attn_metadata.max_seq_len,
                num_heads_q=self.num_heads_q,
                num_heads_kv=self.num_heads_kv,
                headdim=self.head_size,
                cache_seqlens=prefix_lens,
                qkv_dtype=self.kv_cache_dtype,
                cu_seqlens_q=query_start_loc,
                page_size=self.block_size,
                causal=False,
                num_splits=num_splits,
            )
            if self.scheduler_metadata is not None:
                n = scheduler_metadata.shape[0]
                self.scheduler_metadata[:n] = scheduler_metadata
                # Zeroed past n, as the FLASH_ATTN builder does, so that a
                # graph captured with a larger batch reads no stale schedule.
                self.scheduler_metadata[n:] = 0
                scheduler_metadata = self.scheduler_metadata[:n]
        return SplitTreeAttentionMetadata(
            prefix_lens=prefix_lens,
            prefix_attention=self.prefix_attention,
            scheduler_metadata=scheduler_metadata,
            num_splits=num_splits,
            whole_sequence=whole_sequence,
        )

    def _longer_requests(self, common_attn_metadata: Any) -> dict[str, Any] | None:
        """`SplitTreeAttentionMetadata.long_from` and the fields that go with
        it, for a batch whose requests of more than ``max_split_query_len``
        query tokens come after all the others (requests with no tokens, CUDA
        graph padding, may follow them); None for any other batch. Host data
        only (the batch's query start locations on the host), and one
        subtraction on the device into a persistent buffer."""
        if common_attn_metadata.max_query_len <= self.max_split_query_len:
            return None
        num_reqs = common_attn_metadata.num_reqs
        starts = common_attn_metadata.query_start_loc_cpu[: num_reqs + 1].numpy()
        query_lens = np.diff(starts)
        longer = query_lens > self.max_split_query_len
        first = int(np.argmax(longer))
        if not (longer[first:] | (query_lens[first:] == 0)).all():
            return None
        first_row = int(starts[first])
        torch.sub(
            common_attn_metadata.query_start_loc[first : num_reqs + 1],
            first_row,
            out=self.long_query_start[: num_reqs - first + 1],
        )
        return dict(
            long_from=(first, first_row),
            long_query_start=self.long_query_start[: num_reqs - first + 1],
            long_num_tokens=int(starts[num_reqs]) - first_row,
            short_max_query_len=int(query_lens[:first].max(initial=0)),
            long_max_query_len=int(query_lens[first:].max()),
        )
