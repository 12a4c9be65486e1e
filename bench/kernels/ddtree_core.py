#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the DDTree core (tree build, ancestor mask, walk, compaction).

Times, per (R, B) at draft depth D and vocabulary V:

* ``build``   build_tree(draft_logits [R, D, V], B)
* ``build_fast``  the same with exact_vocab_ties=False (boundary ties over
              the vocabulary left to torch.topk)
* ``vocab``   only the build's vocabulary stage (per-row top-K and log-probs)
* ``tree``    only its tree stage (depth loop, global top-B, decode)
* ``walk``    walk_tree + compaction_indices (given the tree and targets)
* ``core``    build + walk + compaction
* ``mask``    tree_positions + ancestor_mask + pack_ancestor_bits
* ``full``    build + mask + walk (using the mask) + compaction
* ``step``    what the V2 runner runs per step: build_fast + its tree-bias,
              walk and KV-compaction kernels, compaction over a Qwen3-8B-shaped
              KV cache (36 layers, 8 KV heads of 128, bf16, block 16); needs
              our wheel installed

The build is ``vllm.v1.spec_decode.ddtree.tree``: the installed vLLM's (our
wheel), else this checkout's ``overlay/``. walk, core, mask and full time the
torch reference of the verification (``tests/ddtree_reference.py``; the
runtime runs the kernels of ``step``), so they need a checkout.

Each column is timed eagerly and (on CUDA) as a CUDA-graph replay, the median
over ``--iters`` runs in microseconds. Prints a table; JSON with ``--out``.

GPU:  python3 -m bench.kernels.ddtree_core --out ddtree_core.json
CPU:  python3 -m bench.kernels.ddtree_core --device cpu --vocab 64 \
          --requests 1,8 --budgets 16,64 --stages build,walk,core
      (a smoke test, not a timing; ``--backend triton`` or ``step`` on CPU:
      TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os

import torch

from bench import common

ALL_COLUMNS = ("build", "build_fast", "vocab", "tree", "walk", "core", "mask", "full")
ALL_COLUMNS += ("step",)
# The columns that time the torch reference's verification.
REFERENCE_COLUMNS = ("walk", "core", "mask", "full")
# Qwen3-8B's KV cache per layer: (blocks, KV heads, block size, 2 * head size),
# as the Triton backend lays it out.
STEP_KV_LAYERS, STEP_KV_HEADS, STEP_HEAD_SIZE, STEP_BLOCK = 36, 8, 128, 16
DDTREE_PACKAGE = "vllm.v1.spec_decode.ddtree"


def load_tree_module():
    """``vllm.v1.spec_decode.ddtree.tree`` of the installed vLLM (our wheel)
    where it has DDTree, else of this checkout's ``overlay/`` (torch and
    Triton suffice there). An installed vLLM without DDTree (a regular
    package, which a directory on sys.path cannot extend) is an error."""
    try:
        importlib.import_module(DDTREE_PACKAGE)
    except ModuleNotFoundError:
        installed = importlib.util.find_spec("vllm")
        if installed is not None and installed.origin:
            raise SystemExit(
                f"{installed.origin}: this vLLM has no {DDTREE_PACKAGE}; "
                "install our wheel (or run where no vLLM is installed)"
            ) from None
        common.use_overlay()
    return importlib.import_module(DDTREE_PACKAGE + ".tree")


def load_reference():
    """The torch reference verification (the reference columns time it)."""
    return common.torch_reference()


def step_fn(T, kw, logits, target, budget, root_positions, query_start_loc):
    """The V2 runner's per-step DDTree work (``step``), or None without our
    wheel or off CUDA (on CPU only under the Triton interpreter)."""
    try:
        from vllm.v1.worker.gpu.spec_decode.ddtree import kernels as K
    except Exception:  # any import failure means "not here"
        return None
    device = logits.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    num_reqs, depth, _ = logits.shape
    idx_mapping = torch.arange(num_reqs, dtype=torch.int32, device=device)
    cu_num_logits = query_start_loc.to(torch.int32)
    depth_with_root = torch.zeros(
        num_reqs, budget + 1, dtype=torch.int64, device=device
    )
    bias = torch.zeros(num_reqs, budget + 1, budget + 1, device=device)
    # Each request's verify rows in their own KV blocks (fewer layers in the
    # interpreter: it copies element by element).
    layers = STEP_KV_LAYERS if device.type == "cuda" else 2
    blocks_per_req = -(-(4096 + budget + 1) // STEP_BLOCK)
    kv_shape = (
        num_reqs * blocks_per_req,
        STEP_KV_HEADS,
        STEP_BLOCK,
        2 * STEP_HEAD_SIZE,
    )
    kv = [
        torch.zeros(kv_shape, dtype=torch.bfloat16, device=device)
        for _ in range(layers)
    ]
    compactor = K.KVCompactor(kv)
    slots = (
        torch.arange(num_reqs, device=device)[:, None] * blocks_per_req * STEP_BLOCK
        + root_positions[:, None]
        + torch.arange(budget + 1, device=device)
    ).view(-1)
    target_flat = target.reshape(-1)

    def step():
        t = T.build_tree(logits, budget, exact_vocab_ties=False, **kw)
        depth_with_root[:, 1:] = t.depth
        K.ddtree_tree_bias(t.parent_idx, idx_mapping, cu_num_logits, depth, bias)
        out, num_accepted, src_row, dst_row = K.ddtree_walk(
            target_flat,
            cu_num_logits,
            idx_mapping,
            cu_num_logits,
            t.token_ids,
            t.parent_idx,
            depth_with_root,
            t.valid,
            depth,
        )
        compactor(slots, src_row, dst_row, num_accepted)
        return out

    return step


def bench_case(
    T,
    ref,
    device: torch.device,
    dtype: torch.dtype,
    num_reqs: int,
    depth: int,
    vocab: int,
    budget: int,
    iters: int,
    warmup: int,
    use_graph: bool,
    backend: str = "auto",
    columns: tuple[str, ...] = (),
) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    # Peaked logits (like a trained drafter) in the requested dtype.
    logits = torch.randn(num_reqs, depth, vocab, device=device, generator=gen) * 4
    logits = logits.to(dtype)
    target = torch.randint(
        0, vocab, (num_reqs, budget + 1), device=device, generator=gen
    )
    # The target agrees with the drafter's first choice at the root, so that
    # the walk is not trivially empty.
    target[:, 0] = logits[:, 0].float().argmax(-1)
    root_positions = torch.randint(0, 4096, (num_reqs,), device=device, generator=gen)
    query_start_loc = torch.arange(num_reqs + 1, device=device) * (budget + 1)
    kw = {"backend": backend}
    tree = T.build_tree(logits, budget, **kw)
    stage_out = T.vocab_stage(logits, budget, exact_vocab_ties=False, **kw)

    def build_fast():
        return T.build_tree(logits, budget, exact_vocab_ties=False, **kw)

    def walk(t=tree, ancestors=None):
        w = ref.walk_tree(t, target, ancestors=ancestors)
        return ref.compaction_indices(w, query_start_loc)

    def mask(t=tree):
        pos = ref.tree_positions(root_positions, t.depth)
        m = ref.ancestor_mask(t.parent_idx, depth)
        return pos, ref.pack_ancestor_bits(m), m

    def full():
        t = build_fast()
        *pos_bits, m = mask(t)
        return *pos_bits, walk(t, m)

    fns = {
        "build": lambda: T.build_tree(logits, budget, **kw),
        "build_fast": build_fast,
        "vocab": lambda: T.vocab_stage(logits, budget, exact_vocab_ties=False, **kw),
        "tree": lambda: T.tree_stage(*stage_out, budget, **kw),
        "walk": walk,
        "core": lambda: walk(build_fast()),
        "mask": mask,
        "full": full,
    }
    if "step" in columns:
        fns["step"] = step_fn(
            T, kw, logits, target, budget, root_positions, query_start_loc
        )
    result = dict(R=num_reqs, D=depth, V=vocab, B=budget, backend=backend)
    result["dtype"] = str(dtype).removeprefix("torch.")
    cuda = device.type == "cuda"
    for name in columns:
        fn = fns[name]
        modes = ("eager", "graph") if use_graph else ("eager",)
        if fn is None:  # "step" without our wheel or CUDA
            result.update({f"{name}_{m}_us": float("nan") for m in modes})
            continue
        for _ in range(warmup):
            fn()
        result[f"{name}_eager_us"] = common.eager_us(fn, iters, cuda=cuda)
        if use_graph:
            result[f"{name}_graph_us"] = common.graph_us(fn, iters)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--requests", type=common.csv_ints, default=[1, 8, 64])
    ap.add_argument("--budgets", type=common.csv_ints, default=[16, 64, 256])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    common.add_kernel_options(ap, iters=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument(
        "--stages",
        default=",".join(ALL_COLUMNS),
        help=f"columns to time, from {','.join(ALL_COLUMNS)}",
    )
    args = ap.parse_args()
    T = load_tree_module()
    device = torch.device(args.device)
    use_graph = device.type == "cuda" and not args.no_graph
    columns = tuple(c for c in args.stages.split(",") if c)
    if set(columns) - set(ALL_COLUMNS):
        ap.error(f"unknown stages {sorted(set(columns) - set(ALL_COLUMNS))}")
    ref = load_reference() if set(columns) & set(REFERENCE_COLUMNS) else None
    modes = ["eager", "graph"] if use_graph else ["eager"]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device={device} ({device_name}) D={args.depth} V={args.vocab} "
        f"dtype={args.dtype} backend={args.backend} torch={torch.__version__}; "
        f"median us over {args.iters} runs; {T.__file__}"
    )
    print(
        f"{'R':>4} {'B':>4} "
        + " ".join(f"{c + '_' + m:>16}" for c in columns for m in modes)
    )
    results = []
    for num_reqs in args.requests:
        for budget in args.budgets:
            res = bench_case(
                T,
                ref,
                device,
                getattr(torch, args.dtype),
                num_reqs,
                args.depth,
                args.vocab,
                budget,
                args.iters,
                args.warmup,
                use_graph,
                args.backend,
                columns,
            )
            results.append(res)
            times = " ".join(
                f"{res[f'{c}_{m}_us']:>16.1f}" for c in columns for m in modes
            )
            print(f"{num_reqs:>4} {budget:>4} {times}", flush=True)
    if args.out:
        meta = dict(
            device=str(device), device_name=device_name, torch=torch.__version__
        )
        meta.update(depth=args.depth, vocab=args.vocab, dtype=args.dtype)
        meta.update(backend=args.backend, iters=args.iters, tree=T.__file__)
        common.write_json(args.out, {"meta": meta, "results": results}, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
