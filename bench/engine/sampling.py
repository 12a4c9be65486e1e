# SPDX-License-Identifier: Apache-2.0
"""Sampling (T > 0) through vLLM with no speculation, the DFlash chain or DDTree:
the distribution of the first three emitted tokens against no-spec sampling
(chi-square), tau at the same settings, and seeded reproducibility.

Run on a GPU host, one engine per invocation; the no-spec run first, it writes
the reference counts:

    M=bench/pairs/models/dense-8b
    python3 -m bench.engine.sampling --target $M/target --mode none --tag ref
    python3 -m bench.engine.sampling --target $M/target --drafter $M/drafter \\
        --mode dflash --chain-k 15 --ref ref --seed 1
    python3 -m bench.engine.sampling --target $M/target --drafter $M/drafter \\
        --mode ddtree --budget 64 --ref ref --seed 2

Each run: (1) ``--samples`` unseeded requests per prompt (``--num-prompts``
of the pairs' held-out prompts, on which neither pair was trained;
temperature 1, top-p 0.95 by default), max_tokens 3: counts of each position's
token and of the 3-token sequences per prompt; with ``--ref``, a two-sample
chi-square test (scipy ``chi2_contingency``, rare categories pooled) against
the reference run's counts, per prompt; (2) tau and tokens/s on
``--tau-requests`` generations of ``--max-tokens`` at the same settings; (3)
``--seeded`` seeded requests generated twice in the same engine (must be
identical). Prints one ``RESULT {json}`` line; the counts go to
``<outdir>/sampling_<tag>.json``. Give the run compared by chi-square another
engine ``--seed`` than the reference: unseeded requests draw their noise from
it, and the test assumes independent samples.
"""

import argparse
import json
import os
import time
from collections import Counter

from bench import common

DEFAULT_PROMPTS = os.path.join(common.PAIR_MODELS, common.HELDOUT)
POSITIONS = ("first", "second", "third")


def load_prompts(path: str, n: int) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]


def two_sample_p(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """Chi-square test that two samples of categories share a distribution.
    Categories with an expected count below `min_expected` in either sample
    are pooled into one."""
    import numpy as np
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b), key=str)
    table = np.array([[c.get(k, 0) for k in keys] for c in (a, b)], dtype=np.float64)
    expected = table.sum(0)[None, :] * table.sum(1)[:, None] / table.sum()
    rare = (expected < min_expected).any(0)
    if rare.any():
        table = np.concatenate(
            [table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1
        )
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(table, correction=False).pvalue)


def p_values(counts: list[dict], ref: list[dict]) -> dict[str, list[float]]:
    """Per kind of count (`POSITIONS`, ``seq3``), each prompt's chi-square p
    against the reference run's counts (as saved: ``[[key, count], ...]``)."""
    out: dict[str, list[float]] = {}
    for mine, theirs in zip(counts, ref):
        for kind, c in mine.items():
            other = Counter(
                {tuple(k) if isinstance(k, list) else k: v for k, v in theirs[kind]}
            )
            out.setdefault(kind, []).append(round(two_sample_p(c, other), 4))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter")
    ap.add_argument("--mode", choices=["none", "dflash", "ddtree"], required=True)
    common.add_engine_options(
        ap, max_tokens=128, gpu_util=0.5, max_model_len=2048, processes=False
    )
    ap.add_argument("--budget", type=int, default=64, help="DDTree tree_budget")
    ap.add_argument("--prompts", help="jsonl, 'prompt' key (default: held-out)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2500, help="per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--tau-requests", type=int, default=64)
    ap.add_argument("--seeded", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0, help="the engine's")
    ap.add_argument("--tag", help="this run's name (default: --mode)")
    ap.add_argument("--ref", help="tag of the no-spec run")
    ap.add_argument("--outdir", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()

    from vllm import LLM, SamplingParams

    hybrid = common.is_hybrid(a.target)
    kw = common.engine_kwargs(
        a,
        a.target,
        a.dtype,
        256,
        hybrid,
        seed=a.seed,
        skip_tokenizer_init=False,
        # The same prompt thousands of times; DDTree refuses prefix caching
        # on hybrid targets, so there every run computes its prompts.
        enable_prefix_caching=not hybrid,
    )
    if a.mode == "dflash":
        kw["speculative_config"] = common.chain_config(a.drafter, a.chain_k)
    elif a.mode == "ddtree":
        kw["speculative_config"] = common.ddtree_config(a.drafter, tree_budget=a.budget)
    tag = a.tag or a.mode
    t0 = time.time()
    llm = LLM(**kw)
    startup_s = time.time() - t0
    held_out = os.path.join(a.models, common.HELDOUT)
    prompts = load_prompts(a.prompts or held_out, a.num_prompts)
    params = dict(temperature=a.temperature, top_p=a.top_p, ignore_eos=True)

    def generate(prompts, sps) -> list[list[int]]:
        outs = llm.generate(prompts, sps, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    # (1) The first three emitted tokens, unseeded.
    t = time.time()
    first_three = SamplingParams(max_tokens=3, **params)
    counts = []
    for prompt in prompts:
        seqs = [tuple(s) for s in generate([prompt] * a.samples, first_three)]
        assert all(len(s) == 3 for s in seqs)
        counts.append({k: Counter(s[i] for s in seqs) for i, k in enumerate(POSITIONS)})
        counts[-1]["seq3"] = Counter(seqs)
    dist_s = time.time() - t
    # (2) tau and tokens/s at the same settings.
    acc0, drafts0 = common.spec_counters(llm)
    t = time.time()
    tau_prompts = (prompts * a.tau_requests)[: a.tau_requests]
    outs = generate(tau_prompts, SamplingParams(max_tokens=a.max_tokens, **params))
    tau_s = time.time() - t
    acc1, drafts1 = common.spec_counters(llm)
    # (3) Seeded requests: twice in this engine, and against another run.
    seeded = [
        SamplingParams(max_tokens=32, seed=1000 + i, **params) for i in range(a.seeded)
    ]
    runs = [generate((prompts * a.seeded)[: a.seeded], seeded) for _ in range(2)]
    drafts = drafts1 - drafts0
    res = dict(
        seed=a.seed,
        tag=tag,
        mode=a.mode,
        k=a.chain_k if a.mode == "dflash" else None,
        budget=a.budget if a.mode == "ddtree" else None,
        dtype=a.dtype,
        temperature=a.temperature,
        top_p=a.top_p,
        prompts=len(prompts),
        samples_per_prompt=a.samples,
        dist_s=round(dist_s, 1),
        tau=round(1 + (acc1 - acc0) / drafts, 3) if drafts else None,
        tau_tok_s=round(sum(map(len, outs)) / tau_s, 1),
        seeded_identical_in_run=f"{sum(x == y for x, y in zip(*runs))}/{a.seeded}",
        startup_s=round(startup_s, 1),
    )
    # As [[key, count], ...]: JSON has no tuple keys (the tuples become lists).
    saved = [{k: list(c.items()) for k, c in pc.items()} for pc in counts]
    out = os.path.join(a.outdir, f"sampling_{tag}.json")
    common.write_json(out, dict(counts=saved, seeded=runs[0]), indent=None)
    ref_path = os.path.join(a.outdir, f"sampling_{a.ref}.json")
    if a.ref and os.path.exists(ref_path):
        with open(ref_path) as f:
            ref = json.load(f)
        res["p_values_vs_ref"] = ps = p_values(counts, ref["counts"])
        res["min_p"] = min(min(v) for v in ps.values())
        # Several tests per run: a Bonferroni-corrected verdict too.
        res["pass_p_gt_0.01"] = res["min_p"] > 0.01
        res["pass_bonferroni_0.01"] = res["min_p"] > 0.01 / sum(map(len, ps.values()))
    common.emit("RESULT", res)


if __name__ == "__main__":
    main()
