# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton kernels for the DDTree build (see tree.py for the contract).

A handful of launches replace the ~100 small torch kernels of the torch build.
Tokens are compared as packed int64 keys ``(ordered value) << 31 | (2**31 -
1 - token id)``: a total order equal to (value desc, token id asc), so
boundary ties are resolved exactly and "the top ``K``" of a row is simply
its ``K`` largest keys (they are all distinct).

Vocabulary pass (per row = (request, depth): the top ``K = min(B, V)``
tokens and the logsumexp), a threshold filter:

1. `_vocab_stats_kernel`, grid ``(R*D, num_chunks)``: one pass over the
   logits in their own dtype, no sort.  Each program reads one chunk (1K
   tokens) of one row and writes the chunk's partial logsumexp ``(max, sum
   exp(x - max))`` and, for each sub-block of ``SUB`` tokens (``SUB`` = the
   chunk, or less so that a row has ``>= 2K`` sub-blocks), the ``KEEP``
   largest maxima of its groups of ``GROUP`` tokens (``KEEP`` up to 8, 16
   tokens a group; the sub-block's maximum first, by rounds of max and
   remove over the groups' maxima).
2. `_vocab_threshold_kernel`, grid ``(R*D,)``: ``t`` = the ``K``-th largest
   kept key (one `tl.topk` / `tl.sort` of the row's kept keys: 149 x 8 =
   1192 for V = 151936, K = 64).  Those are ``K`` keys ``>= t``, so every
   top-``K`` key is ``>= t``; and every key ``>= t`` lies in a sub-block
   whose maximum is ``>= t``, at most ``K`` of them (each puts its maximum
   among the ``K``), whose indices the kernel writes (a prefix sum over the
   sub-blocks; -1 in the slots left).  It also zeroes the row's candidate
   counter.  Keeping several keys per sub-block raises ``t`` where the
   likely tokens sit in few sub-blocks (trained drafters: byte-pair ids
   number frequent tokens first), which with the maxima alone put most of
   those sub-blocks' tokens above ``t``.
3. `_vocab_filter_kernel`, grid ``(R*D, K / G)``: re-reads those (at most
   ``K``) sub-blocks (``G`` slots per program, ~2K tokens) and appends their
   keys ``>= t`` to the row's buffer of ``CAP`` slots: slots from one `tl.atomic_add`
   on the row's counter plus a prefix sum.  The order of the appends does
   not matter (the keys are sorted next); the count is exact even past
   ``CAP``.  The programs' slot ranges tile ``[0, count)``, so exactly one
   program of an overflowing row holds slot ``CAP``: it appends the row to
   a list of overflowed rows (a second atomic counter).
4. Fallback for the listed rows: the exact tournament of the build before
   the filter (below), always launched (fixed shapes, no host
   synchronisation: CUDA graphs) as `_fallback_chunk_kernel` and
   `_fallback_merge_kernel`, grid ``(min(work, 1024),)``: the programs share
   out the (listed row, chunk or group) pairs, so a batch without overflow
   costs 1024 programs that each read one counter (not R*D*num_chunks).
5. `_vocab_merge_kernel`, grid ``(R*D,)``: combines the partial
   logsumexps; for rows with ``count <= CAP`` keeps the top ``K`` of the
   buffer (one `tl.topk` of ``CAP`` keys), otherwise of the tournament's
   candidates: ``token_lp [R*D, K]`` (float32 log-probs) and ``token_ids
   [R*D, K]``, ordered by (value desc, id asc).

``CAP = 16K`` (at least ``4K`` where ``16K`` exceeds 2048).  Were the top
tokens at independent positions, the expected count with one key per
sub-block would be ``M ln(M / (M - K))`` for ``M`` sub-blocks (a coupon
collector), at most ``1.39 K`` for ``M >= 2K``.  A trained drafter's are
not: on the dense benchmark pair's drafter (held-out prompts, its own
byte-pair vocabulary) the maxima alone overflowed ``4K`` slots on 85% of
the rows at K = 15 and 40% at K = 64; with 8 keys kept and ``16K`` slots on
none (`tree.py`, ``_THRESHOLD_KEEP``, ``_THRESHOLD_GROUP``).  Long runs
of equal (or -inf, NaN) values in consecutive tokens can still overflow.
Where the filter's sorts would exceed 2K keys (``K`` above ~512) the
tournament alone runs, for every row (`_vocab_threshold_plan` in tree.py).
The tournament:

* `_vocab_chunk_kernel`, grid ``(R*D, num_chunks)``: sorts each chunk (1K
  tokens) and keeps its top ``K`` keys, and the partial logsumexps.
* `_topk_merge_kernel`, grid ``(R*D, num_groups)``: keeps the top ``K`` of
  each group of ``fan_in`` chunks' candidates; applied until one group is
  left.  Every `tl.sort` stays at about 1K entries: a single program sorting
  4K int64 keys per row cost ~100 us on the H200, while a few launches of
  many small sorts cost a few us each.

Why: the tournament's per-chunk sorts dominated the build (H200, V =
151936, D = 15, K = 64: 85 us for R = 1, 462 us for R = 8, 3494 us for R =
64; R*D*149 programs each sorting 1K keys).  The filter replaces them by a
sort-free pass, two sorts of up to 2K keys per row and a re-read of at
most ``K * SUB`` tokens per row (43% of the row for K = 64).  Measured
with one key kept (H200, dummy weights, R = 32, K = 15: the stats kernel
200 us, the whole build 289 us per step; with every row overflowing, the
benchmark pair's logits: 2241 us); core bench (random logits, R = 32,
K = 15, graph): the whole build 1069 us with one key, 1438 us with 8 keys,
1217 us with 8 group maxima (the shipped form).  Expected
when first built: about 1.4 reads of the logits, so at R = 64 (290 MB of bf16
logits) on the order of 0.1-0.15 ms at HBM bandwidth instead of 3.5 ms,
and at R = 1 six latency-bound launches (some 20-30 us instead of 85 us);
the fallback launches cost little more than their launch overhead when no
row overflows, and an overflowing row costs about what every row cost
before.  Tile sizes and the fallback grid are not tuned on a GPU.

Bit-identical results: the filter selects the same ``K`` keys as the
tournament (both exact), and the log-probs use the same float32 partial
logsumexps combined in the same order.  For the last point the kernels keep
the float32 reductions in the layouts of the tournament's kernels: Triton
vectorises a load as widely as the widest access of the same shape in the
kernel allows, and a reduction adds in its input layout's order.  So
`_vocab_stats_kernel` keeps `_vocab_chunk`'s candidate store (never
executed), and the new memory accesses use 2-D pointer blocks that match no
1-D shape of the old ones (checked by compiling both versions for sm_90 and
comparing the layouts of every float32 reduction).

Tree stage:

* `_tree_kernel`, grid ``(R,)``: the whole depth loop of the build and the
  final global top-``B``, in one program per request.  Per depth the
  candidate pairs ``(a, b)`` of the static plan are scored (float32 add,
  bit-identical to torch), packed with their candidate index into int64
  keys and sorted (bitonic, `tl.sort`); the stable-sort tie order of the
  torch build is exactly the packed-key order.  Then the global top-``B``
  over all depths and the decoding (token, depth, parent) of the nodes.

All keys use ``ordered(x) = bits ^ ((bits >> 31) & 0x7fffffff)`` on the
float32 bits (a signed int32 that orders like the float), after NaN ->
-inf and -0.0 -> +0.0 (so -0.0 ties with +0.0 as in torch's comparisons).
"""

from __future__ import annotations

import triton
import triton.language as tl

_LOW31 = tl.constexpr(2147483647)  # 2**31 - 1
_INVALID_KEY = tl.constexpr(-9223372036854775807)  # INT64_MIN + 1: below every key
_INT32_MIN = tl.constexpr(-2147483648)
_MAX_KEY = tl.constexpr(9223372036854775807)  # above every key
# `tl.topk` (partial bitonic sort) is newer than `tl.sort`; without it the
# callers sort everything (same result: keys are distinct).
HAS_TOPK = hasattr(tl, "topk")


@triton.jit
def _ordered_f32(x):
    """Signed int32 that orders like float32 ``x`` (NaN-free, -0 folded)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _unordered_f32(o):
    """Inverse of `_ordered_f32` (int32 -> float32)."""
    bits = o ^ ((o >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _canonical(x, IS_LOGPROBS: tl.constexpr):
    x = tl.where(x != x, float("-inf"), x)  # NaN -> -inf
    if IS_LOGPROBS:
        x = tl.minimum(x, 0.0)
    return tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0


@triton.jit
def _load_chunk(
    logits_ptr, row, chunk, V, stride, CHUNK: tl.constexpr, IS_LOGPROBS: tl.constexpr
):
    """One chunk of one row as canonical float32 (``-inf`` past ``V``)."""
    local = tl.arange(0, CHUNK)
    tok = chunk * CHUNK + local
    in_range = tok < V
    x = tl.load(
        logits_ptr + row.to(tl.int64) * stride + tok, mask=in_range, other=float("-inf")
    ).to(tl.float32)
    x = _canonical(x, IS_LOGPROBS)
    return x, local, tok, in_range


@triton.jit
def _partial_lse(x, part_max_ptr, part_sum_ptr, row, chunk, NC):
    # Partial logsumexp, torch.logsumexp convention: an infinite max is
    # replaced by 0 before exp.
    m = tl.max(x, axis=0)
    m = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    s = tl.sum(tl.exp(x - m), axis=0)
    tl.store(part_max_ptr + row * NC + chunk, m)
    tl.store(part_sum_ptr + row * NC + chunk, s)


@triton.jit
def _vocab_chunk_kernel(
    logits_ptr,  # [rows, V], any float dtype, row stride `stride`
    part_max_ptr,  # [rows, NC] float32
    part_sum_ptr,  # [rows, NC] float32
    cand_ptr,  # [rows, NC * K] int64
    V,
    stride,
    NC,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    IS_LOGPROBS: tl.constexpr,
    COMPUTE_LSE: tl.constexpr,
    KEY16: tl.constexpr,  # bfloat16 input: sort int32 keys (chunk-local id)
):
    _vocab_chunk(
        logits_ptr,
        part_max_ptr,
        part_sum_ptr,
        cand_ptr,
        tl.program_id(0),
        tl.program_id(1),
        V,
        stride,
        NC,
        K,
        CHUNK,
        IS_LOGPROBS,
        COMPUTE_LSE,
        KEY16,
    )


@triton.jit
def _vocab_chunk(
    logits_ptr,
    part_max_ptr,
    part_sum_ptr,
    cand_ptr,
    row,
    chunk,
    V,
    stride,
    NC,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    IS_LOGPROBS: tl.constexpr,
    COMPUTE_LSE: tl.constexpr,
    KEY16: tl.constexpr,
):
    """Sorts the chunk, keeps its top ``K`` keys (the tournament's input)."""
    x, local, tok, in_range = _load_chunk(
        logits_ptr, row, chunk, V, stride, CHUNK, IS_LOGPROBS
    )
    if COMPUTE_LSE:
        _partial_lse(x, part_max_ptr, part_sum_ptr, row, chunk, NC)

    o = _ordered_f32(x)
    out_offs = row.to(tl.int64) * NC * K + chunk * K + local
    if KEY16:
        # bfloat16 inputs: the low 16 bits of the float32 bits are 0, so the
        # high half of `o` orders the value; the low half holds the
        # reversed chunk-local id (CHUNK <= 65536).
        key = (o & -65536) | (65535 - local)
        key = tl.where(in_range, key, _INT32_MIN)
        key = tl.sort(key, descending=True)
        hi = key & -65536
        full = tl.where(hi < 0, hi | 65535, hi)  # restore ordered(x)
        gid = chunk * CHUNK + (65535 - (key & 65535))
        gkey = (full.to(tl.int64) << 31) | (gid * -1 + _LOW31).to(tl.int64)
        gkey = tl.where(key == _INT32_MIN, _INVALID_KEY, gkey)
    else:
        gkey = (o.to(tl.int64) << 31) | (tok * -1 + _LOW31).to(tl.int64)
        gkey = tl.where(in_range, gkey, _INVALID_KEY)
        gkey = tl.sort(gkey, descending=True)
    tl.store(cand_ptr + out_offs, gkey, mask=local < K)


@triton.jit
def _vocab_stats_kernel(
    logits_ptr,  # [rows, V], any float dtype, row stride `stride`
    part_max_ptr,  # [rows, NC] float32 (only with COMPUTE_LSE)
    part_sum_ptr,  # [rows, NC] float32 (only with COMPUTE_LSE)
    cand_ptr,  # [rows, NC * K] int64: never written (see below)
    submax_ptr,  # [rows, NSUB * KEEP] int64 out: each sub-block's kept keys
    V,
    stride,
    NC,
    NSUB,
    no_store,  # -1: masks off the store into cand_ptr
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,  # sub-block size, a power of 2 dividing CHUNK
    KEEP: tl.constexpr,  # keys kept per sub-block (power of 2, <= SUB // GROUP)
    GROUP: tl.constexpr,  # tokens per group, a power of 2 dividing SUB
    IS_LOGPROBS: tl.constexpr,
    COMPUTE_LSE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    x, local, tok, in_range = _load_chunk(
        logits_ptr, row, chunk, V, stride, CHUNK, IS_LOGPROBS
    )
    if COMPUTE_LSE:
        _partial_lse(x, part_max_ptr, part_sum_ptr, row, chunk, NC)

    o = _ordered_f32(x)
    gkey = (o.to(tl.int64) << 31) | (tok * -1 + _LOW31).to(tl.int64)
    gkey = tl.where(in_range, gkey, _INVALID_KEY)
    # Triton vectorises a load as widely as the widest memory access of the
    # same shape in the kernel allows, and the float32 partial sum above
    # reduces in that layout's order.  This store (the address expression
    # of `_vocab_chunk`'s; never executed: no_store = -1, a runtime value
    # that Triton does not specialise) keeps that width, hence the partial
    # sums, bit-identical to the sorting kernel's.
    out_offs = row.to(tl.int64) * NC * K + chunk * K + local
    tl.store(cand_ptr + out_offs, gkey, mask=local < no_store)
    # Each sub-block's KEEP largest group maxima (its maximum first), stored
    # through 2-D [NUM, 1] pointer blocks so that no other 1-D access of
    # CHUNK elements joins the load's. One reduction over the chunk gives
    # the groups' maxima; the KEEP rounds then run over SUB // GROUP keys a
    # sub-block, not SUB (a round over int64 keys is the kernel's costliest
    # step). Keys are distinct: each round removes one.
    NUM: tl.constexpr = CHUNK // SUB
    blocks = tl.max(tl.reshape(gkey, (NUM, SUB // GROUP, GROUP)), axis=2)
    sidx = chunk * NUM + tl.arange(0, NUM)[:, None]
    out = submax_ptr + row.to(tl.int64) * NSUB * KEEP + sidx * KEEP
    for i in tl.static_range(KEEP):
        smax = tl.max(blocks, axis=1, keep_dims=True)
        # Sub-blocks wholly past V are not stored (NSUB = ceil(V / SUB)).
        tl.store(out + i, smax, mask=sidx < NSUB)
        if i + 1 < KEEP:
            blocks = tl.where(blocks == smax, _INVALID_KEY, blocks)


@triton.jit
def _top_desc(keys, TOP: tl.constexpr):
    """The ``TOP`` largest of ``keys`` (distinct int64, last axis) in
    descending order; all of them sorted when ``TOP`` is their length
    (`tl.topk` is only called where this Triton has it, see `HAS_TOPK`)."""
    # An if statement on a constexpr (compiled away), not a runtime select.
    if keys.shape[-1] > TOP:  # noqa: SIM108
        out = tl.topk(keys, TOP)
    else:
        out = tl.sort(keys, descending=True)
    return out


@triton.jit
def _vocab_threshold_kernel(
    submax_ptr,  # [rows, NSUB * KEEP] int64, each sub-block's maximum first
    thresh_ptr,  # [rows] int64 out: K-th largest of those keys
    blocks_ptr,  # [rows, K] int32 out: the sub-blocks with max >= thresh, then -1
    count_ptr,  # [rows] int32 out: zeroed for `_vocab_filter_kernel`
    num_over_ptr,  # [1] int32 out: zeroed (overflowed rows)
    NSUB,
    K: tl.constexpr,
    KEEP: tl.constexpr,
    MP: tl.constexpr,  # power of 2 >= NSUB * KEEP
    MB: tl.constexpr,  # power of 2 >= NSUB
    TOP: tl.constexpr,  # power of 2 >= K (MP without tl.topk)
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, MP)
    keys = tl.load(
        submax_ptr + row * NSUB * KEEP + offs,
        mask=offs < NSUB * KEEP,
        other=_INVALID_KEY,
    )
    top = _top_desc(keys, TOP)
    t_offs = tl.arange(0, TOP)
    thresh = tl.min(tl.where(t_offs < K, top, _MAX_KEY), axis=0)
    # The sub-blocks whose maximum is >= thresh, in block order: at most K
    # (each puts its maximum among the K kept keys >= thresh).
    b_offs = tl.arange(0, MB)
    bmax = tl.load(
        submax_ptr + row * NSUB * KEEP + b_offs * KEEP,
        mask=b_offs < NSUB,
        other=_INVALID_KEY,
    )
    hit = (bmax >= thresh) & (b_offs < NSUB)
    hit_i = hit.to(tl.int32)
    slot = tl.cumsum(hit_i, axis=0) - 1
    tl.store(blocks_ptr + row * K + slot, b_offs, mask=hit & (slot < K))
    num_hit = tl.sum(hit_i, axis=0)
    tl.store(blocks_ptr + row * K + t_offs, -1, mask=(t_offs >= num_hit) & (t_offs < K))
    tl.store(thresh_ptr + row, thresh)
    tl.store(count_ptr + row, 0)
    if row == 0:
        tl.store(num_over_ptr, 0)


@triton.jit
def _vocab_filter_kernel(
    logits_ptr,  # [rows, V], any float dtype, row stride `stride`
    thresh_ptr,  # [rows] int64
    blocks_ptr,  # [rows, K] int32
    count_ptr,  # [rows] int32: number of keys >= thresh (atomic)
    small_ptr,  # [rows, CAP] int64 out: the first CAP of them, any order
    num_over_ptr,  # [1] int32: rows whose count exceeds CAP (atomic)
    over_rows_ptr,  # [rows] int32 out: their ids, in no particular order
    V,
    stride,
    K: tl.constexpr,
    SUB: tl.constexpr,
    G: tl.constexpr,  # sub-blocks per program (power of 2)
    CAP: tl.constexpr,
    IS_LOGPROBS: tl.constexpr,
):
    row = tl.program_id(0)
    j = tl.program_id(1) * G + tl.arange(0, G)
    blk = tl.load(blocks_ptr + row.to(tl.int64) * K + j, mask=j < K, other=-1)
    # -1: no sub-block in this slot (fewer than K hold keys >= thresh).
    j_ok = blk >= 0
    blk = tl.maximum(blk, 0)
    tok = blk[:, None] * SUB + tl.arange(0, SUB)[None, :]
    live = j_ok[:, None] & (tok < V)
    x = tl.load(
        logits_ptr + row.to(tl.int64) * stride + tok, mask=live, other=float("-inf")
    ).to(tl.float32)
    x = _canonical(x, IS_LOGPROBS)
    key = (_ordered_f32(x).to(tl.int64) << 31) | (tok * -1 + _LOW31).to(tl.int64)
    sel = live & (key >= tl.load(thresh_ptr + row))
    sel_i = sel.to(tl.int32)
    per_blk = tl.sum(sel_i, axis=1)
    # Slots: a row-wide atomic counter, then a prefix sum in the program.
    n = tl.sum(per_blk, axis=0)
    base = tl.atomic_add(count_ptr + row, n)
    pos = (
        base
        + (tl.cumsum(per_blk, axis=0) - per_blk)[:, None]
        + tl.cumsum(sel_i, axis=1)
        - 1
    )
    tl.store(small_ptr + row.to(tl.int64) * CAP + pos, key, mask=sel & (pos < CAP))
    # The slot ranges [base, base + n) of a row's programs tile [0, count):
    # exactly one holds slot CAP when the row overflows.  It lists the row.
    if (base <= CAP) & (base + n > CAP):
        tl.store(over_rows_ptr + tl.atomic_add(num_over_ptr, 1), row)


@triton.jit
def _topk_merge_kernel(
    cand_ptr,  # [rows, NCAND] int64 keys
    out_ptr,  # [rows, num_groups * K] int64 keys
    NCAND,
    NUM_GROUPS,
    K: tl.constexpr,
    GROUP: tl.constexpr,  # candidates per group (fan_in * K)
    BLOCK: tl.constexpr,  # power of 2 >= GROUP
):
    _topk_merge(
        cand_ptr,
        out_ptr,
        tl.program_id(0).to(tl.int64),
        tl.program_id(1),
        NCAND,
        NUM_GROUPS,
        K,
        GROUP,
        BLOCK,
    )


@triton.jit
def _topk_merge(
    cand_ptr,
    out_ptr,
    row,
    group,
    NCAND,
    NUM_GROUPS,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    idx = group * GROUP + offs
    keys = tl.load(
        cand_ptr + row * NCAND + idx,
        mask=(offs < GROUP) & (idx < NCAND),
        other=_INVALID_KEY,
    )
    keys = tl.sort(keys, descending=True)
    tl.store(out_ptr + row * NUM_GROUPS * K + group * K + offs, keys, mask=offs < K)


@triton.jit
def _fallback_chunk_kernel(
    logits_ptr,  # [rows, V], any float dtype, row stride `stride`
    cand_ptr,  # [rows, NC * K] int64 out (overflowed rows only)
    num_over_ptr,  # [1] int32: number of overflowed rows
    over_rows_ptr,  # [rows] int32: their ids (first num_over entries)
    V,
    stride,
    NC,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    IS_LOGPROBS: tl.constexpr,
    KEY16: tl.constexpr,
):
    """`_vocab_chunk_kernel` for the (overflowed row, chunk) pairs only,
    shared out over a fixed grid: without overflow each program returns
    after one load (instead of R*D*num_chunks programs doing so)."""
    num_items = tl.load(num_over_ptr) * NC
    for w in range(tl.program_id(0), num_items, tl.num_programs(0)):
        _vocab_chunk(
            logits_ptr,
            cand_ptr,
            cand_ptr,
            cand_ptr,
            tl.load(over_rows_ptr + w // NC),
            w % NC,
            V,
            stride,
            NC,
            K,
            CHUNK,
            IS_LOGPROBS,
            False,
            KEY16,
        )


@triton.jit
def _fallback_merge_kernel(
    cand_ptr,  # [rows, NCAND] int64 keys
    out_ptr,  # [rows, num_groups * K] int64 keys (overflowed rows only)
    num_over_ptr,  # [1] int32
    over_rows_ptr,  # [rows] int32
    NCAND,
    NUM_GROUPS,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """`_topk_merge_kernel` for the overflowed rows only (as above)."""
    num_items = tl.load(num_over_ptr) * NUM_GROUPS
    for w in range(tl.program_id(0), num_items, tl.num_programs(0)):
        row = tl.load(over_rows_ptr + w // NUM_GROUPS).to(tl.int64)
        _topk_merge(
            cand_ptr, out_ptr, row, w % NUM_GROUPS, NCAND, NUM_GROUPS, K, GROUP, BLOCK
        )


@triton.jit
def _vocab_merge_kernel(
    part_max_ptr,
    part_sum_ptr,  # [rows, NC] float32
    cand_ptr,  # [rows, NCAND] int64: the tournament's last candidates
    token_lp_ptr,  # [rows, K] float32 out
    token_ids_ptr,  # [rows, K] int64 out
    lse_ptr,  # [rows] float32 (only with HAS_LSE)
    small_ptr,  # [rows, CAP] int64 threshold candidates (only THRESHOLD)
    count_ptr,  # [rows] int32 their count (only THRESHOLD)
    NC,  # chunks (partial logsumexps) per row
    NCAND,  # candidate keys per row in cand_ptr
    K: tl.constexpr,
    NC_BLOCK: tl.constexpr,
    CAND_BLOCK: tl.constexpr,
    IS_LOGPROBS: tl.constexpr,
    HAS_LSE: tl.constexpr,  # use the caller's logsumexp, not the partials
    THRESHOLD: tl.constexpr,  # rows with count <= CAP read small_ptr
    CAP: tl.constexpr,
    CAP_TOP: tl.constexpr,  # `_top_desc` size for small_ptr's keys
):
    row = tl.program_id(0)
    if IS_LOGPROBS:
        lse = 0.0
    else:
        if HAS_LSE:
            lse = tl.load(lse_ptr + row)
        else:
            lse = _combine_lse(part_max_ptr, part_sum_ptr, row, NC, NC_BLOCK)
    if THRESHOLD:
        count = tl.load(count_ptr + row)
        if count <= CAP:
            # 2-D [1, CAP] blocks: no 1-D access of NC_BLOCK elements joins
            # the partial logsumexp loads (see `_vocab_stats_kernel`), so
            # _combine_lse reduces in the same order as without THRESHOLD.
            offs = tl.arange(0, CAP)[None, :]
            keys = tl.load(
                small_ptr + row.to(tl.int64) * CAP + offs,
                mask=offs < count,
                other=_INVALID_KEY,
            )
            keys = _top_desc(keys, CAP_TOP)
            _emit(
                keys,
                tl.arange(0, CAP_TOP)[None, :],
                lse,
                row,
                token_lp_ptr,
                token_ids_ptr,
                K,
                IS_LOGPROBS,
            )
        else:
            _merge_candidates(
                cand_ptr,
                row,
                NCAND,
                lse,
                token_lp_ptr,
                token_ids_ptr,
                K,
                CAND_BLOCK,
                IS_LOGPROBS,
            )
    else:
        _merge_candidates(
            cand_ptr,
            row,
            NCAND,
            lse,
            token_lp_ptr,
            token_ids_ptr,
            K,
            CAND_BLOCK,
            IS_LOGPROBS,
        )


@triton.jit
def _merge_candidates(
    cand_ptr,
    row,
    NCAND,
    lse,
    token_lp_ptr,
    token_ids_ptr,
    K: tl.constexpr,
    CAND_BLOCK: tl.constexpr,
    IS_LOGPROBS: tl.constexpr,
):
    """Top ``K`` of the tournament's last candidates (a full sort: the
    memory accesses are the ones of the kernel before the threshold
    filter, see `_vocab_merge_kernel`)."""
    offs = tl.arange(0, CAND_BLOCK)
    keys = tl.load(
        cand_ptr + row.to(tl.int64) * NCAND + offs,
        mask=offs < NCAND,
        other=_INVALID_KEY,
    )
    keys = tl.sort(keys, descending=True)
    _emit(keys, offs, lse, row, token_lp_ptr, token_ids_ptr, K, IS_LOGPROBS)


@triton.jit
def _emit(
    keys,
    offs,
    lse,
    row,
    token_lp_ptr,
    token_ids_ptr,
    K: tl.constexpr,
    IS_LOGPROBS: tl.constexpr,
):
    """Stores the first ``K`` of the sorted ``keys`` as (log-prob, id)."""
    value = _unordered_f32((keys >> 31).to(tl.int32))
    ids = (keys & _LOW31) * -1 + _LOW31
    if IS_LOGPROBS:
        lp = value
    else:
        lp = value - lse
        # As torch.nan_to_num(lp, nan=-inf, posinf=-inf) in the torch
        # backend: NaN (-inf - -inf, inf - inf) and +inf -> -inf, and (its
        # default neginf) -inf -> -FLT_MAX.  Then clamp to <= 0.
        bad = (lp != lp) | (lp == float("inf"))
        lp = tl.where(lp == float("-inf"), -3.4028234663852886e38, lp)
        lp = tl.where(bad, float("-inf"), lp)
        lp = tl.minimum(lp, 0.0)
    keep = offs < K
    tl.store(token_lp_ptr + row * K + offs, lp, mask=keep)
    tl.store(token_ids_ptr + row * K + offs, ids, mask=keep)


@triton.jit
def _combine_lse(part_max_ptr, part_sum_ptr, row, NC, NC_BLOCK: tl.constexpr):
    c = tl.arange(0, NC_BLOCK)
    cm = tl.load(part_max_ptr + row * NC + c, mask=c < NC, other=0.0)
    cs = tl.load(part_sum_ptr + row * NC + c, mask=c < NC, other=0.0)
    m = tl.max(tl.where(cs > 0.0, cm, float("-inf")), axis=0)
    m = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    total = tl.sum(tl.where(cs > 0.0, cs * tl.exp(cm - m), 0.0), axis=0)
    return tl.log(total) + m


@triton.jit
def _tree_kernel(
    token_lp_ptr,  # [R, D, K] float32
    top_tokens_ptr,  # [R, D * K] int64
    cand_a_ptr,
    cand_b_ptr,  # [D, CP] int32: pair (a, b) of candidate c
    # at depth d + 1 (row 0 unused)
    cand_count_ptr,  # [D] int32: number of candidates at depth d + 1
    col_start_ptr,  # [D] int32: first column of depth d + 1
    prefix_count_ptr,  # [D] int32: n_{d+1}
    col_depth_ptr,
    col_cand_offset_ptr,  # [N] int64
    cand_token_slot_ptr,
    cand_parent_col_ptr,  # [total candidates] int64
    all_scores_ptr,  # [R, N] float32 scratch
    all_cands_ptr,  # [R, N] int32 scratch
    col_position_ptr,  # [R, N + 1] int64 scratch
    out_tokens_ptr,
    out_parent_ptr,
    out_depth_ptr,  # [R, B] int64
    out_score_ptr,  # [R, B] float32
    out_valid_ptr,  # [R, B] int8 (bool storage)
    N,
    NUM_SEL,
    D: tl.constexpr,
    K: tl.constexpr,
    B: tl.constexpr,
    CP: tl.constexpr,  # power of 2 >= max candidates per depth
    KP: tl.constexpr,  # power of 2 >= K
    NB: tl.constexpr,  # power of 2 >= max(N, B)
    TN: tl.constexpr,  # keys kept per depth: power of 2 >= max n_d, or CP
    TB: tl.constexpr,  # keys kept of the global sort: power of 2 >= B, or NB
):
    r = tl.program_id(0).to(tl.int64)
    scores_row = all_scores_ptr + r * N
    cands_row = all_cands_ptr + r * N
    lp_row = token_lp_ptr + r * D * K

    # Depth 1: the top-K tokens, already in order.
    k_offs = tl.arange(0, KP)
    n1 = tl.load(prefix_count_ptr)
    s1 = tl.load(lp_row + k_offs, mask=k_offs < K, other=float("-inf"))
    tl.store(scores_row + k_offs, s1, mask=k_offs < n1)
    tl.store(cands_row + k_offs, k_offs, mask=k_offs < n1)
    tl.debug_barrier()

    c_offs = tl.arange(0, CP)
    for d in range(1, D):  # depth d + 1
        count = tl.load(cand_count_ptr + d)
        prev_start = tl.load(col_start_ptr + d - 1)
        start = tl.load(col_start_ptr + d)
        n_d = tl.load(prefix_count_ptr + d)
        live = c_offs < count
        a = tl.load(cand_a_ptr + d * CP + c_offs, mask=live, other=0)
        b = tl.load(cand_b_ptr + d * CP + c_offs, mask=live, other=0)
        s = tl.load(scores_row + prev_start + a, mask=live, other=0.0) + tl.load(
            lp_row + d * K + b, mask=live, other=0.0
        )
        s = tl.where(s == 0.0, 0.0, s)
        key = (_ordered_f32(s).to(tl.int64) << 31) | (c_offs * -1 + _LOW31).to(tl.int64)
        key = tl.where(live, key, _INVALID_KEY)
        # Only the first n_d <= TN are kept: a top-TN costs fewer bitonic
        # stages than sorting all CP (the same keys in the same order).
        key = _top_desc(key, TN)
        t_offs = tl.arange(0, TN)
        keep = t_offs < n_d
        tl.store(
            scores_row + start + t_offs,
            _unordered_f32((key >> 31).to(tl.int32)),
            mask=keep,
        )
        tl.store(
            cands_row + start + t_offs,
            ((key & _LOW31) * -1 + _LOW31).to(tl.int32),
            mask=keep,
        )
        tl.debug_barrier()

    # Global top-B over all columns: (score desc, column asc), and columns
    # are depth-major and rank-ordered within a depth.
    n_offs = tl.arange(0, NB)
    live = n_offs < N
    s = tl.load(scores_row + n_offs, mask=live, other=0.0)
    key = (_ordered_f32(s).to(tl.int64) << 31) | (n_offs * -1 + _LOW31).to(tl.int64)
    key = tl.where(live, key, _INVALID_KEY)
    key = _top_desc(key, TB)  # the first B (<= TB) of the global order
    o_offs = tl.arange(0, TB)
    col = (key & _LOW31) * -1 + _LOW31
    score = _unordered_f32((key >> 31).to(tl.int32))
    # Sorted position < N: a real column (padding keys sort last).
    sel = (o_offs < NUM_SEL) & (o_offs < N)
    col = tl.where(sel, col, 0)
    depth = tl.load(col_depth_ptr + col, mask=sel, other=1)
    cand = tl.load(cands_row + col, mask=sel, other=0).to(tl.int64) + tl.load(
        col_cand_offset_ptr + col, mask=sel, other=0
    )
    slot = tl.load(cand_token_slot_ptr + cand, mask=sel, other=0)
    token = tl.load(top_tokens_ptr + r * D * K + slot, mask=sel, other=0)
    parent_col = tl.load(cand_parent_col_ptr + cand, mask=sel, other=0)
    pos_row = col_position_ptr + r * (N + 1)
    tl.store(pos_row + col, o_offs + 1, mask=sel)
    tl.store(pos_row + N, 0)
    tl.debug_barrier()
    parent = tl.load(pos_row + parent_col, mask=sel, other=0)

    out = r * B + o_offs
    in_b = o_offs < B
    tl.store(out_tokens_ptr + out, tl.where(sel, token, 0), mask=in_b)
    tl.store(out_parent_ptr + out, tl.where(sel, parent, 0), mask=in_b)
    tl.store(out_depth_ptr + out, tl.where(sel, depth, 1), mask=in_b)
    tl.store(out_score_ptr + out, tl.where(sel, score, float("-inf")), mask=in_b)
    tl.store(out_valid_ptr + out, sel.to(tl.int8), mask=in_b)
