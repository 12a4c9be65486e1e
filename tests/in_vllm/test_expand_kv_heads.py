# SPDX-License-Identifier: Apache-2.0
"""bench/expand_kv_heads.py: the copy with repeated key/value heads computes
the same logits as the original (transformers' Qwen3 on CPU, float32), so a
TP = 2 run of the copy can be compared with TP = 1 outputs of the original.

Needs transformers and safetensors (vLLM dependencies: the wheel's venv)."""

import importlib.util
import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "expand_kv_heads", os.path.join(ROOT, "bench", "expand_kv_heads.py")
)
expand = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(expand)


def _tiny_qwen3(path: str, num_kv_heads: int, attention_bias: bool = False) -> None:
    config = transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=16,
        attention_bias=attention_bias,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    # Larger than the default init so that heads differ visibly in the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        f.write("{}")


def _logits(path: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("attention_bias", [False, True])
def test_expanded_copy_computes_the_same_logits(tmp_path, attention_bias):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _tiny_qwen3(src, num_kv_heads=2, attention_bias=attention_bias)
    config = expand.expand_kv_heads(src, dst, kv_heads=4)
    assert config["num_key_value_heads"] == 4
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["num_key_value_heads"] == 4
    assert os.path.exists(os.path.join(dst, "tokenizer_config.json"))
    want, got = _logits(src), _logits(dst)
    assert want.abs().max() > 1.0  # not flat: a wrong head order would show
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_head_j_of_the_copy_is_head_j_div_repeat():
    # 3 heads of 2 rows each, repeated twice: rows of head 0, 0, 1, 1, 2, 2.
    rows = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    out = expand.repeat_kv_heads(rows, num_kv_heads=3, repeat=2)
    assert out.shape == (12, 5)
    for j in range(6):
        torch.testing.assert_close(
            out[2 * j : 2 * j + 2], rows[2 * (j // 2) : 2 * (j // 2) + 2]
        )
    bias = torch.arange(6, dtype=torch.float32)
    assert expand.repeat_kv_heads(bias, 3, 2).tolist() == [
        0,
        1,
        0,
        1,
        2,
        3,
        2,
        3,
        4,
        5,
        4,
        5,
    ]


def test_refuses_a_head_count_that_does_not_fit(tmp_path):
    src = str(tmp_path / "src")
    _tiny_qwen3(src, num_kv_heads=2)
    with pytest.raises(ValueError, match="must be a multiple"):
        expand.expand_kv_heads(src, str(tmp_path / "a"), kv_heads=3)
    with pytest.raises(ValueError, match="must be a multiple"):
        expand.expand_kv_heads(src, str(tmp_path / "b"), kv_heads=8)
