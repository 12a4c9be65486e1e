# SPDX-License-Identifier: Apache-2.0
"""The benchmark pair's MTP head (bench/pairs/mtp.py): its packed recursion is
vLLM's draft loop (one MTP layer run k times, each step attending to the
head's keys and values of the verified positions and of its own earlier
steps), and the committed checkpoint carries the names and config key vLLM's
qwen3_5_mtp.py loads."""

from __future__ import annotations

import json

import pytest
from repo_paths import PAIR_MODELS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench.pairs import mtp  # noqa: E402
from bench.pairs import pair_configs as pc  # noqa: E402

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
    """The loop vLLM runs for one bonus position p, step by step: the head's causal
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
        forced = mtp.recursive_logits(
            head, hidden, tokens, embed, embed, anchors, 3, True
        )
        # step 1 at anchor p is the causal pass's output at p - 1
        out1 = head(embed[tokens[:, 1:]], hidden[:, :-1], torch.arange(19)[None])
        torch.testing.assert_close(forced[0, :, 0], out1[0, anchors[0] - 1] @ embed.T)
        # when the drafts are the true tokens, greedy and forced agree
        # (one anchor: the tokens after it feed later positions' step 1)
        last = anchors[:, -1:]
        p = int(last)
        free = mtp.recursive_logits(head, hidden, tokens, embed, embed, last, 3, False)
        tokens2 = tokens.clone()
        tokens2[0, p + 1] = free[0, 0, 0].argmax()
        tokens2[0, p + 2] = free[0, 0, 1].argmax()
        forced2 = mtp.recursive_logits(
            head, hidden, tokens2, embed, embed, last, 3, True
        )
        torch.testing.assert_close(forced2, free, rtol=1e-5, atol=1e-5)


def test_checkpoint_is_what_vllm_loads():
    from safetensors.torch import load_file

    path = PAIR_MODELS / "hybrid-27b" / "mtp"
    names = set(load_file(str(path / "model.safetensors")))
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
    with open(path / "config.json") as f:
        saved = json.load(f)
    assert saved["text_config"]["mtp_num_hidden_layers"] == 1


# ---------------------------------------------------------------- embedding

# A reduced Qwen3.6-27B shape (the hybrid pair's structure), as
# test_pairs_embed.py embeds the target at.
BIG_TEXT = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=1,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    intermediate_size=1024,
    vocab_size=8300,
)
PLACEMENT = [0, 4, 5, 7]


def randomise_(module, gen: torch.Generator, scale: float) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(
                    torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5
                )
            elif "A_log" in name or "dt_bias" in name:
                p.copy_(torch.rand(p.shape, generator=gen))
            else:  # one-plus norms start at 0
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def test_embedded_mtp_drafts_as_the_small_one():
    """At a reduced production width, the embedded MTP head, fed the embedded
    target's hidden states and sharing its embedding and lm_head, gives the
    small head's logits at every draft step of vLLM's recursion (its own
    output hidden states fed back), and padded tokens get no probability."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from bench.pairs import embed

    spec = pc.pair("hybrid-27b")
    big_cfg = pc.scaled(spec["big_target"], **BIG_TEXT)
    assert pc.text_config(big_cfg)["mtp_num_hidden_layers"] == 1
    gen = torch.Generator().manual_seed(0)
    small = Qwen3_5ForCausalLM(
        Qwen3_5TextConfig(**pc.text_config(spec["small_target"]))
    ).eval()
    randomise_(small, gen, 1.5)
    small_sd = {
        (
            "model.language_model." + k[len("model.") :]
            if k.startswith("model.")
            else k
        ): v
        for k, v in small.state_dict().items()
    }
    big = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**pc.text_config(big_cfg))).eval()
    big.load_state_dict(
        {
            (
                "model." + k[len("model.language_model.") :]
                if k.startswith("model.")
                else k
            ): v
            for k, v in embed.target_weights(
                spec["small_target"], big_cfg, PLACEMENT, small_sd
            )
        }
    )
    head = mtp.build_head(spec["small_target"]).eval()
    randomise_(head, gen, 1.5)
    small_msd = {"mtp." + k: v for k, v in head.state_dict().items()}
    big_head = mtp.build_head(big_cfg).eval()
    names = []
    big_msd = {}
    for name, t in embed.mtp_weights(spec["small_target"], big_cfg, small_msd):
        names.append(name)
        big_msd[name[len("mtp.") :]] = t
    assert len(names) == len(set(names)) == len(small_msd)
    big_head.load_state_dict(big_msd, strict=True)

    toks = torch.randint(3, 8192, (1, 40), generator=gen)
    anchors = torch.tensor([[1, 12, 25, 36]])
    v_s = pc.SMALL_VOCAB
    with torch.no_grad():
        h_small = small.model(input_ids=toks).last_hidden_state
        h_big = big.model(input_ids=toks).last_hidden_state
        want = mtp.recursive_logits(
            head,
            h_small,
            toks,
            small.model.embed_tokens.weight,
            small.lm_head.weight,
            anchors,
            3,
            False,
        )
        got = mtp.recursive_logits(
            big_head,
            h_big,
            toks,
            big.model.embed_tokens.weight,
            big.lm_head.weight,
            anchors,
            3,
            False,
        )
    assert want.std() > 1.0  # logits spread over several nats
    torch.testing.assert_close(got[..., :v_s], want, rtol=1e-4, atol=1e-3)
    assert (got[..., v_s:].max(-1).values < got[..., :v_s].min(-1).values - 100).all()


# ---------------------------------------------------------------- the committed head

MODELS = PAIR_MODELS


def test_committed_head_and_its_draft_length():
    """The committed head is what vLLM loads (names, config), and the mtp
    method's default draft length is the one its offline tau gives the most
    tokens per unit of single-request step time (``mtp.best_k``)."""
    head, cfg = mtp.load_head(str(MODELS / "hybrid-27b" / "mtp"))
    with open(MODELS / "hybrid-27b" / "target" / "config.json") as f:
        assert mtp.with_mtp_keys(json.load(f)) == cfg
    with open(MODELS / "hybrid-27b" / "mtp" / "train_log.json") as f:
        rec = json.load(f)
    assert rec["mtp_id"] == pc.weights_id(str(MODELS), "hybrid-27b", "mtp")
    tau = rec["offline_heldout"]["mtp_tau"]
    assert sorted(tau) == ["1", "2", "3", "4"]
    big = pc.pair("hybrid-27b")["big_target"]
    assert mtp.best_k(tau, big) == mtp.SPECULATIVE_TOKENS


def test_best_k_weighs_tau_against_the_draft_steps():
    big = pc.pair("hybrid-27b")["big_target"]
    target, draft = mtp.step_weights(big)
    # Qwen3.6-27B: about 25.6 B weights a target step, 1.7 B a draft step
    # (its lm_head is most of it)
    assert 25e9 < target < 26e9 and 1.6e9 < draft < 1.8e9
    flat = {"1": 1.8, "2": 2.0, "3": 2.05, "4": 2.06}
    steep = {"1": 1.9, "2": 2.7, "3": 3.4, "4": 4.0}
    assert mtp.best_k(flat, big) == 2
    assert mtp.best_k(steep, big) == 4


def test_run_pairs_mtp_method_passes_its_draft_length():
    from bench.pairs import run_pairs

    ap = run_pairs.argparse.ArgumentParser()
    run_pairs.add_engine_options(ap)
    ap.add_argument("--out", default="x.json")
    ap.add_argument("--workdir", default="w")
    a = ap.parse_args(["--prompts", "p.jsonl"])
    assert a.mtp_k == mtp.SPECULATIVE_TOKENS
    a = ap.parse_args(["--prompts", "p.jsonl", "--mtp-k", "2"])
    cmd = run_pairs.engine_command(a, "hybrid-27b", "bfloat16", "mtp", "1,8")
    assert cmd[cmd.index("--mtp-k") + 1] == "2"
    assert cmd[cmd.index("--method") + 1] == "mtp"
    assert mtp.speculative_config(2) == {"method": "mtp", "num_speculative_tokens": 2}
