# SPDX-License-Identifier: Apache-2.0
"""Sampling (T > 0) through vLLM with no speculation, the DFlash chain or DDTree:
the distribution of the first three emitted tokens against no-spec sampling
(chi-square), tau at the same settings, and seeded reproducibility.

Run on a GPU host, one engine per invocation (one configuration per process);
the no-spec run first, it writes the reference counts:

    M=bench/pairs/models/dense-8b
    python3 -m bench.engine.sampling --target $M/target --mode none --tag ref
    python3 -m bench.engine.sampling --target $M/target --drafter $M/drafter \\
        --mode dflash --k 15 --ref ref --seed 1
    python3 -m bench.engine.sampling --target $M/target --drafter $M/drafter \\
        --mode ddtree --budget 64 --ref ref --seed 2

Each run: (1) ``--samples`` unseeded requests per prompt (``--num-prompts``
prompts, temperature 1, top-p 0.95 by default), max_tokens 3: counts of the
first token, of each position and of the 3-token sequences per prompt; with
``--ref``, a two-sample chi-square test (scipy ``chi2_contingency``, rare
categories pooled) against the reference run's counts, per prompt; (2) tau
and tokens/s on ``--tau-requests`` longer generations at the same settings;
(3) ``--seeded`` seeded requests generated twice in the same engine (must be
identical) and written out, so that two processes can be compared too
(``--seeded-ref``). Prints one ``RESULT {json}`` line; the per-prompt counts
go to ``<outdir>/sampling_<tag>.json``. Give the run compared by chi-square
another engine ``--seed`` than the reference: unseeded requests draw their
noise from it, and the test assumes independent samples. ``--prompts``
defaults to the benchmark pairs' held-out prompts
(``bench/pairs/models/prompts/heldout.jsonl``), on which neither pair was
trained.
"""

import argparse
import json
import os
import sys
import time
from collections import Counter

DEFAULT_PROMPTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "pairs",
    "models",
    "prompts",
    "heldout.jsonl",
)


def load_prompts(path: str, n: int) -> list[str]:
    with open(path) as f:
        rows = [json.loads(line)["prompt"] for line in f if line.strip()]
    return rows[:n]


def spec_metrics(llm) -> tuple[float, float]:
    accepted = drafts = 0.0
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted = m.value
        elif m.name == "vllm:spec_decode_num_drafts":
            drafts = m.value
    return accepted, drafts


def two_sample_p(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """Chi-square test that two samples of categories share a distribution.
    Categories with an expected count below `min_expected` in either sample
    are pooled into one."""
    import numpy as np
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b), key=str)
    table = np.array(
        [[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]], dtype=np.float64
    )
    total = table.sum()
    expected = table.sum(0)[None, :] * table.sum(1)[:, None] / total
    rare = (expected < min_expected).any(0)
    if rare.any():
        table = np.concatenate(
            [table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1
        )
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(table, correction=False).pvalue)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter")
    ap.add_argument("--mode", choices=["none", "dflash", "ddtree"], required=True)
    ap.add_argument("--k", type=int, default=15, help="DFlash chain length")
    ap.add_argument("--budget", type=int, default=64, help="DDTree tree_budget")
    ap.add_argument("--depth", type=int, default=None, help="DDTree draft_depth")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help="jsonl, 'prompt' key")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2500, help="per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--tau-requests", type=int, default=64)
    ap.add_argument("--tau-tokens", type=int, default=128)
    ap.add_argument("--seeded", type=int, default=32)
    ap.add_argument("--seeded-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="engine seed: unseeded requests draw from it, so give the runs "
        "compared by chi-square different seeds (independent samples)",
    )
    ap.add_argument("--tag", default=None)
    ap.add_argument("--ref", default=None, help="tag of the no-spec run")
    ap.add_argument(
        "--seeded-ref",
        default=None,
        help="tag of a run whose seeded outputs must be equal",
    )
    ap.add_argument("--outdir", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    a = ap.parse_args()

    from vllm import LLM, SamplingParams

    kw = dict(
        model=a.target,
        dtype=a.dtype,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        gpu_memory_utilization=a.gpu_memory_utilization,
        seed=a.seed,
        disable_log_stats=False,
    )
    if a.mode == "dflash":
        kw["speculative_config"] = dict(
            method="dflash", model=a.drafter, num_speculative_tokens=a.k
        )
    elif a.mode == "ddtree":
        spec = dict(method="ddtree", model=a.drafter, tree_budget=a.budget)
        if a.depth is not None:
            spec["draft_depth"] = a.depth
        kw["speculative_config"] = spec
    tag = a.tag or a.mode
    t0 = time.time()
    llm = LLM(**kw)
    startup_s = time.time() - t0
    prompts = load_prompts(a.prompts, a.num_prompts)
    params = dict(temperature=a.temperature, top_p=a.top_p, ignore_eos=True)

    # (1) The first three emitted tokens, unseeded.
    t = time.time()
    sp3 = SamplingParams(max_tokens=3, **params)
    counts = []
    for prompt in prompts:
        outs = llm.generate([prompt] * a.samples, sp3, use_tqdm=False)
        seqs = [tuple(o.outputs[0].token_ids) for o in outs]
        assert all(len(s) == 3 for s in seqs)
        counts.append(
            dict(
                first=Counter(s[0] for s in seqs),
                second=Counter(s[1] for s in seqs),
                third=Counter(s[2] for s in seqs),
                seq3=Counter(seqs),
            )
        )
    dist_s = time.time() - t

    # (2) tau and tokens/s at the same settings.
    acc0, drafts0 = spec_metrics(llm)
    t = time.time()
    tau_prompts = (prompts * a.tau_requests)[: a.tau_requests]
    outs = llm.generate(
        tau_prompts,
        SamplingParams(max_tokens=a.tau_tokens, **params),
        use_tqdm=False,
    )
    tau_s = time.time() - t
    acc1, drafts1 = spec_metrics(llm)
    drafts = drafts1 - drafts0
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    # (3) Seeded requests: twice in this engine, and against another run.
    seeded_prompts = (prompts * a.seeded)[: a.seeded]
    seeded_params = [
        SamplingParams(max_tokens=a.seeded_tokens, seed=1000 + i, **params)
        for i in range(a.seeded)
    ]
    runs = [
        [
            list(o.outputs[0].token_ids)
            for o in llm.generate(seeded_prompts, seeded_params, use_tqdm=False)
        ]
        for _ in range(2)
    ]
    same_run = sum(x == y for x, y in zip(*runs))

    res = dict(
        seed=a.seed,
        tag=tag,
        mode=a.mode,
        k=a.k if a.mode == "dflash" else None,
        budget=a.budget if a.mode == "ddtree" else None,
        dtype=a.dtype,
        temperature=a.temperature,
        top_p=a.top_p,
        prompts=len(prompts),
        samples_per_prompt=a.samples,
        dist_s=round(dist_s, 1),
        tau=round(1 + (acc1 - acc0) / drafts, 3) if drafts else None,
        tau_tok_s=round(num_tokens / tau_s, 1),
        seeded_identical_in_run=f"{same_run}/{a.seeded}",
        startup_s=round(startup_s, 1),
    )
    out = dict(
        counts=[
            {
                k: [
                    [list(key) if isinstance(key, tuple) else key, v]
                    for key, v in c.items()
                ]
                for k, c in pc.items()
            }
            for pc in counts
        ],
        seeded=runs[0],
    )
    with open(os.path.join(a.outdir, f"sampling_{tag}.json"), "w") as f:
        json.dump(out, f)

    def load(tag_: str):
        path = os.path.join(a.outdir, f"sampling_{tag_}.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    ref = load(a.ref) if a.ref else None
    if ref is not None:
        p_values: dict[str, list[float]] = {}
        for mine, theirs in zip(counts, ref["counts"]):
            for key, c in mine.items():
                other = Counter(
                    {tuple(k) if isinstance(k, list) else k: v for k, v in theirs[key]}
                )
                p_values.setdefault(key, []).append(round(two_sample_p(c, other), 4))
        res["p_values_vs_ref"] = p_values
        res["min_p"] = min(min(v) for v in p_values.values())
        # Several tests per run: report a Bonferroni-corrected verdict too.
        n_tests = sum(len(v) for v in p_values.values())
        res["pass_p_gt_0.01"] = res["min_p"] > 0.01
        res["pass_bonferroni_0.01"] = res["min_p"] > 0.01 / n_tests
    seeded_ref = load(a.seeded_ref) if a.seeded_ref else None
    if seeded_ref is not None:
        same = sum(x == y for x, y in zip(seeded_ref["seeded"], runs[0]))
        res["seeded_identical_vs_" + a.seeded_ref] = f"{same}/{a.seeded}"
    print("RESULT", json.dumps(res), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
