# SPDX-License-Identifier: Apache-2.0
"""Float32 prefill of the Gated DeltaNet layers (patch
gdn-float32-prefill-through-the-recurrent-kernel): the FLA chunk kernels
refuse float32, so `ChunkGatedDeltaRule` routes float32 inputs through the
recurrent kernel. Checked against a plain PyTorch recurrence over variable-
length sequences with initial states (Triton interpreter on a CPU machine)."""

import math

import pytest
import torch

gdn = pytest.importorskip("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")
from vllm.triton_utils import tl, triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HV, K, V = 2, 4, 16, 48  # GVA (HV > H); V > 32: a masked value block


@pytest.fixture(autouse=True)
def _interpretable_exp(monkeypatch):
    """FLA's kernel calls ``exp``, a module-level alias of ``tl.exp``; the
    Triton interpreter patches ``tl`` itself but not such aliases, so under
    the interpreter the alias is pointed at a jitted wrapper (same math)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from vllm.third_party.flash_linear_attention.ops import fused_recurrent

    monkeypatch.setattr(fused_recurrent, "exp", _exp)


@triton.jit
def _exp(x):
    return tl.exp(x)


def _inputs(lengths, seed, l2norm):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen) * (1.0 if l2norm else 0.3)
    if not l2norm:  # the layer normalises before the prefill call
        q = q / q.norm(dim=-1, keepdim=True)
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen) + 2)
    beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen))
    h0 = torch.randn(len(lengths), HV, V, K, generator=gen) * 0.1
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return q, k, v, g, beta, h0, cu


def _reference(q, k, v, g, beta, h0, cu, l2norm):
    """The gated delta rule, token by token, in float64."""
    q, k, v, g, beta, h0 = (x.double() for x in (q, k, v, g, beta, h0))
    o = torch.zeros_like(v)
    final = h0.clone()
    scale = K**-0.5
    for n in range(h0.shape[0]):
        for hv in range(HV):
            h = h0[n, hv].clone()  # [V, K]
            for t in range(int(cu[n]), int(cu[n + 1])):
                qt, kt = q[0, t, hv // (HV // H)], k[0, t, hv // (HV // H)]
                if l2norm:
                    qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                    kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                h = h * math.exp(float(g[0, t, hv]))
                vt = (v[0, t, hv] - h @ kt) * beta[0, t, hv]
                h = h + torch.outer(vt, kt)
                o[0, t, hv] = h @ (qt * scale)
            final[n, hv] = h
    return o, final


@pytest.mark.parametrize(
    "lengths,l2norm", [([5, 1, 9], False), ([3, 7], True), ([1], False)]
)
def test_float32_prefill_matches_recurrence(lengths, l2norm):
    q, k, v, g, beta, h0, cu = _inputs(lengths, sum(lengths), l2norm)
    args = [x.to(DEVICE) for x in (q, k, v, g, beta, h0, cu)]
    h0_before = args[5].clone()
    out = torch.zeros(1, q.shape[1], HV, V, device=DEVICE)
    o, final = gdn.recurrent_prefill_gated_delta_rule(
        *args, use_qk_l2norm_in_kernel=l2norm, core_attn_out=out
    )
    ref_o, ref_final = _reference(q, k, v, g, beta, h0, cu, l2norm)
    assert o.dtype == final.dtype == torch.float32
    assert o.shape == (1, q.shape[1], HV, V) and final.shape == h0.shape
    torch.testing.assert_close(o.cpu().double(), ref_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.cpu().double(), ref_final, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, o)  # the caller's output buffer too
    assert torch.equal(args[5], h0_before)  # initial states are not written


def _bare_op(sentinel):
    op = gdn.ChunkGatedDeltaRule.__new__(gdn.ChunkGatedDeltaRule)
    torch.nn.Module.__init__(op)
    op._forward_method = sentinel
    return op


def test_dispatch_by_dtype():
    """float32 takes the recurrent path (equal-length [B, T] inputs too);
    bf16 keeps the configured chunk backend."""
    calls = []
    op = _bare_op(lambda *a, **kw: calls.append(a[0].dtype) or "chunk")
    lengths = [4, 4]
    q, k, v, g, beta, h0, cu = _inputs(lengths, 1, False)
    assert op(q.bfloat16(), k, v, g, beta, h0, True, cu) == "chunk"
    assert calls == [torch.bfloat16]
    batched = [x.reshape(2, 4, *x.shape[2:]).to(DEVICE) for x in (q, k, v, g, beta)]
    o, final = op(*batched, h0.to(DEVICE), True)
    assert calls == [torch.bfloat16]  # not called for float32
    ref_o, ref_final = _reference(q, k, v, g, beta, h0, cu, False)
    assert o.shape == (2, 4, HV, V)
    torch.testing.assert_close(
        o.reshape(1, 8, HV, V).cpu().double(), ref_o, rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(final.cpu().double(), ref_final, rtol=1e-4, atol=1e-5)


def test_index_rows_bucketed(monkeypatch):
    """The slot-index rows' stride is a constexpr of the recurrent kernel:
    each new value is a Triton compile (~1 s on the H200, seen as a 10x
    slower float32 hybrid engine). Prefill sizes 1..300 must give a handful
    of strides, each covering its batch's tokens."""
    seen = {}

    def fake_kernel(**kw):
        idx = kw["ssm_state_indices"]
        seen[kw["q"].shape[1]] = idx.stride(0)
        assert idx.shape[1] >= kw["q"].shape[1]  # every token has its slot
        return kw["v"].clone(), None

    monkeypatch.setattr(gdn, "fused_recurrent_gated_delta_rule", fake_kernel)
    for num_tokens in range(1, 301):
        q = torch.zeros(1, num_tokens, H, K)
        v = torch.zeros(1, num_tokens, HV, V)
        g = beta = torch.zeros(1, num_tokens, HV)
        h0 = torch.zeros(2, HV, V, K)
        cu = torch.tensor([0, num_tokens // 2, num_tokens], dtype=torch.int32)
        gdn.recurrent_prefill_gated_delta_rule(q, q, v, g, beta, h0, cu)
    assert len(seen) == 300
    assert len(set(seen.values())) <= 10, sorted(set(seen.values()))
