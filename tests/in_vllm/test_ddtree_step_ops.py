# SPDX-License-Identifier: Apache-2.0
"""The eager work a DDTree step dispatches outside the CUDA graphs on the
dense path, per verifier hook: Triton launches by kernel name and torch
operators (dispatch_counts.py), counted on CPU. They are host-dispatch
counts, the same on a GPU; not timings.

Each hook is checked against a stated bound, for a batch of 1 and of 3 tree
requests (beside a prefill row): the launches are exactly the stated ones,
no operator runs besides views of persistent buffers (and the few stated
ones), and nothing grows with the batch. A gather / scatter chain in place
of a launch (``aten.index``, ``index_put_``, ``copy_``, casts) fails here.
"""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from dispatch_counts import count_dispatch  # noqa: E402
from verifier_fakes import (  # noqa: E402
    DEPTH,
    PARENT,
    TOKENS,
    ArgmaxSampler,
    B,
    make_verifier,
    needs_runner_holding_the_verifier,
    store_trees,
)

# Views of existing tensors: no kernel, no allocation.
VIEW_OPS = {
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.view.default",
    "aten.unsqueeze.default",
    "aten.alias.default",
    "aten.as_strided.default",
    "aten.expand.default",
    # `Tensor.numpy()` of a host tensor (vLLM 0.33's sampler takes the
    # batch's host sequence-length bound as an array).
    "aten.detach.default",
}
PREFILL_STATE, PREFILL_LEN = 1, 3


def work_ops(counts):
    """The dispatched operators that are not views."""
    return [op for op in counts.ops if op not in VIEW_OPS]


class Step:
    """A verify batch: batch row 0 prefills request state 1 (3 tokens at
    positions 0..2), then each of ``tree_states`` verifies the stored tree
    (root + B nodes, root at 20 + 10 k); two padding tokens after them."""

    def __init__(self, tree_states):
        self.tree_states = tree_states
        self.verifier = make_verifier()
        trees = [(PARENT, DEPTH, TOKENS)] * len(tree_states)
        self.draft_tokens = store_trees(self.verifier, tree_states, trees)
        k = len(tree_states)
        num_tokens = PREFILL_LEN + k * (1 + B)
        roots = [20 + 10 * i for i in range(k)]
        positions = list(range(PREFILL_LEN))
        for root in roots:
            positions += list(range(root, root + 1 + B))
        self.sequential = positions + [0, 0]
        self.tree_positions = list(range(PREFILL_LEN))
        for root in roots:
            self.tree_positions += [root] + [root + d for d in DEPTH]
        logits_indices = [PREFILL_LEN - 1] + list(range(PREFILL_LEN, num_tokens))
        self.logits_indices = logits_indices
        states = [PREFILL_STATE] + list(tree_states)
        self.batch = SimpleNamespace(
            num_reqs=1 + k,
            num_tokens=num_tokens,
            num_tokens_after_padding=num_tokens + 2,
            num_draft_tokens=k * B,
            positions=torch.tensor(self.sequential, dtype=torch.int64),
            input_ids=torch.arange(100, 100 + num_tokens + 2, dtype=torch.int32),
            logits_indices=torch.tensor(logits_indices),
            expanded_idx_mapping=torch.tensor(
                [PREFILL_STATE] + [s for s in tree_states for _ in range(1 + B)],
                dtype=torch.int32,
            ),
            expanded_local_pos=torch.tensor(
                [0] + list(range(1 + B)) * k, dtype=torch.int32
            ),
            idx_mapping=torch.tensor(states, dtype=torch.int32),
            idx_mapping_np=np.array(states, dtype=np.int32),
            cu_num_logits=torch.tensor(
                [0] + [1 + i * (1 + B) for i in range(k + 1)], dtype=torch.int32
            ),
            query_start_loc=torch.tensor(
                [0] + [PREFILL_LEN + i * (1 + B) for i in range(k + 1)],
                dtype=torch.int32,
            ),
            seq_lens=torch.tensor(
                [PREFILL_LEN] + [root + 1 + B for root in roots], dtype=torch.int32
            ),
            # vLLM 0.33+: the sampler's per-request sequence-length bound.
            seq_lens_cpu_upper_bound=torch.tensor(
                [PREFILL_LEN] + [root + 1 + B for root in roots], dtype=torch.int32
            ),
        )


@pytest.mark.parametrize("tree_states", [[2], [2, 0, 3]])
def test_tree_positions_and_their_restore_are_one_launch_each(tree_states):
    step = Step(tree_states)
    verifier, batch = step.verifier, step.batch
    with count_dispatch() as prepare:
        verifier.prepare_verify(batch)
    # Tree positions in place; the sampler's rows: positions and input ids.
    assert batch.positions.tolist() == step.tree_positions + [0, 0]
    num_logits = len(step.logits_indices)
    assert verifier.logits_pos[:num_logits].tolist() == [
        step.tree_positions[t] for t in step.logits_indices
    ]
    assert verifier.logits_input_ids[:num_logits].tolist() == [
        100 + t for t in step.logits_indices
    ]

    with count_dispatch() as restore:
        verifier.compact(batch, None, None)  # no walk: positions only
    assert batch.positions.tolist() == step.sequential

    assert dict(prepare.launches) == {
        "_ddtree_tree_positions_kernel": 1,
        "_ddtree_tree_bias_kernel": 1,
    }
    assert work_ops(prepare) == [] and len(prepare.ops) <= 4, prepare.ops
    assert dict(restore.launches) == {"_ddtree_tree_positions_kernel": 1}
    assert restore.ops == []


@pytest.mark.parametrize("tree_states", [[2], [2, 0, 3]])
def test_store_trees_is_one_launch(tree_states):
    """The drafter's batch-ordered trees (its max_num_reqs rows) and their
    node tokens go to the request states in one launch."""
    gen = torch.Generator().manual_seed(len(tree_states))
    verifier = make_verifier()
    k = len(tree_states)
    speculator = SimpleNamespace(
        tree_parent_idx=torch.randint(0, B, (4, B), generator=gen),
        tree_depth=torch.randint(1, 4, (4, B), generator=gen),
        tree_valid=torch.rand(4, B, generator=gen) < 0.5,
        draft_tokens=torch.randint(0, 1000, (4, B), generator=gen),
    )
    req_draft_tokens = torch.zeros(4, B, dtype=torch.int64)
    idx_mapping = torch.tensor(tree_states, dtype=torch.int32)
    untouched = [s for s in range(4) if s not in tree_states]
    before = [
        t.clone()
        for t in (verifier.req_parent_idx, verifier.req_depth, verifier.req_valid)
    ]
    with count_dispatch() as counts:
        verifier.store_trees(idx_mapping, speculator, req_draft_tokens)
    assert dict(counts.launches) == {"_ddtree_store_trees_kernel": 1}
    assert counts.ops == []

    rows = list(range(k))
    assert torch.equal(
        verifier.req_parent_idx[tree_states], speculator.tree_parent_idx[rows]
    )
    assert torch.equal(verifier.req_depth[tree_states, 1:], speculator.tree_depth[rows])
    assert torch.all(verifier.req_depth[:, 0] == 0)  # the root
    assert torch.equal(verifier.req_valid[tree_states], speculator.tree_valid[rows])
    assert torch.equal(req_draft_tokens[tree_states], speculator.draft_tokens[rows])
    assert torch.all(req_draft_tokens[untouched] == 0)
    after = (verifier.req_parent_idx, verifier.req_depth, verifier.req_valid)
    for t, t0 in zip(after, before):
        assert torch.equal(t[untouched], t0[untouched])


@needs_runner_holding_the_verifier
def test_the_runner_leaves_the_draft_tokens_to_store_trees():
    """With DDTree the runner's own scatter of the drafts
    (``req_states.draft_tokens[idx_mapping] = draft_tokens``) does not run:
    store_trees writes them, in its one launch."""
    import ast
    import inspect
    import textwrap

    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    source = textwrap.dedent(inspect.getsource(GPUModelRunner))
    branches = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "self.ddtree is not None"
        and any(
            ast.unparse(call.func) == "self.ddtree.store_trees"
            for call in ast.walk(node)
            if isinstance(call, ast.Call)
        )
    ]
    assert len(branches) == 1
    (branch,) = branches
    (call,) = [n for n in ast.walk(branch.body[0]) if isinstance(n, ast.Call)]
    assert ast.unparse(call.args[2]) == "self.req_states.draft_tokens"
    scatter = "self.req_states.draft_tokens[input_batch.idx_mapping] = draft_tokens"
    assert [ast.unparse(n) for n in branch.orelse] == [scatter]


class FixedSampler(ArgmaxSampler):
    """The target's draws, given: the sampler's own work is upstream's and
    not counted here."""

    def __init__(self, tokens):
        super().__init__()
        self.tokens = tokens

    def sample(self, logits, *args, **kwargs):
        return self.tokens, logits


# Every tree accepts root -> 1 -> 4 (the target says 11 at the root, 14 at
# node 1, then 9), or root -> 2 (12 at the root, then 7 at node 2).
DRAWS_1_4 = [11, 14, 30, 30, 9]
DRAWS_2 = [12, 30, 7, 30, 30]


def sample_step(step, draws):
    """sample() of ``step`` with the target's draws ``draws`` for every tree
    (the prefill row draws 5), counted."""
    sampler = FixedSampler(torch.tensor([5] + draws * len(step.tree_states)))
    logits = torch.zeros(len(step.logits_indices), 32)
    prefill_len = torch.tensor([3, 3, 10, 0], dtype=torch.int32)
    with count_dispatch() as counts:
        out = step.verifier.sample(
            sampler, logits, step.batch, step.draft_tokens, prefill_len
        )
    return out, counts


@pytest.mark.parametrize("tree_states", [[2], [2, 0, 3]])
def test_sample_allocates_nothing(tree_states):
    """sample() around the sampler: one launch, the walk (its path and
    scratch in persistent buffers), which also writes upstream's num_sampled
    / num_rejected and puts the sequential positions back. The emitted
    tokens and both counts, which the runner copies to the host, are views
    of the walk buffers' output slots too: nothing is allocated, and no
    other operator runs."""
    from vllm.v1.worker.gpu.spec_decode.ddtree.sampling import (
        SAMPLE_TAKES_IDX_MAPPING,
    )

    step = Step(tree_states)
    verifier = step.verifier
    verifier.prepare_verify(step.batch)
    out, counts = sample_step(step, DRAWS_1_4)
    k = len(tree_states)
    assert out.num_sampled.tolist() == [1] + [3] * k
    # Prefill row: 1 logit, 1 sampled; trees: 5 logits, 3 sampled.
    assert out.num_rejected.tolist() == [0] + [2] * k
    assert out.sampled_token_ids[0].tolist() == [5, -1, -1, -1]
    assert out.sampled_token_ids[1:].tolist() == [[11, 14, 9, -1]] * k
    assert dict(counts.launches) == {"_ddtree_walk_kernel": 1}
    assert work_ops(counts) == [], counts.ops
    assert step.batch.positions.tolist() == step.sequential
    # vLLM 0.33's Sampler.sample takes the batch's host sequence-length bound
    # as an array: one more op, the alias of a host tensor.
    assert len(counts.ops) <= 10 + SAMPLE_TAKES_IDX_MAPPING, counts.ops

    num_accepted, src_row, _ = verifier._walk
    buffers = verifier.walk_buffers
    assert num_accepted.data_ptr() == buffers.num_accepted.data_ptr()
    assert src_row.data_ptr() == buffers.src_row.data_ptr()
    assert out.sampled_token_ids.data_ptr() == buffers.output_token_ids[0].data_ptr()
    assert out.num_sampled.data_ptr() == buffers.num_sampled[0].data_ptr()
    assert out.num_rejected.data_ptr() == buffers.num_rejected[0].data_ptr()
    # compact() then has no positions left to restore: no launch of its own.
    with count_dispatch() as compact:
        verifier.compact(step.batch, None, None)
    assert "_ddtree_tree_positions_kernel" not in compact.launches


@pytest.mark.parametrize("tree_states", [[2], [2, 0, 3]])
def test_sample_outputs_rotate_through_the_steps_in_flight(tree_states):
    """The runner copies a step's outputs to the host on its copy stream,
    which the next step does not wait for: the next step writes the next
    output slot and leaves this one as it was. With async scheduling
    (2 steps in flight) the third step reuses the first step's slot."""
    step = Step(tree_states)
    verifier = step.verifier
    assert verifier.num_output_slots == 2
    k = len(tree_states)
    verifier.prepare_verify(step.batch)
    first, _ = sample_step(step, DRAWS_1_4)
    # Each step prepares its verify (the walk put the positions back).
    verifier.prepare_verify(step.batch)
    second, counts = sample_step(step, DRAWS_2)
    assert work_ops(counts) == [], counts.ops
    assert second.sampled_token_ids[1:].tolist() == [[12, 7, -1, -1]] * k
    assert second.num_sampled.tolist() == [1] + [2] * k
    assert second.num_rejected.tolist() == [0] + [3] * k
    # The first step's outputs, still in flight, are untouched.
    assert first.sampled_token_ids[1:].tolist() == [[11, 14, 9, -1]] * k
    assert first.num_sampled.tolist() == [1] + [3] * k
    assert first.num_rejected.tolist() == [0] + [2] * k
    for a, b in [
        (first.sampled_token_ids, second.sampled_token_ids),
        (first.num_sampled, second.num_sampled),
        (first.num_rejected, second.num_rejected),
    ]:
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()

    verifier.prepare_verify(step.batch)
    third, _ = sample_step(step, DRAWS_2)
    assert third.sampled_token_ids.data_ptr() == first.sampled_token_ids.data_ptr()
    assert third.num_sampled.data_ptr() == first.num_sampled.data_ptr()
    assert third.num_rejected.data_ptr() == first.num_rejected.data_ptr()
    assert first.sampled_token_ids[1:].tolist() == [[12, 7, -1, -1]] * k
