# SPDX-License-Identifier: Apache-2.0
"""DDTree through the Gated DeltaNet layers of hybrid targets, on CPU (the
Triton kernels run in the interpreter, see conftest.py).

The reference is upstream's own layer code: every root -> node path of a
tree is replayed as single-token decode steps through the real
`QwenGatedDeltaNetAttention._forward_core` (non-speculative branch:
`causal_conv1d_update` + `fused_sigmoid_gating_delta_rule_update`) from a
copy of the committed states. The DDTree branch of the same `_forward_core`
must give every node the output of its path's last step, leave the committed
states alone and save its inputs; after the walk `DDTreeGDN.commit` must
leave exactly the states of the accepted path's replay.
"""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
qgdn = pytest.importorskip("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")

from dispatch_counts import count_dispatch  # noqa: E402

from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    is_conv_state_dim_first,
)
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402
from vllm.v1.spec_decode.ddtree import gdn_verify  # noqa: E402
from vllm.v1.spec_decode.ddtree.tree import build_tree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HV, K, V, W = 2, 4, 16, 16, 4
CONV_DIM = 2 * H * K + HV * V
PREFIX = "model.layers.3.linear_attn"
NUM_SLOTS = 9


# ------------------------------------------------------------------ fixtures
def make_layer(seed, prefix=PREFIX):
    """A QwenGatedDeltaNetAttention with random weights and states, without
    vLLM's distributed / config setup (only what _forward_core reads)."""
    gen = torch.Generator().manual_seed(seed)
    layer = object.__new__(qgdn.QwenGatedDeltaNetAttention)
    torch.nn.Module.__init__(layer)
    layer.prefix = prefix
    layer.tp_size = 1
    layer.num_k_heads, layer.num_v_heads = H, HV
    layer.head_k_dim, layer.head_v_dim = K, V
    layer.key_dim, layer.value_dim = H * K, HV * V
    layer.conv_kernel_size = W
    layer.activation = "silu"
    layer.enable_packed_recurrent_decode = False
    # What __init__ resolves off CUDA: the Triton (FLA) prefill kernel.
    layer.gdn_prefill_backend = "triton"
    layer.tree_verifier = None  # as __init__ leaves it; bind_layers sets it
    layer.conv1d = SimpleNamespace(
        weight=torch.randn(CONV_DIM, 1, W, generator=gen) * 0.5,
        bias=torch.randn(CONV_DIM, generator=gen) * 0.1,
    )
    layer.A_log = torch.randn(HV, generator=gen) * 0.5
    layer.dt_bias = torch.randn(HV, generator=gen) * 0.1
    if is_conv_state_dim_first():
        conv = torch.randn(NUM_SLOTS, CONV_DIM, W - 1, generator=gen)
    else:
        conv = torch.randn(NUM_SLOTS, W - 1, CONV_DIM, generator=gen)
    ssm = torch.randn(NUM_SLOTS, HV, V, K, generator=gen) * 0.1
    layer.kv_cache = [conv.to(DEVICE), ssm.to(DEVICE)]
    layer.conv1d.weight = layer.conv1d.weight.to(DEVICE)
    layer.conv1d.bias = layer.conv1d.bias.to(DEVICE)
    layer.A_log = layer.A_log.to(DEVICE)
    layer.dt_bias = layer.dt_bias.to(DEVICE)
    return layer


def run_core(monkeypatch, layer, md, mixed_qkv, b, a, num_tokens):
    monkeypatch.setattr(
        qgdn,
        "get_forward_context",
        lambda: SimpleNamespace(attn_metadata={layer.prefix: md}),
    )
    out = torch.full((num_tokens, HV, V), float("nan"), device=DEVICE)
    layer._forward_core(mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=out)
    return out


def decode_md(slot):
    return GDNAttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=1,
        num_decode_tokens=1,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=1,
        non_spec_query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        non_spec_state_indices_tensor=torch.tensor(
            [slot], dtype=torch.int32, device=DEVICE
        ),
    )


def spec_md(query_start, slots, num_spec, num_actual_tokens):
    """Spec-decode metadata as the GDN builder makes it under DDTree: one
    state column; in full-CUDA-graph form the rows past num_spec are padding
    (null slot, no tokens)."""
    rows = len(slots)
    dev = dict(device=DEVICE)
    return GDNAttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=num_spec,
        num_spec_decode_tokens=int(query_start[num_spec]),
        num_actual_tokens=num_actual_tokens,
        spec_query_start_loc=torch.tensor(query_start, dtype=torch.int32, **dev),
        spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32, **dev)[
            :, None
        ],
        spec_sequence_masks=torch.arange(rows, **dev) < num_spec,
        spec_token_indx=torch.arange(num_actual_tokens, dtype=torch.int32, **dev),
        non_spec_token_indx=torch.zeros(0, dtype=torch.int32, **dev),
        num_accepted_tokens=torch.ones(rows, dtype=torch.int32, **dev),
    )


def path_of(parent_row, node):
    path = [node]
    while path[-1] != 0:
        path.append(int(parent_row[path[-1] - 1]))
    return path[::-1]


def replay(monkeypatch, layer, slot, rows_x, rows_b, rows_a):
    """Upstream's decode steps over the given rows from copies of the
    committed states: (output of each step, conv state, ssm state after)."""
    saved = layer.kv_cache
    layer.kv_cache = [saved[0].clone(), saved[1].clone()]
    outs = []
    try:
        for x, b, a in zip(rows_x, rows_b, rows_a):
            out = run_core(
                monkeypatch,
                layer,
                decode_md(slot),
                x[None].clone().contiguous(),
                b[None].clone(),
                a[None].clone(),
                1,
            )
            outs.append(out[0])
        return outs, layer.kv_cache[0][slot].clone(), layer.kv_cache[1][slot].clone()
    finally:
        layer.kv_cache = saved


def replay_from(monkeypatch, layer, committed, slot, rows_x, rows_b, rows_a):
    """`replay` from the states ``committed`` (the layer's own states are
    left as they are): (conv state, ssm state) after the rows."""
    saved = layer.kv_cache
    layer.kv_cache = committed
    try:
        _, ref_conv, ref_ssm = replay(monkeypatch, layer, slot, rows_x, rows_b, rows_a)
    finally:
        layer.kv_cache = saved
    return ref_conv, ref_ssm


def assert_slot_is_replay(monkeypatch, layer, committed, slot, rows_x, rows_b, rows_a):
    """The layer's states in ``slot`` are upstream's decode over the rows,
    from ``committed``."""
    ref_conv, ref_ssm = replay_from(
        monkeypatch, layer, committed, slot, rows_x, rows_b, rows_a
    )
    torch.testing.assert_close(layer.kv_cache[1][slot], ref_ssm, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.kv_cache[0][slot], ref_conv)


def gdn_context(parent_idx, draft_depth, max_reqs, max_rows=64):
    """A one-layer DDTreeGDN context of this file's layer shape."""
    return gdn_verify.DDTreeGDN(
        parent_idx=parent_idx,
        draft_depth=draft_depth,
        max_num_reqs=max_reqs,
        max_rows=max_rows,
        num_layers=1,
        conv_dim=CONV_DIM,
        num_v_heads=HV,
        dtype=torch.float32,
        device=torch.device(DEVICE),
    )


class Case:
    """Requests with draft trees in a spec-only verify batch."""

    def __init__(self, seed, budgets, depth, pad_rows=0, pad_tokens=0):
        gen = torch.Generator().manual_seed(seed)
        self.budgets = budgets
        self.depth = depth
        num_rows = len(budgets)
        budget = max(budgets)
        tree = build_tree(torch.randn(num_rows, depth, 6, generator=gen) * 2, budget)
        self.max_reqs = num_rows + 3
        # Batch row r verifies request state idx_mapping[r].
        self.idx_mapping = torch.randperm(self.max_reqs, generator=gen)[:num_rows]
        parent = torch.zeros(self.max_reqs, budget, dtype=torch.int64)
        parent[self.idx_mapping] = tree.parent_idx
        self.parent = parent.to(DEVICE)
        counts = [1 + n for n in budgets]
        self.query_start = [0] + list(np.cumsum(counts))
        self.num_tokens = self.query_start[-1]
        self.num_actual = self.num_tokens + pad_tokens
        self.slots = list(range(2, 2 + num_rows))  # slot 0: null
        self.md_query_start = self.query_start + [self.num_tokens] * pad_rows
        self.md_slots = self.slots + [0] * pad_rows
        wide = torch.randn(self.num_actual, CONV_DIM + 7, generator=gen).to(DEVICE)
        self.mixed_qkv = wide[:, 3 : 3 + CONV_DIM]  # strided, as a qkvz split
        self.a = torch.randn(self.num_actual, HV, generator=gen).to(DEVICE)
        self.b = torch.randn(self.num_actual, HV, generator=gen).to(DEVICE)
        self.gen = gen

    def batch(self):
        budgets = np.array(self.budgets, dtype=np.int32)
        return SimpleNamespace(
            num_reqs=len(self.budgets),
            num_draft_tokens_per_req=budgets,
            num_scheduled_tokens=budgets + 1,
            idx_mapping_np=self.idx_mapping.numpy().astype(np.int32),
        )

    def md(self):
        return spec_md(
            self.md_query_start, self.md_slots, len(self.budgets), self.num_actual
        )

    def context(self, layer, parent=None):
        ctx = gdn_context(
            self.parent if parent is None else parent, self.depth, self.max_reqs
        )
        ctx.bind_layers({layer.prefix: layer, "model.layers.4.mlp": object()})
        ctx.prepare_step(self.batch())
        return ctx

    def rows(self, r, nodes):
        return [self.query_start[r] + i for i in nodes]


# --------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "seed, budgets, depth, pad_rows, pad_tokens",
    [(0, [5, 3], 3, 0, 0), (1, [6, 2, 4], 4, 2, 5)],
)
def test_tree_branch_outputs_match_upstream_decode_over_every_path(
    monkeypatch, seed, budgets, depth, pad_rows, pad_tokens
):
    case = Case(seed, budgets, depth, pad_rows, pad_tokens)
    layer = make_layer(seed)
    committed = [t.clone() for t in layer.kv_cache]
    ctx = case.context(layer)
    with count_dispatch() as counts:
        out = run_core(
            monkeypatch,
            layer,
            case.md(),
            case.mixed_qkv,
            case.b,
            case.a,
            case.num_actual,
        )
    # The verify inputs are saved in one launch, not by copies.
    assert counts.launches["_save_verify_inputs_kernel"] == 1

    # The committed states are only read.
    assert torch.equal(layer.kv_cache[0], committed[0])
    assert torch.equal(layer.kv_cache[1], committed[1])
    # Padding tokens get zeros, not garbage.
    assert torch.all(out[case.num_tokens :] == 0)
    # Inputs saved for the post-walk update (pre-conv rows, a, b).
    n = case.num_tokens
    assert torch.equal(ctx.x_buf[0, :n], case.mixed_qkv[:n])
    assert torch.equal(ctx.a_buf[0, :n], case.a[:n])
    assert torch.equal(ctx.b_buf[0, :n], case.b[:n])

    for r, budget in enumerate(budgets):
        parent_row = case.parent[int(case.idx_mapping[r])].cpu()
        for node in range(1 + budget):
            rows = case.rows(r, path_of(parent_row, node))
            ref, _, _ = replay(
                monkeypatch,
                layer,
                case.slots[r],
                case.mixed_qkv[rows],
                case.b[rows],
                case.a[rows],
            )
            torch.testing.assert_close(
                out[case.query_start[r] + node], ref[-1], rtol=1e-5, atol=1e-5
            )


def test_the_steps_longest_query_reaches_the_tree_kernel(monkeypatch):
    """DDTreeGDN.attach keeps the longest query of the step's attention
    metadata (the GDN metadata has none) and the tree kernel gets it: trees
    of 5 and 3 nodes in a 40-column parent table (the blocked form without
    it) give the same outputs in the form of their own size."""
    case = Case(0, [5, 3], 3)
    layer = make_layer(0)
    wide = torch.zeros(case.max_reqs, 40, dtype=torch.int64, device=DEVICE)
    wide[:, :5] = case.parent
    ctx = case.context(layer, parent=wide)
    seen = []
    kernel = gdn_verify.tree_gated_delta_rule

    def spy(*args, **kwargs):
        seen.append(kwargs["max_query_len"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(gdn_verify, "tree_gated_delta_rule", spy)
    md = case.md()
    # prepare_step (in case.context) bounded it by the longest tree.
    assert ctx.max_query_len == 6
    ctx.max_query_len = None
    table_out = run_core(
        monkeypatch, layer, md, case.mixed_qkv, case.b, case.a, case.num_actual
    )
    attention_md = SimpleNamespace(max_query_len=6)
    ctx.attach({layer.prefix: md, "model.layers.3.self_attn": attention_md})
    assert ctx.max_query_len == 6
    out = run_core(
        monkeypatch, layer, md, case.mixed_qkv, case.b, case.a, case.num_actual
    )
    assert seen == [None, 6]
    torch.testing.assert_close(out, table_out, rtol=1e-5, atol=1e-5)
    ctx.attach({layer.prefix: md})
    assert ctx.max_query_len is None


def test_a_prefill_chunk_in_the_step_does_not_widen_the_tree_form(monkeypatch):
    """A step that mixes a new request's prefill chunk with trees of 5 and 3
    nodes: the attention metadata's longest query is the chunk's (300), so
    attach alone would give the trees the form of the 40-column table;
    prepare_step, which the runner calls after attach, bounds it by the
    longest tree (6 rows), and the tree kernels get that."""
    case = Case(0, [5, 3], 3)
    layer = make_layer(0)
    wide = torch.zeros(case.max_reqs, 40, dtype=torch.int64, device=DEVICE)
    wide[:, :5] = case.parent
    ctx = case.context(layer, parent=wide)
    md = case.md()
    ctx.attach(
        {
            layer.prefix: md,
            "model.layers.3.self_attn": SimpleNamespace(max_query_len=300),
        }
    )
    assert ctx.max_query_len == 300
    mixed = SimpleNamespace(
        num_reqs=3,
        num_draft_tokens_per_req=np.array([5, 3, 0], dtype=np.int32),
        num_scheduled_tokens=np.array([6, 4, 300], dtype=np.int32),
        idx_mapping_np=np.append(case.idx_mapping.numpy(), 0).astype(np.int32),
    )
    ctx.prepare_step(mixed)
    assert ctx.num_spec == 2 and ctx.max_query_len == 6
    seen = []
    kernels = (gdn_verify.tree_gated_delta_rule, gdn_verify.tree_causal_conv1d)

    def spy(kernel):
        def call(*args, **kwargs):
            seen.append((kernel.__name__, kwargs["max_query_len"]))
            return kernel(*args, **kwargs)

        return call

    for kernel in kernels:
        monkeypatch.setattr(gdn_verify, kernel.__name__, spy(kernel))
    run_core(monkeypatch, layer, md, case.mixed_qkv, case.b, case.a, case.num_actual)
    assert sorted(seen) == [("tree_causal_conv1d", 6), ("tree_gated_delta_rule", 6)]


def test_chain_parent_mutant_is_caught(monkeypatch):
    """The comparison above fails when the kernels see chain parents (each
    node the child of the previous row, upstream's chain semantics)."""
    case = Case(0, [5, 3], 3)
    layer = make_layer(0)
    chain = torch.zeros_like(case.parent)
    chain[:, 1:] = torch.arange(1, chain.shape[1])
    case.context(layer, parent=chain)
    out = run_core(
        monkeypatch, layer, case.md(), case.mixed_qkv, case.b, case.a, case.num_actual
    )
    mismatches = 0
    for r, budget in enumerate(case.budgets):
        parent_row = case.parent[int(case.idx_mapping[r])].cpu()
        for node in range(1 + budget):
            rows = case.rows(r, path_of(parent_row, node))
            ref, _, _ = replay(
                monkeypatch,
                layer,
                case.slots[r],
                case.mixed_qkv[rows],
                case.b[rows],
                case.a[rows],
            )
            mismatches += not torch.allclose(
                out[case.query_start[r] + node], ref[-1], rtol=1e-5, atol=1e-5
            )
    assert mismatches > 0


def accepted_paths(case, gen):
    """A random accepted path per request: (nodes [R, D + 1] root first,
    padded with the root as the walk pads, counts [R])."""
    nodes = torch.zeros(len(case.budgets), case.depth + 1, dtype=torch.int64)
    counts = torch.zeros(len(case.budgets), dtype=torch.int32)
    for r, budget in enumerate(case.budgets):
        parent_row = case.parent[int(case.idx_mapping[r])].cpu()
        leaf = int(torch.randint(0, 1 + budget, (1,), generator=gen))
        path = path_of(parent_row, leaf)
        nodes[r, : len(path)] = torch.tensor(path)
        counts[r] = len(path)
    return nodes.to(DEVICE), counts.to(DEVICE)


@pytest.mark.parametrize(
    "seed, budgets, depth, pad_rows", [(2, [6, 4], 3, 0), (3, [7, 1, 5], 4, 1)]
)
def test_commit_leaves_the_states_of_the_accepted_path(
    monkeypatch, seed, budgets, depth, pad_rows
):
    case = Case(seed, budgets, depth, pad_rows, pad_tokens=2)
    layer = make_layer(seed)
    committed = [t.clone() for t in layer.kv_cache]
    ctx = case.context(layer)
    md = case.md()
    run_core(monkeypatch, layer, md, case.mixed_qkv, case.b, case.a, case.num_actual)
    ctx.attach({layer.prefix: md, "model.layers.0.self_attn": object()})

    nodes, counts = accepted_paths(case, case.gen)
    # The walk's view: flat verify rows per batch row, query_start_loc.
    query_start = torch.tensor(case.query_start, dtype=torch.int32, device=DEVICE)
    src_row = nodes + query_start[:-1, None].to(torch.int64)
    ctx.commit(counts, src_row, query_start)

    conv, ssm = gdn_verify.gdn_layer_states(layer)
    for r in range(len(budgets)):
        slot = case.slots[r]
        rows = case.rows(r, nodes[r, : int(counts[r])].cpu().tolist())
        ref_conv, ref_ssm = replay_from(
            monkeypatch,
            layer,
            committed,
            slot,
            case.mixed_qkv[rows],
            case.b[rows],
            case.a[rows],
        )
        torch.testing.assert_close(ssm[slot], ref_ssm, rtol=1e-5, atol=1e-5)
        ref_conv_ds = ref_conv if is_conv_state_dim_first() else ref_conv.T
        assert torch.equal(conv[slot][:, : W - 1], ref_conv_ds[:, : W - 1])
    # Other slots untouched.
    for slot in set(range(NUM_SLOTS)) - set(case.slots):
        assert torch.equal(layer.kv_cache[0][slot], committed[0][slot])
        assert torch.equal(layer.kv_cache[1][slot], committed[1][slot])


def test_commit_with_only_the_root_accepted_is_one_decode_step(monkeypatch):
    case = Case(4, [4, 2], 2)
    layer = make_layer(4)
    committed = [t.clone() for t in layer.kv_cache]
    ctx = case.context(layer)
    md = case.md()
    run_core(monkeypatch, layer, md, case.mixed_qkv, case.b, case.a, case.num_actual)
    ctx.attach({layer.prefix: md})
    nodes = torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)
    counts = torch.ones(2, dtype=torch.int32, device=DEVICE)
    query_start = torch.tensor(case.query_start, dtype=torch.int32, device=DEVICE)
    ctx.commit(counts, nodes + query_start[:-1, None].to(torch.int64), query_start)
    for r in range(2):
        slot = case.slots[r]
        row = [case.query_start[r]]
        assert_slot_is_replay(
            monkeypatch,
            layer,
            committed,
            slot,
            case.mixed_qkv[row],
            case.b[row],
            case.a[row],
        )


def test_commit_refuses_metadata_that_disagrees_with_the_verifier(monkeypatch):
    case = Case(5, [3, 3], 2)
    layer = make_layer(5)
    ctx = case.context(layer)
    md = case.md()
    md.num_spec_decodes = 1  # the GDN layers saw another batch
    ctx.attach({layer.prefix: md})
    query_start = torch.tensor(case.query_start, dtype=torch.int32, device=DEVICE)
    with pytest.raises(RuntimeError, match="spec rows"):
        ctx.commit(
            torch.ones(2, dtype=torch.int32, device=DEVICE),
            torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)
            + query_start[:-1, None].long(),
            query_start,
        )


def test_spec_rows_follow_the_mamba_model_state_rule():
    drafts = np.array([3, 0, 2, 4], dtype=np.int32)
    scheduled = np.array([4, 7, 3, 5], dtype=np.int32)
    assert gdn_verify.spec_decode_rows(drafts, scheduled).tolist() == [0, 2, 3]
    assert gdn_verify.spec_decode_rows(None, scheduled).tolist() == []
    # Draft tokens next to other scheduled tokens: refused, not mis-verified.
    layer = make_layer(0)
    case = Case(0, [2, 2], 2)
    ctx = case.context(layer)
    bad = SimpleNamespace(
        num_reqs=2,
        num_draft_tokens_per_req=np.array([2, 2], dtype=np.int32),
        num_scheduled_tokens=np.array([3, 5], dtype=np.int32),
        idx_mapping_np=np.array([0, 1], dtype=np.int32),
    )
    with pytest.raises(RuntimeError, match="draft tokens"):
        ctx.prepare_step(bad)


def test_prepare_step_maps_spec_rows_to_request_states():
    layer = make_layer(0)
    case = Case(0, [2, 2], 2)
    ctx = case.context(layer)
    batch = SimpleNamespace(
        num_reqs=3,
        num_draft_tokens_per_req=np.array([0, 2, 3], dtype=np.int32),
        num_scheduled_tokens=np.array([5, 3, 4], dtype=np.int32),
        idx_mapping_np=np.array([4, 0, 2], dtype=np.int32),
    )
    from dispatch_counts import count_dispatch

    addresses = [t.data_ptr() for t in (ctx.tree_rows, ctx.spec_query_start)]
    with count_dispatch() as counts:
        ctx.prepare_step(batch)
    assert ctx.num_spec == 2 and ctx.num_spec_tokens == 7
    assert ctx.tree_rows[:2].tolist() == [0, 2]
    assert ctx.spec_batch_rows[:2].tolist() == [1, 2]
    assert ctx.spec_query_start[:3].tolist() == [0, 3, 7]
    # The tables stay where the captured graphs read them, and arrive in
    # one copy from the staging buffers (no tensor, pinned or not, made
    # per step; host numbers only).
    assert [t.data_ptr() for t in (ctx.tree_rows, ctx.spec_query_start)] == addresses
    assert counts.num_launches == 0
    # (the slice: the staging buffer's used part)
    assert counts.ops == ["aten.slice.Tensor", "aten.copy_.default"], counts.ops


def test_bind_layers_checks_the_buffer_shapes():
    layer = make_layer(0)
    case = Case(0, [2, 2], 2)
    ctx = case.context(layer)
    assert ctx.layer_index == {PREFIX: 0}
    other = make_layer(1, prefix="model.layers.7.linear_attn")
    with pytest.raises(ValueError, match="expected 1 Gated DeltaNet layers"):
        ctx.bind_layers({PREFIX: layer, other.prefix: other})
    other.num_v_heads = 2 * HV
    ctx2 = case.context(layer)
    with pytest.raises(ValueError, match="value heads"):
        ctx2.bind_layers({other.prefix: other})
