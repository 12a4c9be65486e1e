# SPDX-License-Identifier: Apache-2.0
"""FlashAttention's metadata builder takes its heads and head size from its
own KV-cache group, not from the target model's config.

FA3's ahead-of-time schedule is planned from the builder's ``num_heads_q``,
``num_heads_kv`` and ``headdim``. A DFlash drafter's attention group has its
own builder, and its layers can differ from the target's: the hybrid
benchmark pair's drafter has 32 query / 8 KV heads of 128, its Qwen3.6-27B
shaped target 24 / 4 of 256. Planned for the target's shape, the drafter's
eager steps failed in FA3 (``scheduler_metadata must have shape
(metadata_size)``, 64 requests with 3-node trees on an H200) and its
CUDA-graph steps ran with a schedule for the wrong tile counts.
"""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.model_executor.layers.attention_layer_base import (  # noqa: E402
    AttentionLayerBase,
)
from vllm.v1.attention.backends.flash_attn import (  # noqa: E402
    FlashAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

# The hybrid benchmark pair at its production shape.
TARGET_HEADS, TARGET_KV_HEADS, TARGET_HEAD_SIZE = 24, 4, 256
DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_HEAD_SIZE = 32, 8, 128


class FakeAttentionLayer(AttentionLayerBase):
    """A registered attention layer: only its impl's head count is read."""

    def __init__(self, num_heads: int):
        self.impl = SimpleNamespace(num_heads=num_heads)

    def get_attn_backend(self):
        raise NotImplementedError

    def get_kv_cache_spec(self, vllm_config):
        raise NotImplementedError


def target_vllm_config(layers: dict[str, AttentionLayerBase]) -> SimpleNamespace:
    model_config = SimpleNamespace(
        get_num_attention_heads=lambda parallel_config: TARGET_HEADS,
        get_num_kv_heads=lambda parallel_config: TARGET_KV_HEADS,
        get_head_size=lambda: TARGET_HEAD_SIZE,
        rswa_window=None,
        hf_config=SimpleNamespace(model_type="qwen3_5"),
        is_mm_prefix_lm=False,  # vLLM 0.33
    )
    return SimpleNamespace(
        model_config=model_config,
        parallel_config=SimpleNamespace(
            cp_kv_cache_interleave_size=1, decode_context_parallel_size=1
        ),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode.NONE,
            max_cudagraph_capture_size=None,
            static_forward_context=layers,
        ),
        attention_config=SimpleNamespace(flash_attn_max_num_splits_for_cuda_graph=32),
        scheduler_config=SimpleNamespace(max_num_seqs=64),
        speculative_config=None,
        kernel_config=SimpleNamespace(enable_jit_warmup=False),  # vLLM 0.33
    )


def group_spec(num_kv_heads: int, head_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=torch.bfloat16,
    )


def test_drafter_group_plans_for_the_drafter_layers():
    draft_layers = {
        f"draft.layers.{i}.attn": FakeAttentionLayer(DRAFT_HEADS) for i in range(5)
    }
    target_layers = {
        f"model.layers.{i}.attn": FakeAttentionLayer(TARGET_HEADS) for i in (3, 7, 11)
    }
    config = target_vllm_config({**target_layers, **draft_layers})

    def planned_shape(kv_heads, head_size, layers):
        builder = FlashAttentionMetadataBuilder(
            group_spec(kv_heads, head_size), list(layers), config, torch.device("cpu")
        )
        return builder.num_heads_q, builder.num_heads_kv, builder.headdim

    assert planned_shape(DRAFT_KV_HEADS, DRAFT_HEAD_SIZE, draft_layers) == (
        DRAFT_HEADS,
        DRAFT_KV_HEADS,
        DRAFT_HEAD_SIZE,
    )
    assert planned_shape(TARGET_KV_HEADS, TARGET_HEAD_SIZE, target_layers) == (
        TARGET_HEADS,
        TARGET_KV_HEADS,
        TARGET_HEAD_SIZE,
    )


def test_group_without_registered_layers_takes_the_model_config_heads():
    # No attention layer under these names (e.g. a group built before its
    # layers are registered): the query heads fall back to the model
    # config's; KV heads and head size still come from the group's spec.
    builder = FlashAttentionMetadataBuilder(
        group_spec(DRAFT_KV_HEADS, DRAFT_HEAD_SIZE),
        ["not.registered.attn"],
        target_vllm_config({}),
        torch.device("cpu"),
    )
    assert (builder.num_heads_q, builder.num_heads_kv, builder.headdim) == (
        TARGET_HEADS,
        DRAFT_KV_HEADS,
        DRAFT_HEAD_SIZE,
    )
