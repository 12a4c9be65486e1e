# SPDX-License-Identifier: Apache-2.0
"""The V2 runner's kernel warmup under a dynamic speculative-decoding schedule
(the `v2-warmup-...` patch of each line): upstream's own warmup, driven with
a runner that records the scheduler outputs it is given, drafts for each
decode batch as many tokens as the schedule gives its size and verifies no
more than a request holds, as the scheduler does, so no warmup step verifies
more rows than DDTree's Gated DeltaNet buffers hold
(`policy.max_spec_rows_per_step`) or a draft slot the runner marked invalid.
Without a schedule every spec-decode request keeps the full draft count. The
0.34.0 line's warmup decodes several batch sizes and schedules the drafts of
each step; the 0.26.0 line's decodes the full batch once."""

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.spec_decode.ddtree.policy import max_spec_rows_per_step  # noqa: E402
from vllm.v1.spec_decode.dynamic.utils import (  # noqa: E402
    build_dynamic_sd_schedule_lookup,
)
from vllm.v1.worker.gpu import warmup  # noqa: E402

MAX_NUM_SEQS = 64
MAX_NUM_TOKENS = 16384
TREE_BUDGET = 64
# DDTree's "batch" policy on the hybrid pair: 64 nodes alone, 32 for 2-3
# requests, 15 from 4.
SCHEDULE = [(1, 1, 64), (2, 3, 32), (4, MAX_NUM_SEQS, 15)]
BLOCK_SIZE = 16
# 0.34.0: `_warmup_kernels` decodes several batch sizes, each step carrying
# its draft count; 0.26.0: `warmup_kernels` decodes the full batch once.
SEVERAL_DECODE_STEPS = hasattr(warmup, "_warmup_kernels")


def _runner(schedule: list[tuple[int, int, int]] | None) -> SimpleNamespace:
    spec = SimpleNamespace(
        num_speculative_tokens_per_batch_size=schedule,
        max_num_new_slots_for_drafting=0,
    )
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BLOCK_SIZE))
    return SimpleNamespace(
        vllm_config=SimpleNamespace(is_mm_encoder_only=False),
        num_speculative_steps=TREE_BUDGET,
        decode_query_len=1 + TREE_BUDGET,
        speculative_config=spec,
        scheduler_config=SimpleNamespace(
            max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_TOKENS
        ),
        max_num_tokens=MAX_NUM_TOKENS,
        is_pooling_model=False,
        is_encoder_decoder=False,
        is_last_pp_rank=False,
        model_state=SimpleNamespace(),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[group], num_blocks=10**6),
        extensible_kv_cache=None,
        kv_block_zeroer=None,
        kv_connector=SimpleNamespace(set_disabled=lambda disabled: None),
        speculator=SimpleNamespace(reset_state=lambda: None),
    )


def _run_warmup(monkeypatch: pytest.MonkeyPatch, schedule) -> list:
    """The scheduler outputs upstream's warmup gives the runner, in order."""
    if SEVERAL_DECODE_STEPS:
        monkeypatch.setattr(
            warmup,
            "_warmup_block_counter",
            lambda runner: lambda n, spec: -(-n // spec.block_size),
        )
    # No device to wait for.
    monkeypatch.setattr(warmup.torch.accelerator, "synchronize", lambda: None)
    outputs = []
    run = warmup._warmup_kernels if SEVERAL_DECODE_STEPS else warmup.warmup_kernels
    run(_runner(schedule), outputs.append, lambda grammar_output: None)
    return outputs


def _decode_steps(outputs: list) -> list:
    return [o for o in outputs if o.scheduled_cached_reqs.req_ids]


def test_warmup_decodes_follow_the_schedule(monkeypatch: pytest.MonkeyPatch):
    outputs = _run_warmup(monkeypatch, SCHEDULE)
    lookup = build_dynamic_sd_schedule_lookup(SCHEDULE, MAX_NUM_SEQS, TREE_BUDGET)
    prefill = outputs[0]
    num_reqs = len(prefill.scheduled_new_reqs)
    assert num_reqs == MAX_NUM_SEQS
    decodes = _decode_steps(outputs)
    sizes = [len(o.num_scheduled_tokens) for o in decodes]
    assert sizes[0] == MAX_NUM_SEQS
    max_rows = max_spec_rows_per_step(MAX_NUM_TOKENS, lookup[1:])
    # The draft tokens each request holds, as the scheduler tracks them: what
    # the last step it ran in scheduled (0.26.0's prefill schedules none and
    # its drafter drafts the most).
    held = dict.fromkeys(
        prefill.num_scheduled_tokens,
        prefill.num_spec_tokens_to_schedule or TREE_BUDGET,
    )
    spec_sizes = set()
    verified = set()
    for o in decodes:
        size = len(o.num_scheduled_tokens)
        if SEVERAL_DECODE_STEPS:
            assert o.num_spec_tokens_to_schedule == lookup[size]
        rows = 0
        for req_id, drafts in o.scheduled_spec_decode_tokens.items():
            k = len(drafts)
            # 0.34.0: what the request holds, as the scheduler verifies (the
            # runner marks the rest of its draft slots invalid); 0.26.0: what
            # the schedule gives the batch, of the most it holds.
            expected = held[req_id] if SEVERAL_DECODE_STEPS else lookup[size]
            assert k == expected <= held[req_id]
            assert o.num_scheduled_tokens[req_id] == 1 + k
            rows += 1 + k
            spec_sizes.add(size)
            verified.add((size, k))
        assert rows <= max_rows
        if SEVERAL_DECODE_STEPS:
            for req_id in o.num_scheduled_tokens:
                held[req_id] = o.num_spec_tokens_to_schedule
    assert MAX_NUM_SEQS in spec_sizes
    if not SEVERAL_DECODE_STEPS:
        return
    assert prefill.num_spec_tokens_to_schedule == lookup[num_reqs] == 15
    assert 1 in sizes and 2 in sizes
    # The full batch and the single request both verify what the schedule
    # gives them: the widest shapes of both ends of the schedule are warmed.
    assert {(1, lookup[1]), (MAX_NUM_SEQS, lookup[MAX_NUM_SEQS])} <= verified
    # Computed tokens follow what each step scheduled.
    first, second = decodes[0], decodes[1]
    req0 = first.scheduled_cached_reqs.req_ids[0]
    i = second.scheduled_cached_reqs.req_ids.index(req0)
    assert (
        second.scheduled_cached_reqs.num_computed_tokens[i]
        == first.scheduled_cached_reqs.num_computed_tokens[0]
        + first.num_scheduled_tokens[req0]
    )


def test_warmup_without_a_schedule_drafts_the_most(monkeypatch: pytest.MonkeyPatch):
    outputs = _run_warmup(monkeypatch, None)
    decodes = _decode_steps(outputs)
    full = decodes[0]
    assert len(full.scheduled_spec_decode_tokens) == MAX_NUM_SEQS
    for o in decodes:
        if SEVERAL_DECODE_STEPS:
            assert o.num_spec_tokens_to_schedule == TREE_BUDGET
        for req_id, drafts in o.scheduled_spec_decode_tokens.items():
            assert len(drafts) == TREE_BUDGET
            assert o.num_scheduled_tokens[req_id] == 1 + TREE_BUDGET
