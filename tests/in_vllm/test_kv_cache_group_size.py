# SPDX-License-Identifier: Apache-2.0
"""The hybrid KV-cache grouping with a DFlash drafter's layers: upstream's
n:1 heuristic takes the smallest bucket's layer count as the group size, so
a Qwen3.6-27B-shaped target (48 Gated DeltaNet + 16 attention layers) with a
5-layer drafter gets 15 groups (a block table and a metadata build each per
step) where 9 need less KV-cache memory per request. The patched grouping
takes the size with the fewest groups among those with fewer groups and
less memory per request than the heuristic's, and the heuristic's own size
everywhere else."""

import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

try:  # vLLM 0.33 moved the grouping out of kv_cache_utils.
    from vllm.v1.core import kv_cache_planning as grouping
except ImportError:
    from vllm.v1.core import kv_cache_utils as grouping

# The Qwen3.6-27B shape: attention 4 KV heads of 256, GDN conv over 16 key
# heads x 2 of 128 + 48 value heads of 128 (kernel 4, bf16), float32 state
# 48 x 128 x 128.
CONV_DIM = 2 * 16 * 128 + 48 * 128
MAMBA_BYTES = 3 * CONV_DIM * 2 + 48 * 128 * 128 * 4
# The attention block size vLLM raises so that a block holds a state's page.
BLOCK = cdiv(MAMBA_BYTES, 4 * 256 * 2 * 2 * 16) * 16
PAGE = BLOCK * 4 * 256 * 2 * 2


def config(max_model_len=1024, mamba_cache_mode="none"):
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_mode=mamba_cache_mode),
        max_in_flight_tokens=8192,
    )


def gdn(num_speculative_blocks=0):
    return MambaSpec(
        block_size=BLOCK,
        shapes=((3, CONV_DIM), (48, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=PAGE,
        num_speculative_blocks=num_speculative_blocks,
    )


def attention(num_kv_heads=4, head_size=256):
    return FullAttentionSpec(
        block_size=BLOCK * 4 * 256 // (num_kv_heads * head_size),
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=torch.bfloat16,
    )


def hybrid_27b(num_speculative_blocks=0, drafter_layers=5):
    """Layer specs as the runner reports them: the target's 64 layers (full
    attention every 4th), then the DFlash drafter's (8 KV heads of 128)."""
    specs = {}
    for i in range(64):
        name = f"model.layers.{i}"
        specs[name] = attention() if i % 4 == 3 else gdn(num_speculative_blocks)
    for i in range(drafter_layers):
        specs[f"draft.layers.{i}"] = attention(8, 128)
    return specs


def group(specs, vllm_config):
    return grouping._get_kv_cache_groups_uniform_page_size(dict(specs), vllm_config)


def memory_per_request(groups, vllm_config):
    """What a request can hold: every group allocates its blocks over the
    group size's layer slots (padding slots included)."""
    size = max(len(g.layer_names) for g in groups)
    return sum(
        size * g.kv_cache_spec.max_memory_usage_bytes(vllm_config) for g in groups
    )


def test_drafter_layers_no_longer_set_the_group_size():
    cfg = config()
    heuristic = group(hybrid_27b(), None)
    groups = group(hybrid_27b(), cfg)
    assert len(heuristic) == 15 and max(len(g.layer_names) for g in heuristic) == 5
    assert len(groups) == 9 and max(len(g.layer_names) for g in groups) == 8
    assert memory_per_request(groups, cfg) < memory_per_request(heuristic, cfg)
    # Every layer in exactly one group, each group of one spec.
    names = [n for g in groups for n in g.layer_names]
    assert sorted(names) == sorted(hybrid_27b())
    specs = hybrid_27b()
    for g in groups:
        assert len({specs[n] for n in g.layer_names}) == 1


def test_the_chain_s_state_per_draft_position_weighs_in():
    # DFlash's chain keeps 1 + 15 states per request: padding a state bucket
    # costs 16 pages, padding the drafter's attention bucket far less.
    cfg = config()
    heuristic = group(hybrid_27b(num_speculative_blocks=15), None)
    groups = group(hybrid_27b(num_speculative_blocks=15), cfg)
    assert len(heuristic) == 15
    assert len(groups) == 5 and max(len(g.layer_names) for g in groups) == 16
    assert memory_per_request(groups, cfg) < memory_per_request(heuristic, cfg)


@pytest.mark.parametrize(
    "counts",
    [
        (10, 50),  # clean n:1 (Gemma-like): the heuristic's 10 has no padding
        (16, 48),  # the target alone (no drafter): 4 groups of 16
        (12, 13),  # eagle-like n + 1 : n, padded to 13
    ],
)
def test_clean_patterns_keep_the_heuristic(counts):
    cfg = config()
    specs = {}
    for kind, n in zip(("attn", "gdn"), counts):
        for i in range(n):
            specs[f"{kind}.{i}"] = attention() if kind == "attn" else gdn()
    assert [g.layer_names for g in group(specs, cfg)] == [
        g.layer_names for g in group(specs, None)
    ]


def test_a_tie_on_memory_keeps_the_heuristic():
    # 3 full + 7 sliding-window layers at max_model_len = one block: padding
    # the full layers to 7 slots (2 groups) ties the heuristic's memory (3
    # slots, 4 groups) and is not taken; 4 slots (3 groups) needs less.
    cfg = config(max_model_len=BLOCK)
    specs = {f"full.{i}": attention() for i in range(3)}
    window = SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=4,
        head_size=256,
        dtype=torch.bfloat16,
        sliding_window=1,
    )
    specs |= {f"sw.{i}": window for i in range(7)}
    heuristic = group(specs, None)
    groups = group(specs, cfg)
    assert len(heuristic) == 4 and max(len(g.layer_names) for g in heuristic) == 3
    assert len(groups) == 3 and max(len(g.layer_names) for g in groups) == 4
    assert memory_per_request(groups, cfg) < memory_per_request(heuristic, cfg)


def brute_force(counts_and_specs, vllm_config, heuristic_size):
    """The size with the fewest groups (then the least memory, then the
    largest) among those with fewer groups and less memory than the
    heuristic's; the heuristic's size when there is none."""

    def cost(size):
        return (
            sum(cdiv(n, size) for n, _ in counts_and_specs),
            sum(
                cdiv(n, size) * size * s.max_memory_usage_bytes(vllm_config)
                for n, s in counts_and_specs
            ),
        )

    base = cost(heuristic_size)
    sizes = range(1, max(n for n, _ in counts_and_specs) + 1)
    better = [s for s in sizes if cost(s)[0] < base[0] and cost(s)[1] < base[1]]
    return min(better, key=lambda s: (*cost(s), -s), default=heuristic_size)


def test_random_buckets_match_the_brute_force():
    rng = random.Random(0)
    kinds = [
        lambda: attention(),
        lambda: attention(8, 128),
        lambda: gdn(),
        lambda: gdn(3),
        lambda: SlidingWindowSpec(
            block_size=BLOCK,
            num_kv_heads=4,
            head_size=256,
            dtype=torch.bfloat16,
            sliding_window=2 * BLOCK,
        ),
    ]
    for _ in range(200):
        cfg = config(max_model_len=rng.choice([1024, 8192, 131072]))
        chosen = rng.sample(range(len(kinds)), rng.randint(2, 4))
        counts = [rng.randint(1, 60) for _ in chosen]
        specs = {}
        for k, n in zip(chosen, counts):
            for i in range(n):
                specs[f"k{k}.{i}"] = kinds[k]()
        heuristic = group(specs, None)
        size = max(len(g.layer_names) for g in heuristic)
        groups = group(specs, cfg)
        want = brute_force([(n, kinds[k]()) for k, n in zip(chosen, counts)], cfg, size)
        assert max(len(g.layer_names) for g in groups) == want
        if want != size:
            assert len(groups) < len(heuristic)
            assert memory_per_request(groups, cfg) < memory_per_request(heuristic, cfg)


def test_a_spec_without_a_memory_figure_keeps_the_heuristic(monkeypatch):
    def no_figure(self, vllm_config):
        raise NotImplementedError

    monkeypatch.setattr(MambaSpec, "max_memory_usage_bytes", no_figure)
    groups = group(hybrid_27b(), config())
    assert [g.layer_names for g in groups] == [
        g.layer_names for g in group(hybrid_27b(), None)
    ]
