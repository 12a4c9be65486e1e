# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The split tree attention (``vllm/v1/spec_decode/ddtree/tree_attention.py``,
``VLLM_DDTREE_TREE_ATTENTION=split``, or ``auto`` where FA3 takes the target):
FA3 over each request's committed prefix, a Triton kernel over the step's own
keys under the packed ancestor mask, merged by log-sum-exp.

CPU (Triton interpreter; tests/in_vllm/conftest.py sets it up without a GPU):

* the intra-tree kernel alone against a brute-force masked softmax in
  float32 (output and LSE): random trees from parent arrays, ragged and
  padded requests (CUDA-graph padding: requests with no tokens, tokens of no
  request), GQA, head sizes 128 and 256, rows that are not tree rows (plain
  decode, a short chunk, a prefill chunk longer than the tree);
* the whole split, with the torch reference of the prefix pass
  (``tests/ddtree_reference.py``: `paged_prefix_attention`), against the
  patched unified kernel with the same packed mask, to 1e-5 in float32,
  softcap and sinks included, and with the prefix's undefined rows (FA's
  empty prefixes) poisoned;
* the TRITON_ATTN backend's hook (`TritonAttentionImpl.forward` takes the
  split when the metadata carries it and the batch fits), the per-step
  prefix lengths, the mode's resolution (``auto``: split where FA3 takes the
  target, with FA3 faked as present; the sinks only known once the layers
  are built), its refusals and its startup line;
* bench/kernels/tree_attention.py's CPU smoke run (the plumbing, not a timing).

GPU (``-m gpu``, an H200: FA3): the split against the unified kernel in bf16
at the Qwen3-8B and Qwen3.6-27B attention shapes, and under CUDA-graph
replay with new trees and longer contexts.
"""

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

try:
    import vllm.v1.attention.ops.triton_unified_attention as tua
    from vllm.v1.kv_cache_interface import KVQuantMode
    from vllm.v1.spec_decode.ddtree import tree_attention as ta
except Exception as e:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"vllm (patched tree) is not importable: {e!r}", allow_module_level=True
    )

from test_tree_attention import (  # noqa: E402
    ancestor_mask_ref,
    make_paged_kv,
    pack_bits,
    random_parents,
)

from ddtree_reference import paged_prefix_attention  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available() and not INTERPRET
KERNEL_DEVICE = "cpu" if INTERPRET else ("cuda" if HAS_CUDA else None)
needs_kernel = pytest.mark.skipif(
    KERNEL_DEVICE is None,
    reason="needs CUDA, or TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES='' for CPU",
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
# float32 on the CPU: the same math in another order. On a GPU tl.dot on
# float32 runs in TF32.
TOL = 1e-5 if INTERPRET else 1e-2
SENTINEL = 1234.5


# ----------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------


def query_len_of(kind: str, t: int) -> int:
    """Query tokens of a request of ``kind`` with a tree of ``t`` tokens."""
    return {
        "tree": t,
        "subtree": max(2, t - 3),  # verifies fewer nodes than the slot holds
        "plain": 1,
        "short": max(2, t // 2),  # a chunk no longer than the tree
        "prefill": 2 * t + 3,  # a chunk longer than the tree
        "pad": 0,  # CUDA-graph padding: no tokens, seq_len 0
    }[kind]


def make_batch(
    t,
    specs,
    num_q_heads,
    num_kv_heads,
    head_size,
    dtype,
    device,
    seed,
    block_size=16,
    padded_tokens=0,
    extra_slots=2,
):
    """``specs``: (kind, context_len) per request, kinds as `query_len_of`.

    The mask buffer is what DDTree's verifier writes: per request slot, the
    packed ancestor bits of its tree (``subtree``: a smaller tree in the
    first rows, stale bits of a larger one elsewhere), zero words for a
    request without a tree; unused slots hold random words. Returns the
    kernel inputs and, per request, the float [n, n] mask of its first
    ``n = min(query_len, t)`` query tokens (None without a tree)."""
    gen = torch.Generator().manual_seed(seed)
    words = (t + 31) // 32
    num_reqs = len(specs)
    mask = torch.randint(
        -(2**31), 2**31, (num_reqs + extra_slots, t, words), generator=gen
    ).to(torch.int32)
    query_lens, kv_lens, tree_masks = [], [], []
    for r, (kind, ctx) in enumerate(specs):
        qlen = query_len_of(kind, t)
        if kind in ("tree", "subtree"):
            n = qlen
            visible = ancestor_mask_ref(random_parents(n, gen))
            stale = torch.rand(t, t, generator=gen) < 0.5
            stale[:n, :n] = ~visible
            mask[r] = pack_bits(stale)
            tree_masks.append(visible)
        else:
            mask[r] = 0
            tree_masks.append(None)
        query_lens.append(qlen)
        kv_lens.append(0 if kind == "pad" else ctx + qlen)
    num_tokens = sum(query_lens) + padded_tokens
    query = torch.randn(num_tokens, num_q_heads, head_size, generator=gen)
    key_cache, value_cache, block_table = make_paged_kv(
        [max(n, 1) for n in kv_lens],
        num_kv_heads,
        head_size,
        block_size,
        torch.float32,
        "cpu",
        gen,
    )
    cu = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    sinks = torch.randn(num_q_heads, generator=gen)
    return dict(
        query=query.to(device=device, dtype=dtype),
        key_cache=key_cache.to(device=device, dtype=dtype),
        value_cache=value_cache.to(device=device, dtype=dtype),
        block_table=block_table.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        prefix_lens=torch.tensor(
            [k - q for k, q in zip(kv_lens, query_lens)],
            dtype=torch.int32,
            device=device,
        ),
        tree_mask=mask.to(device),
        query_lens=query_lens,
        kv_lens=kv_lens,
        tree_masks=tree_masks,
        sinks=sinks.to(device),
        scale=head_size**-0.5,
    )


def gather(cache, block_row, lo, hi):
    """Keys ``[lo, hi)`` of one request's paged cache, float32 on the CPU."""
    block_size = cache.shape[1]
    slots = torch.arange(lo, hi)
    blocks = block_row.cpu()[slots // block_size].long()
    return cache.cpu()[blocks, slots % block_size].float()


def ref_own_keys(batch, softcap=0.0):
    """Brute force of the kernel alone: each request's query tokens over
    its own keys, causal, the tree mask on the first T rows and keys.
    Returns (out, lse) for the tokens of the requests (float32, CPU)."""
    query = batch["query"].cpu().float()
    num_heads = query.shape[1]
    n_tok = sum(batch["query_lens"])
    out = torch.zeros(n_tok, num_heads, query.shape[2])
    lse = torch.zeros(num_heads, n_tok)
    start = 0
    for r, (qlen, kvlen) in enumerate(zip(batch["query_lens"], batch["kv_lens"])):
        if qlen == 0:
            continue
        ctx = kvlen - qlen
        k = gather(batch["key_cache"], batch["block_table"][r], ctx, kvlen)
        v = gather(batch["value_cache"], batch["block_table"][r], ctx, kvlen)
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[start : start + qlen]
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch["scale"]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        allowed = torch.ones(qlen, qlen).tril().bool()
        visible = batch["tree_masks"][r]
        if visible is not None:
            n = visible.shape[0]
            allowed[:n, :n] &= visible
        scores = scores.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        out[start : start + qlen] = torch.einsum(
            "hqk,khd->qhd", torch.softmax(scores, dim=-1), v
        )
        lse[:, start : start + qlen] = row_lse
        start += qlen
    return out, lse


def run_unified(batch, softcap=0.0, sinks=None):
    """The patched unified kernel with the same packed mask (its qq_bias)."""
    query = batch["query"]
    out = torch.full_like(query, SENTINEL)
    num_tokens, num_heads, head_size = query.shape
    segments = 4
    hs_pad = 1 << (head_size - 1).bit_length()
    segm_out = torch.empty(num_tokens, num_heads, segments, hs_pad, device=query.device)
    segm_max = torch.empty(num_tokens, num_heads, segments, device=query.device)
    tua.unified_attention(
        q=query,
        k=batch["key_cache"],
        v=batch["value_cache"],
        out=out,
        cu_seqlens_q=batch["cu_seqlens_q"],
        max_seqlen_q=max(batch["query_lens"]),
        seqused_k=batch["seq_lens"],
        max_seqlen_k=max(batch["kv_lens"]),
        softmax_scale=batch["scale"],
        causal=True,
        window_size=(-1, -1),
        block_table=batch["block_table"],
        softcap=softcap,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        seq_threshold_3D=1 << 20,
        num_par_softmax_segments=segments,
        softmax_segm_output=segm_out,
        softmax_segm_max=segm_max,
        softmax_segm_expsum=torch.empty_like(segm_max),
        qq_bias=batch["tree_mask"],
        sinks=sinks,
        kv_quant_mode=KVQuantMode.NONE,
    )
    return out


def run_split(batch, softcap=0.0, sinks=None, prefix_attention=None, causal=False):
    out = torch.full_like(batch["query"], SENTINEL)
    ta.split_tree_attention(
        batch["query"],
        batch["key_cache"],
        batch["value_cache"],
        out,
        batch["cu_seqlens_q"],
        max(batch["query_lens"]),
        batch["seq_lens"],
        batch["prefix_lens"],
        max(batch["kv_lens"]),
        batch["block_table"],
        batch["tree_mask"],
        batch["scale"],
        softcap,
        sinks,
        prefix_attention=prefix_attention or paged_prefix_attention,
        causal=causal,
    )
    return out


def run_own_keys(batch, softcap=0.0, **launch):
    out = torch.full_like(batch["query"], SENTINEL)
    num_tokens, num_heads, _ = out.shape
    lse = torch.full(
        (num_heads, num_tokens), SENTINEL, dtype=torch.float32, device=out.device
    )
    ta.tree_attention(
        batch["query"],
        batch["key_cache"],
        batch["value_cache"],
        out,
        batch["cu_seqlens_q"],
        batch["seq_lens"],
        batch["block_table"],
        batch["tree_mask"],
        batch["scale"],
        softcap,
        out_lse=lse,
        **launch,
    )
    return out, lse


def assert_untouched(out, batch):
    """Tokens of no request (CUDA-graph padding) keep what they held."""
    n = sum(batch["query_lens"])
    assert (out[n:] == SENTINEL).all()


MIXED = [
    ("tree", 21),
    ("plain", 33),
    ("subtree", 12),
    ("prefill", 18),
    ("tree", 40),
    ("short", 5),
    ("tree", 3),
]
# What a decode CUDA graph replays: trees only, then padding requests.
DECODE_PADDED = [("tree", 30), ("subtree", 7), ("tree", 50), ("pad", 0), ("pad", 0)]
# (num_q_heads, num_kv_heads): MHA, Qwen3-8B's 4 queries per KV head,
# Qwen3.6-27B's 6 (not a power of two).
MHA, GQA4, GQA6 = (2, 2), (8, 2), (6, 1)
# (T, heads, batch): 32 bits per word, so 33 and 65 span two and three
# words; the Triton interpreter is slow, so the widest tree runs on trees
# and padding only.
CPU_CASES = [
    pytest.param(5, MHA, "mixed", id="t5-mha-mixed"),
    pytest.param(16, GQA4, "mixed", id="t16-gqa4-mixed"),
    pytest.param(33, GQA6, "mixed", id="t33-gqa6-mixed"),
    pytest.param(65, GQA4, "decode", id="t65-gqa4-decode"),
]


# ----------------------------------------------------------------------------
# The intra-tree kernel alone (CPU interpreter or GPU)
# ----------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("t, heads, specs", CPU_CASES)
def test_own_keys_match_brute_force(t, heads, specs):
    specs = MIXED if specs == "mixed" else DECODE_PADDED
    batch = make_batch(
        t, specs, *heads, 128, torch.float32, KERNEL_DEVICE, seed=t, padded_tokens=3
    )
    out, lse = run_own_keys(batch)
    ref_out, ref_lse = ref_own_keys(batch)
    n = sum(batch["query_lens"])
    torch.testing.assert_close(out[:n].cpu(), ref_out, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse[:, :n].cpu(), ref_lse, atol=TOL, rtol=TOL)
    assert_untouched(out, batch)
    assert (lse[:, n:] == SENTINEL).all()
    # Not vacuous: without the tree masks the result differs.
    batch["tree_masks"] = [None] * len(specs)
    assert (out[:n].cpu() - ref_own_keys(batch)[0]).abs().max() > 0.1


@needs_kernel
@pytest.mark.parametrize(
    "t, heads, query_block, num_warps",
    [
        pytest.param(16, GQA4, 16, 4, id="t16-gqa4-whole-tree"),
        pytest.param(33, GQA6, 8, 8, id="t33-gqa6-q8-w8"),
        pytest.param(5, MHA, 3, 4, id="t5-mha-q3"),
    ],
)
def test_own_keys_launch_shapes_match_brute_force(t, heads, query_block, num_warps):
    """The tuning knobs change the launch, not the result: more query tokens
    per program (a whole tree, a block that is not a power of two) on every
    kind of row."""
    batch = make_batch(
        t,
        MIXED,
        *heads,
        128,
        torch.float32,
        KERNEL_DEVICE,
        seed=70 + t,
        padded_tokens=3,
    )
    out, lse = run_own_keys(batch, query_block=query_block, num_warps=num_warps)
    ref_out, ref_lse = ref_own_keys(batch)
    n = sum(batch["query_lens"])
    torch.testing.assert_close(out[:n].cpu(), ref_out, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse[:, :n].cpu(), ref_lse, atol=TOL, rtol=TOL)
    assert_untouched(out, batch)


@needs_kernel
@pytest.mark.parametrize("head_size", [128, 256])
def test_own_keys_head_sizes_padded_batch(head_size):
    batch = make_batch(
        17,
        DECODE_PADDED,
        8,
        2,
        head_size,
        torch.float32,
        KERNEL_DEVICE,
        seed=head_size,
        padded_tokens=5,
    )
    out, lse = run_own_keys(batch)
    ref_out, ref_lse = ref_own_keys(batch)
    n = sum(batch["query_lens"])
    torch.testing.assert_close(out[:n].cpu(), ref_out, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse[:, :n].cpu(), ref_lse, atol=TOL, rtol=TOL)
    assert_untouched(out, batch)


@needs_kernel
def test_own_keys_softcap():
    batch = make_batch(9, MIXED[:4], 8, 2, 128, torch.float32, KERNEL_DEVICE, seed=3)
    batch["query"] *= 4  # scores large enough for the cap to bind
    out, lse = run_own_keys(batch, softcap=2.0)
    ref_out, ref_lse = ref_own_keys(batch, softcap=2.0)
    n = sum(batch["query_lens"])
    torch.testing.assert_close(out[:n].cpu(), ref_out, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse[:, :n].cpu(), ref_lse, atol=TOL, rtol=TOL)
    assert (out[:n].cpu() - ref_own_keys(batch)[0]).abs().max() > 0.1


@needs_kernel
def test_own_keys_read_no_slot_before_the_request():
    """CUDA-graph capture builds the metadata with every seq_len set to 1
    under T query tokens (negative context lengths): the kernel must read no
    slot before the request's first. Every used block sits after a block of
    NaNs, and the block table row before the first request's names one."""
    batch = make_batch(
        9, [("tree", 0), ("tree", 0)], 8, 2, 64, torch.float32, KERNEL_DEVICE, 8
    )
    for name in ("key_cache", "value_cache"):
        cache = batch[name]
        spread = torch.full(
            (2 * cache.shape[0] + 1, *cache.shape[1:]),
            float("nan"),
            dtype=cache.dtype,
            device=cache.device,
        )
        spread[1::2] = cache
        batch[name] = spread
    table = 2 * batch["block_table"] + 1
    batch["block_table"] = torch.cat([torch.zeros_like(table[:1]), table])[1:]
    reference, _ = run_own_keys(batch)
    assert torch.isfinite(reference[: sum(batch["query_lens"])]).all()
    batch["seq_lens"].fill_(1)
    out, _ = run_own_keys(batch)
    assert torch.isfinite(out).all()


@needs_kernel
def test_own_keys_bad_mask_rejected():
    batch = make_batch(33, MIXED[:2], 2, 2, 128, torch.float32, KERNEL_DEVICE, seed=1)
    with pytest.raises(AssertionError):
        batch["tree_mask"] = batch["tree_mask"][:, :, :1]  # 33 keys need 2 words
        run_own_keys(batch)
    batch = make_batch(33, MIXED[:2], 2, 2, 128, torch.float32, KERNEL_DEVICE, seed=1)
    with pytest.raises(AssertionError):
        batch["tree_mask"] = batch["tree_mask"][:1]  # fewer slots than requests
        run_own_keys(batch)
    with pytest.raises(AssertionError):
        batch["tree_mask"] = torch.zeros(2, 33, 33, device=KERNEL_DEVICE)  # float
        run_own_keys(batch)


# ----------------------------------------------------------------------------
# The whole split against the unified kernel
# ----------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("t, heads, specs", CPU_CASES)
def test_split_equals_unified(t, heads, specs):
    """Every kind of row in one batch: the split is exact for all of them
    (what a CUDA graph captured on the split path may replay)."""
    specs = MIXED if specs == "mixed" else DECODE_PADDED
    batch = make_batch(t, specs, *heads, 128, torch.float32, KERNEL_DEVICE, seed=50 + t)
    split = run_split(batch)
    unified = run_unified(batch)
    assert torch.isfinite(split).all()
    torch.testing.assert_close(split, unified, atol=TOL, rtol=TOL)


@needs_kernel
@pytest.mark.parametrize("head_size", [128, 256])
def test_split_equals_unified_decode_padded(head_size):
    batch = make_batch(
        17,
        DECODE_PADDED,
        12,
        2,
        head_size,
        torch.float32,
        KERNEL_DEVICE,
        seed=7,
        padded_tokens=4,
    )
    split = run_split(batch)
    torch.testing.assert_close(split, run_unified(batch), atol=TOL, rtol=TOL)
    assert_untouched(split, batch)


@needs_kernel
def test_split_softcap_and_sinks_equal_unified():
    specs = [s for s in MIXED if s[0] != "prefill"]
    batch = make_batch(9, specs, 8, 2, 128, torch.float32, KERNEL_DEVICE, seed=11)
    batch["query"] *= 4
    for softcap, sinks in ((0.0, batch["sinks"]), (3.0, batch["sinks"])):
        split = run_split(batch, softcap, sinks)
        unified = run_unified(batch, softcap, sinks)
        torch.testing.assert_close(split, unified, atol=TOL, rtol=TOL)
    assert (split - run_unified(batch)).abs().max() > 0.1


@needs_kernel
@pytest.mark.parametrize("empty_lse", [float("-inf"), float("inf")])
def test_split_empty_prefix_undefined_rows(empty_lse):
    """A request with no prefix key: FA leaves its rows undefined (NaN here)
    and returns -inf (FA3) or +inf (FA2); the merge must ignore them."""

    def prefix(*args, **kwargs):
        return paged_prefix_attention(*args, empty_lse=empty_lse, **kwargs)

    specs = [("tree", 0), ("tree", 20), ("short", 0), ("plain", 9)]
    batch = make_batch(9, specs, 8, 2, 128, torch.float32, KERNEL_DEVICE, seed=5)
    split = run_split(batch, prefix_attention=prefix)
    assert torch.isfinite(split).all()
    torch.testing.assert_close(split, run_unified(batch), atol=TOL, rtol=TOL)


# ----------------------------------------------------------------------------
# The TRITON_ATTN backend's side
# ----------------------------------------------------------------------------


def triton_metadata(batch, tree_split):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    num_tokens, num_heads, head_size = batch["query"].shape
    device = batch["query"].device
    hs_pad = 1 << (head_size - 1).bit_length()
    segm_max = torch.empty(num_tokens, num_heads, 4, device=device)
    # Cascade attention off: vLLM 0.26's metadata has its fields, 0.33's none.
    fields = {f.name for f in dataclasses.fields(TritonAttentionMetadata)}
    cascade = dict(
        use_cascade=False,
        common_prefix_len=0,
        cu_prefix_query_lens=None,
        prefix_kv_lens=None,
        suffix_kv_lens=None,
    )
    return TritonAttentionMetadata(
        num_actual_tokens=num_tokens,
        max_query_len=max(batch["query_lens"]),
        query_start_loc=batch["cu_seqlens_q"],
        max_seq_len=max(batch["kv_lens"]),
        seq_lens=batch["seq_lens"],
        block_table=batch["block_table"],
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        seq_threshold_3D=1 << 20,
        num_par_softmax_segments=4,
        softmax_segm_output=torch.empty(
            num_tokens, num_heads, 4, hs_pad, device=device
        ),
        softmax_segm_max=segm_max,
        softmax_segm_expsum=torch.empty_like(segm_max),
        causal=True,
        tree_attn_bias=batch["tree_mask"],
        tree_split=tree_split,
        **{name: value for name, value in cascade.items() if name in fields},
    )


def backend_forward(batch, tree_split):
    """TritonAttentionImpl.forward on the batch: the TRITON_ATTN KV cache
    (num_blocks, num_kv_heads, block_size, 2 * head_size) holding the same
    keys and values."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    query, key_cache = batch["query"], batch["key_cache"]
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    kv_cache = torch.cat([key_cache, batch["value_cache"]], dim=-1).transpose(1, 2)
    impl = TritonAttentionImpl(
        num_heads=num_heads,
        head_size=head_size,
        scale=batch["scale"],
        num_kv_heads=num_kv_heads,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    one = torch.ones((), device=query.device)
    layer = SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)
    output = torch.full_like(query, SENTINEL)
    impl.forward(
        layer,
        query,
        None,
        None,
        kv_cache.contiguous(),
        triton_metadata(batch, tree_split),
        output,
    )
    return output


@needs_kernel
def test_backend_takes_the_split_when_the_batch_fits():
    calls = []

    def prefix(*args, **kwargs):
        calls.append(args[6].clone())  # prefix_lens
        return paged_prefix_attention(*args, **kwargs)

    batch = make_batch(9, DECODE_PADDED, 8, 2, 64, torch.float32, KERNEL_DEVICE, seed=2)
    split_meta = ta.SplitTreeAttentionMetadata(
        prefix_lens=batch["prefix_lens"], prefix_attention=prefix
    )
    with_split = backend_forward(batch, split_meta)
    assert len(calls) == 1 and torch.equal(calls[0], batch["prefix_lens"])
    without = backend_forward(batch, None)
    assert len(calls) == 1
    torch.testing.assert_close(with_split, without, atol=TOL, rtol=TOL)
    torch.testing.assert_close(with_split, run_unified(batch), atol=TOL, rtol=TOL)


@needs_kernel
def test_backend_decode_step_attends_over_the_whole_sequence(monkeypatch):
    """A step in which every request decodes one token (no tree: the
    measured policy's no speculation) runs the prefix pass alone over each
    request's whole sequence, the step's own key included, as an engine
    without speculation attends; the intra-tree pass does not run."""
    calls = []

    def prefix(*args, **kwargs):
        calls.append(args[6].clone())  # prefix_lens
        return paged_prefix_attention(*args, **kwargs)

    def no_tree_pass(*args, **kwargs):
        raise AssertionError("the intra-tree pass ran in a plain decode step")

    plain = [("plain", 33), ("plain", 5), ("plain", 70), ("pad", 0)]
    batch = make_batch(9, plain, 8, 2, 64, torch.float32, KERNEL_DEVICE, seed=6)
    assert max(batch["query_lens"]) == 1
    split = ta.SplitTreeAttention(
        fake_vllm_config(),
        8,
        2,
        64,
        16,
        torch.float32,
        torch.device(KERNEL_DEVICE),
        prefix_attention=prefix,
    )
    num_reqs = len(plain)
    common = SimpleNamespace(
        num_reqs=num_reqs,
        query_start_loc=batch["cu_seqlens_q"],
        seq_lens=batch["seq_lens"],
        num_actual_tokens=sum(batch["query_lens"]),
        max_query_len=1,
        max_seq_len=max(batch["kv_lens"]),
        causal=True,
    )
    split_meta = split.build(common)
    assert split_meta.whole_sequence
    monkeypatch.setattr(ta, "tree_attention", no_tree_pass)
    out = backend_forward(batch, split_meta)
    assert len(calls) == 1
    assert torch.equal(calls[0], batch["seq_lens"][:num_reqs])
    torch.testing.assert_close(out, run_unified(batch), atol=TOL, rtol=TOL)
    assert_untouched(out, batch)


def longer_request_batch(specs, prefix, seed):
    """A batch of T = 9 with a request longer than the tree, and split
    metadata whose prefix pass is ``prefix``."""
    batch = make_batch(9, specs, 8, 2, 64, torch.float32, KERNEL_DEVICE, seed=seed)
    assert max(batch["query_lens"]) > 9
    split_meta = ta.SplitTreeAttentionMetadata(
        prefix_lens=batch["prefix_lens"], prefix_attention=prefix
    )
    return batch, split_meta


@needs_kernel
def test_backend_takes_the_split_with_a_short_prefill_chunk():
    """Trees with a prefill chunk longer than the tree mixed in (continuous
    batching), the chunk within `SPLIT_MAX_CHUNK`: the split, non-causal
    over the prefixes then the chunk's own keys causally in (b), equal to
    the unified kernel with the same mask."""
    calls = []

    def prefix(*args, **kwargs):
        calls.append((args[6].clone(), kwargs.get("causal")))
        return paged_prefix_attention(*args, **kwargs)

    batch, split_meta = longer_request_batch(MIXED, prefix, seed=4)
    assert max(batch["query_lens"]) <= ta.SPLIT_MAX_CHUNK
    out = backend_forward(batch, split_meta)
    assert len(calls) == 1
    prefix_lens, causal = calls[0]
    assert torch.equal(prefix_lens, batch["prefix_lens"]) and causal is False
    torch.testing.assert_close(out, run_unified(batch), atol=TOL, rtol=TOL)
    assert_untouched(out, batch)


@needs_kernel
def test_backend_runs_unified_for_a_long_prefill_chunk(monkeypatch):
    """Trees with a prefill chunk longer than `SPLIT_MAX_CHUNK`, in metadata
    that does not split the batch in two (`long_from` unset, as the builder
    leaves it where the longer requests are not last): the unified kernel
    (the split's prefix pass is not called)."""

    def prefix(*args, **kwargs):
        raise AssertionError("the split ran for a batch with a long prefill chunk")

    batch, split_meta = longer_request_batch(MIXED, prefix, seed=4)
    monkeypatch.setattr(ta, "SPLIT_MAX_CHUNK", max(batch["query_lens"]) - 1)
    out = backend_forward(batch, split_meta)
    torch.testing.assert_close(out, run_unified(batch), atol=TOL, rtol=TOL)


# A step that verifies no tree: prefill chunks longer than the tree, one-token
# decodes, a short chunk, CUDA-graph padding (zero mask words throughout).
NO_TREE = [("prefill", 18), ("plain", 33), ("short", 5), ("prefill", 40), ("pad", 0)]


@needs_kernel
def test_backend_no_tree_batch_is_causal_over_the_whole_sequence(monkeypatch):
    """A batch with a prefill chunk longer than the tree that verifies no
    tree (`SplitTreeAttentionMetadata.no_tree`): the prefix pass alone,
    causal, over each whole sequence, equal to the unified kernel without a
    mask (what an engine without speculation computes) and to it with the
    batch's zeroed mask words; neither the intra-tree pass nor the unified
    kernel runs."""
    calls = []

    def prefix(*args, **kwargs):
        calls.append((args[6].clone(), args[12], kwargs.get("causal")))
        return paged_prefix_attention(*args, **kwargs)

    def no_tree_pass(*args, **kwargs):
        raise AssertionError("the intra-tree pass ran in a step without trees")

    batch, split_meta = longer_request_batch(NO_TREE, prefix, seed=8)
    split_meta.no_tree = True
    monkeypatch.setattr(ta, "tree_attention", no_tree_pass)
    out = backend_forward(batch, split_meta)
    assert len(calls) == 1  # the split ran (the unified kernel did not)
    prefix_lens, scheduler_metadata, causal = calls[0]
    assert torch.equal(prefix_lens, batch["seq_lens"])
    assert scheduler_metadata is None and causal is True
    unmasked = run_unified({**batch, "tree_mask": None})
    torch.testing.assert_close(out, unmasked, atol=TOL, rtol=TOL)
    # The same as the unified kernel with the batch's zeroed mask words.
    torch.testing.assert_close(out, run_unified(batch), atol=TOL, rtol=TOL)
    assert_untouched(out, batch)


# As vLLM's V2 model runner orders a batch: the uniform tree verifications
# first, then the other requests by query length (`sort_batch_req_ids`), so
# the prefill chunks longer than the split's bound come last; CUDA-graph
# padding after them.
TREES_THEN_LONG_CHUNKS = [
    ("tree", 21),
    ("tree", 40),
    ("tree", 3),
    ("plain", 33),
    ("subtree", 12),
    ("short", 5),
    ("prefill", 18),
    ("prefill", 0),
    ("pad", 0),
]


def common_metadata(batch, num_reqs=None):
    """The `CommonAttentionMetadata` fields `SplitTreeAttention.build` reads."""
    num_reqs = len(batch["query_lens"]) if num_reqs is None else num_reqs
    return SimpleNamespace(
        num_reqs=num_reqs,
        query_start_loc=batch["cu_seqlens_q"],
        query_start_loc_cpu=batch["cu_seqlens_q"].cpu(),
        seq_lens=batch["seq_lens"],
        num_actual_tokens=sum(batch["query_lens"]),
        max_query_len=max(batch["query_lens"]),
        max_seq_len=max(batch["kv_lens"]),
        causal=True,
    )


def split_in_two(monkeypatch, specs, seed, prefix):
    """A batch of T = 9 whose prefill chunks (2 T + 3 = 21 tokens) are
    longer than the split's bound (12 here, for the interpreter's sake), and
    the metadata `SplitTreeAttention.build` makes of it."""
    monkeypatch.setattr(ta, "SPLIT_MAX_CHUNK", 12)
    batch = make_batch(9, specs, 8, 2, 64, torch.float32, KERNEL_DEVICE, seed=seed)
    split = ta.SplitTreeAttention(
        fake_vllm_config(tree_budget=8, max_num_seqs=16),
        8,
        2,
        64,
        16,
        torch.float32,
        torch.device(KERNEL_DEVICE),
        prefix_attention=prefix,
    )
    return batch, split, split.build(common_metadata(batch))


@needs_kernel
def test_backend_splits_a_batch_with_long_prefill_chunks_in_two(monkeypatch):
    """Trees with prefill chunks longer than the split's bound, last in the
    batch: the split over the requests before them (FA3's prefix pass,
    non-causal, then the intra-tree pass over those requests alone) and FA3
    alone, causal, over the chunks' whole sequences; equal to the unified
    kernel with the same mask, padding rows untouched."""
    calls, own_keys = [], []

    def prefix(*args, **kwargs):
        calls.append(
            dict(
                rows=args[0].shape[0],
                cu=args[4].tolist(),
                max_q=args[5],
                lens=args[6].tolist(),
                scheduler=args[12],
                causal=kwargs.get("causal"),
            )
        )
        return paged_prefix_attention(*args, **kwargs)

    real_tree_attention = ta.tree_attention

    def tree_pass(*args, **kwargs):
        own_keys.append(args[5].shape[0])  # the requests it runs over
        return real_tree_attention(*args, **kwargs)

    monkeypatch.setattr(ta, "tree_attention", tree_pass)
    batch, split, meta = split_in_two(monkeypatch, TREES_THEN_LONG_CHUNKS, 11, prefix)
    qlens, kv = batch["query_lens"], batch["kv_lens"]
    first, first_row = 6, sum(qlens[:6])
    assert meta.long_from == (first, first_row)
    assert meta.short_max_query_len == 9 and meta.long_max_query_len == 21
    assert meta.long_num_tokens == sum(qlens[first:])
    assert meta.long_query_start.tolist() == [0, 21, 42, 42]
    assert meta.scheduler_metadata is None and not meta.whole_sequence
    out = backend_forward(batch, meta)
    short, chunks = calls
    assert short == dict(
        rows=first_row,
        cu=batch["cu_seqlens_q"][: first + 1].tolist(),
        max_q=9,
        lens=[k - q for k, q in zip(kv[:first], qlens[:first])],
        scheduler=None,
        causal=False,
    )
    assert chunks == dict(
        rows=sum(qlens[first:]),
        cu=[0, 21, 42, 42],
        max_q=21,
        lens=kv[first:],
        scheduler=None,
        causal=True,
    )
    assert own_keys == [first]
    torch.testing.assert_close(out, run_unified(batch), atol=TOL, rtol=TOL)
    assert_untouched(out, batch)


@needs_kernel
def test_backend_long_chunks_alone_run_causal_over_their_sequences(monkeypatch):
    """Every request longer than the bound (a batch of prompts' chunks that
    still carries a tree mask): only FA3, causal, over the whole sequences."""
    calls = []

    def prefix(*args, **kwargs):
        calls.append(kwargs.get("causal"))
        return paged_prefix_attention(*args, **kwargs)

    def no_tree_pass(*args, **kwargs):
        raise AssertionError("the intra-tree pass ran without a short request")

    monkeypatch.setattr(ta, "tree_attention", no_tree_pass)
    batch, _, meta = split_in_two(
        monkeypatch, [("prefill", 18), ("prefill", 3), ("pad", 0)], 12, prefix
    )
    assert meta.long_from == (0, 0)
    out = backend_forward(batch, meta)
    assert calls == [True]
    torch.testing.assert_close(out, run_unified(batch), atol=TOL, rtol=TOL)
    assert_untouched(out, batch)


@needs_kernel
def test_backend_runs_unified_when_a_long_chunk_is_not_last(monkeypatch):
    """A longer request before a shorter one (not the V2 runner's order):
    the builder does not split the batch, the unified kernel runs."""

    def prefix(*args, **kwargs):
        raise AssertionError("the split ran for a batch it cannot split")

    specs = [("tree", 21), ("prefill", 18), ("plain", 33), ("tree", 4)]
    batch, _, meta = split_in_two(monkeypatch, specs, 13, prefix)
    assert meta.long_from is None
    out = backend_forward(batch, meta)
    torch.testing.assert_close(out, run_unified(batch), atol=TOL, rtol=TOL)


@needs_kernel
def test_backend_no_tree_batch_with_long_chunks_is_causal_throughout(monkeypatch):
    """The verifier marks the batch as verifying no tree after the build:
    one causal pass over every whole sequence, as before the split in two."""
    calls = []

    def prefix(*args, **kwargs):
        calls.append((args[6].tolist(), kwargs.get("causal")))
        return paged_prefix_attention(*args, **kwargs)

    specs = [("plain", 33), ("short", 5), ("prefill", 18), ("prefill", 40)]
    batch, _, meta = split_in_two(monkeypatch, specs, 14, prefix)
    batch["tree_mask"].zero_()
    assert meta.long_from is not None
    meta.no_tree = True
    out = backend_forward(batch, meta)
    assert calls == [(batch["kv_lens"], True)]
    torch.testing.assert_close(out, run_unified(batch), atol=TOL, rtol=TOL)


def common_for_query_lens(query_lens, context=50):
    """Common metadata of a batch of these query lengths after ``context``
    keys each."""
    qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return SimpleNamespace(
        num_reqs=len(query_lens),
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([q + context for q in query_lens], dtype=torch.int32),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens) + context,
        causal=True,
    )


def test_the_v2_runner_orders_the_longer_requests_last():
    """The split in two relies on vLLM's V2 model runner ordering a batch
    by query length after its tree verifications (`sort_batch_req_ids`;
    0.33.0 also puts the requests with drafts first): requests longer than
    the split's bound come last, and the builder splits such a batch."""
    import inspect

    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    t = 16  # 1 + tree_budget
    tokens = {
        "chunk-1000": 1000,
        "tree-a": t,
        "chunk-20": 20,
        "plain": 1,
        "chunk-300": 300,
        "tree-b": t,
        "subtree": 9,
        "chunk-257": 257,
    }
    drafts = {r: [0] * (n - 1) for r, n in tokens.items() if "tree" in r}
    params = inspect.signature(sort_batch_req_ids).parameters
    if "draft_tokens" in params:
        order = sort_batch_req_ids(tokens, drafts, t)
    else:
        order = sort_batch_req_ids(tokens, t)
    query_lens = [tokens[r] for r in order]
    bound = max(t, ta.SPLIT_MAX_CHUNK)
    first = next(i for i, n in enumerate(query_lens) if n > bound)
    assert all(n > bound for n in query_lens[first:]), order
    split = ta.SplitTreeAttention(
        fake_vllm_config(tree_budget=t - 1, max_num_seqs=16),
        8,
        2,
        64,
        16,
        torch.bfloat16,
        torch.device("cpu"),
        prefix_attention=paged_prefix_attention,
    )
    meta = split.build(common_for_query_lens(query_lens))
    assert meta.long_from == (first, sum(query_lens[:first]))


def test_build_keeps_the_long_chunks_rows_in_one_buffer(monkeypatch):
    """The longer requests' query starts, from 0, in a persistent buffer,
    step after step; a batch within the bound has none."""
    monkeypatch.setattr(ta, "SPLIT_MAX_CHUNK", 12)
    split = ta.SplitTreeAttention(
        fake_vllm_config(tree_budget=8),
        8,
        2,
        128,
        16,
        torch.bfloat16,
        torch.device("cpu"),
        prefix_attention=paged_prefix_attention,
    )
    assert split.max_split_query_len == 12
    pointers = set()
    for query_lens, first, starts in (
        ([9, 9, 1, 13, 40], 3, [0, 13, 53]),
        ([9, 30, 0], 1, [0, 30, 30]),
        ([20], 0, [0, 20]),
    ):
        qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
        meta = split.build(common_for_query_lens(query_lens))
        assert meta.long_from == (first, int(qsl[first]))
        assert meta.long_query_start.tolist() == starts
        assert meta.long_num_tokens == starts[-1]
        pointers.add(meta.long_query_start.data_ptr())
    assert pointers == {split.long_query_start.data_ptr()}
    # Within the bound (the tree's own length counts: T = 9 here is below
    # it), or a longer request that is not last: no split in two.
    for query_lens in ([9, 12, 1], [30, 9]):
        assert split.build(common_for_query_lens(query_lens)).long_from is None


def test_applies_rule():
    bias = torch.zeros(4, 17, 1, dtype=torch.int32)
    meta = ta.SplitTreeAttentionMetadata(prefix_lens=torch.zeros(4, dtype=torch.int32))

    def attn(**kw):
        base = dict(
            tree_attn_bias=bias,
            max_query_len=17,
            causal=True,
            mm_prefix_range_tensor=None,
        )
        return SimpleNamespace(**{**base, **kw})

    assert meta.applies(attn(), None)
    assert meta.applies(attn(max_query_len=1), None)
    # Trees with a prefill chunk mixed in, up to SPLIT_MAX_CHUNK tokens (or
    # T where the tree is longer).
    assert meta.applies(attn(max_query_len=18), None)
    assert meta.applies(attn(max_query_len=ta.SPLIT_MAX_CHUNK), None)
    assert not meta.applies(attn(max_query_len=ta.SPLIT_MAX_CHUNK + 1), None)
    wide = torch.zeros(4, ta.SPLIT_MAX_CHUNK + 9, 9, dtype=torch.int32)
    assert meta.applies(attn(tree_attn_bias=wide, max_query_len=wide.shape[1]), None)
    assert not meta.applies(
        attn(tree_attn_bias=wide, max_query_len=wide.shape[1] + 1), None
    )
    assert not meta.applies(attn(tree_attn_bias=None), None)
    assert not meta.applies(attn(causal=torch.ones(4, dtype=torch.bool)), None)
    assert not meta.applies(attn(), torch.ones(()))
    assert not meta.applies(attn(mm_prefix_range_tensor=torch.zeros(4, 1, 2)), None)
    # A batch whose longer requests come last (split in two) takes it.
    in_two = ta.SplitTreeAttentionMetadata(
        prefix_lens=torch.zeros(4, dtype=torch.int32),
        long_from=(2, 34),
        long_query_start=torch.zeros(3, dtype=torch.int32),
        short_max_query_len=17,
        long_max_query_len=4096,
    )
    assert in_two.applies(attn(max_query_len=4096), None)
    assert not in_two.applies(attn(max_query_len=4096), torch.ones(()))
    # A batch that verifies no tree takes it with a longer request too, under
    # the same other conditions.
    no_tree = ta.SplitTreeAttentionMetadata(
        prefix_lens=torch.zeros(4, dtype=torch.int32), no_tree=True
    )
    assert no_tree.applies(attn(max_query_len=18), None)
    assert no_tree.applies(attn(max_query_len=4096), None)
    assert not no_tree.applies(attn(max_query_len=18, tree_attn_bias=None), None)
    assert not no_tree.applies(
        attn(max_query_len=18, causal=torch.ones(4, dtype=torch.bool)), None
    )
    assert not no_tree.applies(attn(max_query_len=18), torch.ones(()))


def fake_vllm_config(
    full_cuda_graphs=False,
    method="ddtree",
    max_capture_size=64,
    dtype=torch.bfloat16,
    tree_budget=8,
    max_num_seqs=8,
):
    return SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype, get_head_size=lambda: 128),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        compilation_config=SimpleNamespace(
            cudagraph_mode=SimpleNamespace(
                has_full_cudagraphs=lambda: full_cuda_graphs
            ),
            max_cudagraph_capture_size=max_capture_size,
        ),
        attention_config=SimpleNamespace(flash_attn_max_num_splits_for_cuda_graph=32),
        speculative_config=SimpleNamespace(
            method=method,
            use_ddtree=lambda: method == "ddtree",
            tree_budget=tree_budget,
        ),
    )


def test_build_writes_prefix_lengths_into_one_buffer():
    split = ta.SplitTreeAttention(
        fake_vllm_config(),
        8,
        2,
        128,
        16,
        torch.bfloat16,
        torch.device("cpu"),
        prefix_attention=paged_prefix_attention,
    )
    pointers = set()
    for query_lens, seq_lens in (([17, 17, 1], [40, 17, 9]), ([5, 0], [105, 0])):
        qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
        common = SimpleNamespace(
            num_reqs=len(query_lens),
            query_start_loc=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            causal=True,
        )
        meta = split.build(common)
        expected = [s - q for s, q in zip(seq_lens, query_lens)]
        assert meta.prefix_lens.tolist() == expected
        assert not meta.whole_sequence
        assert meta.prefix_attention is paged_prefix_attention
        assert meta.scheduler_metadata is None and meta.num_splits == 0
        pointers.add(meta.prefix_lens.data_ptr())
    # A plain decode step (one token per request, padding rows of none):
    # the whole sequence, the step's own key included.
    qsl = torch.tensor([0, 1, 2, 2], dtype=torch.int32)
    common = SimpleNamespace(
        num_reqs=3,
        query_start_loc=qsl,
        seq_lens=torch.tensor([40, 9, 0], dtype=torch.int32),
        num_actual_tokens=2,
        max_query_len=1,
        max_seq_len=40,
        causal=True,
    )
    meta = split.build(common)
    assert meta.whole_sequence and meta.prefix_lens.tolist() == [40, 9, 0]
    pointers.add(meta.prefix_lens.data_ptr())
    # Persistent: a captured graph reads the same rows every step.
    assert pointers == {split.prefix_lens.data_ptr()}
    # A bidirectional (drafter) batch never takes the split.
    common.causal = False
    assert split.build(common) is None


def fa3_available(monkeypatch, reason=None):
    """FA3 faked as runnable (reason None) or not: this host has no Hopper
    GPU."""
    monkeypatch.setattr(ta, "_fa3_unsupported_reason", lambda: reason)


def set_mode(monkeypatch, mode):
    if mode is None:
        monkeypatch.delenv(ta.TREE_ATTENTION_ENV, raising=False)
    else:
        monkeypatch.setenv(ta.TREE_ATTENTION_ENV, mode)


def test_for_builder_follows_the_resolved_mode(monkeypatch):
    args = (8, 2, 128, 16, torch.bfloat16, torch.device("cpu"))

    def split_for(config=None):
        config = config or fake_vllm_config()
        return ta.SplitTreeAttention.for_builder(config, *args)

    # This host (no FA3): the default is unified, an explicit split refused.
    for mode in (None, "auto", "unified"):
        set_mode(monkeypatch, mode)
        assert split_for() is None, mode
    set_mode(monkeypatch, "split")
    with pytest.raises(ValueError, match="needs FlashAttention 3, which is not"):
        split_for()
    # FA3 runnable: the default and an explicit split take it.
    fa3_available(monkeypatch)
    for mode in (None, "auto", "split"):
        set_mode(monkeypatch, mode)
        split = split_for()
        assert isinstance(split, ta.SplitTreeAttention), mode
        assert split.prefix_attention is ta.fa3_prefix_attention
    set_mode(monkeypatch, "unified")
    assert split_for() is None
    # Resolved from the config: a float32 target stays unified by default.
    set_mode(monkeypatch, None)
    assert split_for(fake_vllm_config(dtype=torch.float32)) is None
    # Not DDTree: no split, and the variable is not DDTree's to read.
    set_mode(monkeypatch, "flash")
    assert split_for(fake_vllm_config(method="dflash")) is None
    config = fake_vllm_config()
    config.speculative_config = None
    assert split_for(config) is None


# ----------------------------------------------------------------------------
# Startup checks
# ----------------------------------------------------------------------------


def sinks_layer(dtype):
    """A built attention layer with sinks: the TRITON_ATTN impl holds them
    where the check reads them."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    impl = TritonAttentionImpl(
        num_heads=8,
        head_size=128,
        scale=128**-0.5,
        num_kv_heads=2,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        sinks=torch.zeros(8, dtype=dtype),
    )
    return SimpleNamespace(impl=impl)


SINKS_LAYER = "model.layers.0.self_attn.attn"


def startup_config(dtype=torch.bfloat16, head_size=128, cache_dtype="auto", sinks=None):
    """A config at startup; ``sinks``: the dtype of the attention sinks of
    one built layer (None: the layers have none, or are not built)."""
    layers = {"model.layers.0.mlp": SimpleNamespace()}
    if sinks is not None:
        layers[SINKS_LAYER] = sinks_layer(sinks)
    return SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype, get_head_size=lambda: head_size),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        compilation_config=SimpleNamespace(static_forward_context=layers),
    )


NEEDS = "DDTree: VLLM_DDTREE_TREE_ATTENTION=split needs FlashAttention 3, "
NO_FA3 = "it needs compute capability 9.x, the GPU has 8.0"
DTYPE_REASON = "which takes float16 or bfloat16, got dtype=float32"
SINKS_REASON = (
    "which takes attention sinks in bfloat16 only, got float16 sinks on layer "
    + SINKS_LAYER
)


@pytest.mark.parametrize(
    "mode, config, fa3, expected",
    [
        # The default: split where FA3 takes the target.
        (None, startup_config(), None, ("split", "auto", None)),
        ("auto", startup_config(), None, ("split", "auto", None)),
        (None, startup_config(torch.float16), None, ("split", "auto", None)),
        (None, startup_config(head_size=256), None, ("split", "auto", None)),
        (None, startup_config(cache_dtype="bfloat16"), None, ("split", "auto", None)),
        # bf16 sinks: what FA3's s_aux takes.
        (None, startup_config(sinks=torch.bfloat16), None, ("split", "auto", None)),
        # Else unified, with the first condition the target fails.
        (None, startup_config(torch.float32), None, ("unified", "auto", DTYPE_REASON)),
        (
            None,
            startup_config(head_size=100),
            None,
            (
                "unified",
                "auto",
                "which takes head sizes that are multiples of 8 up to 256, got "
                "head_size=100",
            ),
        ),
        (
            None,
            startup_config(cache_dtype="fp8"),
            None,
            (
                "unified",
                "auto",
                "which reads the KV cache in the model's own dtype, got "
                "kv_cache_dtype='fp8'",
            ),
        ),
        (
            None,
            startup_config(torch.float16, sinks=torch.float16),
            None,
            ("unified", "auto", SINKS_REASON),
        ),
        (
            None,
            startup_config(),
            NO_FA3,
            ("unified", "auto", f"which is not available here ({NO_FA3})"),
        ),
        # The first failing condition, in the order of the checks.
        (
            "auto",
            startup_config(torch.float32, cache_dtype="fp8"),
            NO_FA3,
            ("unified", "auto", DTYPE_REASON),
        ),
        (
            None,
            startup_config(torch.float16, sinks=torch.float16),
            NO_FA3,
            ("unified", "auto", SINKS_REASON),
        ),
        # Explicit values.
        ("unified", startup_config(), None, ("unified", "unified", None)),
        (
            "unified",
            startup_config(torch.float32),
            NO_FA3,
            ("unified", "unified", None),
        ),
        ("split", startup_config(), None, ("split", "split", None)),
        ("split", startup_config(torch.float16), None, ("split", "split", None)),
    ],
)
def test_resolve_tree_attention(monkeypatch, mode, config, fa3, expected):
    set_mode(monkeypatch, mode)
    fa3_available(monkeypatch, fa3)
    choice = ta.resolve_tree_attention(config)
    assert (choice.mode, choice.requested, choice.reason) == expected
    assert ta.tree_attention_mode(config) == expected[0]
    ta.verify_tree_attention(config)


@pytest.mark.parametrize(
    "mode, config, expected",
    [
        (None, startup_config(torch.float32, 72, "fp8"), None),
        ("unified", startup_config(torch.float32), None),
        (
            "flash",
            startup_config(),
            "DDTree: VLLM_DDTREE_TREE_ATTENTION='flash' is not a tree attention "
            "mode; set it to 'auto', 'unified' or 'split', or unset it.",
        ),
        (
            "split",
            startup_config(torch.float32),
            NEEDS + "which takes float16 or bfloat16, got dtype=float32; pass "
            "--dtype bfloat16 or unset VLLM_DDTREE_TREE_ATTENTION.",
        ),
        (
            "split",
            startup_config(head_size=288),
            NEEDS + "which takes head sizes that are multiples of 8 up to 256, "
            "got head_size=288; unset VLLM_DDTREE_TREE_ATTENTION.",
        ),
        (
            "split",
            startup_config(cache_dtype="fp8"),
            NEEDS + "which reads the KV cache in the model's own dtype, got "
            "kv_cache_dtype='fp8'; pass --kv-cache-dtype auto or unset "
            "VLLM_DDTREE_TREE_ATTENTION.",
        ),
        (
            "split",
            startup_config(cache_dtype="float16"),
            NEEDS + "which reads the KV cache in the model's own dtype, got "
            "kv_cache_dtype='float16'; pass --kv-cache-dtype auto or unset "
            "VLLM_DDTREE_TREE_ATTENTION.",
        ),
        # Sinks in the model's dtype follow --dtype; float32 sinks do not.
        (
            "split",
            startup_config(torch.float16, sinks=torch.float16),
            NEEDS + SINKS_REASON + "; pass --dtype bfloat16 or unset "
            "VLLM_DDTREE_TREE_ATTENTION.",
        ),
        (
            "split",
            startup_config(sinks=torch.float32),
            NEEDS + "which takes attention sinks in bfloat16 only, got float32 "
            f"sinks on layer {SINKS_LAYER}; unset VLLM_DDTREE_TREE_ATTENTION.",
        ),
    ],
)
def test_verify_tree_attention(monkeypatch, mode, config, expected):
    """One-line refusals; FA3 faked as runnable, so that only the target
    refuses."""
    set_mode(monkeypatch, mode)
    fa3_available(monkeypatch)
    if expected is None:
        ta.verify_tree_attention(config)
        return
    with pytest.raises(ValueError) as e:
        ta.verify_tree_attention(config)
    assert str(e.value) == expected
    assert "\n" not in str(e.value)


def test_verify_split_needs_fa3_here(monkeypatch):
    """Without a Hopper GPU an explicit split is refused, never silently
    unified; the default resolves to unified and says why."""
    reason = ta._fa3_unsupported_reason()
    set_mode(monkeypatch, None)
    choice = ta.resolve_tree_attention(startup_config())
    monkeypatch.setenv(ta.TREE_ATTENTION_ENV, "split")
    if reason is None:
        assert choice.mode == "split"
        ta.verify_tree_attention(startup_config())
        return
    assert (choice.mode, choice.reason) == (
        "unified",
        f"which is not available here ({reason})",
    )
    with pytest.raises(ValueError) as e:
        ta.verify_tree_attention(startup_config())
    assert str(e.value) == (
        NEEDS + f"which is not available here ({reason}); unset "
        "VLLM_DDTREE_TREE_ATTENTION (the unified Triton kernel runs everywhere)."
    )
    assert "\n" not in str(e.value)


def test_sinks_only_known_once_the_layers_are_built(monkeypatch):
    """An fp16 target with sinks passes the config-time check (its config
    does not show them) and is caught once its layers exist: unified by
    default, refused with an explicit split."""
    fa3_available(monkeypatch)
    config = startup_config(torch.float16)
    set_mode(monkeypatch, "split")
    ta.verify_tree_attention(config)
    config.compilation_config.static_forward_context[SINKS_LAYER] = sinks_layer(
        torch.float16
    )
    with pytest.raises(ValueError, match="bfloat16 only, got float16 sinks"):
        ta.verify_tree_attention_layers(config)
    set_mode(monkeypatch, None)
    assert ta.tree_attention_mode(config) == "unified"
    args = (8, 2, 128, 16, torch.float16, torch.device("cpu"))
    builder_config = fake_vllm_config(dtype=torch.float16)
    builder_config.compilation_config.static_forward_context = (
        config.compilation_config.static_forward_context
    )
    assert ta.SplitTreeAttention.for_builder(builder_config, *args) is None
    del builder_config.compilation_config.static_forward_context[SINKS_LAYER]
    assert ta.SplitTreeAttention.for_builder(builder_config, *args) is not None


@pytest.mark.parametrize(
    "mode, config, fa3, expected",
    [
        (
            None,
            startup_config(),
            None,
            "DDTree: split tree attention (VLLM_DDTREE_TREE_ATTENTION=auto): "
            "FlashAttention 3 over each request's prefix + a Triton kernel over "
            "its tree, merged by LSE, in batches whose requests have at most "
            "max(1 + tree_budget, 256) query tokens each (trees, with short "
            "prefill chunks mixed in); longer prefill chunks run FlashAttention "
            "3 alone, causal, over their whole sequences, beside the trees of "
            "their batch.",
        ),
        (
            None,
            startup_config(torch.float16, sinks=torch.float16),
            None,
            "DDTree: unified tree attention (VLLM_DDTREE_TREE_ATTENTION=auto): "
            "the Triton unified attention kernel with a per-request tree mask; "
            f"split needs FlashAttention 3, {SINKS_REASON}.",
        ),
        (
            "auto",
            startup_config(),
            NO_FA3,
            "DDTree: unified tree attention (VLLM_DDTREE_TREE_ATTENTION=auto): "
            "the Triton unified attention kernel with a per-request tree mask; "
            f"split needs FlashAttention 3, which is not available here ({NO_FA3}).",
        ),
        (
            "unified",
            startup_config(),
            None,
            "DDTree: unified tree attention (VLLM_DDTREE_TREE_ATTENTION=unified): "
            "the Triton unified attention kernel with a per-request tree mask.",
        ),
        (
            "split",
            startup_config(),
            None,
            "DDTree: split tree attention (VLLM_DDTREE_TREE_ATTENTION=split): "
            "FlashAttention 3 over each request's prefix + a Triton kernel over "
            "its tree, merged by LSE, in batches whose requests have at most "
            "max(1 + tree_budget, 256) query tokens each (trees, with short "
            "prefill chunks mixed in); longer prefill chunks run FlashAttention "
            "3 alone, causal, over their whole sequences, beside the trees of "
            "their batch.",
        ),
    ],
)
def test_the_mode_in_use_is_logged_once_the_layers_are_built(
    monkeypatch, mode, config, fa3, expected
):
    """One INFO line, whatever the mode: never a silent fallback."""
    set_mode(monkeypatch, mode)
    fa3_available(monkeypatch, fa3)
    lines = []
    monkeypatch.setattr(
        ta,
        "logger",
        SimpleNamespace(info_once=lambda msg, *args: lines.append(msg % args)),
    )
    ta.verify_tree_attention_layers(config)
    assert lines == [expected]


def test_docs_show_the_logged_line(monkeypatch):
    """The example of the startup line in docs/tuning.md is the code's."""
    from pathlib import Path

    set_mode(monkeypatch, None)
    fa3_available(monkeypatch)
    lines = []
    monkeypatch.setattr(
        ta,
        "logger",
        SimpleNamespace(info_once=lambda msg, *args: lines.append(msg % args)),
    )
    ta.verify_tree_attention_layers(startup_config(torch.float32))
    tuning = (Path(__file__).resolve().parents[2] / "docs" / "tuning.md").read_text()
    assert len(lines) == 1 and f"\n    {lines[0]}\n" in tuning, lines


# ----------------------------------------------------------------------------
# GPU: FA3 for the prefix
# ----------------------------------------------------------------------------

# (num_q_heads, num_kv_heads, head_size): Qwen3-8B, Qwen3.6-27B.
GPU_SHAPES = [(32, 8, 128), (24, 4, 256)]
GPU_MIXED = [
    ("tree", 1000),
    ("plain", 1500),
    ("subtree", 1777),
    ("prefill", 1200),
    ("short", 1024),
    ("tree", 4097),
    ("tree", 1),
]


def gpu_split(batch, **kw):
    return run_split(batch, prefix_attention=ta.fa3_prefix_attention, **kw)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("t", [16, 65, 257])
def test_gpu_split_equals_unified(shape, t):
    batch = make_batch(
        t, GPU_MIXED, *shape, torch.bfloat16, "cuda", seed=t, padded_tokens=7
    )
    split = gpu_split(batch)
    unified = run_unified(batch)
    torch.cuda.synchronize()
    assert torch.isfinite(split[: sum(batch["query_lens"])]).all()
    torch.testing.assert_close(split, unified, atol=2e-2, rtol=2e-2)
    assert_untouched(split, batch)
    # And against the float32 brute force of the whole attention.
    ref = run_unified(
        {
            **batch,
            "query": batch["query"].float(),
            "key_cache": batch["key_cache"].float(),
            "value_cache": batch["value_cache"].float(),
        }
    )
    torch.testing.assert_close(split.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_plain_decode_is_fa3_over_the_whole_sequence(shape):
    """A step of one token per request (the measured policy's no
    speculation): FA3 alone over each whole sequence, the step's own key
    included (no mask, no intra-tree pass), equals the unified kernel."""
    plain = [("plain", 1500), ("plain", 1), ("plain", 4097), ("pad", 0)]
    batch = make_batch(16, plain, *shape, torch.bfloat16, "cuda", seed=3)
    assert max(batch["query_lens"]) == 1
    # As the backend calls it in such a step: no mask, the whole sequence.
    whole = {**batch, "tree_mask": None, "prefix_lens": batch["seq_lens"]}
    out = gpu_split(whole)
    unified = run_unified(batch)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, unified, atol=2e-2, rtol=2e-2)
    assert_untouched(out, batch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_no_tree_batch_is_fa3_causal_over_the_whole_sequence(shape):
    """A step with prefill chunks that verifies no tree: FA3 causal over
    each whole sequence, as the backend calls it, equals the unified kernel
    without a mask."""
    specs = [("prefill", 1500), ("plain", 1), ("prefill", 0), ("short", 4097)]
    specs.append(("pad", 0))
    batch = make_batch(65, specs, *shape, torch.bfloat16, "cuda", seed=5)
    # As the backend calls it in such a step: no mask, the whole sequences.
    whole = {**batch, "tree_mask": None, "prefix_lens": batch["seq_lens"]}
    out = gpu_split(whole, causal=True)
    unmasked = run_unified({**batch, "tree_mask": None})
    torch.cuda.synchronize()
    torch.testing.assert_close(out, unmasked, atol=2e-2, rtol=2e-2)
    assert_untouched(out, batch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_trees_with_long_chunks_split_in_two(monkeypatch, shape):
    """Trees with prefill chunks longer than `SPLIT_MAX_CHUNK` last in the
    batch (the V2 runner's order), through the builder and the metadata's
    forward with FA3: the split over the trees, FA3 causal over the chunks'
    whole sequences; equal to the unified kernel with the same mask."""
    t = 16
    specs = [("tree", 1000), ("tree", 4097), ("plain", 1500), ("short", 1024)]
    specs += [("prefill", 1200), ("prefill", 0), ("pad", 0)]
    # Chunks of 2 T + 3 = 35 tokens, longer than a bound of 24.
    monkeypatch.setattr(ta, "SPLIT_MAX_CHUNK", 24)
    num_q, num_kv, head_size = shape
    batch = make_batch(t, specs, num_q, num_kv, head_size, torch.bfloat16, "cuda", 9)
    split = ta.SplitTreeAttention(
        fake_vllm_config(tree_budget=t - 1, max_num_seqs=16),
        num_q,
        num_kv,
        head_size,
        16,
        torch.bfloat16,
        torch.device("cuda"),
    )
    meta = split.build(common_metadata(batch))
    assert meta.long_from == (4, sum(batch["query_lens"][:4]))
    attn = SimpleNamespace(
        query_start_loc=batch["cu_seqlens_q"],
        seq_lens=batch["seq_lens"],
        block_table=batch["block_table"],
        max_seq_len=max(batch["kv_lens"]),
        tree_attn_bias=batch["tree_mask"],
    )
    out = torch.full_like(batch["query"], SENTINEL)
    meta.forward(
        batch["query"],
        batch["key_cache"],
        batch["value_cache"],
        out,
        attn,
        batch["scale"],
        0.0,
        None,
    )
    unified = run_unified(batch)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, unified, atol=2e-2, rtol=2e-2)
    assert_untouched(out, batch)


@pytest.mark.gpu
@needs_cuda
def test_gpu_split_sinks_and_softcap():
    batch = make_batch(65, GPU_MIXED, 32, 8, 128, torch.bfloat16, "cuda", seed=1)
    # In the model's dtype, as attention layers hold them: FA3's s_aux takes
    # bf16 only.
    sinks = batch["sinks"].to(torch.bfloat16)
    split = gpu_split(batch, softcap=30.0, sinks=sinks)
    unified = run_unified(batch, softcap=30.0, sinks=sinks)
    torch.cuda.synchronize()
    torch.testing.assert_close(split, unified, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_split_cuda_graph_replay(shape):
    """The backend's path under a full CUDA graph: SplitTreeAttention's
    persistent prefix lengths and FA3 schedule, refilled by `build` outside
    the graph before each replay, with new queries, new trees and other
    context lengths in the captured buffers."""
    t = 65
    specs = [("tree", 2400), ("tree", 1600), ("subtree", 3000), ("pad", 0)]
    batch = make_batch(t, specs, *shape, torch.bfloat16, "cuda", seed=0)
    num_q, num_kv, head_size = shape
    split = ta.SplitTreeAttention(
        fake_vllm_config(
            # Above the batch's 4 x 65 tokens, so that it takes the graph's
            # fixed FA3 split count.
            full_cuda_graphs=True,
            max_capture_size=512,
        ),
        num_q,
        num_kv,
        head_size,
        batch["key_cache"].shape[1],
        torch.bfloat16,
        torch.device("cuda"),
    )
    query, seq_lens, mask = batch["query"], batch["seq_lens"], batch["tree_mask"]
    out = torch.zeros_like(query)
    max_seq_len = 4096
    common = SimpleNamespace(
        num_reqs=len(specs),
        query_start_loc=batch["cu_seqlens_q"],
        seq_lens=seq_lens,
        num_actual_tokens=query.shape[0],
        max_query_len=t,
        max_seq_len=max_seq_len,
        causal=True,
    )
    attn = SimpleNamespace(
        query_start_loc=batch["cu_seqlens_q"],
        max_query_len=t,
        seq_lens=seq_lens,
        max_seq_len=max_seq_len,
        block_table=batch["block_table"],
        tree_attn_bias=mask,
    )
    meta = split.build(common)
    assert meta.scheduler_metadata is not None and meta.num_splits == 32

    def step():
        meta.forward(
            query,
            batch["key_cache"],
            batch["value_cache"],
            out,
            attn,
            batch["scale"],
            0.0,
            None,
        )

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(1)
    n = sum(batch["query_lens"])
    for shrink in (0, 700, 1500):
        kv_lens = [
            0 if kind == "pad" else max(q + 1, kv - shrink)
            for (kind, _), kv, q in zip(specs, batch["kv_lens"], batch["query_lens"])
        ]
        seq_lens.copy_(torch.tensor(kv_lens, dtype=torch.int32))
        query.copy_(torch.randn(query.shape, generator=gen).to(query))
        for r, (kind, _) in enumerate(specs):
            if kind in ("tree", "subtree"):
                qlen = batch["query_lens"][r]
                hidden = torch.ones(t, t, dtype=torch.bool)
                hidden[:qlen, :qlen] = ~ancestor_mask_ref(random_parents(qlen, gen))
                mask[r] = pack_bits(hidden).cuda()
        split.build(common)  # outside the graph, as every step
        graph.replay()
        torch.cuda.synchronize()
        expected = run_unified({**batch, "kv_lens": kv_lens})
        torch.testing.assert_close(out[:n], expected[:n], atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------
# bench/kernels/tree_attention.py (CPU smoke run: the plumbing, not a timing)
# ----------------------------------------------------------------------------


@needs_kernel
def test_bench_script_smoke(tmp_path):
    import json

    from bench.kernels import tree_attention as bench

    if KERNEL_DEVICE != "cpu":
        pytest.skip("the GPU run is the benchmark itself")
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--shapes", "tiny", "--contexts", "40"]
    argv += ["--tree-tokens", "5", "--batch", "2", "--iters", "1", "--repeats", "1"]
    # With and without a new prompt's 20-token prefill chunk in the batch.
    # The split as shipped and split in two at any chunk longer than the tree.
    argv += ["--chunks", "0,20", "--methods", "unified,split,split_in_two"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["unified", "split", "split_in_two"] * 2
    assert [r["prefill_chunk"] for r in rows] == [0, 0, 0, 20, 20, 20]
    for row in rows:
        assert row["us"] > 0 and row["tree_tokens"] == 5 and row["batch"] == 2
        assert row["split_vs_unified_max_abs_diff"] < 1e-4
