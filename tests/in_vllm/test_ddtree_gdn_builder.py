# SPDX-License-Identifier: Apache-2.0
"""DDTree hybrid path with upstream's real GDN metadata builder: one state
column per spec row under DDTree (num_speculative_blocks = 0), and a mixed
verify batch (prefill chunk + draft trees) through the real `_forward_core`,
whose spec rows must still match upstream's decode over every path, and
whose post-walk commit must follow the spec rows' batch positions."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
qgdn = pytest.importorskip("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")

from test_ddtree_gdn_hybrid import (  # noqa: E402
    CONV_DIM,
    DEVICE,
    HV,
    Case,
    K,
    V,
    W,
    assert_slot_is_replay,
    gdn_context,
    make_layer,
    path_of,
    replay,
    run_core,
)

from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import (  # noqa: E402
    GDNAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

B = 6  # tree budget = num_speculative_tokens


@pytest.fixture(autouse=True)
def _no_pinned_memory(monkeypatch):
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.attention.backends.utils as backend_utils

    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    monkeypatch.setattr(backend_utils, "PIN_MEMORY", False)


def builder(num_speculative_blocks, cudagraph_mode=CUDAGraphMode.NONE):
    vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_mode=cudagraph_mode, max_cudagraph_capture_size=None
        ),
        # use_eagle_block_drop (vLLM 0.33's prefill checkpoints): DDTree drafts
        # with DFlash, which keeps the trailing prefix-cache block.
        speculative_config=SimpleNamespace(
            num_speculative_tokens=B,
            parallel_drafting=False,
            use_eagle_block_drop=lambda: False,
            # vLLM 0.33+ (DFlash's drafting slots are not the GDN builder's).
            enable_adaptive_verification=False,
            max_num_new_slots_for_drafting=0,
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_mode="none"),
        additional_config={},
        use_v2_model_runner=True,  # DDTree's runner (read by vLLM 0.33)
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(linear_key_head_dim=K)
        ),
    )
    spec = MambaSpec(
        block_size=1024,
        shapes=((W - 1, CONV_DIM), (HV, V, K)),
        dtypes=(torch.float32, torch.float32),
        num_speculative_blocks=num_speculative_blocks,
    )
    return GDNAttentionMetadataBuilder(spec, ["l"], vllm_config, torch.device(DEVICE))


def common(query_lens, context_lens, block_table):
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32) + torch.tensor(
        query_lens, dtype=torch.int32
    )
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE),
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens.to(DEVICE),
        num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table.to(DEVICE),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=DEVICE),
    )


@pytest.mark.parametrize("cudagraph_mode", [CUDAGraphMode.NONE, CUDAGraphMode.FULL])
def test_ddtree_spec_rows_get_one_state_column(cudagraph_mode):
    # Block tables as the V2 runner has them for mamba_cache_mode "none":
    # 1 + num_speculative_blocks columns.
    ddtree = builder(0, cudagraph_mode)
    assert ddtree.num_state_cols == 1
    assert ddtree.spec_state_indices_tensor.shape[1] == 1
    m = common([4, 3], [10, 7], torch.tensor([[5], [3]], dtype=torch.int32))
    md = ddtree.build(
        0,
        m,
        num_accepted_tokens=torch.ones(2, dtype=torch.int32, device=DEVICE),
        num_decode_draft_tokens_cpu=torch.tensor([3, 2], dtype=torch.int32),
    )
    assert md.num_spec_decodes == 2
    assert md.spec_state_indices_tensor.tolist() == [[5], [3]]
    assert md.spec_query_start_loc.tolist() == [0, 4, 7]
    # Upstream chain speculation keeps its B + 1 slots per request.
    chain = builder(B, cudagraph_mode)
    assert chain.spec_state_indices_tensor.shape[1] == B + 1
    table = torch.arange(2 * (B + 1), dtype=torch.int32).view(2, B + 1) + 1
    md = chain.build(
        0,
        common([4, 3], [10, 7], table),
        num_accepted_tokens=torch.ones(2, dtype=torch.int32, device=DEVICE),
        num_decode_draft_tokens_cpu=torch.tensor([3, 2], dtype=torch.int32),
    )
    assert md.spec_state_indices_tensor.tolist() == table.tolist()


def stub_prefill_kernels(monkeypatch, layer):
    """The prefill chunk's kernels (causal_conv1d_fn's and FLA's chunked
    delta rule) do not run in the Triton interpreter and are not what is
    tested here: torch stand-ins that leave a mark (7.0) in the prefill
    slot; on vLLM 0.33+ the chunk kernel's state gather and scatter (CUDA
    kernels) around it too."""
    monkeypatch.setattr(qgdn, "causal_conv1d_fn", lambda x, *args, **kwargs: x.clone())

    def chunk_stub(q, k, v, initial_state, **kwargs):
        o = torch.zeros(*v.shape[:2], HV, V, device=v.device)
        return o, torch.full_like(initial_state, 7.0)

    layer.chunk_gated_delta_rule = chunk_stub
    if hasattr(qgdn, "gather_initial_states"):
        layer.gdn_prefill_backend = "triton"

        def gather(state, indices, has_initial_state):
            mask = has_initial_state.view(-1, *[1] * (state.ndim - 1))
            return torch.where(mask, state[indices.long()], 0.0)

        def scatter(state, src, indices):
            state[indices.long()] = src.to(state.dtype)

        monkeypatch.setattr(qgdn, "gather_initial_states", gather)
        monkeypatch.setattr(qgdn, "scatter_states", scatter)


def test_mixed_batch_spec_rows_and_commit(monkeypatch):
    """Batch: [tree of request A, prefill chunk of request P, tree of B]."""
    case = Case(7, [5, 3], 3)
    layer = make_layer(7)
    stub_prefill_kernels(monkeypatch, layer)
    committed = [t.clone() for t in layer.kv_cache]
    gen = torch.Generator().manual_seed(70)
    prefill_len = 3
    n_a, n_b = 1 + case.budgets[0], 1 + case.budgets[1]
    query_lens = [n_a, prefill_len, n_b]
    # Batch rows: A, P, B; rows of the flat batch of each.
    flat_a = list(range(0, n_a))
    flat_p = list(range(n_a, n_a + prefill_len))
    flat_b = list(range(n_a + prefill_len, n_a + prefill_len + n_b))
    num_tokens = sum(query_lens)
    wide = torch.randn(num_tokens, CONV_DIM + 5, generator=gen).to(DEVICE)
    mixed_qkv = wide[:, 1 : 1 + CONV_DIM]
    mixed_qkv[flat_a] = case.mixed_qkv[:n_a]
    mixed_qkv[flat_b] = case.mixed_qkv[n_a : n_a + n_b]
    a = torch.randn(num_tokens, HV, generator=gen).to(DEVICE)
    b = torch.randn(num_tokens, HV, generator=gen).to(DEVICE)
    a[flat_a], a[flat_b] = case.a[:n_a], case.a[n_a : n_a + n_b]
    b[flat_a], b[flat_b] = case.b[:n_a], case.b[n_a : n_a + n_b]

    slot_a, slot_p, slot_b = case.slots[0], 6, case.slots[1]
    md = builder(0).build(
        0,
        common(
            query_lens,
            [9, 0, 4],
            torch.tensor([[slot_a], [slot_p], [slot_b]], dtype=torch.int32),
        ),
        num_accepted_tokens=torch.ones(3, dtype=torch.int32, device=DEVICE),
        num_decode_draft_tokens_cpu=torch.tensor(
            [n_a - 1, -1, n_b - 1], dtype=torch.int32
        ),
    )
    assert md.num_spec_decodes == 2 and md.num_prefills == 1

    ctx = gdn_context(case.parent, case.depth, case.max_reqs, max_rows=32)
    ctx.bind_layers({layer.prefix: layer})
    idx_mapping = case.idx_mapping.numpy().astype(np.int32)
    ctx.prepare_step(
        SimpleNamespace(
            num_reqs=3,
            num_draft_tokens_per_req=np.array([n_a - 1, 0, n_b - 1], dtype=np.int32),
            num_scheduled_tokens=np.array(query_lens, dtype=np.int32),
            idx_mapping_np=np.array(
                [idx_mapping[0], 7, idx_mapping[1]], dtype=np.int32
            ),
        )
    )
    out = run_core(monkeypatch, layer, md, mixed_qkv, b, a, num_tokens)
    ctx.attach({layer.prefix: md})

    # Spec rows saved in spec order (A's rows, then B's).
    spec_rows = flat_a + flat_b
    assert torch.equal(ctx.x_buf[0, : n_a + n_b], mixed_qkv[spec_rows])
    assert torch.equal(ctx.a_buf[0, : n_a + n_b], a[spec_rows])
    assert torch.equal(ctx.b_buf[0, : n_a + n_b], b[spec_rows])
    # Tree outputs of both spec rows, around the prefill row.
    for r, flat in ((0, flat_a), (1, flat_b)):
        parent_row = case.parent[int(case.idx_mapping[r])].cpu()
        for node in range(len(flat)):
            rows = [flat[i] for i in path_of(parent_row, node)]
            ref, _, _ = replay(
                monkeypatch, layer, case.slots[r], mixed_qkv[rows], b[rows], a[rows]
            )
            torch.testing.assert_close(out[flat[node]], ref[-1], rtol=1e-5, atol=1e-5)
    # The prefill row wrote its own slot; the tree slots are untouched.
    assert torch.all(layer.kv_cache[1][slot_p] == 7.0)
    for slot in (slot_a, slot_b):
        assert torch.equal(layer.kv_cache[0][slot], committed[0][slot])
        assert torch.equal(layer.kv_cache[1][slot], committed[1][slot])

    # The walk, per batch row (the prefill row accepts only its root).
    path_a = path_of(case.parent[int(case.idx_mapping[0])].cpu(), n_a - 1)
    path_b = path_of(case.parent[int(case.idx_mapping[1])].cpu(), 1)
    src_row = torch.tensor(
        [
            [flat_a[i] for i in path_a] + [flat_a[0]] * (4 - len(path_a)),
            [flat_p[-1]] * 4,
            [flat_b[i] for i in path_b] + [flat_b[0]] * (4 - len(path_b)),
        ],
        dtype=torch.int64,
        device=DEVICE,
    )
    num_accepted = torch.tensor(
        [len(path_a), 1, len(path_b)], dtype=torch.int32, device=DEVICE
    )
    query_start = torch.tensor(
        [0, n_a, n_a + prefill_len, num_tokens], dtype=torch.int32, device=DEVICE
    )
    states_before_commit = [t.clone() for t in layer.kv_cache]
    ctx.commit(num_accepted, src_row, query_start)
    assert torch.equal(layer.kv_cache[1][slot_p], states_before_commit[1][slot_p])
    for slot, flat, path in ((slot_a, flat_a, path_a), (slot_b, flat_b, path_b)):
        rows = [flat[i] for i in path]
        assert_slot_is_replay(
            monkeypatch, layer, committed, slot, mixed_qkv[rows], b[rows], a[rows]
        )
