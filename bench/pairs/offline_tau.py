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


def text_model(cfg: dict, device="cpu"):
    """The Hugging Face text-only model of a target config, float32 (a Qwen3.5
    config's language model), its weights unset."""
    import torch
    from transformers.initialization import no_init_weights

    if "text_config" in cfg:
        from transformers import Qwen3_5ForCausalLM as cls
        from transformers import Qwen3_5TextConfig as config_cls
    else:
        from transformers import Qwen3Config as config_cls
        from transformers import Qwen3ForCausalLM as cls
    with no_init_weights(), torch.device(device):
        model = cls(config_cls(**pc.text_config(cfg)))
    model.tie_weights()  # a tied small target shares embedding and lm_head
    return model.to(dtype=torch.float32)


def load_target(path: str, device="cpu"):
    """A trained small target (its text part), float32, in eval mode."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    with open(os.path.join(path, "config.json")) as f:
        cls = Qwen3_5ForCausalLM if "text_config" in json.load(f) else Qwen3ForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).to(device).eval()


def load_drafter(path: str, device="cpu"):
    """A trained DFlash drafter (dflash_ref.py), float32, in eval mode."""
    from safetensors.torch import load_file

    from bench.pairs.dflash_ref import DFlashDrafter

    with open(os.path.join(path, "config.json")) as f:
        drafter = DFlashDrafter(json.load(f))
    sd = load_file(os.path.join(path, "model.safetensors"))
    drafter.load_state_dict({k: v.float() for k, v in sd.items()})
    return drafter.to(device).eval()


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
    sampling = dict(do_sample=False)
    if temperature > 0:
        sampling = dict(do_sample=True, temperature=temperature, top_k=None, top_p=None)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        return model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            eos_token_id=None,
            **sampling,
        )


def heldout_sequences(
    model,
    prompts_path: str,
    n_prompts: int,
    plen: int,
    new: int,
    device,
    temperature: float = 0.0,
    least: int = 0,
):
    """The first ``n_prompts`` prompts of ``prompts_path`` with at least
    ``max(plen, least)`` tokens, cut to their last ``plen`` (one batch, no
    padding), continued ``new`` tokens by the target (see target_continue)."""
    import torch

    rows = common.load_prompts(prompts_path)
    rows = [r[-plen:] for r in rows if len(r) >= max(plen, least)][:n_prompts]
    prompts = torch.tensor(rows, device=device)
    return target_continue(model, prompts, new, device.type == "cuda", temperature)


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
    """Offline tau on heldout_sequences (sampled at ``temperature`` > 0, seeded
    by ``seed``: acceptance.py says why the same replay then gives the tau of
    sampled verification)."""
    import torch

    from bench.pairs import acceptance
    from bench.pairs.dflash_ref import draft_logits, target_forward

    layer_ids = drafter.cfg["dflash_config"]["target_layer_ids"]
    block = drafter.cfg["block_size"]
    amp = device.type == "cuda"
    plen, r = prompt_tokens, max(EVAL_BUDGETS)
    torch.manual_seed(seed)
    least = min_prompt_tokens or 0
    seqs = heldout_sequences(
        model, prompts_path, n_prompts, plen, new_tokens, device, temperature, least
    )
    chain, trees = [], {b: [] for b in EVAL_BUDGETS}
    end = seqs.shape[1] - 1
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    for seq in seqs[:, None]:
        toks = seq[0].tolist()
        vals = [torch.zeros(plen, block - 1, r)]
        idx = [torch.zeros(plen, block - 1, r, dtype=torch.long)]
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            feats = target_forward(model, seq, layer_ids)[1].float()
            # every anchor from the first bonus token (position plen) on
            for chunk in torch.arange(plen, end, device=device).split(64):
                lg = draft_logits(drafter, feats, seq, chunk[None], embed, lm_head)
                v, i = lg[0].float().log_softmax(-1).topk(r, dim=-1)
                vals.append(v.cpu())
                idx.append(i.cpu())
        # indexed by absolute anchor position
        v_all, i_all = torch.cat(vals), torch.cat(idx)
        chain.append(acceptance.chain_steps(i_all[..., 0], toks, plen, end))
        for b in EVAL_BUDGETS:
            trees[b].append(acceptance.tree_steps(v_all, i_all, toks, plen, end, b))
    return {
        "prompts": len(chain),
        "temperature": temperature,
        "prompt_tokens": plen,
        "new_tokens": new_tokens,
        "chain_k15_tau": round(acceptance.tau(chain), 3),
        "ddtree_tau": {
            str(b): round(acceptance.tau(trees[b]), 3) for b in EVAL_BUDGETS
        },
    }


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
    common.add_options(ap, {
        "--models": (common.PAIR_MODELS, None),
        "--pairs": ("dense-8b,hybrid-27b", None),
        "--temperatures": ("0,1", None),
        "--prompts": (48, None),
        "--seed": (0, "of the sampled continuations"),
        "--out": (None, "JSON rows to update (pairs.json)"),
        "--prompt-tokens": (EVAL_PROMPT_LEN, "cut each prompt to its last N tokens "
            "(with 256 new tokens, inside the 512-token windows the pairs were "
            "trained on)"),
        "--cpu": (False, None),
        "--min-prompt-tokens": (None, "only prompts at least this long (default: "
            "--prompt-tokens), so that runs at several --prompt-tokens can share "
            "their prompts"),
    }, {"--min-prompt-tokens": int})  # fmt: skip
    a = ap.parse_args(argv)

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu else "cpu")
    new: list[dict] = []
    for pair in a.pairs.split(","):
        model = load_target(os.path.join(a.models, pair, "target"), device)
        drafter = load_drafter(os.path.join(a.models, pair, "drafter"), device)
        for t in (float(x) for x in a.temperatures.split(",") if x):
            t0 = time.time()
            res = evaluate(
                model,
                drafter,
                os.path.join(a.models, common.HELDOUT),
                device,
                a.prompts,
                temperature=t,
                seed=a.seed,
                prompt_tokens=a.prompt_tokens,
                min_prompt_tokens=a.min_prompt_tokens,
            )
            res.update(
                seed=a.seed,
                device=device.type,
                torch=torch.__version__,
                drafter_id=pc.weights_id(a.models, pair),
            )
            row = {"pair": pair, f"offline_heldout_tau_t{t:g}": res}
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
