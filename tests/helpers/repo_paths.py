# SPDX-License-Identifier: Apache-2.0
"""The checkout's parts that tests read as files (modules are imported through
the ``pythonpath`` of pytest.ini and tests/in_vllm/pytest.ini)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
OVERLAY = REPO_ROOT / "overlay"
BENCH = REPO_ROOT / "bench"
BENCH_RESULTS = BENCH / "results"
TEST_HELPERS = REPO_ROOT / "tests" / "helpers"

# The dense benchmark pair (bench/pairs): a small trained Qwen3 target and its
# DFlash drafter, committed with the tokenizer and prompts they were trained
# and measured on.
PAIR_MODELS = BENCH / "pairs" / "models"
TARGET = PAIR_MODELS / "dense-8b" / "target"
DRAFTER = PAIR_MODELS / "dense-8b" / "drafter"
HELDOUT_PROMPTS = PAIR_MODELS / "prompts" / "heldout.jsonl"
