# SPDX-License-Identifier: Apache-2.0
"""Power, SM clock and time of one verify-sized GEMM against its input rows.

With dummy weights the DFlash chain's drafted tokens of a step are likely one
token repeated (every mask position sees the same embedding through
near-zero layers), where a tree's nodes are distinct tokens by construction.
Under the H200's 700 W cap the clock follows the power, and the power follows
how much the GEMM's inputs change from row to row: this script times the MLP
up-projection of a Qwen3-8B verify step (32 requests x 16 tokens, 4096 ->
12288, bf16, weights of dummy scale) on three kinds of input rows, 8 s of
back-to-back GEMMs each, sampling ``nvidia-smi`` every 100 ms:

* ``chain_like``: per request one row and then 15 copies of one other row;
* ``distinct``: every row a different token's embedding;
* ``same``: every row the same embedding.

Usage: ``python3 bench/gemm_power.py --out results.json`` (needs only torch and
``nvidia-smi``; ~45 s).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch


def inputs(emb: torch.Tensor, kind: str, reqs: int = 32, rows: int = 16):
    dev = emb.device
    if kind == "distinct":
        ids = torch.randint(0, emb.shape[0], (reqs * rows,), device=dev)
    elif kind == "chain_like":
        a = torch.randint(0, emb.shape[0], (reqs, 1), device=dev)
        b = torch.randint(0, emb.shape[0], (reqs, 1), device=dev)
        ids = torch.cat([a, b.expand(reqs, rows - 1)], 1).reshape(-1)
    else:
        ids = torch.full((reqs * rows,), 7, device=dev)
    return emb[ids].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=8.0)
    a = ap.parse_args()
    torch.manual_seed(0)
    w = torch.empty(12288, 4096, device="cuda", dtype=torch.bfloat16)
    w.uniform_(-1e-3, 1e-3)
    emb = torch.randn(151936 // 8, 4096, device="cuda", dtype=torch.bfloat16)
    out: dict[str, list[dict]] = {}
    # Each kind twice (but "same"), interleaved: a drift of the GPU's
    # temperature over the run would show as two figures apart.
    for kind in ["chain_like", "distinct", "same", "chain_like", "distinct"]:
        x = inputs(emb, kind)
        for _ in range(50):
            x @ w.t()
        torch.cuda.synchronize()
        with open("/tmp/gemm_power_smi.txt", "w") as log:
            smi = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=clocks.sm,power.draw",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "100",
                ],
                stdout=log,
            )
            t, n = time.time(), 0
            while time.time() - t < a.seconds:
                for _ in range(200):
                    x @ w.t()
                torch.cuda.synchronize()
                n += 200
            dt = time.time() - t
            smi.terminate()
            smi.wait()
        # The first second's samples are the clock still settling.
        with open("/tmp/gemm_power_smi.txt") as f:
            samples = [line.split(",") for line in f if line.strip()][10:]
        clock = [float(c) for c, _ in samples]
        power = [float(p) for _, p in samples]
        row = dict(
            us_per_gemm=round(dt / n * 1e6, 2),
            sm_clock=round(sum(clock) / len(clock)),
            power=round(sum(power) / len(power), 1),
        )
        print(kind, row, flush=True)
        out.setdefault(kind, []).append(row)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
