# SPDX-License-Identifier: Apache-2.0
"""DDTree's tree verification through the V2 runner's speculator hooks (the
vLLM 0.34.0 line): the runner takes the speculator's own rejection sampler
(`BaseSpeculator.custom_sampler`), lets it prepare the verify inputs before
the target forward (`BaseSpeculator.prepare_verify`), and the target's
TRITON_ATTN metadata builders call a hook with every metadata they build
(`TritonAttentionMetadataBuilder.metadata_hook`). DDTreeSpeculator fills them with
its verifier; the tests drive one tree step through the runner's own
`sample` and the speculator's hooks in the runner's order, and check that
the runner calls each hook where the step needs it. Skipped where the
runner has no such hooks (the 0.26.0 line, whose patched runner holds the
verifier itself: tests/in_vllm/test_ddtree_runner.py)."""

import ast
import inspect
import textwrap
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from engine_on_cpu import run_on_cpu  # noqa: E402
from verifier_fakes import (  # noqa: E402
    DRAFTER,
    TARGET,
    B,
    logits_for,
    prefill_and_tree_batch,
    prefill_and_tree_step_state,
    skip_module_without_speculator_hooks,
)

skip_module_without_speculator_hooks()

from speculator_fakes import (  # noqa: E402
    DRAFT_LAYER,
    NEXT_DEPTH,
    NEXT_PARENT,
    NEXT_TOKENS,
    TARGET_LAYER,
    attn_group,
    common_metadata,
    fake_dflash_propose,
    fake_dflash_set_attn,
    make_speculator,
    propose_after_the_walk,
    sample_through_the_runner,
    triton_builder,
)

from vllm.v1.attention.backends import triton_attn  # noqa: E402
from vllm.v1.worker.gpu.model_runner import GPUModelRunner  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.ddtree.sampling import (  # noqa: E402
    TreePenaltiesState,
)
from vllm.v1.worker.gpu.spec_decode.ddtree.speculator import (  # noqa: E402
    TreeWalkSampler,
)


def _runner_calls(method, name):
    """The calls of ``name`` in the runner method ``method``, its source and
    its syntax tree."""
    source = textwrap.dedent(inspect.getsource(method))
    tree = ast.parse(source)
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == name
    ]
    return calls, source, tree


def test_the_runner_takes_the_speculators_sampler_when_the_model_state_has_none():
    """load_model asks the speculator once the target's model state supplied
    no custom sampler, and installs what it returns as (sampler,
    rejection_sampler)."""
    calls, source, tree = _runner_calls(
        GPUModelRunner.load_model, "self.speculator.custom_sampler"
    )
    assert [ast.unparse(c) for c in calls] == [
        "self.speculator.custom_sampler(self.sampler)"
    ]
    (assign,) = [
        n for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.value is calls[0]
    ]
    assert [ast.unparse(t) for t in assign.targets] == ["custom"]
    assert "self.sampler, self.rejection_sampler = custom" in source


def test_custom_sampler_binds_tree_penalties_and_returns_the_walk():
    from vllm.v1.worker.gpu.spec_decode.ddtree.sampling import (
        PENALTIES_ARE_LOGITS_PROCESSOR,
    )

    speculator = make_speculator()
    penalties = SimpleNamespace(
        req_states=SimpleNamespace(max_num_reqs=4, vocab_size=32, device="cpu")
    )
    sampler = SimpleNamespace(
        penalties_state=penalties, logits_processors=["other", penalties]
    )
    sampler.req_states = penalties.req_states
    sampler_out, walk = speculator.custom_sampler(sampler)
    assert sampler_out is sampler
    assert isinstance(walk, TreeWalkSampler) and walk.verifier is speculator.verifier
    assert isinstance(sampler.penalties_state, TreePenaltiesState)
    if PENALTIES_ARE_LOGITS_PROCESSOR:
        assert sampler.logits_processors == ["other", sampler.penalties_state]
    # Without a verifier (the 0.26.0 line's runner verifies), no sampler.
    speculator.verifier = None
    assert speculator.custom_sampler(sampler) is None


def test_set_attn_hooks_the_target_builders_and_refuses_one_without_the_hook(
    monkeypatch,
):
    """set_attn sets the metadata hook of every target builder that has one
    (the drafter's own builders, which the base class makes, keep theirs
    unset), leaves linear-attention (mamba) groups to the GDN path, and
    refuses a target attention group whose backend has no hook; the
    runner's groups of drafter layers only, whatever their backend, are
    skipped."""
    from vllm.v1.kv_cache_interface import MambaSpec

    draft_builder = SimpleNamespace(metadata_hook=None)
    calls = fake_dflash_set_attn(monkeypatch, draft_builder)
    speculator = make_speculator()
    speculator.target_kv_caches_bound = True
    target_builders = [SimpleNamespace(metadata_hook=None) for _ in range(2)]
    mamba = attn_group(SimpleNamespace(), object.__new__(MambaSpec), "GDN_ATTN")
    runner_draft_builder = SimpleNamespace(metadata_hook=None)
    runner_draft = attn_group(runner_draft_builder, None, "FLASH_ATTN", [DRAFT_LAYER])
    groups = [
        [attn_group(target_builders[0]), runner_draft],
        [mamba],
        [attn_group(target_builders[1])],
    ]
    speculator.set_attn("state", "kv_cache_config", "block_tables", "bufs", groups)
    assert calls == [("state", "kv_cache_config", "block_tables", "bufs", groups)]
    for builder in target_builders:
        assert builder.metadata_hook.func == speculator.verifier.attach_bias_to
        assert builder.metadata_hook.keywords == {"builder": builder}
    assert draft_builder.metadata_hook is None
    assert runner_draft_builder.metadata_hook is None
    # New KV caches follow every set_attn: bound again at the next propose.
    assert not speculator.target_kv_caches_bound
    other = [[attn_group(SimpleNamespace(), backend="FLASH_ATTN")]]
    with pytest.raises(ValueError, match="TRITON_ATTN.*FLASH_ATTN"):
        speculator.set_attn("state", "kv_cache_config", "b", "i", other)


def test_the_builder_calls_the_hook_with_every_metadata_it_builds():
    """TritonAttentionMetadataBuilder.build (steps, and the captures, which
    build through it) hands its metadata to the hook before returning it;
    unset, upstream's behaviour."""
    builder = triton_builder()
    seen = []
    builder.metadata_hook = seen.append
    out = builder.build(0, common_metadata([3, 5], [3, 25]))
    capture = builder.build_for_cudagraph_capture(common_metadata([5, 5], [5, 5]))
    assert seen == [out, capture]
    assert isinstance(out, triton_attn.TritonAttentionMetadata)
    builder.metadata_hook = None
    builder.build(0, common_metadata([1], [4]))
    assert len(seen) == 2


def test_the_runner_prepares_the_verify_inputs_before_the_target_forward():
    """execute_model calls prepare_verify on real steps only, with the
    model's own positions, once the model inputs are built."""
    calls, _, tree = _runner_calls(
        GPUModelRunner.execute_model, "self.speculator.prepare_verify"
    )
    assert [ast.unparse(c) for c in calls] == [
        "self.speculator.prepare_verify(input_batch, model_inputs['positions'])"
    ]
    (branch,) = [
        n for n in ast.walk(tree) if isinstance(n, ast.If) and calls[0] in ast.walk(n)
    ]
    assert ast.unparse(branch.test) == (
        "self.speculator is not None and (not dummy_run)"
    )
    (inputs,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and [ast.unparse(t) for t in n.targets] == ["model_inputs"]
    ]
    # Every way the target runs: a FULL graph, a piecewise graph, eager.
    forwards = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and ast.unparse(n.func)
        in (
            "self.cudagraph_manager.run_fullgraph",
            "self.cudagraph_manager.run_pw_graph",
            "self.model",
        )
    ]
    assert len(forwards) == 3
    assert inputs.lineno < calls[0].lineno < min(forwards)


def test_a_tree_step_through_the_runners_hooks(monkeypatch):
    """One step in the runner's order: the target metadata gets the tree
    bias (the drafter's does not), prepare_verify writes tree positions, the
    runner's own `sample` walks the tree through the speculator's sampler,
    and propose compacts the accepted path's KV and hidden states before the
    DFlash pass and stores the new tree per request after it."""
    speculator = make_speculator()
    verifier = speculator.verifier
    hidden, kv_cache, slots = prefill_and_tree_step_state()
    draft_kv = torch.full((4, 1, 16, 2), -1.0)
    speculator.vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            static_forward_context={
                TARGET_LAYER: SimpleNamespace(kv_cache=kv_cache),
                DRAFT_LAYER: SimpleNamespace(kv_cache=draft_kv),
                "model.layers.0.mlp": SimpleNamespace(),
            }
        )
    )
    speculator.kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=[TARGET_LAYER, DRAFT_LAYER])]
    )

    # The builders' hook: the target's metadata gets the tree bias; the
    # drafter's builders (its own) have no hook.
    target_builder, draft_builder = triton_builder(), triton_builder()
    fake_dflash_set_attn(monkeypatch, draft_builder)
    speculator.set_attn(None, None, None, None, [[attn_group(target_builder)]])
    target_meta = target_builder.build(0, common_metadata([3, 5], [3, 25]))
    draft_meta = draft_builder.build(0, common_metadata([3, 5], [3, 25]))
    assert target_meta.tree_attn_bias is verifier.attn_bias
    assert draft_meta.tree_attn_bias is None

    # Before the target forward: tree positions (root 20, nodes 20 + depth).
    batch = prefill_and_tree_batch()
    speculator.prepare_verify(batch, batch.positions)
    assert batch.positions.tolist() == [0, 1, 2, 20, 21, 21, 22, 22, 0, 0]

    # The runner's own sample(): the target says 5 on the prefill row; 11 at
    # the root (node 1), 14 at node 1 (node 4), 9 at node 4 (bonus).
    hidden_states = torch.zeros(10, 32)
    hidden_states[batch.logits_indices] = logits_for([5, 11, 14, 30, 30, 9])
    out, num_sampled, num_rejected = sample_through_the_runner(
        speculator, hidden_states, batch
    )
    assert num_sampled.tolist() == [1, 3]
    assert num_rejected.tolist() == [0, 2]
    assert out.sampled_token_ids[1, :3].tolist() == [11, 14, 9]
    # Sequential positions are back after the walk.
    assert batch.positions.tolist() == [0, 1, 2, 20, 21, 22, 23, 24, 0, 0]

    # propose: compaction, then the DFlash pass (its new tree in the batch
    # rows), then the tree store.
    dflash_calls = fake_dflash_propose(monkeypatch, next_tree_row=1)
    draft_tokens = propose_after_the_walk(
        speculator,
        batch,
        {},
        {TARGET_LAYER: slots, DRAFT_LAYER: slots},
        hidden,
        [hidden],
        num_sampled,
        num_rejected,
    )
    assert dflash_calls == [{"dummy_run": False, "num_speculative_tokens": B}]
    assert speculator.target_kv_caches_bound
    # Accepted path root(3) -> node1(4) -> node4(7): rows 3, 4, 5 hold 3, 4, 7
    # in the hidden states and in the target's KV cache; the drafter's KV is
    # not the target's.
    assert hidden[:, 0].tolist() == [0, 10, 20, 30, 40, 70, 60, 70, 80, 90]
    got = [float(kv_cache[int(s) // 16, 0, int(s) % 16, 0]) for s in slots[:8]]
    assert got == [0, 1, 2, 3, 4, 7, 6, 7]
    assert torch.all(draft_kv == -1)
    # The new tree per request state: the runner's draft tokens and the
    # verifier's parents and depths (what the next step's walk reads).
    assert draft_tokens[1].tolist() == NEXT_TOKENS
    assert speculator.req_states.draft_tokens[2].tolist() == NEXT_TOKENS
    assert verifier.req_parent_idx[2].tolist() == NEXT_PARENT
    assert verifier.req_depth[2, 1:].tolist() == NEXT_DEPTH


def test_dummy_runs_neither_compact_nor_store_trees(monkeypatch):
    speculator = make_speculator()
    before = speculator.req_states.draft_tokens.clone()
    fake_dflash_propose(monkeypatch)
    speculator.draft_tokens.fill_(99)
    speculator.propose(
        prefill_and_tree_batch(),
        {},
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        dummy_run=True,
        skip_attn_for_dummy_run=True,
    )
    assert torch.equal(speculator.req_states.draft_tokens, before)
    assert not speculator.target_kv_caches_bound


SPECULATOR_FROM_THE_ENGINE_CONFIG = """
import json, os, sys
import torch
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.ddtree import plugin
from vllm.v1.worker.gpu import buffer_utils

def cpu_buffer(self, size, dtype):
    # As tests/in_vllm/conftest.py: UVA staging buffers as CPU tensors.
    self.cpu = torch.zeros(size, dtype=dtype)
    self.np = self.cpu.numpy()
    self._uva = self.cpu

buffer_utils.UvaBuffer.__init__ = cpu_buffer
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.spec_decode import init_speculator
from vllm.v1.worker.gpu.spec_decode.ddtree.sampling import TreePenaltiesState
from vllm.v1.worker.gpu.states import RequestState

plugin.register()
target, drafter = sys.argv[1], sys.argv[2]
config = EngineArgs(
    model=target, dtype="float32", max_model_len=512, max_num_seqs=4,
    speculative_config={"method": "ddtree", "model": drafter,
                        "speculator_options": {"tree_budget": 8}},
).create_engine_config()
spec = config.speculative_config
device = torch.device("cpu")
vocab = config.model_config.get_vocab_size()
with set_current_vllm_config(config):
    req_states = RequestState(
        4, 512, config.scheduler_config.max_num_batched_tokens,
        config.num_speculative_tokens, vocab, device,
    )
    speculator = init_speculator(config, device, req_states)
    sampler = Sampler(config, 4, vocab, device, req_states,
                      num_speculative_tokens=1 + spec.num_speculative_tokens)
    sampler_out, walk = speculator.custom_sampler(sampler)
verifier = speculator.verifier
print("RESULT " + json.dumps({
    "method": [spec.method, spec.custom_method],
    "speculator": type(speculator).__name__,
    "budget": [speculator.tree_budget, verifier.tree_budget,
               spec.num_speculative_tokens],
    "depth": [speculator.draft_depth, verifier.draft_depth],
    "policy": spec.speculator_options["budget_policy"],
    "bias": list(verifier.attn_bias.shape),
    "req_draft_tokens": list(req_states.draft_tokens.shape),
    "same_req_states": speculator.req_states is req_states,
    "walk": type(walk).__name__,
    "same_sampler": sampler_out is sampler,
    "tree_penalties": isinstance(sampler.penalties_state, TreePenaltiesState)
    and sampler.penalties_state in sampler.logits_processors,
}))
"""


def test_the_engine_configs_speculator_owns_the_verifier_and_the_walk():
    """From `vllm serve`'s config path (vLLM's CPU platform, the dense
    pair): `init_speculator` builds DDTreeSpeculator with the runner's
    request states; it owns a verifier sized from DDTree's options, and the
    runner's `custom_sampler` hook gets the walk and tree-aware penalties on
    a real Sampler."""
    out = run_on_cpu(SPECULATOR_FROM_THE_ENGINE_CONFIG, TARGET, DRAFTER)
    assert out == {
        "method": ["dflash", "ddtree"],
        "speculator": "DDTreeSpeculator",
        "budget": [8, 8, 8],
        # The pair's drafter has block_size 16.
        "depth": [15, 15],
        "policy": "batch",
        # One int32 word of mask bits per node of 9 (root + 8).
        "bias": [4, 9, 1],
        "req_draft_tokens": [4, 8],
        "same_req_states": True,
        "walk": "TreeWalkSampler",
        "same_sampler": True,
        "tree_penalties": True,
    }
