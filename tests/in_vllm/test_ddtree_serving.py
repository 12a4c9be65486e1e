# SPDX-License-Identifier: Apache-2.0
"""DDTree under `vllm serve`, on CPU: the Prometheus series (names, per-depth
length, values moving when fed the scheduler's stats), the periodic log line
(both on the 0.26.0 line only), and the startup errors of the real CLI
(`python -m vllm.entrypoints.cli.main serve ...`): one readable line, no
traceback, a non-zero exit."""

import json
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")
prometheus_client = pytest.importorskip("prometheus_client")

from engine_on_cpu import CLI_ON_CPU, cpu_env, run_on_cpu  # noqa: E402
from verifier_fakes import DRAFTER, TARGET, make_spec  # noqa: E402

LABELS = ["model_name", "engine"]
PER_ENGINE = {0: ["tiny", "0"]}
ENGINE = {"model_name": "tiny", "engine": "0"}

try:  # vLLM's speculative-method interface (0.34.0): DDTree is a plugin
    from vllm.v1.worker.gpu.spec_decode import speculator_config  # noqa: F401

    SPECULATOR_PLUGIN = True
except ImportError:  # the 0.26.0 line: its patched SpeculativeConfig
    SPECULATOR_PLUGIN = False

ddtree_metrics_line = pytest.mark.skipif(
    SPECULATOR_PLUGIN,
    reason="DDTree's Prometheus series and log line are not ported to vLLM's "
    "speculative-method interface (docs/architecture.md, H7)",
)


@pytest.fixture
def registry():
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    yield prometheus_client.REGISTRY
    unregister_vllm_metrics()


def _value(registry, name, **labels):
    return registry.get_sample_value(name, {**ENGINE, **labels})


def _series(registry, name):
    return [s for m in registry.collect() for s in m.samples if s.name == name]


# ---------------------------------------------------------------- metrics
@ddtree_metrics_line
def test_ddtree_prometheus_series_exist_and_move(target_model_config, registry):
    from vllm.v1.spec_decode.ddtree.metrics import DDTREE_METRIC_NAMES
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    spec = make_spec(
        target_model_config, method="ddtree", model=DRAFTER, tree_budget=256
    )
    assert spec.use_ddtree() and spec.draft_depth == 15
    prom = SpecDecodingProm(spec, LABELS, PER_ENGINE)

    text = prometheus_client.generate_latest(registry).decode()
    types = {
        line.split()[2].removesuffix("_total"): line.split()[3]
        for line in text.splitlines()
        if line.startswith("# TYPE vllm:")
    }
    assert {n: types.get(n) for n in DDTREE_METRIC_NAMES} == {
        "vllm:ddtree_tree_budget": "gauge",
        "vllm:ddtree_draft_depth": "gauge",
        "vllm:ddtree_acceptance_length": "histogram",
        "vllm:ddtree_num_accepted_tokens_per_depth": "counter",
        "vllm:ddtree_budget_by_batch_size": "gauge",
        "vllm:ddtree_expected_acceptance_length": "gauge",
        "vllm:ddtree_tree_requests_by_batch_size": "counter",
        "vllm:ddtree_emitted_tokens_by_batch_size": "counter",
    }
    for name in (
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ):
        assert types.get(name) == "counter", name
    # One per-position series per tree depth, not one per tree node (256).
    per_pos = _series(registry, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert sorted(int(s.labels["position"]) for s in per_pos) == list(range(15))
    per_depth = _series(registry, "vllm:ddtree_num_accepted_tokens_per_depth_total")
    assert sorted(int(s.labels["depth"]) for s in per_depth) == list(range(1, 16))
    assert _value(registry, "vllm:ddtree_tree_budget") == 256
    assert _value(registry, "vllm:ddtree_draft_depth") == 15

    # One scheduler step, three requests: accepted paths of depth 3, 0 and 15
    # (emitted 4, 1 and 16 tokens); the last one verified only 200 nodes.
    stats = SpecDecodingStats.new(spec.num_speculative_tokens)
    stats.observe_draft(num_draft_tokens=256, num_accepted_tokens=3)
    stats.observe_draft(num_draft_tokens=256, num_accepted_tokens=0)
    stats.observe_draft(num_draft_tokens=200, num_accepted_tokens=15)
    prom.observe(stats, engine_idx=0)

    assert _value(registry, "vllm:spec_decode_num_drafts_total") == 3
    assert _value(registry, "vllm:spec_decode_num_draft_tokens_total") == 712
    assert _value(registry, "vllm:spec_decode_num_accepted_tokens_total") == 18
    h = "vllm:ddtree_acceptance_length"
    assert _value(registry, f"{h}_count") == 3
    assert _value(registry, f"{h}_sum") == 4 + 1 + 16
    assert _value(registry, f"{h}_bucket", le="1.0") == 1
    assert _value(registry, f"{h}_bucket", le="4.0") == 2
    assert _value(registry, f"{h}_bucket", le="16.0") == 3
    d = "vllm:ddtree_num_accepted_tokens_per_depth_total"
    assert [_value(registry, d, depth=str(k)) for k in (1, 3, 4, 15)] == [2, 2, 1, 1]
    pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert _value(registry, pos, position="0") == 2
    assert _value(registry, pos, position="14") == 1
    assert _value(registry, "vllm:ddtree_tree_budget") == 256

    # A later step verifying smaller trees: the gauge follows the budget in use.
    stats = SpecDecodingStats.new(spec.num_speculative_tokens)
    stats.observe_draft(num_draft_tokens=32, num_accepted_tokens=1)
    prom.observe(stats, engine_idx=0)
    assert _value(registry, "vllm:ddtree_tree_budget") == 32
    assert _value(registry, f"{h}_count") == 4
    assert _value(registry, d, depth="1") == 3


@ddtree_metrics_line
def test_plain_dflash_keeps_upstream_series_only(target_model_config, registry):
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    spec = make_spec(
        target_model_config, method="dflash", model=DRAFTER, num_speculative_tokens=7
    )
    prom = SpecDecodingProm(spec, LABELS, PER_ENGINE)
    assert prom.ddtree is None
    text = prometheus_client.generate_latest(registry).decode()
    assert "vllm:ddtree_" not in text
    per_pos = _series(registry, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert len(per_pos) == 7


STAT_LOGGERS_ON_CPU = """
import json, sys
import prometheus_client
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

target, drafter = sys.argv[1:3]
args = EngineArgs(model=target, dtype="float32", max_model_len=512,
                  speculative_config={"method": "ddtree", "model": drafter,
                                      "tree_budget": 48})
config = args.create_engine_config()
prom = PrometheusStatLogger(config, engine_indexes=[0])
log = LoggingStatLogger(config, engine_index=0)
spec = SpecDecodingStats.new(config.speculative_config.num_speculative_tokens)
spec.observe_draft(num_draft_tokens=48, num_accepted_tokens=6)
stats = SchedulerStats(spec_decoding_stats=spec)
prom.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
log.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
lines = []
log.spec_decoding_logging.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
samples = {
    s.name + json.dumps({k: v for k, v in sorted(s.labels.items())
                         if k not in ("model_name", "engine")}): s.value
    for m in prometheus_client.REGISTRY.collect() for s in m.samples
    if s.name.startswith(("vllm:ddtree", "vllm:spec_decode"))
}
print("RESULT " + json.dumps({"samples": samples, "log": lines,
      "backend": str(config.attention_config.backend)}))
"""


@ddtree_metrics_line
def test_vllm_stat_loggers_export_ddtree_series():
    """The PrometheusStatLogger and LoggingStatLogger of vLLM, built from the
    engine config that `vllm serve` would build (EngineArgs ->
    create_engine_config, on vLLM's CPU platform), fed one scheduler step."""
    r = run_on_cpu(STAT_LOGGERS_ON_CPU, TARGET, DRAFTER, timeout=300)
    s = r["samples"]
    assert r["backend"].endswith("TRITON_ATTN")
    assert s["vllm:ddtree_tree_budget{}"] == 48
    assert s["vllm:ddtree_draft_depth{}"] == 15
    assert s["vllm:ddtree_acceptance_length_count{}"] == 1
    assert s["vllm:ddtree_acceptance_length_sum{}"] == 7
    assert s['vllm:ddtree_num_accepted_tokens_per_depth_total{"depth": "6"}'] == 1
    assert s['vllm:ddtree_num_accepted_tokens_per_depth_total{"depth": "7"}'] == 0
    assert s["vllm:spec_decode_num_drafts_total{}"] == 1
    assert s["vllm:spec_decode_num_accepted_tokens_total{}"] == 6
    positions = [
        k
        for k in s
        if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")
    ]
    assert len(positions) == 15  # per depth, not one per tree node (48)
    assert r["log"] and r["log"][0].startswith(
        "SpecDecoding metrics (DDTree, tree_budget=48, draft_depth=15): "
        "Mean acceptance length: 7.00"
    ), r["log"]


@ddtree_metrics_line
def test_periodic_log_line_names_ddtree_and_budget(target_model_config):
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging, SpecDecodingStats

    spec = make_spec(
        target_model_config, method="ddtree", model=DRAFTER, tree_budget=64
    )
    logging = SpecDecodingLogging(speculative_config=spec)
    stats = SpecDecodingStats.new(spec.num_speculative_tokens)
    stats.observe_draft(num_draft_tokens=64, num_accepted_tokens=5)
    stats.observe_draft(num_draft_tokens=64, num_accepted_tokens=1)
    logging.observe(stats)
    lines = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith(
        "SpecDecoding metrics (DDTree, tree_budget=64, draft_depth=15): "
        "Mean acceptance length: 4.00"
    ), line
    rates = line.split("Per-position acceptance rate: ")[1].split(", Avg")[0]
    assert len(rates.split(", ")) == 15  # one per depth, not 64
    assert rates.startswith("1.000, 0.500, 0.500")

    plain = SpecDecodingLogging()
    plain.observe(stats)
    lines.clear()
    plain.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines[0].startswith("SpecDecoding metrics: Mean acceptance length: 4.00")


# ------------------------------------------------------------ startup errors
def test_error_line_unwraps_pydantic_validation_errors():
    import pydantic

    from vllm.v1.spec_decode.ddtree.startup import ddtree_config_error_line

    @pydantic.dataclasses.dataclass
    class Cfg:
        x: int = 0

        def __post_init__(self):
            raise ValueError("DDTree: tree_budget must be a positive integer,\n got 0.")

    with pytest.raises(Exception) as info:
        Cfg()
    assert "\n" in str(info.value)
    assert (
        ddtree_config_error_line(info.value)
        == "DDTree: tree_budget must be a positive integer, got 0."
    )
    try:
        try:
            Cfg()
        except Exception as e:
            raise RuntimeError("engine start failed") from e
    except RuntimeError as outer:
        assert ddtree_config_error_line(outer).startswith("DDTree: tree_budget")
    assert ddtree_config_error_line(ValueError("max_model_len too large")) is None


def test_upstream_speculative_errors_of_a_ddtree_request_are_shortened():
    import pydantic

    from vllm.v1.spec_decode.ddtree.startup import ddtree_spec_error_line

    def failing(title, message):
        cls = type(title, (), {"__annotations__": {"x": int}, "x": 0})
        cls.__post_init__ = lambda self: (_ for _ in ()).throw(ValueError(message))
        cls = pydantic.dataclasses.dataclass(cls)
        with pytest.raises(Exception) as info:
            cls()
        return info.value

    ddtree = {"method": "ddtree", "model": "org/some-model"}
    arch = failing(
        "SpeculativeConfig",
        "Model architectures ['DFlashLlamaForCausalLM'] are not supported for now. "
        "Supported architectures: " + ", ".join(f"'A{i}'" for i in range(500)),
    )
    assert ddtree_spec_error_line(arch, ddtree) == (
        "DDTree: the draft model 'org/some-model' is not a DFlash drafter "
        "(resolved architectures ['DFlashLlamaForCausalLM']); use a DFlash "
        "checkpoint (DFlashDraftModel with a dflash_config)."
    )
    long = failing("SpeculativeConfig", "something\nwent wrong " + "x" * 1000)
    line = ddtree_spec_error_line(long, ddtree)
    assert line.startswith("DDTree: invalid --speculative-config: something went wrong")
    assert len(line) <= 300 and "\n" not in line
    # Not DDTree, or not the speculative config: left to upstream.
    assert ddtree_spec_error_line(arch, {"method": "dflash"}) is None
    assert ddtree_spec_error_line(failing("ModelConfig", "bad"), ddtree) is None


def speculative_config(method, drafter, options=None, **fields):
    """`--speculative-config` with DDTree's ``options`` (tree_budget,
    draft_depth) where this line takes them: fields of the 0.26.0 line's
    patched config, ``speculator_options`` on vLLM's speculative-method
    interface."""
    config = dict(method=method, model=drafter, **fields)
    if options and SPECULATOR_PLUGIN:
        config["speculator_options"] = options
    elif options:
        config.update(options)
    return json.dumps(config)


# On vLLM's speculative-method interface, vLLM itself refuses another method's
# speculator_options, in its own words.
UPSTREAM_OPTIONS_REFUSAL = (
    "speculator_options is not supported with speculative method 'dflash'."
)
BUDGET_ON_DFLASH_MESSAGE = (
    UPSTREAM_OPTIONS_REFUSAL
    if SPECULATOR_PLUGIN
    else "DDTree: tree_budget and draft_depth are only valid with method='ddtree', "
    "got method='dflash'."
)

# (name, method, DDTree options, other fields, extra CLI arguments, message)
BAD_CONFIGS = [
    (
        "budget0",
        "ddtree",
        {"tree_budget": 0},
        {},
        [],
        "DDTree: tree_budget must be a positive integer, got 0.",
    ),
    (
        "depth16",
        "ddtree",
        {"draft_depth": 16},
        {},
        [],
        "DDTree: draft_depth=16 exceeds the drafter's block_size - 1 = 15.",
    ),
    (
        "nst",
        "ddtree",
        {},
        {"num_speculative_tokens": 8},
        [],
        "num_speculative_tokens=8",
    ),
    (
        "not_dflash",
        "ddtree",
        {},
        {},
        ["TARGET_AS_DRAFTER"],
        # Upstream refuses the wrapped architecture before our own check runs.
        "is not a DFlash drafter (resolved architectures ['DFlashQwen3ForCausalLM'])",
    ),
    (
        "flash_attn",
        "ddtree",
        {},
        {},
        ["--attention-backend", "FLASH_ATTN"],
        "got FLASH_ATTN",
    ),
    (
        "budget_on_dflash",
        "dflash",
        {"tree_budget": 8},
        {"num_speculative_tokens": 4},
        [],
        BUDGET_ON_DFLASH_MESSAGE,
    ),
    # What the tree path cannot do, through the VllmConfig hook and through
    # SpeculativeConfig (pipeline parallelism); test_ddtree_refusals.py builds
    # every refusal's engine config.
    (
        "sliding_window",
        "ddtree",
        {},
        {},
        ["--hf-overrides", '{"sliding_window": 256}'],
        "DDTree cannot verify trees on Qwen3ForCausalLM: its sliding-window "
        "attention (sliding_window=256) is shorter than max_model_len=512",
    ),
    (
        "pipeline_parallel",
        "ddtree",
        {},
        {},
        ["--pipeline-parallel-size", "2"],
        "DDTree does not support pipeline parallelism (pipeline_parallel_size=2)",
    ),
]
if SPECULATOR_PLUGIN:
    # A misspelt option: DDTree's config class refuses it, and the excepthook
    # that DDTree's general plugin installs prints the refusal.
    BAD_CONFIGS.append(
        (
            "unknown_option",
            "ddtree",
            {"tree_bugdet": 8},
            {},
            [],
            "DDTree: unknown speculator_options 'tree_bugdet'",
        )
    )


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Run `vllm serve` with every bad config at once (each start imports vLLM)."""
    env = cpu_env(logging_level="WARNING")
    port = 18000
    procs = {}
    for i, (name, method, options, fields, extra, _) in enumerate(BAD_CONFIGS):
        drafter = DRAFTER
        if extra == ["TARGET_AS_DRAFTER"]:
            drafter, extra = TARGET, []
        cmd = [
            sys.executable,
            "-c",
            CLI_ON_CPU,
            "serve",
            TARGET,
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--host",
            "127.0.0.1",
            "--port",
            str(port + i),
            "--speculative-config",
            speculative_config(method, drafter, options, **fields),
            *extra,
        ]
        procs[name] = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    out = {}
    # One deadline for all: the starts share the CPUs (8 vLLM imports at once on
    # a 2-core machine under other load took over 300 s for the first to exit).
    deadline = time.monotonic() + 900
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out[name] = (p.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize(
    "name, method, options, fields, extra, message",
    BAD_CONFIGS,
    ids=[c[0] for c in BAD_CONFIGS],
)
def test_vllm_serve_bad_config_is_one_line(
    cli_runs, name, method, options, fields, extra, message
):
    rc, stdout, stderr = cli_runs[name]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert rc == 1, (rc, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert lines, stdout[-2000:]
    # vLLM prefixes its processes' output with "(APIServer pid=N) ".
    last = lines[-1].split(") ", 1)[-1] if lines[-1].startswith("(") else lines[-1]
    if message == UPSTREAM_OPTIONS_REFUSAL:
        assert last == f"vllm serve: error: {message}", last
    else:
        assert last.startswith("vllm serve: error: DDTree"), stderr[-3000:]
        assert message in last, last
        if message.startswith("DDTree"):
            assert last.startswith(f"vllm serve: error: {message}"), last
    assert len(last) < 400
