# SPDX-License-Identifier: Apache-2.0
"""Chain speculation (upstream's spec-decode branch, not DDTree) through the
Gated DeltaNet layer in a mixed batch: a request's prefill chunk sits between
two spec-decode rows in the flat batch. The spec rows' q, k, v are gathered
by ``spec_token_indx``; their gates ``a`` and ``b`` must be gathered the same
way (vLLM 0.26.0 passed the batch's first rows). Each spec row's outputs must
equal upstream's one-token decode steps over its tokens from its committed
state. The convolutions and the prefill chunk's delta rule are torch
stand-ins (what is tested is the recurrent step's inputs), the same in the
reference."""

import pytest

torch = pytest.importorskip("torch")
qgdn = pytest.importorskip("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")

from test_ddtree_gdn_builder import B, builder, common  # noqa: E402
from test_ddtree_gdn_hybrid import (  # noqa: E402
    CONV_DIM,
    DEVICE,
    HV,
    K,
    V,
    make_layer,
    replay,
    run_core,
)

NUM_SLOTS = 3 * (B + 1) + 1


@pytest.fixture(autouse=True)
def _stand_ins(monkeypatch):
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.attention.backends.utils as backend_utils

    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    monkeypatch.setattr(backend_utils, "PIN_MEMORY", False)
    monkeypatch.setattr(qgdn, "causal_conv1d_fn", lambda x, *args, **kwargs: x.clone())
    monkeypatch.setattr(
        qgdn, "causal_conv1d_update", lambda x, *args, **kwargs: x.clone()
    )
    # vLLM 0.34.0 reads and writes the prefill rows' states with Triton
    # kernels for CUDA / XPU; the same gather and scatter in torch.
    if hasattr(qgdn, "gather_initial_states"):

        def gather(state, indices, has_initial_state):
            rows = state[indices.long()].clone()
            rows[~has_initial_state] = 0
            return rows

        def scatter(state, src, indices):
            state[indices.long()] = src.to(state.dtype)

        monkeypatch.setattr(qgdn, "gather_initial_states", gather)
        monkeypatch.setattr(qgdn, "scatter_states", scatter)


def chain_layer(seed):
    layer = make_layer(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    conv = torch.randn(NUM_SLOTS, *layer.kv_cache[0].shape[1:], generator=gen)
    ssm = torch.randn(NUM_SLOTS, HV, V, K, generator=gen) * 0.1
    layer.kv_cache = [conv.to(DEVICE), ssm.to(DEVICE)]

    def chunk_stub(q, k, v, initial_state, **kwargs):
        o = torch.zeros(*v.shape[:2], HV, V, device=v.device)
        return o, initial_state.clone()

    layer.chunk_gated_delta_rule = chunk_stub
    return layer


def layer_inputs(seed, num_tokens):
    """The layer's pre-conv rows and gates for a flat batch."""
    gen = torch.Generator().manual_seed(seed)
    mixed_qkv = torch.randn(num_tokens, CONV_DIM, generator=gen).to(DEVICE)
    a = torch.randn(num_tokens, HV, generator=gen).to(DEVICE)
    b = torch.randn(num_tokens, HV, generator=gen).to(DEVICE)
    return mixed_qkv, a, b


def chain_metadata(query_lens, context_lens, drafts):
    """Upstream's builder for chain speculation (B + 1 state columns per
    request, one per draft position); ``drafts`` -1 for a prefill row."""
    rows = len(query_lens)
    table = torch.arange(rows * (B + 1), dtype=torch.int32).view(rows, B + 1) + 1
    md = builder(B).build(
        0,
        common(query_lens, context_lens, table),
        num_accepted_tokens=torch.ones(rows, dtype=torch.int32, device=DEVICE),
        num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32),
    )
    return table, md


@pytest.mark.parametrize("drafts", [(2, 3), (4, 1)])
def test_chain_spec_rows_after_a_prefill_chunk_get_their_own_gates(monkeypatch, drafts):
    layer = chain_layer(3)
    n_a, prefill_len, n_b = 1 + drafts[0], 5, 1 + drafts[1]
    query_lens = [n_a, prefill_len, n_b]
    flat_a = list(range(n_a))
    flat_b = list(range(n_a + prefill_len, n_a + prefill_len + n_b))
    num_tokens = sum(query_lens)
    mixed_qkv, a, b = layer_inputs(30, num_tokens)
    table, md = chain_metadata(query_lens, [9, 0, 4], [n_a - 1, -1, n_b - 1])
    assert md.num_spec_decodes == 2 and md.num_prefills == 1
    assert md.spec_token_indx.tolist() == flat_a + flat_b
    committed = [t.clone() for t in layer.kv_cache]
    out = run_core(monkeypatch, layer, md, mixed_qkv, b, a, num_tokens)

    for row, flat in ((0, flat_a), (2, flat_b)):
        saved = layer.kv_cache
        layer.kv_cache = [t.clone() for t in committed]
        try:
            ref, _, _ = replay(
                monkeypatch,
                layer,
                int(table[row, 0]),
                mixed_qkv[flat],
                b[flat],
                a[flat],
            )
        finally:
            layer.kv_cache = saved
        torch.testing.assert_close(out[flat], torch.stack(ref), rtol=1e-5, atol=1e-5)


def test_a_spec_only_batch_keeps_its_rows_as_they_are(monkeypatch):
    """No prefill or decode rows: no gather (the CUDA-graph batch), and the
    same outputs as the decode steps."""
    layer = chain_layer(4)
    query_lens = [3, 2]
    num_tokens = sum(query_lens)
    mixed_qkv, a, b = layer_inputs(40, num_tokens)
    table, md = chain_metadata(query_lens, [9, 4], [2, 1])
    assert md.num_prefills == 0 and md.num_decodes == 0
    index_selects = []
    real_index_select = torch.Tensor.index_select

    def spy(self, *args, **kwargs):
        index_selects.append(tuple(self.shape))
        return real_index_select(self, *args, **kwargs)

    committed = [t.clone() for t in layer.kv_cache]
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "index_select", spy)
        out = run_core(monkeypatch, layer, md, mixed_qkv, b, a, num_tokens)
    assert (num_tokens, HV) not in index_selects
    layer.kv_cache = committed
    for row, flat in ((0, [0, 1, 2]), (1, [3, 4])):
        ref, _, _ = replay(
            monkeypatch,
            layer,
            int(table[row, 0]),
            mixed_qkv[flat],
            b[flat],
            a[flat],
        )
        torch.testing.assert_close(out[flat], torch.stack(ref), rtol=1e-5, atol=1e-5)
