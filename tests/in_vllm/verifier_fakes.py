# SPDX-License-Identifier: Apache-2.0
"""Fakes shared by the verifier tests (test_ddtree_runner.py,
test_ddtree_hybrid_runner.py and the 0.34.0 line's test_ddtree_runner_v034.py,
test_ddtree_hybrid_runner_v034.py): the dense benchmark pair's paths, a
DDTreeVerifier on a minimal config, a stored 4-node tree, a step's batch that
verifies it next to a prefill chunk, that step's KV cache and hidden states,
an argmax sampler."""

from types import SimpleNamespace

import numpy as np
import pytest
import repo_paths
import torch

TARGET = str(repo_paths.TARGET)
DRAFTER = str(repo_paths.DRAFTER)


def _speculator_verifies() -> bool:
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    return hasattr(BaseSpeculator, "prepare_verify")


def _patched_speculative_config() -> bool:
    from vllm.config import SpeculativeConfig

    return hasattr(SpeculativeConfig, "use_ddtree")


# Tests of one release line's interfaces. The 0.26.0 line's patched
# SpeculativeConfig takes method "ddtree" and DDTree's options as fields (the
# 0.34.0 line's config class: test_ddtree_plugin.py), and its patched runner
# holds the verifier; the 0.34.0 line's runner asks its speculator instead
# (test_ddtree_runner_v034.py).
needs_patched_speculative_config = pytest.mark.skipif(
    not _patched_speculative_config(),
    reason="the 0.26.0 line's patched SpeculativeConfig",
)
needs_runner_holding_the_verifier = pytest.mark.skipif(
    _speculator_verifies(),
    reason="the 0.26.0 line's runner holds the verifier",
)


def skip_module_without_speculator_hooks():
    """Skip the calling test module where the runner has no speculator
    verifier hooks (before it imports speculator_fakes)."""
    if not _speculator_verifies():
        pytest.skip(
            "the V2 runner has no speculator verifier hooks (the 0.26.0 line)",
            allow_module_level=True,
        )


B, D = 4, 3
# Request state 2 in most tests: root -> 1 -> 3, root -> 2, 1 -> 4
# (depths 1, 1, 2, 2).
PARENT = [0, 0, 1, 1]
DEPTH = [1, 1, 2, 2]
TOKENS = [11, 12, 13, 14]


def make_spec(model_config, **kw):
    """A real SpeculativeConfig for ``model_config`` (kw: method, model, ...)."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    return SpeculativeConfig(
        **kw,
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
    )


def make_verifier(device="cpu", max_reqs=4, max_tokens=64):
    from vllm.v1.worker.gpu.spec_decode.ddtree.verifier import DDTreeVerifier

    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(
            use_ddtree=lambda: True, tree_budget=B, draft_depth=D
        ),
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_reqs, max_num_batched_tokens=max_tokens
        ),
        # Async scheduling without pipeline parallelism (VllmConfig's).
        max_concurrent_batches=2,
    )
    return DDTreeVerifier(cfg, torch.device(device))


def store_trees(verifier, req_states, trees, device="cpu"):
    """Store ``trees`` (parent, depth, tokens) for ``req_states`` as the
    runner does after a DFlash pass; returns the per-request draft tokens
    [4, B] (the runner's ``req_states.draft_tokens``, which store_trees
    writes) that the verifier's sample() takes."""
    spec = SimpleNamespace(
        tree_parent_idx=torch.tensor([t[0] for t in trees], device=device),
        tree_depth=torch.tensor([t[1] for t in trees], device=device),
        tree_valid=torch.ones(len(trees), B, dtype=torch.bool, device=device),
        draft_tokens=torch.tensor([t[2] for t in trees], device=device),
    )
    draft_tokens = torch.zeros(4, B, dtype=torch.int64, device=device)
    verifier.store_trees(
        torch.tensor(req_states, dtype=torch.int32, device=device),
        spec,
        draft_tokens,
    )
    return draft_tokens


def prefill_and_tree_batch(device="cpu"):
    """Batch row 0: a prefill chunk of 3 tokens (request state 0); batch row
    1: tree verification of request state 2 (root + 4 nodes) at positions
    20..24; 2 padding tokens. The fields of the V2 runner's input batch that
    the verifier, the runner's `sample` and the GDN tree path read."""
    positions = torch.tensor([0, 1, 2, 20, 21, 22, 23, 24, 0, 0], dtype=torch.int64)
    batch = SimpleNamespace(
        num_reqs=2,
        num_tokens=8,
        num_tokens_after_padding=10,
        num_draft_tokens=B,
        positions=positions,
        input_ids=torch.arange(10, dtype=torch.int64),
        logits_indices=torch.tensor([2, 3, 4, 5, 6, 7]),
        expanded_idx_mapping=torch.tensor([0, 2, 2, 2, 2, 2], dtype=torch.int32),
        expanded_local_pos=torch.tensor([0, 0, 1, 2, 3, 4], dtype=torch.int32),
        idx_mapping=torch.tensor([0, 2], dtype=torch.int32),
        idx_mapping_np=np.array([0, 2], dtype=np.int32),
        cu_num_logits=torch.tensor([0, 1, 6], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 8], dtype=torch.int32),
        seq_lens=torch.tensor([3, 25], dtype=torch.int32),
        num_draft_tokens_per_req=np.array([0, B], dtype=np.int32),
        num_scheduled_tokens=np.array([3, 1 + B], dtype=np.int32),
    )
    on_device(batch, device)
    # vLLM 0.33+: the sampler's per-request sequence-length bound, a host
    # tensor.
    batch.seq_lens_cpu_upper_bound = torch.tensor([3, 25], dtype=torch.int32)
    return batch


def on_device(batch, device):
    """``batch`` with its tensors moved to ``device``."""
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(batch, name, value.to(device))
    return batch


def prefill_and_tree_step_state():
    """What compaction moves in prefill_and_tree_batch()'s step: hidden
    states (row = token index * 10), one layer's KV cache (one block of 16
    slots per request; each slot holds its token index) and the step's slot
    mapping (token i at slot i for the prefill, 20 * 16 + 4 + (i - 3) for the
    tree, -1 for padding). Returns (hidden, kv_cache, slots)."""
    hidden = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 2) * 10
    slots = torch.tensor([0, 1, 2] + [20 * 16 + 4 + i for i in range(5)] + [-1, -1])
    kv_cache = torch.zeros(32, 1, 16, 2)
    for tok in range(8):
        s = int(slots[tok])
        kv_cache[s // 16, 0, s % 16] = float(tok)
    return hidden, kv_cache, slots


def tree_penalties(vocab=32, device="cpu"):
    """The verifier's real TreePenaltiesState for 4 request states, no
    penalties set (tests/in_vllm/conftest.py makes its buffers CPU tensors)."""
    from vllm.v1.worker.gpu.spec_decode.ddtree.sampling import (
        PENALTIES_ARE_LOGITS_PROCESSOR,
        TreePenaltiesState,
    )

    req_states = SimpleNamespace(
        max_num_reqs=4, vocab_size=vocab, device=torch.device(device)
    )
    if PENALTIES_ARE_LOGITS_PROCESSOR:
        # vLLM 0.33+: (vllm_config, req_states); the state reads no config.
        return TreePenaltiesState(None, req_states)
    return TreePenaltiesState(req_states)


class ArgmaxSampler:
    def __init__(self):
        self.penalties_state = tree_penalties()

    def returns_logprobs(self, idx_mapping_np):  # vLLM 0.26
        return False

    def get_logprobs_dims(self, idx_mapping_np):  # vLLM 0.33+
        return None

    def sample(self, logits, *args, **kwargs):
        return logits.argmax(dim=-1), logits


def logits_for(targets, vocab=32, device="cpu"):
    """Logit rows whose argmax is each of ``targets``."""
    logits = torch.zeros(len(targets), vocab)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 1.0
    return logits.to(device)
