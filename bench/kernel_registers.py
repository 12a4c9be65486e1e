#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Registers and spills of the tree Gated DeltaNet kernels, compiled for
Hopper (sm_90a) without a GPU.

Compiles `_tree_gdn_chunk_kernel` (one block) and `_tree_gdn_blocked_kernel`
at the Qwen3.6-27B shape (16 key / 48 value heads of 128, bf16 inputs,
float32 states, draft depth 15) for each block size and value block given,
and prints what Triton's bundled ``ptxas -v`` reports: registers per thread
and the bytes of spill stores and loads. A kernel whose tiles hold more than
the registers do spills to local memory; that is how blocks of 32 rows were
found to cost more than 2 blocks of 16 (bench/bench_tree_gdn.py times them).

    python3 bench/kernel_registers.py [--rows 16,32] [--block-v 64,128] \\
        [--num-warps 4]

Runs where vLLM and Triton are installed; set CUDA_VISIBLE_DEVICES="" on a
machine without a GPU (the compile needs none).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

C = "constexpr"
GDN_SIGNATURE = {
    "A_log": "*fp32",
    "a": "*bf16",
    "b": "*bf16",
    "dt_bias": "*fp32",
    "q": "*bf16",
    "k": "*bf16",
    "v": "*bf16",
    "o": "*bf16",
    "state": "*fp32",
    "state_stride": "i64",
    "state_idx_ptr": "*i32",
    "query_start_ptr": "*i32",
    "parent_ptr": "*i64",
    "parent_stride": "i32",
    "idx_mapping_ptr": "*i32",
    "softplus_beta": "fp32",
    "softplus_threshold": "fp32",
    "scale": "fp32",
}
SHAPE = dict(H=16, HV=48, K=128, V=128, BK=128, MAX_PATH=16)
BF16_FORM = dict(
    PRODUCTS=True,
    PATH_SQUARINGS=4,
    USE_QK_L2NORM_IN_KERNEL=True,
    DOT_PRECISION="tf32",
)


def ptxas_report(fn, signature: dict, constexprs: dict, num_warps: int) -> str:
    """``ptxas -v``'s registers and spills of ``fn`` compiled for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(
        fn=fn,
        signature={**signature, **dict.fromkeys(constexprs, C)},
        constexprs=constexprs,
    )
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", ptx + ".cubin"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", out)
    stores = re.search(r"(\d+) bytes spill stores", out)
    loads = re.search(r"(\d+) bytes spill loads", out)
    return (
        f"{regs.group(1) if regs else '?'} registers, "
        f"{stores.group(1) if stores else '?'} B spill stores, "
        f"{loads.group(1) if loads else '?'} B spill loads"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,32", help="rows per block")
    ap.add_argument("--block-v", default="64,128", help="value blocks")
    ap.add_argument("--num-warps", type=int, default=4)
    a = ap.parse_args(argv)
    from vllm.v1.spec_decode.ddtree import tree_gdn as tg

    inverse = tg.INVERSE_PRECISION
    for rows in [int(r) for r in a.rows.split(",")]:
        for block_v in [int(v) for v in a.block_v.split(",")]:
            common = dict(
                SHAPE,
                **BF16_FORM,
                BV=block_v,
                INVERSE_FACTORS=min(rows.bit_length() - 2, 3),
                INVERSE_PRECISION=inverse,
            )
            one_block = ptxas_report(
                tg._tree_gdn_chunk_kernel,
                GDN_SIGNATURE,
                dict(common, BN=rows, ROOT_APART=0),
                a.num_warps,
            )
            print(f"one block of {rows} rows, value block {block_v}: {one_block}")
            # A 64-node tree, the root apart, ancestors first (the default).
            blocked = ptxas_report(
                tg._tree_gdn_blocked_kernel,
                dict(GDN_SIGNATURE, u_ws="*fp32", g_ws="*fp32", anc_ws="*i8"),
                dict(
                    common,
                    BC=rows,
                    PATH_BLOCK=16,
                    ROOT_APART=1,
                    ANCESTORS_FIRST=True,
                    BN_ALL=64,
                ),
                a.num_warps,
            )
            print(f"blocks of {rows} rows, value block {block_v}: {blocked}")


if __name__ == "__main__":
    main()
