# SPDX-License-Identifier: Apache-2.0
"""Fakes shared by the tests of DDTree's speculator on the vLLM 0.34.0 line
(test_ddtree_runner_v034.py, test_ddtree_hybrid_runner_v034.py): a
DDTreeSpeculator holding the stored tree of verifier_fakes, the DFlash
drafter's passes it wraps, TRITON_ATTN metadata builders, and the runner's
own `sample` with the speculator's tree walk. Import it only where the
runner has the speculator verifier hooks."""

from types import SimpleNamespace

import torch
from verifier_fakes import (
    DEPTH,
    PARENT,
    TOKENS,
    ArgmaxSampler,
    B,
    make_verifier,
    store_trees,
)

from vllm.v1.attention.backends import triton_attn
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.spec_decode.ddtree.speculator import (
    DDTreeSpeculator,
    TreeWalkSampler,
)
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

TARGET_LAYER = "model.layers.0.self_attn.attn"
DRAFT_LAYER = "draft.layers.0.self_attn.attn"
# The drafter's next tree for request state 2: root -> 1 -> 2 -> 3, root -> 4.
NEXT_PARENT = [0, 1, 2, 0]
NEXT_DEPTH = [1, 2, 3, 1]
NEXT_TOKENS = [21, 22, 23, 24]


def make_speculator():
    """A DDTreeSpeculator with DDTree's own state only (the DFlash drafter's
    model and buffers are not built: the DFlash pass is replaced where a
    test runs it), its verifier on the shared fakes' sizes, and the runner's
    request states; request state 2 holds the 4-node tree of the fakes."""
    speculator = object.__new__(DDTreeSpeculator)
    speculator.verifier = make_verifier()
    speculator.req_states = SimpleNamespace(
        draft_tokens=store_trees(speculator.verifier, [2], [(PARENT, DEPTH, TOKENS)]),
        prefill_len=SimpleNamespace(gpu=torch.tensor([3, 0, 10, 0], dtype=torch.int32)),
    )
    speculator.draft_attn_layer_names = {DRAFT_LAYER}
    speculator.target_kv_caches_bound = False
    speculator.dflash_input_blocks_compiled = True
    speculator.draft_next_step = True
    speculator.tree_parent_idx = torch.zeros(4, B, dtype=torch.int64)
    speculator.tree_depth = torch.zeros(4, B, dtype=torch.int64)
    speculator.tree_valid = torch.zeros(4, B, dtype=torch.bool)
    speculator.draft_tokens = torch.zeros(4, B, dtype=torch.int64)
    return speculator


def attn_group(builder, spec=None, backend="TRITON_ATTN", layers=(TARGET_LAYER,)):
    """An attention group as `init_attn_backend` makes it: its metadata
    builders (one per micro-batch), KV-cache spec, backend and layers."""
    return SimpleNamespace(
        metadata_builders=[builder],
        kv_cache_spec=spec,
        backend=SimpleNamespace(get_name=lambda: backend),
        layer_names=list(layers),
    )


def fake_dflash_set_attn(monkeypatch, draft_builder):
    """DFlash's own set_attn, replaced: it records its arguments and gives
    the drafter one attention group of ``draft_builder`` (its own builders,
    which DDTree must leave unhooked whatever layers they name). Returns the
    calls."""
    calls = []

    def dflash_set_attn(self, *args):
        calls.append(args)
        self.attn_groups = [[attn_group(draft_builder)]]

    monkeypatch.setattr(DFlashSpeculator, "set_attn", dflash_set_attn)
    return calls


def fake_dflash_propose(monkeypatch, next_tree_row=None):
    """DFlash's own pass, replaced: it records its keyword arguments and,
    given ``next_tree_row``, drafts the NEXT_* tree in that batch row.
    Returns the calls."""
    calls = []

    def dflash_propose(self, input_batch, *args, **kwargs):
        calls.append(kwargs)
        if next_tree_row is not None:
            self.tree_parent_idx[next_tree_row] = torch.tensor(NEXT_PARENT)
            self.tree_depth[next_tree_row] = torch.tensor(NEXT_DEPTH)
            self.tree_valid[next_tree_row] = True
            self.draft_tokens[next_tree_row] = torch.tensor(NEXT_TOKENS)
        return self.draft_tokens[: input_batch.num_reqs]

    monkeypatch.setattr(DFlashSpeculator, "propose", dflash_propose)
    return calls


def triton_builder():
    """TRITON_ATTN's metadata builder with what its `build` reads (its
    __init__ needs a whole engine config)."""
    builder = object.__new__(triton_attn.TritonAttentionMetadataBuilder)
    scratch = torch.zeros(1)
    builder.seq_threshold_3D = 1
    builder.num_par_softmax_segments = 16
    builder.softmax_segm_output = builder.softmax_segm_max = scratch
    builder.softmax_segm_expsum = scratch
    builder.max_seqs_64_segments = 0
    builder.rswa_window = None
    builder.tree_split = None
    builder.metadata_hook = None
    return builder


def common_metadata(query_lens, seq_lens):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros(len(query_lens), 4, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
    )


def sample_through_the_runner(speculator, hidden_states, batch):
    """The runner's own `sample` with the speculator's tree walk as its
    rejection sampler, an argmax sampler, and the hidden states as logits.
    Returns (sampler output, num_sampled, num_rejected)."""
    sampler = ArgmaxSampler()
    runner = SimpleNamespace(
        batch_sharder=None,
        model_state=SimpleNamespace(compute_sample_logits=lambda h: h),
        structured_outputs_worker=None,
        sampler=sampler,
        rejection_sampler=TreeWalkSampler(
            speculator.verifier, sampler, speculator.req_states
        ),
        speculator=SimpleNamespace(draft_logits=None),
    )
    return GPUModelRunner.sample(runner, hidden_states, batch, None)


def propose_after_the_walk(
    speculator,
    batch,
    attn_metadata,
    slot_mappings,
    hidden_states,
    aux_hidden_states,
    num_sampled,
    num_rejected,
    **kwargs,
):
    """The runner's propose call after a step's walk, with B speculative
    tokens and the sampler's other per-request-state inputs (last sampled
    tokens, next prefill tokens, temperatures, seeds) as zeros."""
    return speculator.propose(
        batch,
        attn_metadata,
        slot_mappings,
        hidden_states,
        aux_hidden_states,
        num_sampled,
        num_rejected,
        torch.zeros(4, dtype=torch.int64),
        torch.zeros(1, 4, dtype=torch.int64),
        torch.zeros(4),
        torch.zeros(4, dtype=torch.int64),
        num_speculative_tokens=B,
        **kwargs,
    )
