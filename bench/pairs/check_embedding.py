#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The embedded production-shaped model computes the small pair's function: max
|logit difference| between the small target and its production-shaped embedding
(Hugging Face transformers, float32) on real prompts, and the same for the
DFlash drafters (dflash_ref.py) at every anchor of those prompts.

    python3 -m bench.pairs.check_embedding --models bench/pairs/models \\
        --pair dense-8b [--prompts N] [--device cuda] [--out FILE.json]

Prints one ``EMBEDDING {json}`` line: {"pair", "embedding_max_abs_logit_diff",
"drafter_max_abs_logit_diff", "pad_logit_margin", ...}. At the real production
shapes this needs the float32 model in memory (Qwen3-8B: 33 GB; Qwen3.6-27B:
about 110 GB): run it on a GPU host. tests/test_pairs_embed.py runs the same
check at reduced widths on the CPU.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench import common
from bench.common import PAIR_MODELS
from bench.pairs import embed
from bench.pairs import pair_configs as pc
from bench.pairs.dflash_ref import DFlashDrafter, draft_logits, target_forward
from bench.pairs.offline_tau import load_drafter, load_target, text_model


def load_into(model, weights, prefix: str) -> int:
    """Copy (name, tensor) pairs in checkpoint names into a text-only HF model."""
    params = dict(model.named_parameters())
    n = 0
    with torch.no_grad():
        for name, t in weights:
            params[name.replace(prefix, "model.", 1)].copy_(t)
            n += 1
    if n != len(params):
        raise RuntimeError(f"{n} tensors written, the model has {len(params)}")
    return n


def reduce_production(spec: dict, placed_only: bool, vocab_cap: int | None) -> dict:
    """The production shape (hidden size, heads, MLP width as they are) without its
    identity layers and/or with fewer padded vocabulary rows. Neither changes the
    real tokens' logits: an identity layer adds exact zeros to the residual stream
    (tests/test_pairs_embed.py checks it bit for bit), and lm_head rows are
    independent of each other. It lets the check run in a CPU's memory."""
    import copy

    spec = copy.deepcopy(spec)
    big, bigd = pc.text_config(spec["big_target"]), spec["big_drafter"]
    if placed_only:
        placement = spec["placement"]
        ends = placement[1:] + [big["num_hidden_layers"]]
        collapsed = [
            next(i for i, (lo, hi) in enumerate(zip(placement, ends)) if lo <= L < hi)
            for L in bigd["dflash_config"]["target_layer_ids"]
        ]
        if "layer_types" in big:
            big["layer_types"] = [big["layer_types"][L] for L in placement]
        big["num_hidden_layers"] = len(placement)
        spec["placement"] = list(range(len(placement)))
        bigd["dflash_config"] = dict(bigd["dflash_config"], target_layer_ids=collapsed)
        bigd["num_target_layers"] = len(placement)
        bigd["num_hidden_layers"] = spec["small_drafter"]["num_hidden_layers"]
    if vocab_cap:
        big["vocab_size"] = min(big["vocab_size"], vocab_cap)
        bigd["vocab_size"] = big["vocab_size"]
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", required=True, choices=list(pc.PAIRS))
    common.add_options(ap, {
        "--models": (PAIR_MODELS, None),
        "--prompts": (8, "held-out prompts"),
        "--device": ("cuda" if torch.cuda.is_available() else "cpu", None),
        "--out": (None, None),
        "--placed-layers-only": (False, "leave out the production model's "
            "identity layers (fits a CPU)"),
        "--vocab-cap": (None, "at most this many vocabulary rows in the "
            "production model"),
    }, {"--vocab-cap": int})  # fmt: skip
    a = ap.parse_args()
    from safetensors.torch import load_file

    t0 = time.time()
    spec = pc.load_pair(a.models, a.pair)
    if a.placed_layers_only or a.vocab_cap:
        spec = reduce_production(spec, a.placed_layers_only, a.vocab_cap)
    pdir = os.path.join(a.models, a.pair)
    dev = torch.device(a.device)
    small_sd = load_file(os.path.join(pdir, "target", "model.safetensors"))
    prefix = embed.target_prefix(spec["small_target"])
    small = load_target(os.path.join(pdir, "target"), dev)
    prompts = common.load_prompts(os.path.join(a.models, common.HELDOUT))[: a.prompts]
    layer_ids_s = spec["small_drafter"]["dflash_config"]["target_layer_ids"]
    layer_ids_b = spec["big_drafter"]["dflash_config"]["target_layer_ids"]
    res_small = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p], device=dev)
            logits, feats = target_forward(small, x, layer_ids_s)
            res_small.append((logits.cpu(), feats))
    big = text_model(spec["big_target"], dev).eval()
    load_into(big, embed.pair_weights(spec, "target", small_sd, device=dev), prefix)
    v = pc.text_config(spec["small_target"])["vocab_size"]
    diff, margin, feats_b = 0.0, float("inf"), []
    with torch.no_grad():
        for p, (ls, _) in zip(prompts, res_small):
            x = torch.tensor([p], device=dev)
            lb, fb = target_forward(big, x, layer_ids_b)
            lb = lb.float()
            diff = max(diff, (lb[..., :v].cpu() - ls).abs().max().item())
            if lb.shape[-1] > v:
                gap = lb[..., :v].min(-1).values - lb[..., v:].max(-1).values
                margin = min(margin, gap.min().item())
            feats_b.append(fb)
    embed_s, lm_s = small.model.embed_tokens.weight, small.lm_head.weight
    embed_b, lm_b = big.model.embed_tokens.weight.clone(), big.lm_head.weight.clone()
    del big, lb
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    d_small = load_drafter(os.path.join(pdir, "drafter"), dev)
    d_big = DFlashDrafter(spec["big_drafter"]).to(dev).eval()
    weights = embed.pair_weights(spec, "drafter", d_small.state_dict(), device=dev)
    d_big.load_state_dict(dict(weights))
    ddiff = 0.0
    with torch.no_grad():
        for p, (_, fs), fb in zip(prompts, res_small, feats_b):
            x = torch.tensor([p], device=dev)
            anchors = torch.arange(
                8, len(p) - 1, max(1, (len(p) - 9) // 16), device=dev
            )[None]
            a_s = draft_logits(d_small, fs, x, anchors, embed_s, lm_s)
            a_b = draft_logits(d_big, fb, x, anchors, embed_b, lm_b)
            ddiff = max(ddiff, (a_b[..., :v] - a_s).abs().max().item())
    row = {
        "pair": a.pair,
        "embedding_max_abs_logit_diff": float(f"{diff:.3g}"),
        "drafter_max_abs_logit_diff": float(f"{ddiff:.3g}"),
        "pad_logit_margin": None if margin == float("inf") else round(margin, 1),
        "prompts": len(prompts),
        "dtype": "float32",
        "production_layers": "placed layers only" if a.placed_layers_only else "all",
        "production_vocab": pc.text_config(spec["big_target"])["vocab_size"],
        "seconds": round(time.time() - t0, 1),
    }
    common.emit("EMBEDDING", row)
    if a.out:
        common.write_json(a.out, row)


if __name__ == "__main__":
    main()
