# SPDX-License-Identifier: Apache-2.0
"""The one-launch post-walk commit of all Gated DeltaNet layers
(`vllm.v1.spec_decode.ddtree.gdn_commit`, through `DDTreeGDN.commit`),
on CPU in the Triton interpreter (tests/in_vllm/conftest.py).

Oracles: the per-layer commit it replaces (gdn_commit_reference.py: the
whole tree's conv, `rearrange_mixed_qkv`, the tree gated delta rule with the
accepted leaf as target, the conv-window update, per layer), on random
trees in a batch of several requests (a prefill row among them, accepted
paths from root-only to the deepest), three layers in two KV-cache groups
whose states are vLLM-style views into shared page buffers, float32 and
bfloat16 states; and upstream's own decode steps (`_forward_core`) along
each accepted path.
"""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")

from gdn_commit_reference import commit_per_layer  # noqa: E402
from test_ddtree_gdn_hybrid import (  # noqa: E402
    CONV_DIM,
    HV,
    W,
    make_layer,
    path_of,
    replay_from,
    spec_md,
)

from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    is_conv_state_dim_first,
)
from vllm.v1.spec_decode.ddtree import gdn_commit, gdn_verify  # noqa: E402
from vllm.v1.spec_decode.ddtree.tree import build_tree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = [f"model.layers.{i}.linear_attn" for i in (0, 1, 2)]
ATTN = "model.layers.3.self_attn"
# Two KV-cache groups, as vLLM's hybrid allocator makes them: layers 0, 1
# (and the attention layer) in group 0, layer 2 in group 1.
GROUPS = [[NAMES[0], NAMES[1], ATTN], [NAMES[2]]]
NUM_BLOCKS = 12


def vllm_state_views(raw, conv_dtype, ssm_dtype, page_bytes):
    """A GDN layer's (conv, ssm) states as vLLM's V2 runner makes them: two
    strided views into one raw page buffer (attn_utils: one page per block,
    conv state first, the recurrent state after it)."""
    dim_first = is_conv_state_dim_first()
    conv_shape = (CONV_DIM, W - 1) if dim_first else (W - 1, CONV_DIM)
    ssm_shape = (HV, 16, 16)
    states = []
    offset = 0
    for shape, dtype in ((conv_shape, conv_dtype), (ssm_shape, ssm_dtype)):
        size = torch.empty(0, dtype=dtype).element_size()
        inner = torch.empty(shape).stride()
        assert offset % size == 0
        states.append(
            torch.as_strided(
                raw.view(dtype),
                (NUM_BLOCKS, *shape),
                (page_bytes // size, *inner),
                offset // size,
            )
        )
        offset += int(np.prod(shape)) * size
    return states


def make_layers(seed, dtype, ssm_dtype, conv_dtype=None):
    """Three GDN layers with weights in ``dtype``; layers 0 and 2 (different
    groups) share one page buffer, as vLLM's shared KV-cache tensors do;
    random states."""
    gen = torch.Generator().manual_seed(seed + 100)
    conv_dtype = conv_dtype or dtype
    conv_bytes = CONV_DIM * (W - 1) * torch.empty(0, dtype=conv_dtype).element_size()
    ssm_bytes = HV * 16 * 16 * torch.empty(0, dtype=ssm_dtype).element_size()
    page_bytes = conv_bytes + ssm_bytes + 64  # padded, as pages are
    raws = [
        torch.zeros(NUM_BLOCKS * page_bytes, dtype=torch.uint8, device=DEVICE)
        for _ in range(2)
    ]
    layers = []
    for i, name in enumerate(NAMES):
        layer = make_layer(seed + i, prefix=name)
        layer.conv1d.weight = layer.conv1d.weight.to(dtype)
        layer.conv1d.bias = layer.conv1d.bias.to(dtype)
        layer.A_log = layer.A_log.to(dtype)
        layer.dt_bias = layer.dt_bias.to(dtype)
        conv, ssm = vllm_state_views(
            raws[0 if i != 1 else 1], conv_dtype, ssm_dtype, page_bytes
        )
        layer.kv_cache = [conv, ssm]
        layers.append(layer)
    for layer in layers:
        # Random states (layers 0 and 2 share their pages: one fill wins).
        conv, ssm = layer.kv_cache
        conv.copy_(torch.randn(conv.shape, generator=gen))
        ssm.copy_(torch.randn(ssm.shape, generator=gen) * 0.1)
    return layers


class Step:
    """A verify batch: batch rows 0, 2, 3 verify trees (budgets), batch row 1
    is a prefill of 3 tokens; each tree row's accepted path chosen by
    ``leaves`` ("root", "deep" or "random")."""

    def __init__(self, seed, budgets, depth, leaves, dtype):
        gen = torch.Generator().manual_seed(seed)
        self.depth = depth
        self.budgets = budgets
        tree = build_tree(torch.randn(3, depth, 6, generator=gen) * 2, max(budgets))
        self.max_reqs = 6
        self.idx_mapping = [4, 1, 0, 2]  # batch row -> request state
        tree_states = [4, 0, 2]
        parent = torch.zeros(self.max_reqs, max(budgets), dtype=torch.int64)
        for t, s in enumerate(tree_states):
            parent[s] = tree.parent_idx[t]
        self.parent = parent.to(DEVICE)
        scheduled = [1 + budgets[0], 3, 1 + budgets[1], 1 + budgets[2]]
        drafts = [budgets[0], 0, budgets[1], budgets[2]]
        self.batch = SimpleNamespace(
            num_reqs=4,
            num_draft_tokens_per_req=np.array(drafts, dtype=np.int32),
            num_scheduled_tokens=np.array(scheduled, dtype=np.int32),
            idx_mapping_np=np.array(self.idx_mapping, dtype=np.int32),
        )
        qsl = [0] + list(np.cumsum(scheduled))
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)
        # Spec rows (0, 2, 3): their tokens, in spec order, at spec_qs.
        self.spec_rows = [0, 2, 3]
        spec_counts = [scheduled[r] for r in self.spec_rows]
        self.spec_qs = [0] + list(np.cumsum(spec_counts))
        self.num_spec_tokens = self.spec_qs[-1]
        # The walk: accepted path per batch row (prefill row: its last token).
        src_row = torch.zeros(4, depth + 1, dtype=torch.int64)
        num_accepted = torch.ones(4, dtype=torch.int32)
        src_row[1] = qsl[2] - 1
        self.paths = {}
        for t, (r, leaf_kind) in enumerate(zip(self.spec_rows, leaves)):
            parent_row = parent[tree_states[t]]
            n = budgets[t]
            if leaf_kind == "root":
                leaf = 0
            elif leaf_kind == "deep":
                leaf = max(
                    range(n + 1), key=lambda i: (len(path_of(parent_row, i)), -i)
                )
            else:
                leaf = int(torch.randint(1, n + 1, (1,), generator=gen))
            path = path_of(parent_row, leaf)
            self.paths[r] = path
            src_row[r] = qsl[r]
            src_row[r, : len(path)] = torch.tensor(path) + qsl[r]
            num_accepted[r] = len(path)
        self.src_row = src_row.to(DEVICE)
        self.num_accepted = num_accepted.to(DEVICE)
        # Verify-row inputs of every layer (spec order), as the forward saves.
        T = self.num_spec_tokens
        self.x = (torch.randn(3, T, CONV_DIM, generator=gen)).to(dtype).to(DEVICE)
        self.a = torch.randn(3, T, HV, generator=gen).to(dtype).to(DEVICE)
        self.b = torch.randn(3, T, HV, generator=gen).to(dtype).to(DEVICE)
        # State slots per group (slot 0: null); padding rows after them.
        self.slots = [[2, 3, 4], [7, 5, 9]]

    def metadata(self, pad_rows=0):
        mds = [
            spec_md(
                self.spec_qs + [self.num_spec_tokens] * pad_rows,
                slots + [0] * pad_rows,
                3,
                self.num_spec_tokens,
            )
            for slots in self.slots
        ]
        return {NAMES[0]: mds[0], NAMES[1]: mds[0], NAMES[2]: mds[1], ATTN: object()}

    def context(self, layers, dtype, kv_cache_groups=GROUPS):
        ctx = gdn_verify.DDTreeGDN(
            parent_idx=self.parent,
            draft_depth=self.depth,
            max_num_reqs=self.max_reqs,
            max_rows=32,
            num_layers=3,
            conv_dim=CONV_DIM,
            num_v_heads=HV,
            dtype=dtype,
            device=torch.device(DEVICE),
        )
        ctx.bind_layers(
            {layer.prefix: layer for layer in layers} | {ATTN: object()},
            kv_cache_groups,
        )
        ctx.prepare_step(self.batch)
        T = self.num_spec_tokens
        ctx.x_buf[:, :T] = self.x
        ctx.a_buf[:, :T] = self.a
        ctx.b_buf[:, :T] = self.b
        return ctx


def _snapshot(layers):
    return [[t.clone() for t in gdn_verify.gdn_layer_states(lay)] for lay in layers]


def _restore(layers, saved):
    for layer, (conv, ssm) in zip(layers, saved):
        c, s = gdn_verify.gdn_layer_states(layer)
        c.copy_(conv)
        s.copy_(ssm)


CASES = [
    # seed, budgets of batch rows 0 / 2 / 3, depth, accepted leaves
    (0, [6, 4, 7], 3, ["deep", "root", "random"]),
    (1, [7, 5, 3], 4, ["random", "deep", "root"]),
]


BF16 = torch.bfloat16
F32 = torch.float32


@pytest.mark.parametrize(
    "dtype, conv_dtype, ssm_dtype",
    [
        (F32, F32, F32),
        # bf16 model, float32 mamba caches (--mamba-cache-dtype float32).
        (BF16, F32, F32),
        # bf16 model and conv state, float32 / bf16 recurrent state. The
        # Triton interpreter multiplies two bf16 values wrongly (not IEEE),
        # so here the conv arithmetic is garbage, identically in both
        # implementations: the comparison checks the plumbing (dtypes,
        # addresses, the bf16 conv windows moved bit for bit); the values
        # are checked compiled, on CUDA (bench/kernels/gpu_checks.sh kernels).
        (BF16, BF16, F32),
        (BF16, BF16, BF16),
    ],
)
@pytest.mark.parametrize("seed, budgets, depth, leaves", CASES)
def test_commit_equals_the_per_layer_commit(
    seed, budgets, depth, leaves, dtype, conv_dtype, ssm_dtype
):
    layers = make_layers(seed, dtype, ssm_dtype, conv_dtype)
    step = Step(seed, budgets, depth, leaves, dtype)
    before = _snapshot(layers)

    # Oracle: the per-layer commit, on its own context.
    ref_ctx = step.context(layers, dtype)
    md = step.metadata(pad_rows=1)
    ref_post = commit_per_layer(
        ref_ctx, md, step.num_accepted, step.src_row, step.query_start_loc
    )
    expected = _snapshot(layers)
    _restore(layers, before)

    ctx = step.context(layers, dtype)
    ctx.attach(md)
    assert ctx.tables.layer_group_list == [0, 0, 1]
    ctx.commit(step.num_accepted, step.src_row, step.query_start_loc)
    got = _snapshot(layers)

    # The Triton interpreter is not IEEE in bf16: a product of two bf16
    # values is wrong (bf16 conv states: the conv arithmetic is garbage, the
    # same in both implementations, so only the plumbing is compared: dtypes,
    # addresses, the conv windows moved bit for bit), and a float32 -> bf16
    # cast truncates where torch (the oracle's cast) and CUDA round to
    # nearest (bf16 rows: the post-conv rows differ by up to one bf16 ulp).
    # Compiled, on CUDA (bench/kernels/gpu_checks.sh kernels), all cases are exact.
    interpreted = not torch.cuda.is_available() and dtype == BF16
    garbage = interpreted and conv_dtype == BF16
    truncated = interpreted and conv_dtype == F32
    tol = dict(rtol=2e-2, atol=2e-2) if truncated else dict(rtol=1e-6, atol=1e-6)
    for (conv, ssm), (ref_conv, ref_ssm) in zip(got, expected):
        assert torch.equal(conv, ref_conv)
        torch.testing.assert_close(ssm, ref_ssm, equal_nan=garbage, **tol)
        if not garbage:
            assert not ssm.isnan().any()
    # The path's post-conv rows, at the front of each spec row's block.
    for layer_idx, post in enumerate(ref_post):
        for t, r in enumerate(step.spec_rows):
            for k, node in enumerate(step.paths[r]):
                new = ctx.x_buf[layer_idx, step.spec_qs[t] + k].float()
                ref = post[step.spec_qs[t] + node].float()
                if garbage:
                    assert torch.equal(new.nan_to_num(), ref.nan_to_num())
                elif truncated:
                    ulp = 2.0 ** (torch.frexp(ref)[1] - 8).float()
                    assert torch.all((new - ref).abs() <= ulp)
                else:
                    assert torch.equal(new, ref)
    # Only the committed slots changed (layers 0 and 2 share their pages:
    # both groups' slots are written there).
    for i, ((conv, ssm), (conv0, ssm0)) in enumerate(zip(got, before)):
        touched = set(step.slots[0]) | (set(step.slots[1]) if i != 1 else set())
        for slot in set(range(NUM_BLOCKS)) - touched:
            assert torch.equal(conv[slot], conv0[slot])
            assert torch.equal(ssm[slot], ssm0[slot])
    # Root-only paths still advance by one step (the root).
    for r, path in step.paths.items():
        if len(path) == 1:
            slot = step.slots[0][step.spec_rows.index(r)]
            assert not torch.equal(got[0][1][slot], before[0][1][slot])


def test_commit_equals_upstream_decode_along_each_path(monkeypatch):
    """float32: every layer's committed states equal upstream's decode
    steps (`_forward_core`, non-speculative) over the accepted path."""
    layers = make_layers(3, torch.float32, torch.float32)
    step = Step(3, [5, 6, 4], 3, ["random", "root", "deep"], torch.float32)
    committed = [[t.clone() for t in layer.kv_cache] for layer in layers]
    ctx = step.context(layers, torch.float32)
    ctx.attach(step.metadata())
    ctx.commit(step.num_accepted, step.src_row, step.query_start_loc)
    for i, layer in enumerate(layers):
        conv, ssm = gdn_verify.gdn_layer_states(layer)
        for t, r in enumerate(step.spec_rows):
            slot = step.slots[0 if i < 2 else 1][t]
            rows = [step.spec_qs[t] + node for node in step.paths[r]]
            ref_conv, ref_ssm = replay_from(
                monkeypatch,
                layer,
                committed[i],
                slot,
                step.x[i][rows],
                step.b[i][rows],
                step.a[i][rows],
            )
            torch.testing.assert_close(ssm[slot], ref_ssm, rtol=1e-5, atol=1e-5)
            ref_ds = ref_conv if is_conv_state_dim_first() else ref_conv.T
            assert torch.equal(conv[slot][:, : W - 1], ref_ds[:, : W - 1])


def test_padding_rows_with_the_null_slot_are_skipped():
    """A launch over more spec rows than the step has (CUDA-graph padding:
    null slot) writes nothing for them, the null block included."""
    layers = make_layers(5, torch.float32, torch.float32)
    step = Step(5, [4, 3, 5], 3, ["deep", "random", "deep"], torch.float32)
    ctx = step.context(layers, torch.float32)
    before = _snapshot(layers)
    # Spec row 3 is padding: batch row 1 (one accepted token), slot 0.
    slots = torch.tensor(
        [s + [0] for s in step.slots], dtype=torch.int32, device=DEVICE
    )
    spec_batch_rows = torch.tensor([0, 2, 3, 1], dtype=torch.int64, device=DEVICE)
    qs = torch.tensor(step.spec_qs + [step.num_spec_tokens], dtype=torch.int32)
    x_before = ctx.x_buf.clone()
    gdn_commit.commit_accepted_paths(
        ctx.tables,
        ctx.x_buf,
        ctx.a_buf,
        ctx.b_buf,
        slots,
        spec_batch_rows,
        qs.to(DEVICE),
        step.num_accepted,
        step.src_row,
        step.query_start_loc,
        step.depth,
    )
    after = _snapshot(layers)
    for (conv, ssm), (conv0, ssm0) in zip(after, before):
        assert torch.equal(conv[0], conv0[0]) and torch.equal(ssm[0], ssm0[0])
    # The padding row's buffer rows (past the step's tokens) are untouched.
    T = step.num_spec_tokens
    assert torch.equal(ctx.x_buf[:, T:], x_before[:, T:])


@pytest.mark.parametrize("kv_cache_groups", [GROUPS, None])
def test_binding_compiles_the_commit_on_a_row_it_skips(monkeypatch, kv_cache_groups):
    """bind_layers launches the commit once, so that its kernels compile at
    startup and not at a server's first verify step: on one spec row with
    state slot 0 (per KV-cache group) and nothing accepted, which changes no
    state and no verify buffer."""
    layers = make_layers(6, torch.float32, torch.float32)
    before = _snapshot(layers)
    launches = []
    commit = gdn_verify.commit_accepted_paths

    def counted(*args, **kwargs):
        launches.append(args)
        return commit(*args, **kwargs)

    monkeypatch.setattr(gdn_verify, "commit_accepted_paths", counted)
    ctx = gdn_verify.DDTreeGDN(
        parent_idx=torch.zeros(6, 4, dtype=torch.int64, device=DEVICE),
        draft_depth=3,
        max_num_reqs=6,
        max_rows=32,
        num_layers=3,
        conv_dim=CONV_DIM,
        num_v_heads=HV,
        dtype=torch.float32,
        device=torch.device(DEVICE),
    )
    ctx.bind_layers(
        {layer.prefix: layer for layer in layers} | {ATTN: object()},
        kv_cache_groups,
    )
    assert len(launches) == 1
    slots = launches[0][4]
    groups = 1 if kv_cache_groups is None else 2
    assert slots.numel() == groups and not slots.any()
    # The runtime's dtypes (one compiled variant for both).
    assert slots.dtype == ctx.spec_batch_rows.dtype == torch.int32
    for (conv, ssm), (conv0, ssm0) in zip(_snapshot(layers), before):
        assert torch.equal(conv, conv0) and torch.equal(ssm, ssm0)
    for buf in (ctx.x_buf, ctx.a_buf, ctx.b_buf):
        assert not buf.any()


def test_kv_cache_groups_name_every_gdn_layer():
    layers = make_layers(0, torch.float32, torch.float32)
    step = Step(0, [3, 3, 3], 2, ["root", "root", "root"], torch.float32)
    with pytest.raises(ValueError, match="in no KV-cache group"):
        step.context(layers, torch.float32, kv_cache_groups=[[NAMES[0], NAMES[1]]])
    # Metadata that does not follow the groups is refused at the first step.
    ctx = step.context(layers, torch.float32)
    md = step.metadata()
    md[NAMES[1]] = md[NAMES[2]]
    with pytest.raises(RuntimeError, match="does not share"):
        ctx.attach(md)


def test_tables_refuse_layers_that_differ():
    layers = make_layers(0, torch.float32, torch.float32)
    step = Step(0, [3, 3, 3], 2, ["root", "root", "root"], torch.float32)
    layers[2].A_log = layers[2].A_log.to(torch.bfloat16)
    with pytest.raises(ValueError, match="differs from"):
        step.context(layers, torch.float32)
