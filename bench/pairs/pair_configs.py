# SPDX-License-Identifier: Apache-2.0
"""The two benchmark pairs: a small trained target + DFlash drafter each, and the
production shape each is embedded into (see embed.py).

- ``dense-8b``: a Qwen3 target with Qwen3-8B's head_dim (128), embedded into the
  Qwen3-8B shape, with a drafter shaped like z-lab/Qwen3-8B-DFlash-b16.
- ``hybrid-27b``: a Qwen3.5-architecture target (Gated DeltaNet and full attention
  3:1, attention head_dim 256 with output gate, GDN key/value head dims 128, conv 4,
  interleaved M-RoPE), embedded into the Qwen3.6-27B shape, with a 5-layer DFlash
  drafter of that width.

Every function returns plain dicts in Hugging Face ``config.json`` form; this module
imports nothing heavy (no torch) so that the trainer, the embedding, the vLLM runs
and the CPU tests share one definition.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os

from bench import common

# Token ids of the shared byte-level BPE tokenizer (trained with the pairs).
EOS_ID, MASK_ID, PAD_ID = 0, 1, 2
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|pad|>"]
SMALL_VOCAB = 8192
BLOCK_SIZE = 16

_QWEN35_ROPE = {
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "rope_type": "default",
}

# A one-block vision tower that only has to parse: the pairs are text-only and
# vLLM runs them with limit_mm_per_prompt {"image": 0, "video": 0}.
_VISION_STUB = {
    "model_type": "qwen3_5_vision",
    "deepstack_visual_indexes": [],
    "depth": 1,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "num_heads": 2,
    "num_position_embeddings": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def _qwen3_text(
    *, vocab, hidden, layers, heads, kv_heads, intermediate, rope_theta, tie, max_pos
) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tie,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16",
    }


def _qwen35_text(
    *,
    vocab,
    hidden,
    layers,
    heads,
    kv_heads,
    k_heads,
    v_heads,
    intermediate,
    tie,
    max_pos,
    mtp_layers=0,
) -> dict:
    out = {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(layers)
        ],
        "full_attention_interval": 4,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 256,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "mamba_ssm_dtype": "float32",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": dict(_QWEN35_ROPE),
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tie,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "initializer_range": 0.02,
        "dtype": "bfloat16",
    }
    if mtp_layers:  # Qwen3.5 / Qwen3.6 checkpoints' MTP module (vLLM's "mtp")
        out["mtp_num_hidden_layers"] = mtp_layers
    return out


def _qwen35_model(text: dict) -> dict:
    """Wrap a Qwen3.5 text config as Qwen3_5ForConditionalGeneration (the class of
    the real Qwen3.5/3.6 checkpoints, the one vLLM registers)."""
    vision = dict(_VISION_STUB, out_hidden_size=text["hidden_size"])
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": vision,
    }


def _dflash(*, target_layers, target_layer_ids, **text) -> dict:
    cfg = _qwen3_text(tie=False, **text)
    cfg.update(
        architectures=["DFlashDraftModel"],
        block_size=BLOCK_SIZE,
        num_target_layers=target_layers,
        dflash_config={
            "mask_token_id": MASK_ID,
            "target_layer_ids": list(target_layer_ids),
        },
    )
    return cfg


_SMALL = dict(
    vocab=SMALL_VOCAB, hidden=256, heads=2, kv_heads=1, intermediate=768, max_pos=4096
)
# Qwen3-8B (vocabulary included: the lm_head and the DDTree vocabulary pass run
# at their real size).
_QWEN3_8B = dict(
    vocab=151936,
    hidden=4096,
    heads=32,
    kv_heads=8,
    intermediate=12288,
    rope_theta=1000000,
    max_pos=40960,
)
_QWEN3_6_27B = dict(vocab=248320, hidden=5120, intermediate=17408, max_pos=262144)

# name -> dict(small_target, small_drafter, big_target, big_drafter, placement)
# ``placement[i]`` is the production layer that small layer i becomes; every other
# production layer is an exact identity. The drafters' target_layer_ids are chosen
# so that each small aux layer is read at a production layer whose output equals it.
PAIRS: dict[str, dict] = {
    "dense-8b": {
        "kind": "dense",
        "small_target": _qwen3_text(**_SMALL, layers=4, rope_theta=1000000, tie=True),
        "small_drafter": _dflash(
            **_SMALL,
            layers=3,
            rope_theta=1000000,
            target_layers=4,
            target_layer_ids=[1, 2, 3],
        ),
        "big_target": _qwen3_text(**_QWEN3_8B, layers=36, tie=False),
        # As z-lab/Qwen3-8B-DFlash-b16: 5 layers, target_layer_ids [1, 9, 17, 25, 33].
        "big_drafter": _dflash(
            **_QWEN3_8B, layers=5, target_layers=36, target_layer_ids=[1, 9, 17, 25, 33]
        ),
        "placement": [0, 8, 16, 24],
    },
    "hybrid-27b": {
        "kind": "hybrid",
        "small_target": _qwen35_model(
            _qwen35_text(**_SMALL, layers=4, k_heads=1, v_heads=3, tie=True)
        ),
        "small_drafter": _dflash(
            **_SMALL,
            layers=2,
            rope_theta=10000000,
            target_layers=4,
            target_layer_ids=[0, 1, 2],
        ),
        # Qwen3.6-27B: 64 layers (full attention every 4th), 24 query / 4 KV heads
        # of 256 with output gate, GDN 16 key / 48 value heads of 128.
        "big_target": _qwen35_model(
            _qwen35_text(
                **_QWEN3_6_27B,
                layers=64,
                heads=24,
                kv_heads=4,
                k_heads=16,
                v_heads=48,
                tie=False,
                mtp_layers=1,
            )
        ),
        "big_drafter": _dflash(
            **_QWEN3_6_27B,
            layers=5,
            heads=32,
            kv_heads=8,
            rope_theta=10000000,
            target_layers=64,
            target_layer_ids=[1, 17, 33, 49, 61],
        ),
        # Small layer types [GDN, GDN, GDN, attention] land on production layers of
        # the same type (attention where index % 4 == 3).
        "placement": [0, 16, 32, 47],
    },
}


def pair(name: str) -> dict:
    if name not in PAIRS:
        raise KeyError(f"unknown pair {name!r}; known: {', '.join(PAIRS)}")
    return copy.deepcopy(PAIRS[name])


def load_pair(models: str, name: str) -> dict:
    """``pair(name)`` with the configs of the trained pair in ``models`` (what its
    weights were trained with) in place of this module's."""
    spec = pair(name)
    for key, sub in (
        ("small_target", "target"),
        ("small_drafter", "drafter"),
        ("big_target", "production-target"),
        ("big_drafter", "production-drafter"),
    ):
        path = os.path.join(models, name, sub, "config.json")
        if os.path.exists(path):
            with open(path) as f:
                spec[key] = json.load(f)
    return spec


def text_config(cfg: dict) -> dict:
    """The language-model part of a target config (itself for Qwen3)."""
    return cfg.get("text_config", cfg)


def scaled(cfg: dict, **text_overrides) -> dict:
    """A copy of a production config with some text fields replaced (CPU tests use
    reduced widths of the same structure)."""
    out = copy.deepcopy(cfg)
    text_config(out).update(text_overrides)
    if "layer_types" in text_config(out) and "num_hidden_layers" in text_overrides:
        n = text_overrides["num_hidden_layers"]
        text_config(out)["layer_types"] = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(n)
        ]
    if "text_config" in out and "hidden_size" in text_overrides:
        out["vision_config"]["out_hidden_size"] = text_overrides["hidden_size"]
    return out


def weights_id(models: str, name: str, part: str = "drafter") -> str:
    """The first 12 hex digits of the sha256 of ``<models>/<name>/<part>``'s
    weights: which trained weights a result row was measured with."""
    h = hashlib.sha256()
    with open(os.path.join(models, name, part, "model.safetensors"), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def write_model_dirs(models: str, name: str) -> None:
    """Write ``<models>/<name>/production-{target,drafter}/config.json`` (the
    production shapes, for ``load_format="dummy"``) and link the shared tokenizer
    (``<models>/tokenizer``) into the target folders."""
    spec = pair(name)
    base = os.path.join(models, name)
    for sub, cfg in (
        ("production-target", spec["big_target"]),
        ("production-drafter", spec["big_drafter"]),
    ):
        common.write_json(os.path.join(base, sub, "config.json"), cfg)
    for sub in ("target", "production-target"):
        d = os.path.join(base, sub)
        os.makedirs(d, exist_ok=True)
        ids = {"bos_token_id": EOS_ID, "eos_token_id": EOS_ID}
        common.write_json(os.path.join(d, "generation_config.json"), ids, None)
        for fn in ("tokenizer.json", "tokenizer_config.json"):
            link = os.path.join(d, fn)
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(os.path.join("..", "..", "tokenizer", fn), link)
