# SPDX-License-Identifier: Apache-2.0
"""What the bench tools share: progress lines, result rows (``ROW {json}``
from an engine process, ``RESULT {json}`` for a reader), JSON result files
rewritten as rows come in, the engine options and engine processes, the
kernel tools' timers and the loopback check of the serving tools.

Run the tools from the checkout's root as modules, e.g.
``python3 -m bench.engine.step_cost --help``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parent.parent
PAIR_MODELS = str(REPO / "bench" / "pairs" / "models")
HELDOUT = "prompts/heldout.jsonl"  # under PAIR_MODELS: prompts no pair trained on
LOOPBACK_HOSTS = {"127.0.0.1", "::1", "localhost"}
# A float32 greedy output that differs from no speculation's where the
# reference's top-2 logprob gap was below this is a near-tie, which the batch
# shape decides (any speculative method diverges there too).
NEAR_TIE_NATS = 0.01

# Child processes import bench from this checkout too: the engine processes
# (``python3 -m bench...``) and vLLM's workers, which load
# bench.pairs.pair_worker as their worker extension.
if str(REPO) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, (str(REPO), os.environ.get("PYTHONPATH")))
    )


def progress(tool: str, msg: str) -> None:
    """One progress line on stderr (stdout holds the rows)."""
    print(f"[{tool} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(kind: str, row: dict) -> None:
    """One ``KIND {json}`` line on stdout: ``ROW`` for the parent of an
    engine process, ``RESULT`` for a reader of the log."""
    print(f"{kind} {json.dumps(row)}", flush=True)


def rows_in(lines, kind: str = "ROW") -> list[dict]:
    """The ``KIND {json}`` rows among ``lines``."""
    prefix = kind + " "
    return [json.loads(x[len(prefix) :]) for x in lines if x.startswith(prefix)]


def write_json(path: str, obj, indent: int = 1) -> None:
    """Write ``obj`` whole (a reader never sees half a file): the tools call
    it after every engine, so an interrupted run keeps what it measured."""
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")
    os.replace(tmp, path)


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that reproduces this run (recorded in its result file)."""
    return " ".join(["python3 -m", module, *(sys.argv[1:] if argv is None else argv)])


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def load_prompts(path: str, last: int = 0) -> list[list[int]]:
    """The token ids of ``path``'s prompts; with ``last``, those of at least
    ``last`` tokens, cut to their last ``last``."""
    with open(path) as f:
        rows = [json.loads(line)["prompt_token_ids"] for line in f if line.strip()]
    return [r[-last:] for r in rows if len(r) >= last] if last else rows


def add_options(
    ap: argparse.ArgumentParser, options: dict, types: dict | None = None
) -> None:
    """``{"--name": (default, help)}``: each option's type is ``types``' or
    its default's (False: a flag; None: a string)."""
    for flag, (default, text) in options.items():
        if default is False:
            ap.add_argument(flag, action="store_true", help=text)
        else:
            kind = (types or {}).get(flag, str if default is None else type(default))
            ap.add_argument(flag, type=kind, default=default, help=text)


# ---------------------------------------------------------------- engines


def add_engine_options(
    ap: argparse.ArgumentParser,
    max_tokens: int = 256,
    gpu_util: float = 0.85,
    max_model_len: int = 1024,
    processes: bool = True,
) -> None:
    """The engine options of every tool that starts vLLM engines;
    ``processes``: one engine process each (``forward`` passes the options
    on), with a time limit."""
    options = {
        "--models": (PAIR_MODELS, "the trained pairs"),
        "--max-tokens": (max_tokens, "new tokens per request"),
        "--max-model-len": (max_model_len, None),
        "--gpu-memory-utilization": (gpu_util, None),
        "--chain-k": (15, "the chain's length K"),
        "--enforce-eager": (False, "no CUDA graphs (tells a graph's effect apart)"),
    }
    if processes:
        options["--engine-timeout"] = (900, "seconds per engine")
    add_options(ap, options)


ENGINE_OPTIONS = ("models", "max_tokens", "max_model_len", "gpu_memory_utilization")
ENGINE_OPTIONS += ("chain_k", "enforce_eager")


def engine_kwargs(
    a, target: str, dtype: str, max_num_seqs: int, hybrid: bool, **overrides
) -> dict:
    """``LLM(...)`` keywords of a benchmark engine with ``a``'s engine
    options: token ids in and out, stats kept (tau comes from them), no
    prefix caching (every timed prompt is computed); a hybrid target without
    its vision inputs and with the Triton GDN prefill."""
    kw = dict(
        model=target,
        dtype=dtype,
        max_model_len=a.max_model_len,
        gpu_memory_utilization=a.gpu_memory_utilization,
        seed=0,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        enforce_eager=a.enforce_eager,
    )
    if hybrid:
        kw.update(
            limit_mm_per_prompt={"image": 0, "video": 0}, gdn_prefill_backend="triton"
        )
    return kw | overrides


def first_divergence(ref: list[int], out: list[int]) -> int | None:
    """The first index where two token sequences differ (the shorter one's
    length where one is the other's prefix); None when they are equal."""
    j = next((j for j, (x, y) in enumerate(zip(ref, out)) if x != y), None)
    if j is None and len(ref) != len(out):
        j = min(len(ref), len(out))
    return j


def top2_gap(position: dict | None) -> float:
    """The logprob gap between the first and second most probable tokens of
    one position of vLLM's prompt or sample logprobs (token id -> ``Logprob``,
    the position's own token beside the top ones); inf without two ranked
    tokens."""
    ranked = sorted(
        (lp.rank, lp.logprob) for lp in (position or {}).values() if lp.rank
    )
    if len(ranked) < 2 or ranked[1][0] != 2:
        return math.inf
    return ranked[0][1] - ranked[1][1]


def is_hybrid(model_dir: str) -> bool:
    """Whether the checkpoint in ``model_dir`` has linear-attention (Gated
    DeltaNet) layers."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return "linear_attention" in cfg.get("text_config", cfg).get("layer_types", ())


def chain_config(drafter: str, k: int) -> dict:
    """The DFlash chain's speculative_config: K draft tokens per step."""
    return dict(method="dflash", model=drafter, num_speculative_tokens=k)


def ddtree_config(drafter: str, **options) -> dict:
    """DDTree's speculative_config with its ``options`` (tree_budget,
    budget_policy, ...): fields of the 0.26.0 line's patched config, the
    plugin's ``speculator_options`` on vLLM 0.34.0 and later."""
    try:
        import vllm.v1.worker.gpu.spec_decode.speculator_config  # noqa: F401
    except ImportError:
        return dict(method="ddtree", model=drafter, **options)
    return dict(method="ddtree", model=drafter, speculator_options=options)


SPEC_COUNTERS = {
    "accepted": "vllm:spec_decode_num_accepted_tokens",
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
}
SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> tuple[float, float]:
    """The accepted-token and draft counters of vLLM (tau over an interval:
    1 + accepted / drafts of their increases)."""
    counters = spec_decode_counters(llm)
    return counters["accepted"], counters["drafts"]


def spec_decode_counters(llm) -> dict:
    """The spec-decode counters of vLLM (`SPEC_COUNTERS`) and its accepted
    tokens per draft position (``per_pos``, a list), read now; `spec_readings`
    turns two readings into an interval's figures."""
    metrics = {m.name: m for m in llm.get_metrics()}
    out: dict = {
        key: getattr(metrics.get(name), "value", 0.0)
        for key, name in SPEC_COUNTERS.items()
    }
    out["per_pos"] = list(getattr(metrics.get(SPEC_PER_POSITION), "values", []))
    return out


def spec_readings(before: dict, after: dict) -> dict:
    """An interval's spec-decode figures from two `spec_decode_counters` readings:
    tau (1 + accepted / drafts), the draft tokens verified per request-step
    (a tree's node count; K for a chain) and, per draft position, the share
    of request-steps that accepted a token there. None without drafts."""
    drafts = after["drafts"] - before["drafts"]
    if not drafts:
        return dict(tau=None, draft_tokens_per_draft=None, accepted_by_position=None)
    before_pos = before["per_pos"] or [0] * len(after["per_pos"])
    per_pos = [b - a for a, b in zip(before_pos, after["per_pos"])]
    # Positions no request-step reached (a tree's past its depth) left out.
    while per_pos and per_pos[-1] == 0:
        per_pos.pop()
    return dict(
        tau=round(1 + (after["accepted"] - before["accepted"]) / drafts, 3),
        draft_tokens_per_draft=round(
            (after["draft_tokens"] - before["draft_tokens"]) / drafts, 2
        ),
        accepted_by_position=[round(n / drafts, 3) for n in per_pos] or None,
    )


def forward(a: argparse.Namespace, names) -> list[str]:
    """``--name value`` for each of ``names`` set in ``a`` (a true flag
    without its value; a false flag or None left out)."""
    out: list[str] = []
    for name in names:
        value = getattr(a, name)
        if value is None or value is False:
            continue
        out.append("--" + name.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


def run_engine_process(
    cmd: list[str],
    timeout: float,
    stderr_path: str | None = None,
    stdout_path: str | None = None,
) -> tuple[list[dict], int | str, str, list[str]]:
    """Run one engine process: its ``ROW`` lines, its exit code
    (``"timeout"`` when it ran past ``timeout``), the last 4000 characters of
    its stderr with ``stderr_path`` (where it goes instead of ours), and the
    rest of its stdout (vLLM's log), saved to ``stdout_path`` when given."""
    with contextlib.ExitStack() as stack:
        err = stack.enter_context(open(stderr_path, "w")) if stderr_path else None
        try:
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout
            )
            out, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc = "timeout"
    lines = out.splitlines()
    log_lines = [x for x in lines if not x.startswith("ROW ")]
    if stdout_path:
        with open(stdout_path, "w") as f:
            f.writelines(x + "\n" for x in log_lines)
    tail = ""
    if stderr_path:
        with open(stderr_path) as f:
            tail = f.read()[-4000:]
    return rows_in(lines), rc, tail, log_lines


# ---------------------------------------------------------------- kernels


def torch_reference():
    """The torch reference implementations of the checkout's tests
    (``tests/ddtree_reference.py``, not in the wheel)."""
    path = REPO / "tests" / "ddtree_reference.py"
    if not path.exists():
        raise SystemExit(f"no {path}: the reference runs from a checkout")
    if "ddtree_reference" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ddtree_reference", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["ddtree_reference"] = module
        spec.loader.exec_module(module)
    return sys.modules["ddtree_reference"]


def add_kernel_options(
    ap: argparse.ArgumentParser, iters: int, repeats: int | None = None
) -> None:
    """The kernel tools' timing options (``--repeats``: timings of ``--iters``
    calls each, the median taken) and result file."""
    ap.add_argument("--iters", type=int, default=iters)
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--out", default=None, help="JSON rows")


def graph_us(fn, repeats: int, calls: int = 1, replays: int = 1) -> float:
    """Microseconds per call of ``fn``: captured ``calls`` times in one CUDA
    graph, ``replays`` replays between two CUDA events, the median of
    ``repeats`` such timings (all queued before one synchronize)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles and builds cached tables before capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    events = [
        [torch.cuda.Event(enable_timing=True) for _ in "se"] for _ in range(repeats)
    ]
    for start, end in events:
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(
        s.elapsed_time(e) * 1e3 / (calls * replays) for s, e in events
    )


def eager_us(fn, repeats: int, calls: int = 1, cuda: bool = False) -> float:
    """Microseconds per call of ``fn`` run eagerly, ``calls`` calls a
    timing, the median of ``repeats`` (CUDA events on a GPU, the wall clock
    otherwise: a CPU smoke run times nothing real)."""
    fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            import torch

            start, end = (torch.cuda.Event(enable_timing=True) for _ in "se")
            start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / calls)
        else:
            samples.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(samples)


# ---------------------------------------------------------------- serving


def check_loopback(base_url: str, tool: str) -> str:
    """``base_url`` without its trailing slash; exits unless it is a plain
    http server on this host (the serving tools load no one else's)."""
    u = urlparse(base_url)
    if u.scheme != "http" or u.hostname not in LOOPBACK_HOSTS:
        raise SystemExit(
            f"{tool}: only loopback http servers are allowed, got {base_url!r}"
        )
    return base_url.rstrip("/")
