# SPDX-License-Identifier: Apache-2.0
"""The two benchmark pairs: a small trained target + DFlash drafter each, and the
production shape each is embedded into (see embed.py).

- ``dense-8b``: a Qwen3 target with Qwen3-8B's head_dim (128), embedded into the
  Qwen3-8B shape, with a drafter shaped like z-lab/Qwen3-8B-DFlash-b16.
- ``hybrid-27b``: a Qwen3.5-architecture target (Gated DeltaNet and full attention
  3:1, attention head_dim 256 with output gate, GDN key/value head dims 128, conv 4,
  interleaved M-RoPE), embedded into the Qwen3.6-27B shape, with a 5-layer DFlash
  drafter of that width.

The configs are the committed ``bench/pairs/models/<pair>/{target,drafter,
production-target,production-drafter}/config.json`` (Hugging Face form; the
hybrid targets are Qwen3_5ForConditionalGeneration with a one-block vision stub
that only has to parse). This module imports nothing heavy (no torch) so that
the trainer, the embedding, the vLLM runs and the CPU tests share them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os

from bench import common

# Token ids of the shared byte-level BPE tokenizer (trained with the pairs).
EOS_ID, PAD_ID = 0, 2
SMALL_VOCAB = 8192
CONFIG_DIRS = {
    "small_target": "target",
    "small_drafter": "drafter",
    "big_target": "production-target",
    "big_drafter": "production-drafter",
}

# ``placement[i]`` is the production layer that small layer i becomes; every
# other production layer is an exact identity. The drafters' target_layer_ids
# are chosen so that each small aux layer is read at a production layer whose
# output equals it. The production drafters have 5 layers, as
# z-lab/Qwen3-8B-DFlash-b16 (target_layer_ids [1, 9, 17, 25, 33]).
PAIRS: dict[str, dict] = {
    "dense-8b": {"kind": "dense", "placement": [0, 8, 16, 24]},
    # Small layer types [GDN, GDN, GDN, attention] land on production layers of
    # the same type (attention where index % 4 == 3).
    "hybrid-27b": {"kind": "hybrid", "placement": [0, 16, 32, 47]},
}


def load_pair(models: str, name: str) -> dict:
    """Pair ``name``: its kind, placement and configs (``CONFIG_DIRS``), each
    from ``<models>/<name>/`` where it is there (what a trained pair's weights
    were trained with), else the committed one."""
    if name not in PAIRS:
        raise KeyError(f"unknown pair {name!r}; known: {', '.join(PAIRS)}")
    spec = copy.deepcopy(PAIRS[name])
    for key, sub in CONFIG_DIRS.items():
        path = os.path.join(models, name, sub, "config.json")
        if not os.path.exists(path):
            path = os.path.join(common.PAIR_MODELS, name, sub, "config.json")
        with open(path) as f:
            spec[key] = json.load(f)
    return spec


def pair(name: str) -> dict:
    """Pair ``name`` with the committed configs."""
    return load_pair(common.PAIR_MODELS, name)


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
    for key in ("big_target", "big_drafter"):
        path = os.path.join(base, CONFIG_DIRS[key], "config.json")
        common.write_json(path, spec[key])
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
