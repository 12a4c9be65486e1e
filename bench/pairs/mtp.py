#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""An MTP head for a Qwen3.5-architecture benchmark pair: the model's own
multi-token-prediction module as vLLM's ``method: "mtp"`` loads it
(``vllm/model_executor/models/qwen3_5_mtp.py``), and the offline acceptance
of the committed head (``<models>/<pair>/mtp``).

    python3 -m bench.pairs.mtp [--models bench/pairs/models] [--pair hybrid-27b]
        [--prompts 48] [--device cpu]

The module (``MTPHead``; checkpoint names ``mtp.*`` as in Qwen3.5 / Qwen3.6
checkpoints): ``fc`` over ``[pre_fc_norm_embedding(embed(token t+1));
pre_fc_norm_hidden(h_t)]``, one full-attention decoder layer of the target's
shape, a final ``norm``; the embedding and lm_head are the target's (vLLM shares
them). ``h_t`` is the target's last hidden state at position t (after its final
norm, as vLLM's Qwen3.5 model returns it) and the head at position t predicts
token t + 2. vLLM drafts k tokens by running the one layer k times: step s + 1
reads step s's output hidden state and its argmax token, one position further,
attending to the head's own keys and values (those of verified positions come
from the target's hidden states).

The offline acceptance: on the held-out evaluation sequences, as
offline_tau.evaluate makes them (the prompts of ``prompts/heldout.jsonl`` cut
to their last 160 tokens, 256 greedy tokens), tau of the chain MTP drafts for
k = 1..4 tokens, replayed as vLLM verifies it at temperature 0
(acceptance.chain_steps); printed as one ``MTP_TAU {json}`` line, the
``offline_heldout`` record of the head's ``train_log.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

from bench import common
from bench.pairs import offline_tau
from bench.pairs import pair_configs as pc

MTP_LAYERS = 1  # Qwen3.5 / Qwen3.6 checkpoints carry one MTP layer
# The mtp method's draft length: best_k of the committed hybrid-27b head's
# offline tau (models/hybrid-27b/mtp/train_log.json).
SPECULATIVE_TOKENS = 3
EVAL_DEPTHS = (1, 2, 3, 4)


def with_mtp_keys(cfg: dict) -> dict:
    """A Qwen3.5 model config with the key vLLM's MTP reads
    (``mtp_num_hidden_layers`` in its text config)."""
    out = copy.deepcopy(cfg)
    pc.text_config(out)["mtp_num_hidden_layers"] = MTP_LAYERS
    return out


def build_head(target_cfg: dict):
    import torch
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer,
        Qwen3_5RMSNorm,
        Qwen3_5TextRotaryEmbedding,
    )

    class MTPHead(torch.nn.Module):
        """Qwen3.5's MTP module (vLLM's Qwen3_5MultiTokenPredictor) on
        transformers' Qwen3.5 decoder layer; state-dict names are the
        checkpoint's without the ``mtp.`` prefix."""

        def __init__(self, text: dict):
            super().__init__()
            # the target's text config, one full-attention layer
            one = dict(num_hidden_layers=1, layer_types=["full_attention"])
            cfg = Qwen3_5TextConfig(**dict(copy.deepcopy(text), **one))
            cfg._attn_implementation = "sdpa"
            h, eps = cfg.hidden_size, cfg.rms_norm_eps
            self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
            self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
            self.fc = torch.nn.Linear(2 * h, h, bias=False)
            self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(cfg, 0)])
            self.norm = Qwen3_5RMSNorm(h, eps=eps)
            self.rotary_emb = Qwen3_5TextRotaryEmbedding(cfg)

        def forward(self, embeds, hidden, positions, mask=None):
            """``embeds``, ``hidden`` [B, T, h]; ``positions`` [B, T]; ``mask``
            None (causal) or bool [B, 1, T, T] (True: attend). Returns the
            normed output hidden states [B, T, h]."""
            e, h = self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)
            x = self.fc(torch.cat([e, h], dim=-1))
            pe = self.rotary_emb(x, positions[None].expand(3, -1, -1))
            for layer in self.layers:
                x = layer(x, position_embeddings=pe, attention_mask=mask)
            return self.norm(x)

    return MTPHead(pc.text_config(target_cfg))


def load_head(path: str):
    """(head in float32, eval mode; its config) from a head's directory."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    head = build_head(cfg)
    sd = {
        k[len("mtp.") :]: v.float()
        for k, v in load_file(os.path.join(path, "model.safetensors")).items()
    }
    head.load_state_dict(sd)
    return head.eval(), cfg


def step_weights(big_cfg: dict) -> tuple[int, int]:
    """Weights one decode step reads at the production shape: (the target's
    layers and lm_head, one MTP draft step's layer, fc and lm_head)."""
    t = pc.text_config(big_cfg)
    h, inter, hd = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    mlp = 3 * h * inter
    attn = h * hd * (3 * t["num_attention_heads"] + 2 * t["num_key_value_heads"])
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    keys, vals = t["linear_num_key_heads"] * dk, t["linear_num_value_heads"] * dv
    gdn = h * (2 * keys + vals) + 2 * h * vals + 2 * h * t["linear_num_value_heads"]
    lm_head = t["vocab_size"] * h
    layers = sum(
        mlp + (attn if kind == "full_attention" else gdn) for kind in t["layer_types"]
    )
    return layers + lm_head, 2 * h * h + attn + mlp + lm_head


def best_k(tau: dict[str, float], big_cfg: dict) -> int:
    """The draft length with the most tokens per unit of single-request step
    time, estimated from offline tau: a decode step at one request reads the
    weights (memory bound), so a step with k MTP drafts costs about
    ``1 + k * r`` target steps, r the ratio of step_weights."""
    target, draft = step_weights(big_cfg)
    r = draft / target
    return max((int(k) for k in tau), key=lambda k: tau[str(k)] / (1 + k * r))


def speculative_config(num_speculative_tokens: int) -> dict:
    """The speculative_config vLLM takes for the target's own MTP module, run
    ``num_speculative_tokens`` times per step (the draft model is the
    target's checkpoint: no ``model``)."""
    return {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}


# ---------------------------------------------------------------- the recursion


def recursive_logits(head, hidden, tokens, embed, lm_head, anchors, depth, forced):
    """Logits [B, N, depth, V] of the head run ``depth`` times as vLLM drafts:
    for a bonus token at position p (``anchors`` [B, N], p >= 1), step 1 reads
    the target's hidden state at p - 1 and token p (position p - 1) and
    predicts token p + 1; step s >= 2 reads step s - 1's output hidden state
    and token p + s - 1 at position p + s - 2 (``forced``: the true
    token, else step s - 1's argmax) and predicts token p + s.

    One pass per step over a packed sequence: the L - 1 step-1 inputs of the
    whole sequence (causal), then each anchor's later steps, which attend to
    the step-1 entries before position p and to their own anchor's earlier
    steps: the keys and values vLLM's draft steps see."""
    import torch

    b, seq_len = tokens.shape
    n = anchors.shape[1]
    dev = tokens.device
    pos1 = torch.arange(seq_len - 1, device=dev).expand(b, -1)
    emb1 = embed[tokens[:, 1:]]
    out1 = head(emb1, hidden[:, :-1], pos1)
    gather = (anchors - 1)[..., None].expand(-1, -1, out1.shape[-1])
    h_prev = torch.gather(out1, 1, gather)  # [B, N, h]
    logits = [h_prev @ lm_head.T]
    if depth == 1:
        return torch.stack(logits, 2)
    t1 = seq_len - 1
    cols1 = torch.arange(t1, device=dev)
    lvl_emb, lvl_hid, lvl_pos = [], [], []
    for s in range(2, depth + 1):
        if forced:  # teacher-forced
            tok = torch.gather(tokens, 1, anchors + s - 1)
        else:
            tok = logits[-1].argmax(-1)
        lvl_emb.append(embed[tok])
        lvl_hid.append(h_prev)
        lvl_pos.append(anchors + s - 2)
        levels = s - 1
        total = t1 + levels * n
        mask = torch.zeros(b, total, total, dtype=torch.bool, device=dev)
        mask[:, :t1, :t1] = torch.ones(t1, t1, dtype=torch.bool, device=dev).tril()
        # draft rows: step-1 columns before the anchor, own anchor's levels <= own
        before = cols1[None, None, :] < anchors[:, :, None]  # [B, N, t1]
        mask[:, t1:, :t1] = before.repeat(1, levels, 1)
        own = torch.ones(levels, levels, device=dev).tril()
        mask[:, t1:, t1:] = torch.kron(own, torch.eye(n, device=dev)).bool()
        out = head(
            torch.cat([emb1, *lvl_emb], 1),
            torch.cat([hidden[:, :-1], *lvl_hid], 1),
            torch.cat([pos1, *lvl_pos], 1),
            mask[:, None],
        )
        h_prev = out[:, -n:]
        logits.append(h_prev @ lm_head.T)
    return torch.stack(logits, 2)


# ---------------------------------------------------------------- offline tau


def target_hidden(model, seqs, batch: int = 16):
    """The target's last hidden states (after its final norm) over ``seqs``
    [B, L]."""
    import torch

    with torch.no_grad():
        out = [model.model(input_ids=x).last_hidden_state for x in seqs.split(batch)]
    return torch.cat(out).float()


def offline_tau_of_head(head, model, seqs, hidden, plen: int) -> dict:
    """Tau of the MTP chain for k = 1..max(EVAL_DEPTHS) draft tokens on the
    greedy sequences ``seqs`` (prompt ``plen`` tokens), replayed as vLLM
    verifies at temperature 0; also the rate at which step s's draft is the
    target's token when steps 1..s-1 were (the chain's per-depth acceptance)."""
    import torch

    from bench.pairs import acceptance

    depth = max(EVAL_DEPTHS)
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    steps = {k: [] for k in EVAL_DEPTHS}
    hits, tries = [0] * depth, [0] * depth
    seq_len = seqs.shape[1]
    end = seq_len - 1
    anchors = torch.arange(plen, end, device=seqs.device)[None]
    with torch.no_grad():
        for x, h in zip(seqs, hidden):
            lg = recursive_logits(
                head, h[None], x[None], embed, lm_head, anchors, depth, False
            )
            draft = torch.zeros(seq_len, depth, dtype=torch.long)
            draft[plen:end] = lg[0].argmax(-1).cpu()
            toks = x.tolist()
            for k in EVAL_DEPTHS:
                steps[k].append(acceptance.chain_steps(draft[:, :k], toks, plen, end))
            for p in range(plen, end):
                for s in range(min(depth, end - p)):
                    tries[s] += 1
                    if int(draft[p, s]) != toks[p + 1 + s]:
                        break
                    hits[s] += 1
    return {
        "prompts": len(seqs),
        "temperature": 0.0,
        "prompt_tokens": plen,
        "new_tokens": seq_len - plen,
        "mtp_tau": {str(k): round(acceptance.tau(steps[k]), 3) for k in EVAL_DEPTHS},
        "per_depth_acceptance": [
            round(hits[s] / max(1, tries[s]), 3) for s in range(depth)
        ],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_options(ap, {
        "--models": (common.PAIR_MODELS, None),
        "--pair": ("hybrid-27b", None),
        "--prompts": (48, None),
        "--device": ("cpu", None),
    })  # fmt: skip
    a = ap.parse_args(argv)

    import torch

    device = torch.device(a.device)
    pdir = os.path.join(a.models, a.pair)
    model = offline_tau.load_target(os.path.join(pdir, "target"), device)
    head = load_head(os.path.join(pdir, "mtp"))[0].to(device)
    prompts, plen = os.path.join(a.models, common.HELDOUT), offline_tau.EVAL_PROMPT_LEN
    held = offline_tau.heldout_sequences(
        model, prompts, a.prompts, plen, offline_tau.EVAL_NEW_TOKENS, device
    )
    rec = offline_tau_of_head(head, model, held, target_hidden(model, held), plen)
    common.emit("MTP_TAU", rec)


if __name__ == "__main__":
    main()
