#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the DDTree core (tree build, ancestor mask, walk, compaction).

Times, per (R, B) at draft depth D and vocabulary V:

* ``build``   build_tree(draft_logits [R, D, V], B)
* ``build_fast``  the same with exact_vocab_ties=False (boundary ties over
              the vocabulary left to torch.topk)
* ``walk``    walk_tree + compaction_indices (given the tree and targets)
* ``core``    build + walk + compaction (the issue's < 100 us goal at R=1,
              B=64, D=15)
* ``mask``    tree_positions + ancestor_mask + pack_ancestor_bits
* ``full``    build + mask + walk (using the mask) + compaction
* ``vocab``   only the vocabulary stage of build_fast (per-row top-K and
              log-probs over [R*D, V]: `vocab_stage`)
* ``tree``    only the tree stage (depth loop + global top-B + decode, from
              precomputed vocab-stage output: `tree_stage`)
* ``step``    what the V2 runner runs per step for DDTree: build_fast + the
              runner's tree-bias, walk and KV-compaction kernels (one launch
              each; ``vllm/v1/worker/gpu/spec_decode/ddtree/kernels.py``),
              compaction over a Qwen3-8B-shaped KV cache (36 layers, 8 KV
              heads of 128, bf16, block 16). Needs ``vllm`` importable (our
              wheel installed); skipped otherwise.

The build is ``vllm.v1.spec_decode.ddtree.tree``: the installed vLLM's (our
wheel), else this checkout's ``overlay/`` (see `load_tree_module`; ``--src``
swaps in a variant of its files). walk, core, mask and full time the torch
reference of the verification, ``tests/ddtree_reference.py`` (the runtime runs
the kernels of ``step`` instead), so they need a checkout.

``--backend torch|triton|auto`` picks the build backend (default auto:
Triton on CUDA when importable); ``--stages vocab,tree`` times only those
columns (e.g. to see where the build's time goes).

Each column is timed eagerly and (on CUDA) captured in a CUDA graph whose
replay is timed with CUDA events; the median over ``--iters`` runs is
reported in microseconds.  Prints a table and writes JSON with ``--out``.

GPU:  python3 -m bench.kernels.ddtree_core --out ddtree_core.json
CPU:  python3 -m bench.kernels.ddtree_core --device cpu --vocab 64 \
          --requests 1,8 --budgets 16,64 --stages build,walk,core
      (``--backend triton`` or ``step`` on CPU: TRITON_INTERPRET=1
      CUDA_VISIBLE_DEVICES= , ``step`` with our wheel installed; a smoke
      test, not a timing)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch

from bench import common

ALL_COLUMNS = (
    "build",
    "build_fast",
    "vocab",
    "tree",
    "walk",
    "core",
    "mask",
    "full",
    "step",
)
# The columns that time the torch reference's verification
# (tests/ddtree_reference.py: walk, compaction, ancestor mask, positions).
REFERENCE_COLUMNS = ("walk", "core", "mask", "full")
# Qwen3-8B's KV cache per layer: (num_blocks, num_kv_heads, block_size,
# 2 * head_size), as the Triton backend lays it out.
STEP_KV_LAYERS, STEP_KV_HEADS, STEP_HEAD_SIZE, STEP_BLOCK = 36, 8, 128, 16
DDTREE_PACKAGE = "vllm.v1.spec_decode.ddtree"


def runner_kernels():
    """The V2 runner's DDTree kernels, or None when vllm is not importable."""
    try:
        from vllm.v1.worker.gpu.spec_decode.ddtree import kernels
    except Exception:  # any import failure means "not here"
        return None
    return kernels


def load_tree_module(src: str | None) -> ModuleType:
    """DDTree's tree build: ``vllm.v1.spec_decode.ddtree.tree``.

    Imported normally: from the installed vLLM (our wheel) where it has
    DDTree, else from this checkout's ``overlay/`` (torch and Triton suffice
    there, ``vllm`` being a namespace package of our modules, as in the
    tests). The fallback is automatic rather than a required argument so
    that one command runs on a GPU host with the wheel and in a checkout;
    an installed vLLM without DDTree (a regular package, which a directory on
    sys.path cannot extend) is an error.

    ``src`` (optional) is a directory holding
    ``vllm/v1/spec_decode/ddtree/`` with variants of some of its files (a
    candidate change of tree.py / tree_triton.py): it goes first on the
    package's ``__path__``, so its files replace the imported package's
    (tree.py imports tree_triton through the package, so loading a single
    file by path would not pick up a variant of both).
    """
    try:
        package = importlib.import_module(DDTREE_PACKAGE)
    except ModuleNotFoundError:
        installed = importlib.util.find_spec("vllm")
        if installed is not None and installed.origin:  # a vLLM without DDTree
            raise SystemExit(
                f"{installed.origin}: this vLLM has no {DDTREE_PACKAGE}; "
                "install our wheel (or run where no vLLM is installed)"
            ) from None
        common.use_overlay()
        package = importlib.import_module(DDTREE_PACKAGE)
    if src:
        variant = pathlib.Path(src).resolve() / DDTREE_PACKAGE.replace(".", "/")
        if not variant.is_dir():
            raise SystemExit(f"--src {src}: no {variant}")
        package.__path__.insert(0, str(variant))
    return importlib.import_module(DDTREE_PACKAGE + ".tree")


def load_reference() -> ModuleType:
    """The torch reference verification (the reference columns time it)."""
    return common.torch_reference()


def time_eager(
    fn: Callable[[], object], device: torch.device, iters: int, warmup: int
) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        samples = [start.elapsed_time(end) * 1e3 for start, end in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def time_graph(fn: Callable[[], object], iters: int, warmup: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # builds cached index tables before capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    samples = [start.elapsed_time(end) * 1e3 for start, end in events]
    del graph
    return statistics.median(samples)


def kernel_times(
    fn: Callable[[], object], device: torch.device, iters: int, warmup: int
) -> dict[str, float]:
    """GPU time per call of ``fn`` by kernel (torch profiler, CUDA kernels:
    µs summed over ``iters`` calls, divided by ``iters``), largest first;
    empty off CUDA."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return kernel_table(prof.events(), iters)


def kernel_table(events, calls: int) -> dict[str, float]:
    """µs per call by kernel name from profiler events (``device_type``
    CUDA, ``name``, ``device_time_total``: a kernel event's duration in µs),
    largest first."""
    totals: dict[str, float] = {}
    for e in events:
        if getattr(e.device_type, "name", str(e.device_type)) != "CUDA":
            continue
        totals[e.name] = totals.get(e.name, 0.0) + float(e.device_time_total)
    return {
        name: round(us / calls, 2)
        for name, us in sorted(totals.items(), key=lambda kv: -kv[1])
    }


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
    kernels: tuple[str, ...] = (),
) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    # Peaked logits (like a trained drafter) in the requested dtype.
    logits = (torch.randn(num_reqs, depth, vocab, device=device, generator=gen) * 4).to(
        dtype
    )
    target = torch.randint(
        0, vocab, (num_reqs, budget + 1), device=device, generator=gen
    )
    # Let the target agree with the drafter's first choice at the root so
    # the walk is not trivially empty.
    target[:, 0] = logits[:, 0].float().argmax(-1)
    root_positions = torch.randint(0, 4096, (num_reqs,), device=device, generator=gen)
    query_start_loc = torch.arange(num_reqs + 1, device=device) * (budget + 1)
    kw = {"backend": backend} if hasattr(T, "vocab_stage") else {}
    tree = T.build_tree(logits, budget, **kw)

    def build():
        return T.build_tree(logits, budget, **kw)

    def build_fast():
        return T.build_tree(logits, budget, exact_vocab_ties=False, **kw)

    stage_out = (
        T.vocab_stage(logits, budget, exact_vocab_ties=False, **kw)
        if hasattr(T, "vocab_stage")
        else None
    )

    def vocab_only():
        return T.vocab_stage(logits, budget, exact_vocab_ties=False, **kw)

    def tree_only():
        return T.tree_stage(*stage_out, budget, **kw)

    # walk / core / mask / full: the build against the torch reference's
    # verification (`ref`, tests/ddtree_reference.py).
    def walk():
        w = ref.walk_tree(tree, target)
        return ref.compaction_indices(w, query_start_loc)

    def core():
        t = T.build_tree(logits, budget, exact_vocab_ties=False, **kw)
        w = ref.walk_tree(t, target)
        return ref.compaction_indices(w, query_start_loc)

    def mask():
        pos = ref.tree_positions(root_positions, tree.depth)
        m = ref.ancestor_mask(tree.parent_idx, depth)
        return pos, ref.pack_ancestor_bits(m)

    def full():
        t = T.build_tree(logits, budget, exact_vocab_ties=False, **kw)
        pos = ref.tree_positions(root_positions, t.depth)
        m = ref.ancestor_mask(t.parent_idx, depth)
        bits = ref.pack_ancestor_bits(m)
        w = ref.walk_tree(t, target, ancestors=m)
        return pos, bits, ref.compaction_indices(w, query_start_loc)

    def make_step():
        K = runner_kernels()
        # On CPU only under the Triton interpreter (a smoke test).
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if K is None or (device.type != "cuda" and not interpreted):
            return None
        num_rows = num_reqs * (budget + 1)
        idx_mapping = torch.arange(num_reqs, dtype=torch.int32, device=device)
        cu_num_logits = query_start_loc.to(torch.int32)
        depth_with_root = torch.zeros(
            num_reqs, budget + 1, dtype=torch.int64, device=device
        )
        attn_bias = torch.zeros(
            num_reqs, budget + 1, budget + 1, dtype=torch.float32, device=device
        )
        # Each request's verify rows in their own KV blocks (fewer layers in
        # the interpreter: it copies element by element).
        layers = STEP_KV_LAYERS if device.type == "cuda" else 2
        blocks_per_req = -(-(4096 + budget + 1) // STEP_BLOCK)
        kv = [
            torch.zeros(
                num_reqs * blocks_per_req,
                STEP_KV_HEADS,
                STEP_BLOCK,
                2 * STEP_HEAD_SIZE,
                dtype=torch.bfloat16,
                device=device,
            )
            for _ in range(layers)
        ]
        compactor = K.KVCompactor(kv)
        slots = (
            torch.arange(num_reqs, device=device)[:, None] * blocks_per_req * STEP_BLOCK
            + root_positions[:, None]
            + torch.arange(budget + 1, device=device)
        ).view(-1)
        target_flat = target.reshape(-1)
        assert target_flat.numel() == num_rows

        def step():
            t = T.build_tree(logits, budget, exact_vocab_ties=False, **kw)
            depth_with_root[:, 1:] = t.depth
            K.ddtree_tree_bias(
                t.parent_idx, idx_mapping, cu_num_logits, depth, attn_bias
            )
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

    result = {
        "R": num_reqs,
        "D": depth,
        "V": vocab,
        "B": budget,
        "dtype": str(dtype).removeprefix("torch."),
        "backend": backend,
    }
    fns = {
        "build": build,
        "build_fast": build_fast,
        "vocab": vocab_only,
        "tree": tree_only,
        "walk": walk,
        "core": core,
        "mask": mask,
        "full": full,
        "step": make_step() if "step" in columns else None,
    }
    for name in columns:
        fn = fns[name]
        if fn is None:  # "step" without vllm or CUDA
            result[f"{name}_eager_us"] = float("nan")
            if use_graph:
                result[f"{name}_graph_us"] = float("nan")
            continue
        result[f"{name}_eager_us"] = time_eager(fn, device, iters, warmup)
        if use_graph:
            result[f"{name}_graph_us"] = time_graph(fn, iters, warmup)
    for name in kernels:
        fn = fns[name]
        if fn is not None:
            result[f"{name}_kernels_us"] = kernel_times(fn, device, iters, warmup)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--requests", default="1,8,64")
    parser.add_argument("--budgets", default="16,64,256")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--no-graph", action="store_true")
    parser.add_argument(
        "--backend", default="auto", choices=["auto", "torch", "triton"]
    )
    parser.add_argument(
        "--stages",
        default=",".join(ALL_COLUMNS),
        help="columns to time, from "
        + ",".join(ALL_COLUMNS)
        + " (e.g. 'vocab,tree' to split the build)",
    )
    parser.add_argument(
        "--src",
        default=None,
        help="a directory holding vllm/v1/spec_decode/ddtree/ "
        "whose files replace those of the imported vLLM (a "
        "candidate variant); default: none",
    )
    parser.add_argument(
        "--kernels",
        default="",
        help="columns whose GPU time to split by kernel (torch profiler, "
        "µs per call: '<column>_kernels_us'), e.g. 'build'",
    )
    parser.add_argument("--out", default=None, help="write JSON here")
    args = parser.parse_args()

    T = load_tree_module(args.src)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    use_graph = device.type == "cuda" and not args.no_graph
    requests = [int(x) for x in args.requests.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]

    columns = [c for c in args.stages.split(",") if c]
    kernel_columns = [c for c in args.kernels.split(",") if c]
    unknown = set(columns + kernel_columns) - set(ALL_COLUMNS)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}")
    ref = load_reference() if set(columns) & set(REFERENCE_COLUMNS) else None
    modes = ["eager", "graph"] if use_graph else ["eager"]
    header = f"{'R':>4} {'B':>4} " + " ".join(
        f"{c + '_' + m:>16}" for c in columns for m in modes
    )
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device={device} ({device_name}) D={args.depth} V={args.vocab} "
        f"dtype={args.dtype} backend={args.backend} torch={torch.__version__}; "
        f"median us over {args.iters} runs; {T.__file__}"
    )
    print(header)
    results = []
    for num_reqs in requests:
        for budget in budgets:
            res = bench_case(
                T,
                ref,
                device,
                dtype,
                num_reqs,
                args.depth,
                args.vocab,
                budget,
                args.iters,
                args.warmup,
                use_graph,
                args.backend,
                tuple(columns),
                tuple(kernel_columns),
            )
            results.append(res)
            print(
                f"{num_reqs:>4} {budget:>4} "
                + " ".join(
                    f"{res[f'{c}_{m}_us']:>16.1f}" for c in columns for m in modes
                ),
                flush=True,
            )
            for c in kernel_columns:
                split = res.get(f"{c}_kernels_us", {})
                print(
                    f"     {c} by kernel (us per call): "
                    + ", ".join(f"{k} {v:.1f}" for k, v in split.items()),
                    flush=True,
                )
    if args.out:
        meta = {
            "device": str(device),
            "device_name": device_name,
            "torch": torch.__version__,
            "depth": args.depth,
            "vocab": args.vocab,
            "dtype": args.dtype,
            "backend": args.backend,
            "iters": args.iters,
            "tree": T.__file__,
        }
        common.write_json(args.out, {"meta": meta, "results": results}, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
