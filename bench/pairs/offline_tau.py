#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Offline tau of trained benchmark pairs on held-out prompts, at temperature 0
and 1: the DFlash chain (K = 15) and DDTree at budgets 16 / 64 / 256, replayed
as vLLM verifies them (acceptance.py), without vLLM.

    python3 -m bench.pairs.offline_tau [--models bench/pairs/models] \\
        [--pairs dense-8b,hybrid-27b] [--temperatures 0,1] [--prompts 48] \\
        [--seed 0] [--out bench/results/pairs.json]

Runs on the CPU (a few minutes per pair and temperature) or a GPU. Prints one
``TAU {json}`` line per (pair, temperature); with ``--out`` it replaces that
pair's ``offline_heldout_tau_t<T>`` row in the file (run_pairs.py's rows).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

from bench import common
from bench.pairs import pair_configs as pc

log = functools.partial(common.progress, "offline_tau")

EVAL_NEW_TOKENS = 256
EVAL_BUDGETS = (16, 64, 256)
# With 256 new tokens, inside the 512-token windows the pairs were trained on.
EVAL_PROMPT_LEN = 160


def build_target(name: str, device):
    import torch

    cfg = pc.pair(name)["small_target"]
    text = pc.text_config(cfg)
    if "text_config" in cfg:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**text))
    return model.to(device=device, dtype=torch.float32)


def load_target(model, path: str) -> None:
    """The target's weights (a Qwen3.5 target's text part) into build_target's model."""
    import torch
    from safetensors.torch import load_file

    sd = {}
    for k, v in load_file(os.path.join(path, "model.safetensors")).items():
        if k.startswith("model.visual."):
            continue
        sd[k.replace("model.language_model.", "model.", 1)] = v.float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(
            f"target weights do not fit: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    with torch.no_grad():
        assert (
            torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
            or "lm_head.weight" in sd
        )


def load_drafter(drafter, path: str) -> None:
    """The drafter's weights, as trained."""
    from safetensors.torch import load_file

    sd = {
        k: v.float()
        for k, v in load_file(os.path.join(path, "model.safetensors")).items()
    }
    drafter.load_state_dict(sd)


def load_trained_pair(models: str, name: str, device):
    """The trained small pair ``name`` under ``models`` (its ``target`` and
    ``drafter`` directories): (target, drafter), both in eval mode."""
    from bench.pairs.dflash_ref import DFlashDrafter

    pdir = os.path.join(models, name)
    model = build_target(name, device)
    load_target(model, os.path.join(pdir, "target"))
    model.eval()
    with open(os.path.join(pdir, "drafter", "config.json")) as f:
        drafter = DFlashDrafter(json.load(f)).to(device)
    load_drafter(drafter, os.path.join(pdir, "drafter"))
    drafter.eval()
    return model, drafter


def target_continue(
    model, prompts, new_tokens: int, amp: bool, temperature: float = 0.0
):
    """The target's continuation, greedy (EOS does not stop it: vLLM's benchmarks
    run with ignore_eos); with ``temperature`` > 0 a sample at that temperature
    from the whole distribution (no top-k / top-p), from torch's global
    generator (seed it first)."""
    import torch

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pc.PAD_ID
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=None, top_p=None)
        if temperature > 0
        else dict(do_sample=False)
    )
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        out = model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            eos_token_id=None,
            **sampling,
        )
    return out


def evaluate(
    model,
    drafter,
    prompts_path: str,
    device,
    n_prompts: int,
    temperature: float = 0.0,
    seed: int = 0,
    prompt_tokens: int = EVAL_PROMPT_LEN,
    min_prompt_tokens: int | None = None,
    new_tokens: int = EVAL_NEW_TOKENS,
) -> dict:
    """Offline tau: the prompts of ``prompts_path`` with at least
    ``min_prompt_tokens`` (default: ``prompt_tokens``) tokens, cut to their
    last ``prompt_tokens`` (one batch, no padding), continued ``new_tokens``
    by the target greedily or, with ``temperature`` > 0, sampled at that
    temperature (seeded by ``seed``): acceptance.py says why the same replay
    then gives the tau of sampled verification."""
    import torch

    from bench.pairs import acceptance
    from bench.pairs.dflash_ref import draft_logits, target_forward

    dcfg = drafter.cfg
    layer_ids = dcfg["dflash_config"]["target_layer_ids"]
    block = dcfg["block_size"]
    amp = device.type == "cuda"
    new, plen = new_tokens, prompt_tokens
    least = max(plen, min_prompt_tokens or 0)
    with open(prompts_path) as f:
        rows = [json.loads(line)["prompt_token_ids"] for line in f if line.strip()]
    rows = [r[-plen:] for r in rows if len(r) >= least][:n_prompts]
    torch.manual_seed(seed)
    seqs = target_continue(
        model, torch.tensor(rows, device=device), new, amp, temperature
    )
    chain, trees = [], {b: [] for b in EVAL_BUDGETS}
    r = max(EVAL_BUDGETS)
    end = seqs.shape[1] - 1
    for seq in seqs:
        seq = seq[None]
        toks = seq[0].tolist()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            feats = target_forward(model, seq, layer_ids)[1].float()
            # every anchor from the first bonus token (position plen) on
            anchors = torch.arange(plen, end, device=device)
            vals, idx = [], []
            for chunk in anchors.split(64):
                lg = draft_logits(
                    drafter,
                    feats,
                    seq,
                    chunk[None],
                    model.model.embed_tokens.weight,
                    model.lm_head.weight,
                )[0].float()
                v, i = lg.log_softmax(-1).topk(min(r, lg.shape[-1]), dim=-1)
                vals.append(v.cpu())
                idx.append(i.cpu())
        # indexed by absolute anchor position
        v_all = torch.cat(
            [torch.zeros(plen, block - 1, vals[0].shape[-1]), torch.cat(vals)]
        )
        i_all = torch.cat(
            [
                torch.zeros(plen, block - 1, vals[0].shape[-1], dtype=torch.long),
                torch.cat(idx),
            ]
        )
        chain.append(acceptance.chain_steps(i_all[..., 0], toks, plen, end))
        for b in EVAL_BUDGETS:
            trees[b].append(acceptance.tree_steps(v_all, i_all, toks, plen, end, b))
    return {
        "prompts": len(chain),
        "temperature": temperature,
        "prompt_tokens": plen,
        "new_tokens": new,
        "chain_k15_tau": round(acceptance.tau(chain), 3),
        "ddtree_tau": {
            str(b): round(acceptance.tau(trees[b]), 3) for b in EVAL_BUDGETS
        },
    }


def row_key(temperature: float) -> str:
    return f"offline_heldout_tau_t{temperature:g}"


def merge_rows(rows: list[dict], new: list[dict]) -> list[dict]:
    """``rows`` with each of ``new`` replacing the row of the same pair and
    key (appended when there is none)."""
    out = list(rows)
    for n in new:
        key = next(k for k in n if k.startswith("offline_heldout_tau_t"))
        out = [r for r in out if not (r.get("pair") == n["pair"] and key in r)]
        out.append(n)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=common.PAIR_MODELS)
    ap.add_argument("--pairs", default="dense-8b,hybrid-27b")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0, help="of the sampled continuations")
    ap.add_argument("--out", default=None, help="JSON rows to update (pairs.json)")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="cut each prompt to its last N tokens (default: 160, with 256 new "
        "tokens inside the 512-token windows the pairs were trained on)",
    )
    ap.add_argument(
        "--min-prompt-tokens",
        type=int,
        default=None,
        help="only prompts at least this long (default: --prompt-tokens), so "
        "that runs at several --prompt-tokens can share their prompts",
    )
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args(argv)

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu else "cpu")
    new: list[dict] = []
    for pair in a.pairs.split(","):
        model, drafter = load_trained_pair(a.models, pair, device)
        for t in (float(x) for x in a.temperatures.split(",") if x):
            t0 = time.time()
            res = evaluate(
                model,
                drafter,
                os.path.join(a.models, "prompts", "heldout.jsonl"),
                device,
                a.prompts,
                temperature=t,
                seed=a.seed,
                prompt_tokens=a.prompt_tokens or EVAL_PROMPT_LEN,
                min_prompt_tokens=a.min_prompt_tokens,
            )
            res.update(
                seed=a.seed,
                device=device.type,
                torch=torch.__version__,
                drafter_id=pc.weights_id(a.models, pair),
            )
            row = {"pair": pair, row_key(t): res}
            common.emit("TAU", row)
            log(f"{pair} T={t:g}: {res} ({time.time() - t0:.0f} s on {device})")
            new.append(row)
    if a.out:
        rows = []
        if os.path.exists(a.out):
            with open(a.out) as f:
                rows = json.load(f)
        common.write_json(a.out, merge_rows(rows, new))


if __name__ == "__main__":
    main()
