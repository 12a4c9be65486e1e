# SPDX-License-Identifier: Apache-2.0
"""The benchmark pair's MTP head (bench/pairs/mtp.py): its packed recursion is
vLLM's draft loop (one MTP layer run k times, each step attending to the
head's keys and values of the verified positions and of its own earlier
steps), a training step reaches every weight, and the checkpoint carries the
names and config key vLLM's qwen3_5_mtp.py loads."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

PAIRS_DIR = Path(__file__).resolve().parent.parent / "bench" / "pairs"
sys.path.insert(0, str(PAIRS_DIR))

import mtp  # noqa: E402
import pair_configs as pc  # noqa: E402

VOCAB = 300


def tiny_target_cfg() -> dict:
    return pc.scaled(
        pc.pair("hybrid-27b")["small_target"],
        hidden_size=64,
        intermediate_size=96,
        vocab_size=VOCAB,
    )


def random_head(seed: int = 0):
    torch.manual_seed(seed)
    head = mtp.build_head(tiny_target_cfg())
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:  # one-plus norms start at zero: make them count
                p.uniform_(-0.5, 0.5)
    return head.eval()


def naive_drafts(head, hidden, tokens, embed, lm_head, p: int, depth: int):
    """vLLM's loop for one bonus position p, step by step: the head's causal
    pass over the verified inputs (target hidden at j, token j + 1, j < p)
    followed by its own drafts, one more each step."""
    emb, hid, pos = [], [], []
    for j in range(p):
        emb.append(embed[tokens[j + 1]])
        hid.append(hidden[j])
        pos.append(j)
    out = []
    for s in range(depth):
        o = head(
            torch.stack(emb)[None], torch.stack(hid)[None], torch.tensor(pos)[None]
        )[0, -1]
        logits = o @ lm_head.T
        out.append(logits)
        emb.append(embed[logits.argmax()])
        hid.append(o)
        pos.append(p + s)
    return torch.stack(out)


def test_packed_recursion_is_the_draft_loop():
    head = random_head()
    torch.manual_seed(1)
    seq_len, depth = 24, 4
    tokens = torch.randint(0, VOCAB, (seq_len,))
    hidden = torch.randn(seq_len, 64)
    embed = torch.randn(VOCAB, 64)
    anchors = torch.tensor([1, 5, 9, 17, 22])
    with torch.no_grad():
        packed = mtp.recursive_logits(
            head, hidden[None], tokens[None], embed, embed, anchors[None], depth, False
        )[0]
        for n, p in enumerate(anchors.tolist()):
            ref = naive_drafts(head, hidden, tokens, embed, embed, p, depth)
            torch.testing.assert_close(packed[n], ref, rtol=1e-4, atol=1e-4)


def test_teacher_forced_steps_read_the_true_tokens():
    head = random_head()
    torch.manual_seed(2)
    tokens = torch.randint(0, VOCAB, (1, 20))
    hidden = torch.randn(1, 20, 64)
    embed = torch.randn(VOCAB, 64)
    anchors = torch.tensor([[3, 8]])
    with torch.no_grad():
        forced, out1 = mtp.recursive_logits(
            head, hidden, tokens, embed, embed, anchors, 3, True, with_step1=True
        )
        # step 1 at anchor p is the causal pass's output at p - 1
        torch.testing.assert_close(forced[0, :, 0], out1[0, anchors[0] - 1] @ embed.T)
        # when the drafts are the true tokens, greedy and forced agree
        # (one anchor: the tokens after it feed later positions' step 1)
        last = anchors[:, -1:]
        p = int(last)
        free = mtp.recursive_logits(head, hidden, tokens, embed, embed, last, 3, False)
        tokens2 = tokens.clone()
        tokens2[0, p + 1] = free[0, 0, 0].argmax()
        tokens2[0, p + 2] = free[0, 0, 1].argmax()
        forced2 = mtp.recursive_logits(head, hidden, tokens2, embed, embed, last, 3, True)
        torch.testing.assert_close(forced2, free, rtol=1e-5, atol=1e-5)


def test_training_step_reaches_every_weight():
    head = random_head().train()
    torch.manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, 16))
    hidden = torch.randn(2, 16, 64)
    embed = torch.randn(VOCAB, 64)
    teacher = torch.randn(2, 16, VOCAB).log_softmax(-1)
    anchors = torch.tensor([[2, 7, 11], [4, 5, 12]])
    logits, out1 = mtp.recursive_logits(
        head, hidden, tokens, embed, embed, anchors, 3, True, with_step1=True
    )
    loss = mtp.distill_loss(out1 @ embed.T, teacher[:, 1:])
    for s in (2, 3):
        idx = (anchors + s - 1)[..., None].expand(-1, -1, VOCAB)
        loss = loss + mtp.distill_loss(logits[:, :, s - 1], torch.gather(teacher, 1, idx))
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_checkpoint_is_what_vllm_loads(tmp_path):
    head = random_head()
    cfg = tiny_target_cfg()
    mtp.save_head(head, cfg, str(tmp_path))
    from safetensors.torch import load_file

    names = set(load_file(os.path.join(tmp_path, "model.safetensors")))
    assert names == {
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
        "mtp.layers.0.input_layernorm.weight",
        "mtp.layers.0.post_attention_layernorm.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.self_attn.k_proj.weight",
        "mtp.layers.0.self_attn.v_proj.weight",
        "mtp.layers.0.self_attn.o_proj.weight",
        "mtp.layers.0.self_attn.q_norm.weight",
        "mtp.layers.0.self_attn.k_norm.weight",
        "mtp.layers.0.mlp.gate_proj.weight",
        "mtp.layers.0.mlp.up_proj.weight",
        "mtp.layers.0.mlp.down_proj.weight",
    }
    with open(os.path.join(tmp_path, "config.json")) as f:
        saved = json.load(f)
    assert saved["text_config"]["mtp_num_hidden_layers"] == 1
    back, _ = mtp.load_head(str(tmp_path))
    for k, v in head.state_dict().items():
        torch.testing.assert_close(
            back.state_dict()[k], v.to(torch.bfloat16).float(), rtol=0, atol=0
        )
