# SPDX-License-Identifier: Apache-2.0
"""The benchmark runs' reference scores (bench/pairs/run_pairs.py
`score_outputs`): the no-speculation engine scores its own greedy outputs in
one pass over prompt + output but its last token, and each output token gets
the top-2 logprob gap of the distribution it was chosen from, with vLLM's own
logprob containers (flat or per-position dicts) and request parameters."""

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from bench.pairs import run_pairs  # noqa: E402
from vllm.logprobs import (  # noqa: E402
    append_logprobs_for_next_position,
    create_prompt_logprobs,
    create_sample_logprobs,
)


def gap_at(index: int) -> float:
    """The test model's top-2 gap at sequence position ``index``."""
    return 0.001 * index


def distribution(index: int, token: int, container) -> None:
    """Appends the position ``index`` distribution as vLLM does: the
    position's own token (rank 3 unless it is one of the top two), then the
    top two, 7 and 8."""
    rank = {7: 1, 8: 2}.get(token, 3)
    append_logprobs_for_next_position(
        container,
        [token, 7, 8],
        [-5.0 if rank == 3 else -gap_at(index) * (rank - 1), 0.0, -gap_at(index)],
        [None] * 3,
        rank,
        2,
    )


class ScoringLLM:
    """An engine that answers `generate` as vLLM's does for prompt_logprobs=2
    and logprobs=2 with max_tokens=1, from the test model's gaps."""

    def __init__(self, flat: bool):
        self.flat = flat
        self.calls = []

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append((prompts, params))
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            prompt_lp = create_prompt_logprobs(self.flat)
            for index in range(1, len(ids)):
                distribution(index, ids[index], prompt_lp)
            sample_lp = create_sample_logprobs(self.flat)
            distribution(len(ids), 7, sample_lp)
            outs.append(
                SimpleNamespace(
                    prompt_token_ids=ids,
                    prompt_logprobs=prompt_lp,
                    outputs=[SimpleNamespace(token_ids=[7], logprobs=sample_lp)],
                )
            )
        return outs


@pytest.mark.parametrize("flat", [False, True])
def test_each_output_token_gets_the_gap_it_was_chosen_at(flat):
    prompts = [[1, 2, 3], [4, 5], [6, 6, 6, 6]]
    outputs = [[9, 7, 8, 9], [], [7]]
    llm = ScoringLLM(flat)
    gaps = run_pairs.score_outputs(llm, prompts, outputs)
    # Output token j of a prompt of n tokens sits at position n + j.
    assert gaps == [
        [round(gap_at(3 + j), 5) for j in range(4)],
        [],
        [round(gap_at(4), 5)],
    ]
    ((sent, params),) = llm.calls
    # An empty output is not sent; each sequence drops its last token, so the
    # pass is never longer than the decode was.
    assert [p["prompt_token_ids"] for p in sent] == [[1, 2, 3, 9, 7, 8], [6, 6, 6, 6]]
    assert params.max_tokens == 1 and params.prompt_logprobs == params.logprobs == 2
    assert params.temperature == 0.0
