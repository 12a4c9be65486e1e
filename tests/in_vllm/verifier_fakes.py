# SPDX-License-Identifier: Apache-2.0
"""Fakes shared by the verifier tests (test_ddtree_runner.py,
test_ddtree_hybrid_runner.py): the dense benchmark pair's paths, a
DDTreeVerifier on a minimal config, a stored 4-node tree, an argmax sampler."""

from types import SimpleNamespace

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
