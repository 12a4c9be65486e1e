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
pipeline, not a model. mtp.py shares this module's corpus, saving and training
loop.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time

from bench import common
from bench.pairs import offline_tau
from bench.pairs import pair_configs as pc

CORPUS_MB, TOKENIZER_MB = 80, 24  # of the corpus: trained on, the tokenizer's
TARGET_BATCH = 96
PROMPT_LEN = 128  # self-distillation: corpus window the target continues
CONT_LEN = 384  # tokens of greedy continuation


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- corpus, tokenizer


def gather_corpus(roots: list[str], max_bytes: int, heldout: set[str], seed: int):
    """(training texts, held-out texts): the ``.py`` files under ``roots`` in a
    seeded order, about ``max_bytes`` for training; files of the top-level
    packages ``heldout`` only in the second list."""
    roots = [r.rstrip("/") for r in roots]
    files = sorted(
        {f for r in roots for f in glob.glob(f"{r}/**/*.py", recursive=True)}
    )
    random.Random(seed).shuffle(files)
    train, held, n = [], [], 0
    for f in files:
        package = next(
            (f[len(r) + 1 :].split("/")[0] for r in roots if f.startswith(r + "/")),
            "",
        )
        if package not in heldout and n >= max_bytes:
            continue
        try:
            with open(f, encoding="utf-8") as fh:
                t = fh.read()
        except (OSError, UnicodeDecodeError):
            continue
        if not 200 < len(t) < 200_000:
            continue
        if package in heldout:
            if len(held) < 2000:
                held.append(t)
        else:
            train.append(t)
            n += len(t)
    return train, held


def encode(tok, texts: list[str]):
    """Token ids of ``texts``, each followed by EOS (int32)."""
    import numpy as np
    import torch

    ids = [
        np.asarray(e.ids + [pc.EOS_ID], dtype=np.int32) for e in tok.encode_batch(texts)
    ]
    return torch.from_numpy(np.concatenate(ids))


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
    special = [tok.token_to_id(s) for s in pc.SPECIAL_TOKENS]
    assert special == [pc.EOS_ID, pc.MASK_ID, pc.PAD_ID], special
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    common.write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
    return tok


def write_prompts(path: str, texts: list[str], k: int, seed: int, tok) -> None:
    """Up to ``k`` 30-line code prefixes of ``texts``, cut at a line start, with
    their last 512 token ids."""
    r, n = random.Random(seed), 0
    with open(path, "w") as f:
        for t in texts:
            lines = t.splitlines(keepends=True)
            if len(lines) < 40 or n >= k:
                continue
            c = r.randrange(10, len(lines) - 20)
            p = "".join(lines[max(0, c - 30) : c])
            ids = tok.encode(p).ids[-512:]
            f.write(json.dumps({"prompt": p, "prompt_token_ids": ids}) + "\n")
            n += 1


def prepare(a) -> None:
    import torch
    from tokenizers import Tokenizer

    t0 = time.time()
    paths = sysconfig.get_paths()
    roots = [r for r in (paths["stdlib"], paths["purelib"]) if os.path.isdir(r)]
    heldout = {h for h in a.heldout.split(",") if h}
    train, held = gather_corpus(
        roots, (2 if a.smoke else CORPUS_MB) << 20, heldout, a.seed
    )
    if not held:
        sys.exit(
            f"no held-out files: none of the packages {sorted(heldout)} under {roots}"
        )
    log(
        f"corpus {sum(map(len, train)) / 2**20:.1f} MiB in {len(train)} files; "
        f"held-out {len(held)} files of {sorted(heldout)} ({time.time() - t0:.0f} s)"
    )
    if a.reuse_target:
        for sub in ("tokenizer", "prompts"):
            src = os.path.join(a.reuse_target, sub)
            shutil.copytree(src, os.path.join(a.out, sub), dirs_exist_ok=True)
        tok = Tokenizer.from_file(os.path.join(a.out, "tokenizer", "tokenizer.json"))
    else:
        sample, n = [], 0
        for t in train:
            sample.append(t)
            n += len(t)
            if n > (1 if a.smoke else TOKENIZER_MB) << 20:
                break
        tok = train_tokenizer(sample, os.path.join(a.out, "tokenizer"))
        log(f"tokenizer trained on {n / 2**20:.1f} MiB ({time.time() - t0:.0f} s)")
        os.makedirs(os.path.join(a.out, "prompts"), exist_ok=True)
        n_held, n_train = (16, 16) if a.smoke else (128, 64)
        prompts = os.path.join(a.out, "prompts")
        write_prompts(f"{prompts}/heldout.jsonl", held, n_held, a.seed + 1, tok)
        write_prompts(f"{prompts}/train.jsonl", train[-3000:], n_train, a.seed + 2, tok)
    ids = encode(tok, train)
    os.makedirs(os.path.join(a.out, "_work"), exist_ok=True)
    torch.save(ids, os.path.join(a.out, "_work", "train_ids.pt"))
    log(f"{ids.numel() / 1e6:.1f}M training tokens ({time.time() - t0:.0f} s)")


# ---------------------------------------------------------------- saving


def save_weights(module, out_dir: str, config: dict, prefix: str = "") -> dict:
    """``module``'s weights as bf16 safetensors (names after ``prefix``) and
    ``config`` as config.json in ``out_dir``; returns the state dict written."""
    import torch
    from safetensors.torch import save_file

    sd = {
        prefix + k: v.detach().to(torch.bfloat16).cpu().contiguous()
        for k, v in module.state_dict().items()
    }
    os.makedirs(out_dir, exist_ok=True)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    common.write_json(os.path.join(out_dir, "config.json"), config)
    return sd


def save_target(name: str, model, out_dir: str, seed: int) -> None:
    """HF layout with the pair's config; a Qwen3.5 target is saved as
    Qwen3_5ForConditionalGeneration (its text weights under
    model.language_model., a seeded stub vision tower)."""
    import torch
    from safetensors.torch import save_file

    cfg = pc.pair(name)["small_target"]
    sd = save_weights(model, out_dir, cfg)
    if pc.text_config(cfg)["tie_word_embeddings"]:
        sd.pop("lm_head.weight", None)
    if "text_config" in cfg:
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        sd = {k.replace("model.", "model.language_model.", 1): v for k, v in sd.items()}
        torch.manual_seed(seed)
        stub = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**cfg))
        for k, v in stub.state_dict().items():
            if k.startswith("model.visual."):
                sd[k] = v.detach().to(torch.bfloat16).contiguous()
    # (pair_configs.write_model_dirs adds generation_config.json)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def round_to_bf16_(module) -> None:
    """Keep float32 compute but the weights as saved (bf16), so that the
    continuations and the evaluation see the model vLLM will load."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


# ---------------------------------------------------------------- training


def lr_at(step: int, frac: float, peak: float, warmup: int, floor: float) -> float:
    """Linear warmup, then cosine decay to ``floor * peak`` over the time budget."""
    cos = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return peak * min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * cos)


# AdamW and lr_at settings of each trained module (the drafter's peak lr is
# --drafter-lr); a curve point every ``every`` steps.
TARGET_FIT = dict(lr=2e-3, warmup=100, floor=0.1, weight_decay=0.1, every=100)
DRAFTER_FIT = dict(warmup=50, floor=0.05, weight_decay=0.01, every=100)


def fit(module, batch_loss, deadline, name, *, lr, warmup, floor, weight_decay, every):
    """AdamW on ``module`` until ``deadline``, the learning rate from lr_at.
    ``batch_loss()`` gives one batch's loss and a function of the curve point
    recorded (and logged) every ``every`` steps and at the end."""
    import torch

    opt = torch.optim.AdamW(
        module.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay
    )
    t1, step, curve = time.time(), 0, []
    budget = max(1.0, deadline - t1)
    module.train()
    while time.time() < deadline:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, (time.time() - t1) / budget, lr, warmup, floor)
        loss, point = batch_loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % every == 0 or time.time() >= deadline:
            curve.append([step, round(loss.item(), 4), *point()])
            log(f"{name}: step {step} {curve[-1][1:]}")
    module.eval()
    return {"steps": step, "seconds": round(time.time() - t1, 1), "curve": curve}


def distill_terms(logits, teacher_logp):
    """Per position: half cross-entropy on the teacher's argmax, half on its
    distribution (the drafters' loss)."""
    import torch

    lq = logits.float().log_softmax(-1)
    hard = teacher_logp.argmax(-1, keepdim=True)
    ce_soft = -(teacher_logp.exp() * lq).sum(-1)
    return 0.5 * -torch.gather(lq, -1, hard)[..., 0] + 0.5 * ce_soft


def windows(ids, n: int, length: int, gen):
    """``n`` random windows of ``length`` tokens of ``ids`` [n, length] (int64)."""
    import torch

    st = torch.randint(0, ids.numel() - length - 1, (n,), generator=gen)
    return torch.stack([ids[s : s + length] for s in st.tolist()]).long()


def train_target(a, model, ids, device, deadline: float) -> dict:
    import torch

    gen = torch.Generator().manual_seed(a.seed)
    seq, bs = (64, 4) if a.smoke else (512, TARGET_BATCH)
    amp = device.type == "cuda"

    def batch_loss():
        x = windows(ids, bs, seq, gen).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            return model(input_ids=x, labels=x).loss, lambda: []

    rec = fit(model, batch_loss, deadline, f"{a.pair} target", **TARGET_FIT)
    rec["loss_curve"] = rec.pop("curve")
    return dict(rec, batch=bs, seq=seq)


def make_continuations(a, model, ids, device, deadline: float, rec: dict):
    import torch

    gen = torch.Generator().manual_seed(a.seed + 7)
    bs = 4 if a.smoke else a.gen_batch
    plen, clen = (16, 48) if a.smoke else (PROMPT_LEN, CONT_LEN)
    seqs, t1 = [], time.time()
    while time.time() < deadline and len(seqs) * bs < a.max_sequences:
        p = windows(ids, bs, plen, gen).to(device)
        seqs.append(
            offline_tau.target_continue(model, p, clen, device.type == "cuda").cpu()
        )
    data = torch.cat(seqs)
    rec["continuations"] = {
        "sequences": data.shape[0],
        "prompt_len": plen,
        "new_tokens": clen,
        "seconds": round(time.time() - t1, 1),
    }
    log(f"{a.pair}: {data.shape[0]} greedy continuations of {clen} tokens")
    return data, plen


def train_drafter(a, model, drafter, data, plen, device, deadline: float) -> dict:
    import torch

    from bench.pairs.dflash_ref import draft_logits, target_forward

    layer_ids = drafter.cfg["dflash_config"]["target_layer_ids"]
    block = drafter.cfg["block_size"]
    model.requires_grad_(False)
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    gen = torch.Generator().manual_seed(a.seed + 11)
    dbs, per_seq = (2, 4) if a.smoke else (a.drafter_batch, 24)
    s_len, lo = data.shape[1], max(1, plen // 4)
    wts = torch.exp(-torch.arange(block - 1, device=device, dtype=torch.float32) / 7.0)
    amp = device.type == "cuda"
    offs = torch.arange(1, block, device=device)

    def batch_loss():
        x = data[torch.randint(0, data.shape[0], (dbs,), generator=gen)].to(device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits_t, feats = target_forward(model, x, layer_ids)
            logp_t = logits_t.float().log_softmax(-1)
        anc = torch.stack(
            [
                torch.randperm(s_len - block - lo, generator=gen)[:per_seq] + lo
                for _ in range(dbs)
            ]
        )
        anc = anc.to(device).sort(1).values
        # slot k predicts position anchor + k: the target's distribution after
        # position anchor + k - 1
        tgt_pos = (anc[:, :, None] + offs - 1).reshape(dbs, -1)
        tgt = torch.gather(
            logp_t, 1, tgt_pos[..., None].expand(-1, -1, logp_t.shape[-1])
        )
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = draft_logits(drafter, feats.float(), x, anc, embed, lm_head)
        logits = logits.float().reshape(dbs, -1, logits.shape[-1])
        per = distill_terms(logits, tgt).view(dbs, per_seq, block - 1)
        loss = (per * wts).sum() / (wts.sum() * dbs * per_seq)

        def point():
            hit = (logits.argmax(-1) == tgt.argmax(-1)).float()
            return [
                [round(v, 3) for v in hit.view(dbs, per_seq, -1).mean((0, 1)).tolist()]
            ]

        return loss, point

    name = f"{a.pair} drafter"
    rec = fit(drafter, batch_loss, deadline, name, lr=a.drafter_lr, **DRAFTER_FIT)
    return dict(rec, batch=dbs, anchors_per_seq=per_seq, peak_lr=a.drafter_lr)


def run_pair(a) -> None:
    import torch
    import transformers

    from bench.pairs.dflash_ref import DFlashDrafter

    torch.manual_seed(a.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu else "cpu")
    ids = torch.load(os.path.join(a.out, "_work", "train_ids.pt"))
    now = time.time()
    left = a.deadline - now
    # time split of what is left: target 30%, continuations 18%, drafter the rest
    # less the evaluation (7%, at most 40 s); with --reuse-target no target stage
    d_target = now + (0.0 if a.reuse_target else 0.30 * left)
    d_gen = d_target + (0.25 if a.reuse_target else 0.18) * left
    d_drafter = a.deadline - min(40.0, 0.07 * left)
    rec: dict = {
        "pair": a.pair,
        "seed": a.seed,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    pdir = os.path.join(a.out, a.pair)
    if a.reuse_target:
        src = os.path.join(a.reuse_target, a.pair, "target")
        model = offline_tau.load_target(src, device)
        rec["target"] = {"reused": src}
        shutil.copytree(
            src, os.path.join(pdir, "target"), dirs_exist_ok=True, symlinks=True
        )
    else:
        model = offline_tau.text_model(pc.pair(a.pair)["small_target"], device)
        rec["target"] = train_target(a, model, ids, device, d_target)
        round_to_bf16_(model)
        save_target(a.pair, model, os.path.join(pdir, "target"), a.seed)
    data, plen = make_continuations(a, model, ids, device, d_gen, rec)
    if a.init_drafter:
        rec["init_drafter"] = os.path.join(a.init_drafter, a.pair, "drafter")
        drafter = offline_tau.load_drafter(rec["init_drafter"], device)
    else:
        drafter = DFlashDrafter(pc.pair(a.pair)["small_drafter"]).to(device)
    rec["drafter"] = train_drafter(a, model, drafter, data, plen, device, d_drafter)
    round_to_bf16_(drafter)
    save_weights(drafter, os.path.join(pdir, "drafter"), drafter.cfg)
    rec["offline_heldout"] = offline_tau.evaluate(
        model,
        drafter,
        os.path.join(a.out, "prompts", "heldout.jsonl"),
        device,
        8 if a.smoke else 48,
        prompt_tokens=32 if a.smoke else offline_tau.EVAL_PROMPT_LEN,
        new_tokens=24 if a.smoke else offline_tau.EVAL_NEW_TOKENS,
    )
    log(f"{a.pair}: offline held-out {rec['offline_heldout']}")
    common.write_json(os.path.join(pdir, "train_log.json"), rec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    common.add_options(ap, {
        "--pairs": (",".join(pc.PAIRS), None),
        "--seconds": (560.0, "the whole run's"),
        "--heldout": ("jax,networkx", "packages kept out of training"),
        "--gen-batch": (384, None),
        "--max-sequences": (8192, None),
        "--drafter-batch": (24, None),
        "--seed": (0, None),
        "--drafter-lr": (1e-3, "peak"),
        "--init-drafter": (None, "start each drafter from <DIR>/<pair>/drafter "
            "(a trained set)"),
        "--reuse-target": (None, "keep the tokenizer, prompts and targets of this "
            "trained set (a DIR); train drafters only"),
        "--smoke": (False, "toy sizes: checks the pipeline"),
        "--cpu": (False, None),
    })  # fmt: skip
    ap.add_argument("--pair", help=argparse.SUPPRESS)  # internal: one pair's subprocess
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.pair:
        return run_pair(a)
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    prepare(a)
    deadline = str(t0 + a.seconds - 15)  # leave time to write and pack
    names = a.pairs.split(",")
    for name in names:
        pc.pair(name)  # unknown names fail here
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "bench.pairs.train", "--pair", name]
            + ["--deadline", deadline, *sys.argv[1:]]
        )
        for name in names
    }
    failed = [name for name, p in procs.items() if p.wait() != 0]
    summary = {"seconds": round(time.time() - t0, 1), "failed": failed, "pairs": {}}
    for name in names:
        if name in failed:
            continue
        pc.write_model_dirs(a.out, name)
        with open(os.path.join(a.out, name, "train_log.json")) as f:
            rec = json.load(f)
        summary["pairs"][name] = {
            "offline_heldout": rec["offline_heldout"],
            "target_steps": rec["target"].get("steps", "reused"),
            "drafter_steps": rec["drafter"]["steps"],
        }
    common.write_json(os.path.join(a.out, "summary.json"), summary)
    print("SUMMARY", json.dumps(summary), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
