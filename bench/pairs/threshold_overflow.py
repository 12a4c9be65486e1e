#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""How often the DDTree build's threshold filter overflows on a trained
drafter's logits, and what the keys kept per sub-block and the capacity do
to it: the dense benchmark pair's drafter (bf16 logits) at every 8th
position of held-out prompts, each (anchor, depth) one row, in three
vocabulary layouts:

- ``own``: the pair's 8192-token byte-pair vocabulary (frequent tokens
  numbered first, as in Qwen's);
- ``spread``: small id i at id 18 i of a 151936-token vocabulary, the rest
  far below;
- ``contiguous``: its tokens as ids 0-8191 of 151936 (the embedded benchmark
  pairs), the rest far below.

    python3 -m bench.pairs.threshold_overflow [--prompts 6] \\
        [--out bench/results/threshold-overflow.json]

Runs on the CPU in a few minutes. Counts are computed in torch from the
same rule as `_vocab_threshold_plan` (sub-block size, capacity) with the
keys kept per sub-block, the group their maxima are taken over
(``--groups``) and the capacity varied; the row of the shipped setting
(`_threshold_keep`, `_threshold_group`, `_threshold_capacity`) is marked.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

from bench import common

common.use_overlay()  # the build's constants, without a vLLM install

PROD_VOCAB = 151936
FAR_BELOW = -1e4


log = functools.partial(common.progress, "threshold_overflow")


def drafter_rows(models: str, pair: str, n_prompts: int):
    """[rows, V_small] float32 of bf16-rounded drafter logits."""
    import torch

    from bench.pairs.dflash_ref import draft_logits, target_forward
    from bench.pairs.offline_tau import load_trained_pair

    model, drafter = load_trained_pair(models, pair, torch.device("cpu"))
    with open(os.path.join(models, "prompts", "heldout.jsonl")) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f if line.strip()]
    prompts = [p[-256:] for p in prompts if len(p) >= 256][:n_prompts]
    layer_ids = drafter.cfg["dflash_config"]["target_layer_ids"]
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = torch.tensor([p])
            feats = target_forward(model, seq, layer_ids)[1].float()
            anchors = torch.arange(128, 255, 8)
            lg = draft_logits(
                drafter,
                feats,
                seq,
                anchors[None],
                model.model.embed_tokens.weight,
                model.lm_head.weight,
            )[0]
            out.append(lg.reshape(-1, lg.shape[-1]).to(torch.bfloat16).float())
    return torch.cat(out)


def ranks(x):
    """Per row, each token's key as a rank (larger = better) in the filter's
    order: value descending, then token id ascending."""
    import torch

    order = torch.sort(-x, dim=1, stable=True).indices
    n = x.shape[1]
    key = torch.empty_like(order)
    best_first = torch.arange(n - 1, -1, -1).expand(x.shape[0], -1).contiguous()
    key.scatter_(1, order, best_first)
    return key


def counts(x, k: int, sub: int, keep: int, group: int = 1):
    """Per row: the keys >= t, t the k-th largest of each sub-block's
    ``keep`` largest maxima of its groups of ``group`` tokens."""
    import torch

    rows, vocab = x.shape
    num_sub = -(-vocab // sub)
    key = ranks(x)
    pad = torch.full((rows, num_sub * sub - vocab), -1, dtype=key.dtype)
    key = torch.cat([key, pad], 1)
    group_max = key.view(rows, num_sub, sub // group, group).amax(-1)
    kept = group_max.topk(min(keep, sub // group), dim=-1).values
    t = kept.reshape(rows, -1).topk(k, dim=1).values[:, -1:]
    return (key >= t).sum(1)


def layouts(small):
    import torch

    rows, v_small = small.shape
    yield "own", small
    full = torch.full((rows, PROD_VOCAB), FAR_BELOW)
    full[:, torch.arange(v_small) * (PROD_VOCAB // v_small)] = small
    yield "spread", full
    full = torch.full((rows, PROD_VOCAB), FAR_BELOW)
    full[:, :v_small] = small
    yield "contiguous", full


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=common.PAIR_MODELS)
    ap.add_argument("--pair", default="dense-8b")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--budgets", default="15,64")
    ap.add_argument("--keeps", default="1,2,4,8")
    ap.add_argument(
        "--groups",
        default="1",
        help="tokens per group whose maxima the kept keys are (1: the keys)",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from vllm.v1.spec_decode.ddtree import tree as T

    t0 = time.time()
    small = drafter_rows(a.models, a.pair, a.prompts)
    log(f"{small.shape[0]} rows of {small.shape[1]} logits in {time.time() - t0:.0f} s")
    results = []
    for layout, x in layouts(small):
        vocab = x.shape[1]
        for k in (int(b) for b in a.budgets.split(",")):
            chunk, _ = T._vocab_chunking(vocab, k)
            sub, num_sub, capacity = T._vocab_threshold_plan(vocab, k, chunk)
            shipped_keep = T._threshold_keep(sub, num_sub)
            shipped_group = T._threshold_group(sub, shipped_keep)
            settings = [
                (int(m), min(int(g), sub // int(m)))
                for m in a.keeps.split(",")
                for g in a.groups.split(",")
            ]
            for keep, group in dict.fromkeys(settings):
                c = counts(x, k, sub, keep, group)
                row = dict(
                    pair=a.pair,
                    layout=layout,
                    vocab=vocab,
                    k=k,
                    sub=sub,
                    keep=keep,
                    group=group,
                    median_count=int(c.median()),
                    max_count=int(c.max()),
                    overflow_share={
                        f"cap_{m}k": round(float((c > m * k).float().mean()), 4)
                        for m in (4, 8, 16)
                    },
                    shipped=(keep, group) == (shipped_keep, shipped_group),
                    shipped_capacity=capacity,
                    shipped_overflow_share=round(
                        float((c > capacity).float().mean()), 4
                    ),
                )
                results.append(row)
                log(
                    f"{layout:10s} K={k:3d} sub={sub:4d} keep={keep} "
                    f"group={group}: median "
                    f"{row['median_count']} max {row['max_count']}, overflow "
                    f"{row['overflow_share']}"
                    + (f" <- shipped (capacity {capacity})" if row["shipped"] else "")
                )
    out = dict(rows=small.shape[0], command=" ".join(sys.argv), results=results)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
