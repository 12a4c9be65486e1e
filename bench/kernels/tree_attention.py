#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Time the target's tree attention: unified vs split vs FA3 causal.

One attention layer's call on a decode batch: ``--batch`` requests of ``T``
query tokens (``--tree-tokens``: 1 + budget; 16 is the chain's K = 15) after
``--context`` committed tokens, a random tree per request, bf16, a paged KV cache
in the TRITON_ATTN layout (block 16), at the Qwen3-8B (32 query / 8 KV heads of
128, 36 attention layers) and Qwen3.6-27B (24 / 4 of 256, 16 layers) shapes:

* ``unified``  the patched Triton unified attention with the packed tree mask as
               its ``qq_bias``;
* ``split``    FA3 over the prefix + the Triton kernel over the tree, merged in
               place (`SplitTreeAttention`, as the backend calls it);
  ``split_in_two`` the same with every request longer than the tree on FA3
               causal alone (where that bound should lie);
* ``fa3_causal`` FA3 causal over the same tokens, as the chain's verification.

``--chunks N`` adds a new prompt's prefill chunk of N tokens to each batch.
Each method is captured in a CUDA graph; ``--iters`` replays between CUDA
events, the median of ``--repeats``, in µs per call and per step (times the
shape's attention layers), with the split's largest difference from the
unified kernel's output. Prints a table, writes JSON rows with ``--out``.

    python3 -m bench.kernels.tree_attention --out bench/results/tree-attention.json

CPU smoke run (Triton interpreter, the torch reference prefix pass instead of
FA3, no graph, no ``fa3_causal``; times nothing):

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python3 -m bench.kernels.tree_attention \\
        --device cpu --shapes tiny --contexts 40 --tree-tokens 5 --batch 2 \\
        --iters 1 --repeats 1
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from types import SimpleNamespace

import torch

from bench import common

# name -> (query heads, KV heads, head size, attention layers per step)
SHAPES = {
    "qwen3-8b": (32, 8, 128, 36),
    "qwen3.6-27b": (24, 4, 256, 16),
    # CPU smoke runs only.
    "tiny": (4, 2, 64, 2),
}
BLOCK_SIZE = 16
# TRITON_ATTN's 3D-kernel constants (unused by tree batches, which run the
# 2D kernel: max_seqlen_q > 1), passed as the backend passes them.
NUM_PAR_SOFTMAX_SEGMENTS = 16
MIN_LAUNCH_GRID_SIZE_2D = 128
# The FLASH_ATTN builder's split bound under full CUDA graphs
# (attention_config.flash_attn_max_num_splits_for_cuda_graph).
FA3_CUDA_GRAPH_SPLITS = 32


def packed_random_trees(
    num_reqs: int, t: int, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """int32 [num_reqs, t, ceil(t / 32)]: a random tree per request (parents
    before children), bit set where a node may not see another."""
    visible = torch.zeros(num_reqs, t, t, dtype=torch.bool)
    for r in range(num_reqs):
        parents = [-1] + [
            int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)
        ]
        for i in range(t):
            j = i
            while j >= 0:
                visible[r, i, j] = True
                j = parents[j]
    words = (t + 31) // 32
    hidden = torch.ones(num_reqs, t, words * 32, dtype=torch.int64)
    hidden[:, :, :t] = (~visible).to(torch.int64)
    packed = (hidden.view(num_reqs, t, words, 32) << torch.arange(32)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32).to(device)


def make_case(
    shape: str,
    context: int,
    t: int,
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    chunk: int = 0,
) -> dict:
    """``batch`` requests of ``t`` tree tokens after ``context`` committed
    ones and, with ``chunk``, one more request last: a new prompt's first
    prefill chunk of ``chunk`` tokens (no tree: zero mask words), as a
    continuous batch mixes them into decode steps."""
    num_q, num_kv, head_size, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    query_lens = [t] * batch + ([chunk] if chunk else [])
    seq_lens_list = [context + t] * batch + ([chunk] if chunk else [])
    num_reqs = len(query_lens)
    blocks_per_req = (max(seq_lens_list) + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = num_reqs * blocks_per_req + 1
    # TRITON_ATTN's cache: logical (blocks, KV heads, block, 2 * head size),
    # K and V side by side in the last dim; the backend's views of it.
    kv_cache = torch.randn(
        num_blocks, num_kv, BLOCK_SIZE, 2 * head_size, generator=gen
    ).to(device=device, dtype=dtype)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    perm = torch.randperm(num_blocks, generator=gen)[: num_reqs * blocks_per_req]
    block_table = perm.view(num_reqs, blocks_per_req).to(torch.int32).to(device)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_q, head_size, generator=gen).to(
        device=device, dtype=dtype
    )
    cu_seqlens_q = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=device)
    tree_mask = packed_random_trees(batch, t, gen, device)
    if chunk:
        tree_mask = torch.cat([tree_mask, torch.zeros_like(tree_mask[:1])])
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q.to(device),
        seq_lens=seq_lens,
        tree_mask=tree_mask,
        t=t,
        batch=num_reqs,
        context=context,
        chunk=chunk,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens_list),
        scale=head_size**-0.5,
        shape=(num_q, num_kv, head_size),
    )


def varlen_args(case: dict, out: torch.Tensor, **caches) -> dict:
    """The keywords the Triton unified kernel and FA3 take alike for ``case``;
    ``caches``: other views of its KV cache (``k``, ``v``) than its own."""
    kw = dict(
        q=case["query"],
        k=case["key_cache"],
        v=case["value_cache"],
        out=out,
        cu_seqlens_q=case["cu_seqlens_q"],
        max_seqlen_q=case["max_query_len"],
        seqused_k=case["seq_lens"],
        max_seqlen_k=case["max_seq_len"],
        softmax_scale=case["scale"],
        causal=True,
        block_table=case["block_table"],
    )
    return kw | caches


def unified_fn(case: dict, out: torch.Tensor) -> Callable[[], None]:
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    num_q, num_kv, head_size = case["shape"]
    threshold = MIN_LAUNCH_GRID_SIZE_2D // num_kv
    hs_pad = 1 << (head_size - 1).bit_length()
    device = out.device
    segm_out = torch.empty(
        threshold, num_q, NUM_PAR_SOFTMAX_SEGMENTS, hs_pad, device=device
    )
    segm_max = torch.empty(threshold, num_q, NUM_PAR_SOFTMAX_SEGMENTS, device=device)
    segm_sum = torch.empty_like(segm_max)
    one = torch.ones(1, device=device)
    descale = one.expand(case["batch"], num_kv)

    def run() -> None:
        unified_attention(
            **varlen_args(case, out),
            window_size=(-1, -1),
            softcap=0,
            q_descale=None,
            k_descale=descale,
            v_descale=descale,
            seq_threshold_3D=threshold,
            num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS,
            softmax_segm_output=segm_out,
            softmax_segm_max=segm_max,
            softmax_segm_expsum=segm_sum,
            qq_bias=case["tree_mask"],
            kv_quant_mode=KVQuantMode.NONE,
        )

    return run


def split_fn(
    case: dict, out: torch.Tensor, reference: bool, in_two: bool = False
) -> Callable[[], None]:
    """The backend's split path: `SplitTreeAttention` built as the
    TRITON_ATTN builder builds it under full CUDA graphs, `build` once
    outside the graph, then the impl's call. ``in_two``: any request longer
    than the tree (not only past `SPLIT_MAX_CHUNK`) runs FA3 causal over its
    whole sequence (method ``split_in_two``: where that bound should lie)."""
    from vllm.v1.spec_decode.ddtree.tree_attention import SplitTreeAttention

    num_q, num_kv, head_size = case["shape"]
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=case["batch"]),
        compilation_config=SimpleNamespace(
            cudagraph_mode=SimpleNamespace(has_full_cudagraphs=lambda: True),
            max_cudagraph_capture_size=max(512, case["query"].shape[0]),
        ),
        attention_config=SimpleNamespace(
            flash_attn_max_num_splits_for_cuda_graph=FA3_CUDA_GRAPH_SPLITS
        ),
        # T = 1 + tree_budget: a longer prefill chunk (last in the batch, as
        # the V2 model runner orders it) runs on FA3 alone, causal.
        speculative_config=SimpleNamespace(tree_budget=case["tree_mask"].shape[1] - 1),
    )
    prefix_attention = None
    if reference:
        prefix_attention = common.torch_reference().paged_prefix_attention
    split = SplitTreeAttention(
        config,
        num_q,
        num_kv,
        head_size,
        BLOCK_SIZE,
        case["query"].dtype,
        out.device,
        prefix_attention=prefix_attention,
    )
    if in_two:
        split.max_split_query_len = case["tree_mask"].shape[1]
    attn = SimpleNamespace(
        num_reqs=case["batch"],
        num_actual_tokens=case["query"].shape[0],
        query_start_loc=case["cu_seqlens_q"],
        query_start_loc_cpu=case["cu_seqlens_q"].cpu(),
        seq_lens=case["seq_lens"],
        max_query_len=case["max_query_len"],
        max_seq_len=case["max_seq_len"],
        block_table=case["block_table"],
        tree_attn_bias=case["tree_mask"],
        causal=True,
    )
    meta = split.build(attn)
    assert meta is not None

    def run() -> None:
        meta.forward(
            case["query"],
            case["key_cache"],
            case["value_cache"],
            out,
            attn,
            case["scale"],
            0.0,
            None,
        )

    return run


def fa3_causal_fn(case: dict, out: torch.Tensor) -> Callable[[], None]:
    """FLASH_ATTN's call for T causal tokens under full CUDA graphs (AOT
    schedule, the CUDA-graph split bound)."""
    from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    num_q, num_kv, head_size = case["shape"]
    key_cache = canonicalize_singleton_dim_strides(case["key_cache"])
    value_cache = canonicalize_singleton_dim_strides(case["value_cache"])
    scheduler_metadata = get_scheduler_metadata(
        batch_size=case["batch"],
        max_seqlen_q=case["max_query_len"],
        max_seqlen_k=case["max_seq_len"],
        num_heads_q=num_q,
        num_heads_kv=num_kv,
        headdim=head_size,
        cache_seqlens=case["seq_lens"],
        qkv_dtype=case["query"].dtype,
        cu_seqlens_q=case["cu_seqlens_q"],
        page_size=BLOCK_SIZE,
        causal=True,
        num_splits=FA3_CUDA_GRAPH_SPLITS,
    )

    def run() -> None:
        flash_attn_varlen_func(
            **varlen_args(case, out, k=key_cache, v=value_cache),
            scheduler_metadata=scheduler_metadata,
            fa_version=3,
            num_splits=FA3_CUDA_GRAPH_SPLITS,
        )

    return run


def bench_case(
    shape: str,
    context: int,
    t: int,
    batch: int,
    device: torch.device,
    methods: list[str],
    iters: int,
    repeats: int,
    chunk: int = 0,
) -> list[dict]:
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    case = make_case(shape, context, t, batch, dtype, device, chunk=chunk)
    layers = SHAPES[shape][3]
    outputs: dict[str, torch.Tensor] = {}
    times: dict[str, float] = {}
    for method in methods:
        out = torch.zeros_like(case["query"])
        if method == "unified":
            fn = unified_fn(case, out)
        elif method in ("split", "split_in_two"):
            fn = split_fn(
                case, out, reference=not on_gpu, in_two=method == "split_in_two"
            )
        else:
            assert method == "fa3_causal" and on_gpu
            fn = fa3_causal_fn(case, out)
        if on_gpu:
            times[method] = common.graph_us(fn, repeats, replays=iters)
        else:
            times[method] = common.eager_us(fn, repeats, calls=iters)
        fn()  # the outputs of one plain call, for the comparison
        outputs[method] = out
    if on_gpu:
        torch.cuda.synchronize()

    # The largest difference of the split's outputs (as shipped and in two)
    # from the unified kernel's.
    def max_diff(a: str, b: str) -> float:
        return float((outputs[a].float() - outputs[b].float()).abs().max())

    splits = [m for m in ("split", "split_in_two") if m in outputs]
    diff = None
    if splits and "unified" in outputs:
        diff = max(max_diff(m, "unified") for m in splits)
    num_q, num_kv, head_size = case["shape"]
    return [
        dict(
            shape=shape,
            num_q_heads=num_q,
            num_kv_heads=num_kv,
            head_size=head_size,
            context=context,
            tree_tokens=t,
            batch=batch,
            prefill_chunk=chunk,
            method=method,
            us=round(us, 2),
            attention_layers=layers,
            us_per_step=round(us * layers, 1),
            split_vs_unified_max_abs_diff=diff,
        )
        for method, us in times.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    lists = ("--contexts", "--tree-tokens", "--batch", "--chunks")
    common.add_options(parser, {
        "--shapes": ("qwen3-8b,qwen3.6-27b", None),
        "--contexts": ("512,1024,2048,4096,8192", None),
        "--tree-tokens": ("16,65", None),
        "--batch": ("1,8,32", None),
        "--chunks": ("0", "also time each batch with one more request: a new "
            "prompt's first prefill chunk of this many tokens (0: none), as "
            "continuous batching mixes prefills into decode steps"),
        "--methods": ("unified,split,fa3_causal", None),
        "--device": ("cuda", None),
    }, dict.fromkeys(lists, common.csv_ints))  # fmt: skip
    common.add_kernel_options(parser, iters=100, repeats=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    methods = [m for m in args.methods.split(",") if m]
    if device.type != "cuda":
        # No FA3 off a GPU: the split runs its torch reference prefix pass.
        methods = [m for m in methods if m != "fa3_causal"]
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    rows: list[dict] = []
    print(
        f"{'shape':<12} {'ctx':>5} {'T':>3} {'batch':>5} {'chunk':>5} {'method':<10} "
        f"{'us/call':>9} {'us/step':>9} {'|split-unified|':>15}"
    )
    cases = (shapes, args.contexts, args.tree_tokens, args.batch, args.chunks)
    for shape, context, t, batch, chunk in itertools.product(*cases):
        for row in bench_case(
            shape, context, t, batch, device, methods, args.iters, args.repeats, chunk
        ):
            rows.append(row)
            diff = row["split_vs_unified_max_abs_diff"]
            print(
                f"{shape:<12} {context:>5} {t:>3} {batch:>5} {chunk:>5} "
                f"{row['method']:<10} {row['us']:>9.1f} {row['us_per_step']:>9.1f} "
                f"{'' if diff is None else f'{diff:.2e}':>15}",
                flush=True,
            )
    meta = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        iters=args.iters,
        repeats=args.repeats,
        block_size=BLOCK_SIZE,
        timing="cuda graph replay" if device.type == "cuda" else "eager (smoke)",
    )
    if args.out is not None:
        common.write_json(args.out, {"meta": meta, "rows": rows}, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
