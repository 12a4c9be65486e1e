#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Time the Gated DeltaNet verify kernel of one layer: DDTree's tree
kernels against the chain's.

One GDN layer's verify call on a decode batch of ``--batch`` requests at
the Qwen3.6-27B shape (16 key / 48 value heads of 128, 48 GDN layers), bf16
inputs, float32 states, a random draft tree per request of ``--budgets``
nodes at draft depth 15 (``build_tree`` of random per-depth logits; peaked
logits give deep, spiny trees):

* ``chunk``   `tree_gated_delta_rule` as the verifier runs it (the chunked
              kernel up to `CHUNK_MAX_NODES` rows, the blocked kernel up to
              `BLOCKED_MAX_NODES`, else the path replay);
* ``replay``  the path-replay kernel (`_tree_gdn_kernel`) on the same tree;
* ``chain``   upstream's `fused_sigmoid_gating_delta_rule_update` over
              1 + budget tokens per request with a state slot per token, as
              the DFlash chain's verification runs it (K = budget).

Each call is captured ``--iters`` times in one CUDA graph; the median of
``--repeats`` replays between CUDA events, in microseconds per call and per
step (times 48 layers). Each row also has the largest difference of the
chunked kernel's output from the replay kernel's. ``--table-budget 64``
gives the trees a parent table of 64 columns, as the engine has with
``tree_budget`` 64 when its batch policy verifies 15-node trees; the call
gets the step's longest query as the verifier passes it. Prints a table,
writes JSON rows with ``--out``.

    python3 -m bench.kernels.tree_gdn --out bench/results/tree-gdn.json
"""

from __future__ import annotations

import argparse

import torch

from bench import common

H, HV, K, V = 16, 48, 128, 128
GDN_LAYERS = 48
DRAFT_DEPTH = 15
# Random per-depth draft logits times these: peaked (deep, spiny trees), flat.
DRAFT_LOGIT_SCALES = (8.0, 1.0)


def make_case(
    batch: int,
    budget: int,
    scale: float,
    device: str,
    seed: int = 0,
    table_budget: int | None = None,
):
    """One layer's verify inputs; ``table_budget`` widens the parent table
    past the trees' ``budget`` nodes, as the engine's table is as wide as
    ``tree_budget`` when the budget policy gives smaller trees."""
    from vllm.v1.spec_decode.ddtree.tree import build_tree

    gen = torch.Generator().manual_seed(seed)
    tree = build_tree(
        torch.randn(batch, DRAFT_DEPTH, 32, generator=gen) * scale, budget
    )
    parent_idx = tree.parent_idx.to(torch.int64)
    if table_budget is not None and table_budget > budget:
        table = torch.zeros(batch, table_budget, dtype=torch.int64)
        table[:, :budget] = parent_idx
        parent_idx = table
    T = batch * (budget + 1)
    qsl = torch.arange(0, T + 1, budget + 1, dtype=torch.int32)
    bf16 = dict(dtype=torch.bfloat16)
    case = dict(
        A_log=torch.randn(HV, generator=gen) * 0.5,
        a=torch.randn(T, HV, generator=gen).to(**bf16),
        b=torch.randn(T, HV, generator=gen).to(**bf16),
        dt_bias=torch.randn(HV, generator=gen) * 0.1,
        q=torch.randn(T, H, K, generator=gen).to(**bf16),
        k=torch.randn(T, H, K, generator=gen).to(**bf16),
        v=torch.randn(T, HV, V, generator=gen).to(**bf16),
        # Slot 0 is the null slot; committed states in 1..batch, the chain's
        # per-token slots after them.
        state=torch.randn(1 + batch * (budget + 2), HV, V, K, generator=gen) * 0.1,
        state_idx=torch.arange(1, batch + 1, dtype=torch.int32),
        query_start_loc=qsl,
        parent_idx=parent_idx,
        idx_mapping=torch.arange(batch, dtype=torch.int32),
    )
    case = {n: t.to(device) for n, t in case.items()}
    depth = max(len(_path(tree.parent_idx[0], i)) - 1 for i in range(budget + 1))
    return case, depth


def _path(parent_row, node):
    path = [node]
    while path[-1] != 0:
        path.append(int(parent_row[path[-1] - 1]))
    return path


def tree_call(case, replay: bool, max_query_len=None):
    """The verifier's call on ``case``; ``replay``: the path replay (the
    chunked and blocked kernels turned off for this call only);
    ``max_query_len``: the step's longest query, as the verifier passes it."""
    from vllm.v1.spec_decode.ddtree import tree_gdn

    settings = dict(CHUNK_MAX_NODES=0, BLOCKED_MAX_NODES=0) if replay else {}

    def run():
        saved = {n: getattr(tree_gdn, n) for n in settings}
        for n, value in settings.items():
            setattr(tree_gdn, n, value)
        try:
            return tree_gdn.tree_gated_delta_rule(
                **case,
                draft_depth=DRAFT_DEPTH,
                use_qk_l2norm_in_kernel=True,
                max_query_len=max_query_len,
            )
        finally:
            for n, value in saved.items():
                setattr(tree_gdn, n, value)

    return run


def chain_call(case, batch: int, budget: int):
    from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
        fused_sigmoid_gating_delta_rule_update,
    )

    n = budget + 1
    first = batch + 1
    indices = torch.arange(
        first, first + batch * n, dtype=torch.int32, device=case["q"].device
    ).view(batch, n)
    accepted = torch.ones(batch, dtype=torch.int32, device=case["q"].device)

    def run():
        return fused_sigmoid_gating_delta_rule_update(
            A_log=case["A_log"],
            a=case["a"],
            b=case["b"],
            dt_bias=case["dt_bias"],
            q=case["q"][None],
            k=case["k"][None],
            v=case["v"][None],
            initial_state=case["state"],
            inplace_final_state=True,
            cu_seqlens=case["query_start_loc"],
            ssm_state_indices=indices,
            num_accepted_tokens=accepted,
            use_qk_l2norm_in_kernel=True,
        )

    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_kernel_options(ap, iters=20, repeats=5)
    common.add_options(ap, {
        "--batches": ("1,8,32", None),
        "--budgets": ("15,31,63", None),
        "--table-budget": (None, "parent table width (the engine's tree_budget) "
            "when wider than a row's budget: e.g. 64 times the 15-node trees of "
            "the default batch policy as the engine runs them (the kernel form "
            "follows the table)"),
    }, {"--table-budget": int})  # fmt: skip
    a = ap.parse_args(argv)

    def timed(fn) -> float:  # a graph of --iters calls, the median of replays
        return common.graph_us(fn, a.repeats, calls=a.iters)

    rows = []
    header = (
        f"{'batch':>5} {'budget':>6} {'scale':>5} {'depth':>5} "
        f"{'chunk us':>9} {'replay us':>9} {'chain us':>9} "
        f"{'chunk/chain':>11} {'max|diff|':>9}"
    )
    print(header, flush=True)
    for batch in common.csv_ints(a.batches):
        for budget in common.csv_ints(a.budgets):
            for scale in DRAFT_LOGIT_SCALES:
                case, depth = make_case(
                    batch, budget, scale, "cuda", table_budget=a.table_budget
                )
                query_len = budget + 1
                chunk = tree_call(case, False, max_query_len=query_len)
                replay = tree_call(case, True, max_query_len=query_len)
                diff = (chunk().float() - replay().float()).abs().max().item()
                us = {
                    "chunk": timed(chunk),
                    "replay": timed(replay),
                    "chain": timed(chain_call(case, batch, budget)),
                }
                row = dict(
                    shape="hybrid-27b",
                    batch=batch,
                    budget=budget,
                    table_budget=max(budget, a.table_budget or 0),
                    logit_scale=scale,
                    tree_depth=depth,
                    us_per_call={m: round(t, 1) for m, t in us.items()},
                    ms_per_step={
                        m: round(t * GDN_LAYERS / 1e3, 3) for m, t in us.items()
                    },
                    chunk_over_chain=round(us["chunk"] / us["chain"], 3),
                    chunk_max_abs_diff_from_replay=diff,
                    step_query_len=query_len,
                )
                rows.append(row)
                print(
                    f"{batch:>5} {budget:>6} {scale:>5} {depth:>5} "
                    f"{us['chunk']:>9.1f} {us['replay']:>9.1f} {us['chain']:>9.1f} "
                    f"{row['chunk_over_chain']:>11.3f} {diff:>9.2e}",
                    flush=True,
                )
                del case
                torch.cuda.empty_cache()
    if a.out:
        common.write_json(
            a.out,
            dict(
                command=common.command_line("bench.kernels.tree_gdn", argv),
                device=torch.cuda.get_device_name(),
                rows=rows,
            ),
        )


if __name__ == "__main__":
    main()
