# SPDX-License-Identifier: Apache-2.0
"""What the bench tools share: progress lines, result rows (``ROW {json}``
from an engine process, ``RESULT {json}`` for a reader), JSON result files
rewritten as rows come in, the options of the engine processes and the
loopback check of the serving tools.

Run the tools from the checkout's root as modules, e.g.
``python3 -m bench.engine.step_cost --help``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parent.parent
PAIR_MODELS = str(REPO / "bench" / "pairs" / "models")
LOOPBACK_HOSTS = {"127.0.0.1", "::1", "localhost"}

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


def add_engine_options(
    ap: argparse.ArgumentParser, max_tokens: int = 256, gpu_util: float = 0.85
) -> None:
    """The options every engine process of step_cost.py and run_pairs.py
    takes (``forward`` passes them on to it)."""
    ap.add_argument("--models", default=PAIR_MODELS, help="the trained pairs")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=gpu_util)
    ap.add_argument("--chain-k", type=int, default=15, help="the chain's length K")
    ap.add_argument(
        "--engine-timeout", type=int, default=900, help="seconds per engine process"
    )


def engine_kwargs(a, target: str, dtype: str, max_num_seqs: int, hybrid: bool) -> dict:
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
    )
    if hybrid:
        kw.update(
            limit_mm_per_prompt={"image": 0, "video": 0}, gdn_prefill_backend="triton"
        )
    return kw


def chain_config(drafter: str, k: int) -> dict:
    """The DFlash chain's speculative_config: K draft tokens per step."""
    return dict(method="dflash", model=drafter, num_speculative_tokens=k)


ENGINE_OPTIONS = ("models", "max_tokens", "max_model_len", "gpu_memory_utilization")
ENGINE_OPTIONS += ("chain_k",)


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


def use_overlay() -> None:
    """Import DDTree's modules from this checkout's ``overlay/`` where no vLLM
    is installed (``vllm`` is then a namespace package of our modules, as in
    the tests; torch and Triton suffice for the core)."""
    overlay = str(REPO / "overlay")
    if overlay not in sys.path:
        sys.path.insert(0, overlay)


def torch_reference():
    """The torch reference implementations of the checkout's tests
    (``ddtree_reference.py``, not in the wheel)."""
    found = sorted(REPO.glob("tests/**/ddtree_reference.py"))
    if not found:
        raise SystemExit(
            f"no ddtree_reference.py under {REPO / 'tests'}: the reference "
            "columns time the torch reference of a checkout"
        )
    if "ddtree_reference" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ddtree_reference", found[0])
        module = importlib.util.module_from_spec(spec)
        sys.modules["ddtree_reference"] = module
        spec.loader.exec_module(module)
    return sys.modules["ddtree_reference"]


def check_loopback(base_url: str, tool: str) -> str:
    """``base_url`` without its trailing slash; exits unless it is a plain
    http server on this host (the serving tools load no one else's)."""
    u = urlparse(base_url)
    if u.scheme != "http" or u.hostname not in LOOPBACK_HOSTS:
        raise SystemExit(
            f"{tool}: only loopback http servers are allowed, got {base_url!r}"
        )
    return base_url.rstrip("/")


def percentiles(values: list[float]) -> dict:
    """n, mean, p50, p90, p99 and max (nearest rank) of ``values``."""
    if not values:
        return {"n": 0}
    v = sorted(values)

    def q(p: float) -> float:
        return round(v[min(len(v) - 1, max(0, math.ceil(p * len(v)) - 1))], 4)

    return {
        "n": len(v),
        "mean": round(sum(v) / len(v), 4),
        "p50": q(0.5),
        "p90": q(0.9),
        "p99": q(0.99),
        "max": round(v[-1], 4),
    }
