# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-request tree attention (per-sequence ``qq_bias``) in the Triton
unified attention kernel, and the DDTree bias helpers.

Runs against whatever ``vllm`` is importable (CI: our built wheel, so the
patched files are in place).  Two modes:

* CPU, Triton interpreter (no GPU needed)::

      TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" \
          pytest tests/in_vllm/test_tree_attention.py

  Without those variables and without CUDA, ``test_cpu_interpreter`` re-runs
  this file in a subprocess with them set.

* GPU (``-m gpu``): the same small cases plus bf16 / fp32 cases with
  T = 65 / 257 and contexts of 1000+ tokens, and a CUDA-graph replay case.

Both bias layouts: float (``[T, T]`` / ``[num_seqs, T, T]``, additive) and
packed (int32 ``[..., T, ceil(T / 32)]``, one bit per query/key pair, set =
-inf: what DDTree's verifier hands the kernel).
"""

import os
import subprocess
import sys

import pytest
import torch

try:
    import vllm.v1.attention.ops.triton_unified_attention as tua
    from vllm.v1.kv_cache_interface import KVQuantMode
except Exception as e:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"vllm (patched tree) is not importable: {e!r}", allow_module_level=True
    )

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available() and not INTERPRET
# Small kernel cases run in the interpreter on CPU, or natively on a GPU.
KERNEL_DEVICE = "cpu" if INTERPRET else ("cuda" if HAS_CUDA else None)

needs_kernel = pytest.mark.skipif(
    KERNEL_DEVICE is None,
    reason="needs CUDA, or TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES='' for CPU",
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
# fp32 tl.dot runs in TF32 on NVIDIA GPUs; the interpreter computes in fp32.
TOL = 2e-3 if INTERPRET else 1e-2
# Same math through differently specialised kernels: exact on CPU.
EXACT_TOL = 0.0 if INTERPRET else 1e-5

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def random_parents(tree_size: int, gen: torch.Generator) -> list[int]:
    """Random tree, parents before children; node 0 is the root."""
    parents = [-1]
    for i in range(1, tree_size):
        parents.append(int(torch.randint(0, i, (1,), generator=gen)))
    return parents


def ancestor_mask_ref(parents: list[int]) -> torch.Tensor:
    t = len(parents)
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def tree_bias(mask: torch.Tensor) -> torch.Tensor:
    bias = torch.zeros(mask.shape, dtype=torch.float32)
    bias.masked_fill_(~mask, NEG_INF)
    return bias


def pack_bits(masked_out: torch.Tensor, pad_bit: int = 1) -> torch.Tensor:
    """``[..., T, T]`` bool (True = -inf) -> the packed layout, int32
    ``[..., T, ceil(T / 32)]``: bit ``k % 32`` of word ``k // 32``. The bits
    past key ``T - 1`` are ``pad_bit`` (the kernel must never read them)."""
    t = masked_out.shape[-1]
    words = (t + 31) // 32
    lead = masked_out.shape[:-1]
    bits = torch.full((*lead, words * 32), pad_bit, dtype=torch.int64)
    bits[..., :t] = masked_out.to(torch.int64)
    packed = (bits.view(*lead, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def garbage_bias(shape, gen: torch.Generator) -> torch.Tensor:
    """Random 0 / -inf entries: what a slot holds where nothing reads it."""
    return tree_bias(torch.rand(shape, generator=gen) < 0.5)


def make_paged_kv(kv_lens, num_kv_heads, head_size, block_size, dtype, device, gen):
    max_blocks = max((n + block_size - 1) // block_size for n in kv_lens)
    num_blocks = len(kv_lens) * max_blocks + 3
    key_cache = torch.randn(
        num_blocks, block_size, num_kv_heads, head_size, generator=gen
    ).to(device=device, dtype=dtype)
    value_cache = torch.randn(
        num_blocks, block_size, num_kv_heads, head_size, generator=gen
    ).to(device=device, dtype=dtype)
    # Scattered, non-overlapping blocks.
    perm = torch.randperm(num_blocks, generator=gen)[: len(kv_lens) * max_blocks]
    block_table = perm.view(len(kv_lens), max_blocks).to(torch.int32).to(device)
    return key_cache, value_cache, block_table


def gather_kv(cache, block_table_row, kv_len):
    block_size = cache.shape[1]
    nblocks = (kv_len + block_size - 1) // block_size
    blocks = cache[block_table_row[:nblocks].long()]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:kv_len]


def ref_attention(
    query, key_cache, value_cache, block_table, query_lens, kv_lens, scale, biases
):
    """float32 softmax attention with explicit causal + per-seq tree mask.

    ``biases[s]`` is None or a ``[T, T]`` bias applied to the first ``T``
    query rows of sequence ``s`` and its last ``query_len`` keys from
    ``context_len`` on (exactly the kernel's contract).
    """
    out = torch.empty(query.shape, dtype=torch.float32)
    num_q_heads = query.shape[1]
    start = 0
    for s, (qlen, kvlen) in enumerate(zip(query_lens, kv_lens)):
        q = query[start : start + qlen].float().cpu()
        k = gather_kv(key_cache, block_table[s], kvlen).float().cpu()
        v = gather_kv(value_cache, block_table[s], kvlen).float().cpu()
        group = num_q_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        ctx = kvlen - qlen
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        qpos = torch.arange(qlen)[:, None] + ctx
        kpos = torch.arange(kvlen)[None, :]
        add = torch.zeros(qlen, kvlen)
        add.masked_fill_(kpos > qpos, NEG_INF)
        bias = biases[s]
        if bias is not None:
            t = bias.shape[0]
            rows = min(t, qlen)
            cols = min(t, kvlen - ctx)
            add[:rows, ctx : ctx + cols] += bias[:rows, :cols].cpu()
        probs = torch.softmax(scores + add, dim=-1)
        out[start : start + qlen] = torch.einsum("hqk,khd->qhd", probs, v)
        start += qlen
    return out


def build_case(
    tree_size,
    specs,
    num_q_heads,
    num_kv_heads,
    head_size,
    block_size,
    dtype,
    device,
    seed,
    extra_slots=2,
    layout="float",
):
    """``specs``: list of (kind, context_len); kind in tree / subtree / plain
    / prefill / short (``subtree``: a tree of fewer than T nodes, as a request
    verifying a smaller budget, whose slot's other rows and columns hold
    garbage). Returns the inputs, the per-seq bias buffer and the per-seq
    reference biases. ``layout``: ``float`` (NaN in unused slots so that
    stray reads show up) or ``bits`` (packed; random words in unused slots,
    set bits past T)."""
    gen = torch.Generator().manual_seed(seed)
    t = tree_size
    query_lens, kv_lens, ref_biases = [], [], []
    buf = torch.full((len(specs) + extra_slots, t, t), float("nan"))
    for s, (kind, ctx) in enumerate(specs):
        if kind == "tree":
            qlen = t
            bias = tree_bias(ancestor_mask_ref(random_parents(t, gen)))
            buf[s] = bias
            ref_biases.append(bias)
        elif kind == "subtree":
            qlen = max(2, t - 2)
            bias = tree_bias(ancestor_mask_ref(random_parents(qlen, gen)))
            buf[s] = garbage_bias((t, t), gen)
            buf[s, :qlen, :qlen] = bias
            ref_biases.append(bias)
        else:
            qlen = {"plain": 1, "short": max(2, t // 2), "prefill": 2 * t + 3}[kind]
            buf[s] = 0.0
            ref_biases.append(None)
        query_lens.append(qlen)
        kv_lens.append(ctx + qlen)
    if layout == "bits":
        slots = len(specs)
        packed = pack_bits(torch.isneginf(buf))
        packed[slots:] = torch.randint(
            -(2**31), 2**31, packed[slots:].shape, generator=gen, dtype=torch.int64
        ).to(torch.int32)
        buf = packed
    else:
        assert layout == "float", layout
    return dict(
        **case_inputs(
            query_lens,
            kv_lens,
            num_q_heads,
            num_kv_heads,
            head_size,
            block_size,
            dtype,
            device,
            gen,
        ),
        bias_buf=buf.to(device),
        ref_biases=ref_biases,
    )


def case_inputs(
    query_lens,
    kv_lens,
    num_q_heads,
    num_kv_heads,
    head_size,
    block_size,
    dtype,
    device,
    gen,
):
    """Random queries and a paged KV cache for sequences of ``query_lens``
    query tokens and ``kv_lens`` keys."""
    query = torch.randn(sum(query_lens), num_q_heads, head_size, generator=gen)
    query = query.to(device=device, dtype=dtype)
    key_cache, value_cache, block_table = make_paged_kv(
        kv_lens, num_kv_heads, head_size, block_size, dtype, device, gen
    )
    cu = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        cu_seqlens_q=cu.to(device),
        seqused_k=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        query_lens=query_lens,
        kv_lens=kv_lens,
    )


def run_kernel(case, qq_bias, force_3d=False, out=None):
    query = case["query"]
    num_q_heads, head_size = query.shape[1], query.shape[2]
    num_tokens = query.shape[0]
    num_segments = 4
    hs_pad = 1 << (head_size - 1).bit_length()
    dev = query.device
    segm_out = torch.empty(
        num_tokens, num_q_heads, num_segments, hs_pad, dtype=torch.float32, device=dev
    )
    segm_max = torch.empty(
        num_tokens, num_q_heads, num_segments, dtype=torch.float32, device=dev
    )
    segm_expsum = torch.empty_like(segm_max)
    if out is None:
        out = torch.empty_like(query)
    tua.unified_attention(
        q=query,
        k=case["key_cache"],
        v=case["value_cache"],
        out=out,
        cu_seqlens_q=case["cu_seqlens_q"],
        # The kernel only uses max_seqlen_q to choose 2D vs 3D; passing 1
        # forces the 3D (split-KV segments) path for multi-token queries.
        max_seqlen_q=1 if force_3d else max(case["query_lens"]),
        seqused_k=case["seqused_k"],
        max_seqlen_k=max(case["kv_lens"]),
        softmax_scale=head_size**-0.5,
        causal=True,
        window_size=(-1, -1),
        block_table=case["block_table"],
        softcap=0,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        seq_threshold_3D=1 << 20,
        num_par_softmax_segments=num_segments,
        softmax_segm_output=segm_out,
        softmax_segm_max=segm_max,
        softmax_segm_expsum=segm_expsum,
        qq_bias=qq_bias,
        kv_quant_mode=KVQuantMode.NONE,
    )
    return out


def reference(case):
    q = case["query"]
    return ref_attention(
        q,
        case["key_cache"],
        case["value_cache"],
        case["block_table"].cpu(),
        case["query_lens"],
        case["kv_lens"],
        q.shape[2] ** -0.5,
        case["ref_biases"],
    )


# Mixed batch: trees with different masks and contexts, a plain decode, a
# prefill longer than T (chunked: with context), a short spec-decode-like
# request (query shorter than T), a tree with an empty context, a tree
# smaller than T.
MIXED_SPECS = [
    ("tree", 20),
    ("plain", 33),
    ("tree", 7),
    ("prefill", 18),
    ("tree", 40),
    ("short", 5),
    ("tree", 0),
    ("subtree", 12),
]

SMALL = dict(num_q_heads=4, num_kv_heads=2, head_size=32, block_size=16)


# ----------------------------------------------------------------------------
# Kernel tests (CPU interpreter or GPU)
# ----------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("tree_size", [5, 6, 7, 8, 9])
def test_per_seq_tree_bias_2d(tree_size):
    case = build_case(
        tree_size,
        MIXED_SPECS,
        dtype=torch.float32,
        device=KERNEL_DEVICE,
        seed=tree_size,
        **SMALL,
    )
    out = run_kernel(case, case["bias_buf"])
    ref = reference(case)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref, atol=TOL, rtol=TOL)
    # Not vacuous: without the tree masks the result would differ.
    case["ref_biases"] = [None] * len(MIXED_SPECS)
    assert (out.float().cpu() - reference(case)).abs().max() > 0.1


@needs_kernel
@pytest.mark.parametrize("tree_size", [5, 9])
def test_per_seq_tree_bias_3d(tree_size):
    """The 3D (segmented) path shares the masking code; force it."""
    case = build_case(
        tree_size,
        MIXED_SPECS,
        dtype=torch.float32,
        device=KERNEL_DEVICE,
        seed=100 + tree_size,
        **SMALL,
    )
    out = run_kernel(case, case["bias_buf"], force_3d=True)
    ref = reference(case)
    torch.testing.assert_close(out.float().cpu(), ref, atol=TOL, rtol=TOL)


@needs_kernel
def test_decode_only_batch_3d_with_bias():
    """A decode-only batch (max_seqlen_q == 1) takes the 3D path for real;
    the per-seq bias must be accepted there and change nothing."""
    specs = [("plain", 20), ("plain", 45), ("plain", 3)]
    case = build_case(
        6, specs, dtype=torch.float32, device=KERNEL_DEVICE, seed=7, **SMALL
    )
    out_bias = run_kernel(case, case["bias_buf"])
    out_none = run_kernel(case, None)
    torch.testing.assert_close(out_bias, out_none, atol=EXACT_TOL, rtol=EXACT_TOL)
    torch.testing.assert_close(
        out_bias.float().cpu(), reference(case), atol=TOL, rtol=TOL
    )


@needs_kernel
@pytest.mark.parametrize("force_3d", [False, True])
def test_per_seq_equals_shared_bias(force_3d):
    """Every slot holding the same bias == the old shared [T, T] form."""
    t = 7
    case = build_case(
        t, MIXED_SPECS, dtype=torch.float32, device=KERNEL_DEVICE, seed=11, **SMALL
    )
    gen = torch.Generator().manual_seed(3)
    shared = tree_bias(ancestor_mask_ref(random_parents(t, gen))).to(KERNEL_DEVICE)
    per_seq = shared.expand(len(MIXED_SPECS), t, t).contiguous()
    out_shared = run_kernel(case, shared, force_3d=force_3d)
    out_per_seq = run_kernel(case, per_seq, force_3d=force_3d)
    torch.testing.assert_close(out_per_seq, out_shared, atol=EXACT_TOL, rtol=EXACT_TOL)
    case["ref_biases"] = [shared.cpu()] * len(MIXED_SPECS)
    torch.testing.assert_close(
        out_shared.float().cpu(), reference(case), atol=TOL, rtol=TOL
    )


@needs_kernel
def test_zero_bias_matches_no_bias():
    case = build_case(
        8, MIXED_SPECS, dtype=torch.float32, device=KERNEL_DEVICE, seed=5, **SMALL
    )
    zeros = torch.zeros_like(case["bias_buf"])
    out_zero = run_kernel(case, zeros)
    out_none = run_kernel(case, None)
    torch.testing.assert_close(out_zero, out_none, atol=1e-6, rtol=1e-6)


@needs_kernel
def test_bad_bias_shapes_rejected():
    case = build_case(
        5,
        MIXED_SPECS[:2],
        dtype=torch.float32,
        device=KERNEL_DEVICE,
        seed=1,
        extra_slots=0,
        **SMALL,
    )
    with pytest.raises(AssertionError):
        run_kernel(case, case["bias_buf"][:1])  # fewer slots than seqs
    with pytest.raises(AssertionError):
        run_kernel(case, case["bias_buf"][:, :, :4])  # not square


# ---------------------------------------------------------------------------
# Packed bits: int32 [..., T, ceil(T / 32)], one bit per query/key pair
# ---------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("tree_size", [5, 9, 32, 33])
def test_packed_tree_bias_2d(tree_size):
    """32: one full word (bit 31 is the sign bit); 33: a key tile spans two
    words."""
    case = build_case(
        tree_size,
        MIXED_SPECS,
        dtype=torch.float32,
        device=KERNEL_DEVICE,
        seed=200 + tree_size,
        layout="bits",
        **SMALL,
    )
    assert case["bias_buf"].dtype == torch.int32
    assert case["bias_buf"].shape[-1] == (tree_size + 31) // 32
    out = run_kernel(case, case["bias_buf"])
    ref = reference(case)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref, atol=TOL, rtol=TOL)
    case["ref_biases"] = [None] * len(MIXED_SPECS)
    assert (out.float().cpu() - reference(case)).abs().max() > 0.1


@needs_kernel
@pytest.mark.parametrize("tree_size", [9])
def test_packed_tree_bias_3d(tree_size):
    case = build_case(
        tree_size,
        MIXED_SPECS,
        dtype=torch.float32,
        device=KERNEL_DEVICE,
        seed=300 + tree_size,
        layout="bits",
        **SMALL,
    )
    out = run_kernel(case, case["bias_buf"], force_3d=True)
    torch.testing.assert_close(out.float().cpu(), reference(case), atol=TOL, rtol=TOL)


@needs_kernel
@pytest.mark.parametrize("force_3d", [False, True])
def test_packed_equals_float_bias(force_3d):
    """The same masks as bits and as a float bias: the same scores, so the
    same outputs (0 and -inf are exact in either)."""
    # 3D: split-KV segments, slower in the interpreter; 2D covers two words.
    t = 9 if force_3d else 33
    case = build_case(
        t, MIXED_SPECS, dtype=torch.float32, device=KERNEL_DEVICE, seed=17, **SMALL
    )
    bits = pack_bits(torch.isneginf(case["bias_buf"].cpu())).to(KERNEL_DEVICE)
    out_float = run_kernel(case, case["bias_buf"], force_3d=force_3d)
    out_bits = run_kernel(case, bits, force_3d=force_3d)
    torch.testing.assert_close(out_bits, out_float, atol=EXACT_TOL, rtol=EXACT_TOL)


@needs_kernel
def test_packed_shared_bias_equals_per_seq():
    t = 33
    case = build_case(
        t, MIXED_SPECS, dtype=torch.float32, device=KERNEL_DEVICE, seed=13, **SMALL
    )
    gen = torch.Generator().manual_seed(4)
    mask = ancestor_mask_ref(random_parents(t, gen))
    shared = pack_bits(~mask).to(KERNEL_DEVICE)
    per_seq = shared.expand(len(MIXED_SPECS), *shared.shape).contiguous()
    out_shared = run_kernel(case, shared)
    out_per_seq = run_kernel(case, per_seq)
    torch.testing.assert_close(out_per_seq, out_shared, atol=EXACT_TOL, rtol=EXACT_TOL)
    case["ref_biases"] = [tree_bias(mask)] * len(MIXED_SPECS)
    torch.testing.assert_close(
        out_shared.float().cpu(), reference(case), atol=TOL, rtol=TOL
    )


@needs_kernel
def test_packed_zero_words_match_no_bias():
    case = build_case(
        9, MIXED_SPECS, dtype=torch.float32, device=KERNEL_DEVICE, seed=6, **SMALL
    )
    zeros = torch.zeros(len(MIXED_SPECS), 9, 1, dtype=torch.int32, device=KERNEL_DEVICE)
    out_zero = run_kernel(case, zeros)
    out_none = run_kernel(case, None)
    torch.testing.assert_close(out_zero, out_none, atol=EXACT_TOL, rtol=EXACT_TOL)


@needs_kernel
def test_bad_packed_shapes_rejected():
    case = build_case(
        33,
        MIXED_SPECS[:2],
        dtype=torch.float32,
        device=KERNEL_DEVICE,
        seed=1,
        extra_slots=0,
        layout="bits",
        **SMALL,
    )
    bits = case["bias_buf"]
    with pytest.raises(AssertionError):
        run_kernel(case, bits[:1])  # fewer slots than seqs
    with pytest.raises(AssertionError):
        run_kernel(case, bits[:, :, :1])  # 33 keys need 2 words
    with pytest.raises(AssertionError):
        # The INT4 path keeps a shared float bias only.
        tua.unified_attention(
            q=case["query"],
            k=case["key_cache"],
            v=case["value_cache"],
            out=torch.empty_like(case["query"]),
            cu_seqlens_q=case["cu_seqlens_q"],
            max_seqlen_q=max(case["query_lens"]),
            seqused_k=case["seqused_k"],
            max_seqlen_k=max(case["kv_lens"]),
            softmax_scale=1.0,
            causal=True,
            window_size=(-1, -1),
            block_table=case["block_table"],
            softcap=0,
            q_descale=None,
            k_descale=None,
            v_descale=None,
            qq_bias=bits[0],
            kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD,
        )


@needs_kernel
def test_verifier_bias_kernel_feeds_the_attention_kernel():
    """DDTree's writer (`ddtree_tree_bias`) into `tree_bias_buffer`, read by
    the attention kernel: a prefill (no tree), a full tree of B nodes, a
    request verifying only its first 5 of B nodes (the slot's other rows
    hold the rest of its stored tree), a plain decode; the buffer has more
    slots than the batch, with stale words."""
    from vllm.v1.worker.gpu.spec_decode.ddtree import kernels

    budget, depth, max_reqs = 40, 6, 6
    gen = torch.Generator().manual_seed(21)
    # Parents (verify index, 0 = root) of nodes 1..B, parents first, depth
    # at most `depth`.
    parent_idx = torch.zeros(max_reqs, budget, dtype=torch.int64)
    for r in range(max_reqs):
        node_depth = [0]
        for i in range(1, budget + 1):
            choices = [p for p in range(i) if node_depth[p] < depth]
            p = choices[int(torch.randint(0, len(choices), (1,), generator=gen))]
            parent_idx[r, i - 1] = p
            node_depth.append(node_depth[p] + 1)
    idx_mapping = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    num_nodes = [1, 1 + budget, 1 + 5, 1]  # logit rows per batch row
    query_lens = [2 * budget + 3, 1 + budget, 1 + 5, 1]
    context = [17, 30, 9, 25]
    cu = torch.tensor([0, *num_nodes], dtype=torch.int32).cumsum(0).to(torch.int32)
    buf = kernels.tree_bias_buffer(max_reqs, budget + 1, torch.device(KERNEL_DEVICE))
    assert buf.shape == (max_reqs, budget + 1, 2)
    buf.fill_(-1)  # stale: every pair masked out
    kernels.ddtree_tree_bias(
        parent_idx.to(KERNEL_DEVICE),
        idx_mapping.to(KERNEL_DEVICE),
        cu.to(KERNEL_DEVICE),
        depth,
        buf,
    )
    ref_biases = []
    for r, n in enumerate(num_nodes):
        if n == 1:
            ref_biases.append(None)
            continue
        parents = [-1] + parent_idx[int(idx_mapping[r]), : n - 1].tolist()
        ref_biases.append(tree_bias(ancestor_mask_ref(parents)))
    kv_lens = [c + q for c, q in zip(context, query_lens)]
    case = case_inputs(
        query_lens,
        kv_lens,
        dtype=torch.float32,
        device=KERNEL_DEVICE,
        gen=torch.Generator().manual_seed(22),
        **SMALL,
    )
    case["ref_biases"] = ref_biases
    out = run_kernel(case, buf)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), reference(case), atol=TOL, rtol=TOL)


def test_cpu_interpreter():
    """CPU CI without a GPU: run this file under the Triton interpreter."""
    if INTERPRET or HAS_CUDA:
        pytest.skip("kernel cases already run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "not test_cpu_interpreter",
            __file__,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


# ----------------------------------------------------------------------------
# GPU tests (the lead runs these on an H200)
# ----------------------------------------------------------------------------

GPU_SPECS = [
    ("tree", 1000),
    ("plain", 1500),
    ("tree", 1777),
    ("prefill", 1200),
    ("short", 1024),
    ("tree", 2049),
    ("tree", 0),
    ("subtree", 1300),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tree_size", [65, 257])
@pytest.mark.parametrize("force_3d", [False, True])
@pytest.mark.parametrize("layout", ["float", "bits"])
def test_gpu_tree_attention_large(dtype, tree_size, force_3d, layout):
    case = build_case(
        tree_size,
        GPU_SPECS,
        num_q_heads=16,
        num_kv_heads=4,
        head_size=128,
        block_size=16,
        dtype=dtype,
        device="cuda",
        seed=tree_size,
        layout=layout,
    )
    out = run_kernel(case, case["bias_buf"], force_3d=force_3d)
    torch.cuda.synchronize()
    ref = reference(case)
    assert torch.isfinite(out).all()
    # tl.dot on fp32 inputs uses TF32 on NVIDIA GPUs.
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["float", "bits"])
def test_gpu_cuda_graph_refill(layout):
    """Capture once, refill the persistent bias buffer, replay: the graph
    must pick up the new trees (stable buffer address)."""
    from ddtree_reference import ancestor_mask, tree_attention_bias

    t = 65
    specs = [("tree", 1100), ("plain", 1300), ("tree", 1500), ("short", 1024)]
    case = build_case(
        t,
        specs,
        num_q_heads=16,
        num_kv_heads=4,
        head_size=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=0,
    )
    is_tree = torch.tensor([k == "tree" for k, _ in specs], device="cuda")
    if layout == "bits":
        buf = torch.zeros(8, t, (t + 31) // 32, dtype=torch.int32, device="cuda")
    else:
        buf = torch.zeros(8, t, t, device="cuda")
    out = torch.empty_like(case["query"])
    gen = torch.Generator().manual_seed(1)

    def new_trees():
        parents = torch.tensor([random_parents(t, gen) for _ in specs])
        # The DDTree core's layout: parent_idx of nodes 1..T-1, 0 = root.
        mask = ancestor_mask(parents[:, 1:].cuda(), t)
        mask = mask | ~is_tree[:, None, None]  # no tree: nothing masked out
        if layout == "bits":
            buf[: len(specs)] = pack_bits(~mask.cpu()).cuda()
        else:
            buf[: len(specs)] = tree_attention_bias(mask, torch.float32)
        return [
            tree_bias(ancestor_mask_ref(p.tolist())) if k == "tree" else None
            for p, (k, _) in zip(parents, specs)
        ]

    new_trees()
    run_kernel(case, buf, out=out)  # warm up / compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(case, buf, out=out)
    for _ in range(3):
        case["ref_biases"] = new_trees()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(
            out.float().cpu(), reference(case), atol=2e-2, rtol=2e-2
        )


def test_metadata_field_default():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    field = TritonAttentionMetadata.__dataclass_fields__.get("tree_attn_bias")
    assert field is not None, "TritonAttentionMetadata.tree_attn_bias missing"
    assert field.default is None
