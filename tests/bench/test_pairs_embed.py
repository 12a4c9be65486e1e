# SPDX-License-Identifier: Apache-2.0
"""The benchmark pairs' embedding into production shapes keeps the function
(bench/pairs/embed.py): at reduced production widths of the same structure
(head dims, GQA groups, GDN head ratio, layer types, identity layers, padded
vocabulary), the embedded target's logits and the embedded drafter's logits
equal the small models' in float32, and padded tokens get no probability."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from repo_paths import PAIR_MODELS  # noqa: E402

from bench.pairs import embed  # noqa: E402
from bench.pairs import pair_configs as pc  # noqa: E402
from bench.pairs.dflash_ref import (  # noqa: E402
    DFlashDrafter,
    draft_logits,
    target_forward,
)

# Reduced production shapes: the same structure as Qwen3-8B / Qwen3.6-27B.
TEST_SHAPES = {
    "dense-8b": dict(
        target=dict(
            hidden_size=640,
            num_hidden_layers=7,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=1024,
            vocab_size=8500,
        ),
        drafter=dict(
            hidden_size=640,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=1024,
            vocab_size=8500,
        ),
        drafter_ids=[1, 2, 4, 6],
        placement=[0, 2, 3, 5],
    ),
    "hybrid-27b": dict(
        target=dict(
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=6,
            num_key_value_heads=1,
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            intermediate_size=1024,
            vocab_size=8300,
        ),
        drafter=dict(
            hidden_size=512,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=1024,
            vocab_size=8300,
        ),
        drafter_ids=[1, 4, 6, 7],
        placement=[0, 4, 5, 7],
    ),
}


def hf_text_model(cfg: dict):
    text = pc.text_config(cfg)
    if "text_config" in cfg:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).eval()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**text)).eval()


def to_text_names(sd: dict, cfg: dict) -> dict:
    """Checkpoint names -> the text-only HF model's names."""
    pre = embed.target_prefix(cfg)
    return {
        ("model." + k[len(pre) :] if k.startswith(pre) else k): v for k, v in sd.items()
    }


def randomise_(module, gen: torch.Generator, scale: float) -> None:
    """Weights large enough that logits spread over several nats (HF's 0.02 init
    gives near-uniform logits, a weak test of equality)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(
                    torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5
                )
            elif "A_log" in name or "dt_bias" in name:
                p.copy_(torch.rand(p.shape, generator=gen))
            else:  # norm weights (one-plus norms start at 0, plain ones at 1)
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def shapes(name: str):
    spec = pc.pair(name)
    t = TEST_SHAPES[name]
    big_t = pc.scaled(spec["big_target"], **t["target"])
    big_d = dict(spec["big_drafter"], **t["drafter"])
    big_d["dflash_config"] = dict(
        big_d["dflash_config"], target_layer_ids=t["drafter_ids"]
    )
    big_d["num_target_layers"] = t["target"]["num_hidden_layers"]
    return spec, big_t, big_d, t["placement"]


@pytest.fixture(scope="module", params=list(TEST_SHAPES))
def embedded(request):
    name = request.param
    spec, big_t, big_d, placement = shapes(name)
    gen = torch.Generator().manual_seed(0)
    small = hf_text_model(spec["small_target"])
    randomise_(small, gen, 1.5)
    small_sd = {
        (
            embed.target_prefix(spec["small_target"]) + k[len("model.") :]
            if k.startswith("model.")
            else k
        ): v
        for k, v in small.state_dict().items()
    }
    big = hf_text_model(big_t)
    big_sd = dict(
        embed.target_weights(spec["small_target"], big_t, placement, small_sd)
    )
    missing, unexpected = big.load_state_dict(
        to_text_names(big_sd, big_t), strict=False
    )
    assert not unexpected and not missing, (missing, unexpected)
    drafter = DFlashDrafter(spec["small_drafter"]).eval()
    randomise_(drafter, gen, 1.5)
    big_drafter = DFlashDrafter(big_d).eval()
    d_sd = dict(
        embed.drafter_weights(
            spec["small_drafter"],
            big_d,
            spec["small_target"],
            big_t,
            placement,
            drafter.state_dict(),
        )
    )
    big_drafter.load_state_dict(d_sd, strict=True)
    return dict(
        name=name,
        small=small,
        big=big,
        drafter=drafter,
        big_drafter=big_drafter,
        small_cfg=pc.text_config(spec["small_target"]),
        big_cfg=pc.text_config(big_t),
        small_d=spec["small_drafter"],
        big_d=big_d,
    )


def tokens(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(
        3, vocab, (n, length), generator=torch.Generator().manual_seed(seed)
    )


def test_target_logits_equal(embedded):
    x = tokens(2, 48, embedded["small_cfg"]["vocab_size"], 1)
    with torch.no_grad():
        a = embedded["small"](input_ids=x).logits
        b = embedded["big"](input_ids=x).logits
    v = a.shape[-1]
    assert a.std() > 1.0  # logits spread: the comparison means something
    assert (a - b[..., :v]).abs().max().item() <= 1e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))  # padded tokens never win
    # padded tokens: far below every real token (no mass at temperature 1)
    margin = (b[..., :v].min(-1).values - b[..., v:].max(-1).values).min().item()
    assert margin > 50


def test_identity_layers_and_padded_units(embedded):
    """Production layers that are no small layer leave the residual stream as is;
    padded units stay zero (except the padded-vocabulary unit)."""
    x = tokens(1, 16, embedded["small_cfg"]["vocab_size"], 2)
    with torch.no_grad():
        hs = embedded["big"](input_ids=x, output_hidden_states=True).hidden_states
        hs_small = embedded["small"](
            input_ids=x, output_hidden_states=True
        ).hidden_states
    h = embedded["small_cfg"]["hidden_size"]
    H = embedded["big_cfg"]["hidden_size"]
    c = (H / h) ** 0.5
    _, _, _, placement = shapes(embedded["name"])
    ends = placement[1:] + [embedded["big_cfg"]["num_hidden_layers"]]
    # hidden_states[-1] is after the final norm: compare the layers before
    for i, (lo, hi) in enumerate(zip(placement[:-1], ends[:-1])):
        for L in range(lo, hi):
            torch.testing.assert_close(
                hs[L + 1][..., :h] / c, hs_small[i + 1], rtol=1e-4, atol=1e-4
            )
            assert hs[L + 1][..., h : H - 1].abs().max() == 0
            if lo < L:  # an identity layer adds exact zeros: bit for bit
                assert torch.equal(hs[L + 1], hs[L])


def test_drafter_logits_equal(embedded):
    e = embedded
    block = e["small_d"]["block_size"]
    x = tokens(2, 80, e["small_cfg"]["vocab_size"], 3)
    anchors = torch.tensor([[20, 41, 60], [5, 33, 62]])
    with torch.no_grad():
        f_s = target_forward(
            e["small"], x, e["small_d"]["dflash_config"]["target_layer_ids"]
        )[1]
        f_b = target_forward(
            e["big"], x, e["big_d"]["dflash_config"]["target_layer_ids"]
        )[1]
        ls = draft_logits(
            e["drafter"],
            f_s,
            x,
            anchors,
            e["small"].model.embed_tokens.weight,
            e["small"].lm_head.weight,
        )
        lb = draft_logits(
            e["big_drafter"],
            f_b,
            x,
            anchors,
            e["big"].model.embed_tokens.weight,
            e["big"].lm_head.weight,
        )
    v = ls.shape[-1]
    assert ls.shape[2] == block - 1
    assert ls.std() > 1.0
    assert (ls - lb[..., :v]).abs().max().item() <= 1e-3
    assert torch.equal(ls.argmax(-1), lb.argmax(-1))


def test_refuses_what_cannot_be_embedded():
    spec = pc.pair("hybrid-27b")
    small = spec["small_target"]
    bad_ratio = pc.scaled(
        spec["big_target"], linear_num_value_heads=32
    )  # 2:1 instead of 3:1
    with pytest.raises(ValueError, match="ratio"):
        next(embed.target_weights(small, bad_ratio, spec["placement"], {}))
    with pytest.raises(ValueError, match="placed on a"):
        bad_place = [0, 16, 32, 48]  # small attention layer 3 on a GDN layer
        next(embed.target_weights(small, spec["big_target"], bad_place, {}))
    with pytest.raises(ValueError, match="no production target_layer_id"):
        embed.aux_slot_map([0, 8, 16, 24], 36, [0, 1, 2], [1, 25, 33])


@pytest.mark.parametrize("name", list(pc.PAIRS))
def test_production_configs_embed(name):
    """The committed production shapes accept their small pair (checked without
    building the 8B / 27B tensors)."""
    spec = pc.pair(name)
    embed.check_compatible(
        pc.text_config(spec["small_target"]), pc.text_config(spec["big_target"])
    )
    embed.check_compatible(spec["small_drafter"], spec["big_drafter"])
    slots = embed.aux_slot_map(
        spec["placement"],
        pc.text_config(spec["big_target"])["num_hidden_layers"],
        spec["small_drafter"]["dflash_config"]["target_layer_ids"],
        spec["big_drafter"]["dflash_config"]["target_layer_ids"],
    )
    assert len(slots) == len(spec["small_drafter"]["dflash_config"]["target_layer_ids"])


# ---------------------------------------------------------------- committed pairs

MODELS = PAIR_MODELS


@pytest.mark.parametrize("name", list(pc.PAIRS))
def test_write_model_dirs_gives_the_committed_production_folders(name, tmp_path):
    """The committed production folders are what write_model_dirs writes for a
    newly trained set (configs, generation config, tokenizer links)."""
    pc.write_model_dirs(str(tmp_path), name)
    for sub in ("production-target", "production-drafter"):
        for f in (tmp_path / name / sub).iterdir():
            committed = MODELS / name / sub / f.name
            assert committed.exists(), committed
            if not f.is_symlink():
                assert committed.read_text() == f.read_text(), committed
            else:
                assert (committed.parent / os.readlink(committed)).resolve() == (
                    MODELS / "tokenizer" / f.name
                ).resolve()


@pytest.mark.parametrize("name", list(pc.PAIRS))
def test_trained_pair_embeds_exactly_on_heldout_prompts(name):
    """The committed trained pair, embedded at the reduced production widths,
    gives its own target and drafter logits on real held-out prompts."""
    import json

    from safetensors.torch import load_file

    spec, big_t, big_d, placement = shapes(name)
    spec = pc.load_pair(str(MODELS), name)
    small_sd = {
        k: v.float()
        for k, v in load_file(MODELS / name / "target" / "model.safetensors").items()
        if "visual" not in k
    }
    small = hf_text_model(spec["small_target"])
    missing, unexpected = small.load_state_dict(
        to_text_names(small_sd, spec["small_target"]), strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    small.tie_weights()
    big = hf_text_model(big_t)
    big.load_state_dict(
        to_text_names(
            dict(
                embed.target_weights(spec["small_target"], big_t, placement, small_sd)
            ),
            big_t,
        )
    )
    d_sd = {
        k: v.float()
        for k, v in load_file(MODELS / name / "drafter" / "model.safetensors").items()
    }
    drafter = DFlashDrafter(spec["small_drafter"]).eval()
    drafter.load_state_dict(d_sd)
    big_drafter = DFlashDrafter(big_d).eval()
    big_drafter.load_state_dict(
        dict(
            embed.drafter_weights(
                spec["small_drafter"],
                big_d,
                spec["small_target"],
                big_t,
                placement,
                d_sd,
            )
        )
    )
    with open(MODELS / "prompts" / "heldout.jsonl") as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f]
    prompts = [p for p in prompts if len(p) >= 160][:3]
    ids_s = spec["small_drafter"]["dflash_config"]["target_layer_ids"]
    ids_b = big_d["dflash_config"]["target_layer_ids"]
    v = pc.text_config(spec["small_target"])["vocab_size"]
    for p in prompts:
        x = torch.tensor([p[:160]])
        anchors = torch.tensor([[20, 80, 140]])
        with torch.no_grad():
            ls, fs = target_forward(small, x, ids_s)
            lb, fb = target_forward(big, x, ids_b)
            ds = draft_logits(
                drafter,
                fs,
                x,
                anchors,
                small.model.embed_tokens.weight,
                small.lm_head.weight,
            )
            db = draft_logits(
                big_drafter,
                fb,
                x,
                anchors,
                big.model.embed_tokens.weight,
                big.lm_head.weight,
            )
        assert (ls - lb[..., :v]).abs().max().item() <= 1e-3
        assert (ds - db[..., :v]).abs().max().item() <= 1e-3
        assert torch.equal(ls.argmax(-1), lb.argmax(-1))
