#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Train the benchmark pairs: a small target and its DFlash drafter, per pair in
pair_configs.py, on Python source, seeded and time-boxed.

    python3 -m bench.pairs.train --out DIR [--pairs dense-8b,hybrid-27b]
        [--seconds 560] [--heldout jax,networkx] [--seed 0]

One GPU; the pairs train side by side in subprocesses after one shared
tokenizer. Steps, per pair:

1. corpus: the ``.py`` files of this Python's standard library and installed
   packages; whole packages (``--heldout``) are kept out and give the held-out
   evaluation prompts;
2. the target, trained on the corpus (next-token loss);
3. its own greedy continuations of corpus windows (the drafter is trained, as
   DFlash drafters are, on its target's outputs);
4. the DFlash drafter on those continuations: for random anchor positions, the
   block ``[bonus, mask x 15]`` predicts the target's next 15 greedy tokens given
   the target's hidden states before the anchor (hard and soft targets);
5. offline acceptance on held-out prompts at temperature 0 (acceptance.py): tau of
   the chain (K = 15) and of DDTree at budgets 16 / 64 / 256.

Writes DIR/tokenizer/, DIR/<pair>/{target,drafter}/ (Hugging Face layout, bf16
safetensors, the configs of pair_configs.py), DIR/prompts/{heldout,train}.jsonl
(text and token ids) and DIR/<pair>/train_log.json.
``--smoke`` runs every step at toy size in seconds (CPU is fine): a check of the
pipeline, not a model.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import random
import subprocess
import sys
import sysconfig
import time

from bench.pairs import pair_configs as pc
from bench.pairs.offline_tau import (
    EVAL_NEW_TOKENS,
    EVAL_PROMPT_LEN,
    build_target,
    evaluate,
    load_drafter,
    load_target,
    target_continue,
)

PROMPT_LEN = 128  # self-distillation: corpus window the target continues
CONT_LEN = 384  # tokens of greedy continuation


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- corpus, tokenizer


def package_of(path: str, roots: list[str]) -> str:
    for r in roots:
        if path.startswith(r.rstrip("/") + "/"):
            return path[len(r.rstrip("/")) + 1 :].split("/")[0]
    return ""


def gather_corpus(roots: list[str], max_bytes: int, heldout: set[str], seed: int):
    files = []
    for r in roots:
        files += glob.glob(os.path.join(r, "**", "*.py"), recursive=True)
    files = sorted(set(files))
    random.Random(seed).shuffle(files)
    train, held, n = [], [], 0
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                t = fh.read()
        except (OSError, UnicodeDecodeError):
            continue
        if not 200 < len(t) < 200_000:
            continue
        if package_of(f, roots) in heldout:
            if len(held) < 2000:
                held.append(t)
        elif n < max_bytes:
            train.append(t)
            n += len(t)
    return train, held


def train_tokenizer(texts: list[str], out_dir: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=pc.SMALL_VOCAB,
        special_tokens=pc.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    assert [tok.token_to_id(s) for s in pc.SPECIAL_TOKENS] == [
        pc.EOS_ID,
        pc.MASK_ID,
        pc.PAD_ID,
    ]
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|pad|>",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
            },
            f,
            indent=1,
        )
    return tok


def code_prompts(texts: list[str], k: int, seed: int) -> list[str]:
    """30-line code prefixes cut at a line start."""
    r, out = random.Random(seed), []
    for t in texts:
        lines = t.splitlines(keepends=True)
        if len(lines) < 40:
            continue
        c = r.randrange(10, len(lines) - 20)
        out.append("".join(lines[max(0, c - 30) : c]))
        if len(out) >= k:
            break
    return out


def write_prompts(path: str, prompts: list[str], tok, max_tokens: int) -> None:
    with open(path, "w") as f:
        for p in prompts:
            ids = tok.encode(p).ids[-max_tokens:]
            f.write(json.dumps({"prompt": p, "prompt_token_ids": ids}) + "\n")


def prepare(a) -> None:
    import torch

    t0 = time.time()
    roots = (
        a.roots.split(",")
        if a.roots
        else [
            sysconfig.get_paths()["stdlib"],
            sysconfig.get_paths()["purelib"],
        ]
    )
    roots = [r for r in roots if os.path.isdir(r)]
    heldout = {h for h in a.heldout.split(",") if h}
    max_bytes = (2 if a.smoke else a.corpus_mb) * 2**20
    train, held = gather_corpus(roots, max_bytes, heldout, a.seed)
    if not held:
        sys.exit(
            f"no held-out files: none of the packages {sorted(heldout)} under {roots}"
        )
    log(
        f"corpus {sum(map(len, train)) / 2**20:.1f} MiB in {len(train)} files; "
        f"held-out {len(held)} files of {sorted(heldout)} ({time.time() - t0:.0f} s)"
    )
    if a.reuse_target:
        import shutil

        from tokenizers import Tokenizer

        for sub in ("tokenizer", "prompts"):
            shutil.copytree(
                os.path.join(a.reuse_target, sub),
                os.path.join(a.out, sub),
                dirs_exist_ok=True,
            )
        tok = Tokenizer.from_file(os.path.join(a.out, "tokenizer", "tokenizer.json"))
    else:
        sample, n = [], 0
        for t in train:
            sample.append(t)
            n += len(t)
            if n > (1 if a.smoke else a.tokenizer_mb) * 2**20:
                break
        tok = train_tokenizer(sample, os.path.join(a.out, "tokenizer"))
        log(f"tokenizer trained on {n / 2**20:.1f} MiB ({time.time() - t0:.0f} s)")
    import numpy as np

    enc = tok.encode_batch(train)
    eos = np.array([pc.EOS_ID], dtype=np.int32)
    ids = torch.from_numpy(
        np.concatenate(
            [a for e in enc for a in (np.asarray(e.ids, dtype=np.int32), eos)]
        )
    )
    work = os.path.join(a.out, "_work")
    os.makedirs(work, exist_ok=True)
    torch.save(ids, os.path.join(work, "train_ids.pt"))
    if a.reuse_target:
        log(
            f"{ids.numel() / 1e6:.1f}M training tokens, tokenizer and prompts of "
            f"{a.reuse_target} ({time.time() - t0:.0f} s)"
        )
        return
    os.makedirs(os.path.join(a.out, "prompts"), exist_ok=True)
    write_prompts(
        os.path.join(a.out, "prompts", "heldout.jsonl"),
        code_prompts(held, 16 if a.smoke else 128, a.seed + 1),
        tok,
        512,
    )
    write_prompts(
        os.path.join(a.out, "prompts", "train.jsonl"),
        code_prompts(train[-3000:], 16 if a.smoke else 64, a.seed + 2),
        tok,
        512,
    )
    log(f"{ids.numel() / 1e6:.1f}M training tokens ({time.time() - t0:.0f} s)")


# ---------------------------------------------------------------- models


def save_target(name: str, model, out_dir: str, seed: int) -> None:
    """HF layout with the pair's config; a Qwen3.5 target is saved as
    Qwen3_5ForConditionalGeneration (its text weights under
    model.language_model., a seeded stub vision tower)."""
    import torch
    from safetensors.torch import save_file

    cfg = pc.pair(name)["small_target"]
    sd = {
        k: v.detach().to(torch.bfloat16).cpu().contiguous()
        for k, v in model.state_dict().items()
    }
    if pc.text_config(cfg)["tie_word_embeddings"]:
        sd.pop("lm_head.weight", None)
    if "text_config" in cfg:
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        sd = {
            (
                k.replace("model.", "model.language_model.", 1)
                if k.startswith("model.")
                else k
            ): v
            for k, v in sd.items()
        }
        torch.manual_seed(seed)
        stub = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**copy.deepcopy(cfg)))
        for k, v in stub.state_dict().items():
            if k.startswith("model.visual."):
                sd[k] = v.detach().to(torch.bfloat16).contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": pc.EOS_ID, "eos_token_id": pc.EOS_ID}, f)


def save_drafter(name: str, drafter, out_dir: str) -> None:
    import torch
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    sd = {
        k: v.detach().to(torch.bfloat16).cpu().contiguous()
        for k, v in drafter.state_dict().items()
    }
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(pc.pair(name)["small_drafter"], f, indent=1)


def round_to_bf16_(module) -> None:
    """Keep float32 compute but the weights as saved (bf16), so that the
    continuations and the evaluation see the model vLLM will load."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


# ---------------------------------------------------------------- training stages


def lr_at(step: int, frac: float, peak: float, warmup: int, floor: float) -> float:
    return (
        peak
        * min(1.0, (step + 1) / warmup)
        * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
    )


def train_target(a, model, ids, device, deadline: float, rec: dict) -> None:
    import torch

    opt = torch.optim.AdamW(
        model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1
    )
    gen = torch.Generator().manual_seed(a.seed)
    seq = 64 if a.smoke else 512
    bs = 4 if a.smoke else a.target_batch
    t1, step, losses = time.time(), 0, []
    budget = max(1.0, deadline - t1)
    amp = device.type == "cuda"
    while time.time() < deadline:
        st = torch.randint(0, ids.numel() - seq - 1, (bs,), generator=gen)
        x = torch.stack([ids[s : s + seq] for s in st.tolist()]).long().to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, (time.time() - t1) / budget, 2e-3, 100, 0.1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0 or time.time() >= deadline:
            losses.append([step, round(loss.item(), 4)])
        if step % 500 == 0:
            log(f"{a.pair}: target step {step} loss {loss.item():.3f}")
    rec["target"] = {
        "steps": step,
        "batch": bs,
        "seq": seq,
        "seconds": round(time.time() - t1, 1),
        "loss_curve": losses,
    }
    log(
        f"{a.pair}: target done, {step} steps, loss {losses[-1][1] if losses else None}"
    )


def make_continuations(a, model, ids, device, deadline: float, rec: dict):
    import torch

    gen = torch.Generator().manual_seed(a.seed + 7)
    bs = 4 if a.smoke else a.gen_batch
    plen, clen = (16, 48) if a.smoke else (PROMPT_LEN, CONT_LEN)
    seqs, t1 = [], time.time()
    while time.time() < deadline and len(seqs) * bs < a.max_sequences:
        st = torch.randint(0, ids.numel() - plen - 1, (bs,), generator=gen)
        p = torch.stack([ids[s : s + plen] for s in st.tolist()]).long().to(device)
        seqs.append(target_continue(model, p, clen, device.type == "cuda").cpu())
    data = torch.cat(seqs)
    rec["continuations"] = {
        "sequences": data.shape[0],
        "prompt_len": plen,
        "new_tokens": clen,
        "seconds": round(time.time() - t1, 1),
    }
    log(
        f"{a.pair}: {data.shape[0]} greedy continuations of {clen} tokens "
        f"({time.time() - t1:.0f} s)"
    )
    return data, plen


def train_drafter(
    a, model, drafter, data, plen, device, deadline: float, rec: dict
) -> None:
    import torch

    from bench.pairs.dflash_ref import draft_logits, target_forward

    dcfg = drafter.cfg
    layer_ids = dcfg["dflash_config"]["target_layer_ids"]
    block = dcfg["block_size"]
    for p in model.parameters():
        p.requires_grad_(False)
    embed = model.model.embed_tokens.weight
    lm_head = model.lm_head.weight
    opt = torch.optim.AdamW(
        drafter.parameters(), lr=a.drafter_lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    gen = torch.Generator().manual_seed(a.seed + 11)
    dbs = 2 if a.smoke else a.drafter_batch
    anchors_per_seq = 4 if a.smoke else 24
    s_len = data.shape[1]
    wts = torch.exp(-torch.arange(block - 1, device=device, dtype=torch.float32) / 7.0)
    amp = device.type == "cuda"
    t1, step, curve = time.time(), 0, []
    budget = max(1.0, deadline - t1)
    lo = max(1, plen // 4)
    while time.time() < deadline:
        rows = torch.randint(0, data.shape[0], (dbs,), generator=gen)
        x = data[rows].to(device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits_t, feats = target_forward(model, x, layer_ids)
            feats = feats.float()
            logp_t = logits_t.float().log_softmax(-1)
        anc = torch.stack(
            [
                torch.randperm(s_len - block - lo, generator=gen)[:anchors_per_seq] + lo
                for _ in range(dbs)
            ]
        ).to(device)
        anc, _ = anc.sort(1)
        offs = torch.arange(1, block, device=device)
        # slot k predicts position anchor + k: the target's distribution after
        # position anchor + k - 1
        tgt_pos = (anc[:, :, None] + offs - 1).reshape(dbs, -1)
        tgt_logp = torch.gather(
            logp_t, 1, tgt_pos[..., None].expand(-1, -1, logp_t.shape[-1])
        )
        hard = tgt_logp.argmax(-1)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, (time.time() - t1) / budget, a.drafter_lr, 50, 0.05)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = draft_logits(drafter, feats, x, anc, embed, lm_head).float()
        logits = logits.reshape(dbs, -1, logits.shape[-1])
        lq = logits.log_softmax(-1)
        ce_hard = -torch.gather(lq, -1, hard[..., None])[..., 0]
        ce_soft = -(tgt_logp.exp() * lq).sum(-1)
        per = (0.5 * ce_hard + 0.5 * ce_soft).view(dbs, anchors_per_seq, block - 1)
        loss = (per * wts).sum() / (wts.sum() * dbs * anchors_per_seq)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0 or time.time() >= deadline:
            acc = (
                (logits.argmax(-1) == hard)
                .float()
                .view(dbs, anchors_per_seq, block - 1)
                .mean((0, 1))
            )
            curve.append(
                [step, round(loss.item(), 4), [round(v, 3) for v in acc.tolist()]]
            )
        if step % 500 == 0:
            log(
                f"{a.pair}: drafter step {step} loss {loss.item():.3f} "
                f"acc@1..4 {curve[-1][2][:4]}"
            )
    rec["drafter"] = {
        "steps": step,
        "batch": dbs,
        "anchors_per_seq": anchors_per_seq,
        "peak_lr": a.drafter_lr,
        "seconds": round(time.time() - t1, 1),
        "curve": curve,
    }
    log(f"{a.pair}: drafter done, {step} steps")


def run_pair(a) -> None:
    import torch

    from bench.pairs.dflash_ref import DFlashDrafter

    torch.manual_seed(a.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu else "cpu")
    work = os.path.join(a.out, "_work")
    ids = torch.load(os.path.join(work, "train_ids.pt"))
    t_end = a.deadline
    now = time.time()
    left = t_end - now
    # time split of what is left: target 30%, continuations 18%, drafter the rest
    # less the evaluation (7%, at most 40 s); with --reuse-target no target stage
    eval_s = min(40.0, 0.07 * left)
    d_target = now + (0.0 if a.reuse_target else 0.30 * left)
    d_gen = d_target + (0.25 if a.reuse_target else 0.18) * left
    d_drafter = t_end - eval_s
    import transformers

    rec: dict = {
        "pair": a.pair,
        "seed": a.seed,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    model = build_target(a.pair, device)
    pdir = os.path.join(a.out, a.pair)
    if a.reuse_target:
        load_target(model, os.path.join(a.reuse_target, a.pair, "target"))
        rec["target"] = {"reused": os.path.join(a.reuse_target, a.pair, "target")}
        import shutil

        shutil.copytree(
            os.path.join(a.reuse_target, a.pair, "target"),
            os.path.join(pdir, "target"),
            dirs_exist_ok=True,
            symlinks=True,
        )
        model.eval()
    else:
        model.train()
        train_target(a, model, ids, device, d_target, rec)
        model.eval()
        round_to_bf16_(model)
        save_target(a.pair, model, os.path.join(pdir, "target"), a.seed)
    data, plen = make_continuations(a, model, ids, device, d_gen, rec)
    drafter = DFlashDrafter(pc.pair(a.pair)["small_drafter"]).to(device)
    if a.init_drafter:
        load_drafter(drafter, os.path.join(a.init_drafter, a.pair, "drafter"))
        rec["init_drafter"] = os.path.join(a.init_drafter, a.pair, "drafter")
    train_drafter(a, model, drafter, data, plen, device, d_drafter, rec)
    drafter.eval()
    round_to_bf16_(drafter)
    save_drafter(a.pair, drafter, os.path.join(pdir, "drafter"))
    n_eval = 8 if a.smoke else 48
    rec["offline_heldout"] = evaluate(
        model,
        drafter,
        os.path.join(a.out, "prompts", "heldout.jsonl"),
        device,
        n_eval,
        prompt_tokens=32 if a.smoke else EVAL_PROMPT_LEN,
        new_tokens=24 if a.smoke else EVAL_NEW_TOKENS,
    )
    log(f"{a.pair}: offline held-out {rec['offline_heldout']}")
    with open(os.path.join(pdir, "train_log.json"), "w") as f:
        json.dump(rec, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pairs", default=",".join(pc.PAIRS))
    ap.add_argument(
        "--seconds",
        type=float,
        default=560.0,
        help="wall-clock budget of the whole run",
    )
    ap.add_argument(
        "--roots", default="", help="source trees (default: stdlib and site-packages)"
    )
    ap.add_argument(
        "--heldout", default="jax,networkx", help="packages kept out of training"
    )
    ap.add_argument("--corpus-mb", type=int, default=80)
    ap.add_argument("--tokenizer-mb", type=int, default=24)
    ap.add_argument("--target-batch", type=int, default=96)
    ap.add_argument("--gen-batch", type=int, default=384)
    ap.add_argument("--max-sequences", type=int, default=8192)
    ap.add_argument("--drafter-batch", type=int, default=24)
    ap.add_argument("--drafter-lr", type=float, default=1e-3, help="peak")
    ap.add_argument(
        "--init-drafter",
        metavar="DIR",
        help="start each drafter from <DIR>/<pair>/drafter (a trained set) "
        "instead of random weights",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--reuse-target",
        metavar="DIR",
        help="keep the tokenizer, prompts and targets of this trained set; "
        "train drafters only",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="toy sizes, seconds: checks the pipeline"
    )
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--pair", help=argparse.SUPPRESS)  # internal: one pair's subprocess
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.pair:
        run_pair(a)
        return
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    prepare(a)
    deadline = t0 + a.seconds - 15  # leave time to write and pack
    procs = []
    for name in a.pairs.split(","):
        pc.pair(name)  # unknown names fail here
        cmd = [
            sys.executable,
            "-m",
            "bench.pairs.train",
            "--pair",
            name,
            "--deadline",
            str(deadline),
            *sys.argv[1:],
        ]
        procs.append((name, subprocess.Popen(cmd)))
    bad = [name for name, p in procs if p.wait() != 0]
    for name, _ in procs:
        if name not in bad:
            pc.write_model_dirs(a.out, name)
    summary = {"seconds": round(time.time() - t0, 1), "failed": bad, "pairs": {}}
    for name, _ in procs:
        path = os.path.join(a.out, name, "train_log.json")
        if os.path.exists(path):
            with open(path) as f:
                rec = json.load(f)
            summary["pairs"][name] = {
                k: rec[k] for k in ("offline_heldout",) if k in rec
            }
            summary["pairs"][name]["target_steps"] = rec["target"].get(
                "steps", "reused"
            )
            summary["pairs"][name]["drafter_steps"] = rec["drafter"]["steps"]
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("SUMMARY", json.dumps(summary), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
