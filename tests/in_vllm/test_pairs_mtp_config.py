# SPDX-License-Identifier: Apache-2.0
"""The benchmark pairs' ``mtp`` method (bench/pairs/run_pairs.py): its
speculative_config, with the hybrid pair's production-target config (the
Qwen3.6-27B shape), is vLLM's Qwen3.5 MTP draft model over the target's own
checkpoint, one MTP layer run ``num_speculative_tokens`` times."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from repo_paths import BENCH
from verifier_fakes import make_spec  # noqa: E402

from bench.pairs import mtp  # noqa: E402

PAIRS = BENCH / "pairs"


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_method_is_qwen3_5_mtp_over_the_target(k):
    from vllm.config import ModelConfig

    target = ModelConfig(
        model=str(PAIRS / "models" / "hybrid-27b" / "production-target"),
        dtype="bfloat16",
        max_model_len=1024,
        skip_tokenizer_init=True,
        limit_mm_per_prompt={"image": 0, "video": 0},
    )
    spec = make_spec(target, **mtp.speculative_config(k))
    assert spec.method == "mtp"
    assert spec.num_speculative_tokens == k
    draft = spec.draft_model_config
    assert draft.model == target.model  # the target's own checkpoint
    assert draft.hf_config.architectures == ["Qwen3_5MTP"]
    assert draft.hf_text_config.mtp_num_hidden_layers == 1
    assert draft.hf_text_config.hidden_size == 5120
