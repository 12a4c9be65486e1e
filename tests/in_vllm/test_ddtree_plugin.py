# SPDX-License-Identifier: Apache-2.0
"""DDTree as a vLLM plugin on a release with the speculative-method interface
(vLLM 0.34.0): the wheel's general-plugin entry point, `register()` (method
"ddtree" through `register_speculative_method`, the neutral tree hooks), and
the `SpeculatorConfig` subclass that holds DDTree's options, validates them
and refuses bad configs in one line. Skipped on the 0.26.0 line, whose
patched configs name DDTree themselves."""

import importlib.metadata
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
speculator_config = pytest.importorskip(
    "vllm.v1.worker.gpu.spec_decode.speculator_config",
    reason="vLLM without the speculative-method interface (the 0.26.0 line)",
)

from engine_on_cpu import engine_config, run_on_cpu  # noqa: E402
from verifier_fakes import DRAFTER, TARGET  # noqa: E402

from vllm.v1.spec_decode import tree_hooks  # noqa: E402
from vllm.v1.spec_decode.ddtree import config as ddtree_config  # noqa: E402
from vllm.v1.spec_decode.ddtree import plugin  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.ddtree import (  # noqa: E402
    config as plugin_config,
)
from vllm.v1.worker.gpu.spec_decode.dflash.config import (  # noqa: E402
    DFlashSpeculatorConfig,
)

ENTRY_POINT = "vllm.v1.spec_decode.ddtree.plugin:register"


def test_the_wheel_declares_the_general_plugin():
    (entry,) = [
        ep
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
        if ep.name == "ddtree"
    ]
    assert entry.value == ENTRY_POINT
    assert entry.load() is plugin.register


def test_register_registers_ddtree_and_its_tree_hooks():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    plugin.register()
    # vLLM may load the general plugins more than once in a process.
    plugin.register()
    assert "ddtree" in speculator_config.registered_speculative_methods()
    config_cls = speculator_config.get_custom_speculator_config_class("ddtree")
    assert config_cls is plugin_config.DDTreeSpeculatorConfig
    assert issubclass(config_cls, DFlashSpeculatorConfig)
    assert config_cls.base_method == "dflash"
    assert config_cls.supported_options == {"speculator_options"}
    speculator_cls = resolve_obj_by_qualname(config_cls.speculator_class)
    assert issubclass(speculator_cls, DFlashSpeculator)
    hook = tree_hooks.get_tree_hook("split_attention_for_builder")
    assert hook is plugin.split_attention_for_builder
    # Not DDTree: the hook leaves the TRITON_ATTN builder on the unified kernel.
    no_spec = SimpleNamespace(speculative_config=None)
    assert hook(no_spec, 8, 2, 64, 16, None, "cpu") is None
    chain = SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash", custom_method=None)
    )
    assert hook(chain, 8, 2, 64, 16, None, "cpu") is None
    with pytest.raises(ValueError, match="already registered"):
        speculator_config.register_speculative_method("ddtree", DFlashSpeculatorConfig)


def test_is_ddtree_reads_the_custom_method():
    assert ddtree_config.is_ddtree(
        SimpleNamespace(method="dflash", custom_method="ddtree")
    )
    assert not ddtree_config.is_ddtree(
        SimpleNamespace(method="dflash", custom_method=None)
    )
    assert not ddtree_config.is_ddtree(None)


def _spec(**options):
    """A speculative config as `SpeculativeConfig.__post_init__` hands it to
    the method's config class (custom method moved out, base method in)."""
    return SimpleNamespace(
        method="dflash",
        custom_method="ddtree",
        model="drafter",
        speculator_options=options,
        num_speculative_tokens=None,
        num_speculative_tokens_per_batch_size=None,
        draft_sample_method="greedy",
        rejection_sample_method="standard",
        enable_adaptive_verification=False,
        target_parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        draft_model_config=None,
        target_model_config=SimpleNamespace(
            is_hybrid=False, architecture="Qwen3ForCausalLM"
        ),
    )


@pytest.fixture()
def dflash_setup(monkeypatch):
    """DFlash's own setup (the draft ModelConfig from a checkpoint) replaced by
    a drafter config with block_size 16; records that it ran."""
    calls = []

    def configure(spec):
        calls.append(spec.num_speculative_tokens)
        hf_config = SimpleNamespace(
            architectures=["DFlashDraftModel"],
            dflash_config={"block_size": 16},
            block_size=16,
        )
        spec.draft_model_config = SimpleNamespace(hf_config=hf_config)

    monkeypatch.setattr(
        DFlashSpeculatorConfig,
        "configure",
        classmethod(lambda cls, spec: configure(spec)),
    )
    return calls


def _configure(spec):
    plugin_config.DDTreeSpeculatorConfig.configure(spec)


def _one_line_error(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        _configure(spec)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_release_line_guard_refuses_ddtree_on_0_34(monkeypatch, dflash_setup):
    import vllm.version

    monkeypatch.setattr(vllm.version, "__version__", "0.34.0+ddtree.1")
    monkeypatch.delenv(ddtree_config.ALLOW_UNVERIFIED_LINE_ENV, raising=False)
    message = _one_line_error(_spec(tree_budget=32), "CPU checks only")
    assert "0.34.0" in message
    assert dflash_setup == []


@pytest.mark.parametrize(
    ("options", "spec_fields", "match"),
    [
        ({"tree_bugdet": 32}, {}, "unknown speculator_options 'tree_bugdet'"),
        ({"tree_budget": 0}, {}, "tree_budget must be a positive integer"),
        ({"draft_depth": -1}, {}, "draft_depth must be a positive integer"),
        ({}, {"num_speculative_tokens": 8}, "do not set num_speculative_tokens"),
        ({}, {"draft_sample_method": "probabilistic"}, "must be 'greedy'"),
        ({}, {"rejection_sample_method": "block"}, "must be 'standard'"),
        ({}, {"enable_adaptive_verification": True}, "adaptive_verification"),
        ({}, {"model": None}, "needs 'model'"),
        ({"budget_policy": "fast"}, {}, "budget_policy must be"),
        ({"draft_depth": 16}, {}, "exceeds the drafter's block_size - 1 = 15"),
        (
            {"budget_policy": "measured"},
            {},
            "budget_policy 'measured' times the captured graphs on the worker",
        ),
    ],
)
def test_bad_configs_are_refused_in_one_line(
    monkeypatch, dflash_setup, options, spec_fields, match
):
    monkeypatch.setenv(ddtree_config.ALLOW_UNVERIFIED_LINE_ENV, "1")
    spec = _spec(**options)
    for name, value in spec_fields.items():
        setattr(spec, name, value)
    _one_line_error(spec, match)


def test_speculator_options_must_be_a_mapping(monkeypatch):
    monkeypatch.setenv(ddtree_config.ALLOW_UNVERIFIED_LINE_ENV, "1")
    spec = _spec()
    spec.speculator_options = [("tree_budget", 8)]
    _one_line_error(spec, "speculator_options must be a mapping")


@pytest.mark.parametrize("budget_policy", ["batch", None])
def test_a_good_config_is_resolved(monkeypatch, dflash_setup, budget_policy):
    """Opted in, a valid config goes through DFlash's setup with
    num_speculative_tokens = tree_budget, gets draft_depth from the drafter and
    the batch policy's schedule (the default here) as vLLM's dynamic
    schedule."""
    monkeypatch.setenv(ddtree_config.ALLOW_UNVERIFIED_LINE_ENV, "1")
    spec = _spec(
        tree_budget=32, budget_policy=budget_policy, verify_tokens_per_step=128
    )
    _configure(spec)
    # The engine-level checks pass it too (TRITON_ATTN for the target).
    plugin_config.DDTreeSpeculatorConfig(spec).verify_vllm_config(
        engine_config(speculative_config=spec)
    )
    assert dflash_setup == [32]
    assert spec.speculator_options["budget_policy"] == "batch"
    assert spec.num_speculative_tokens == 32
    assert spec.speculator_options["draft_depth"] == 15
    assert spec.speculator_options["tree_budget"] == 32
    assert spec.num_speculative_tokens_per_batch_size == (
        ddtree_config.budget_schedule(32, 15, 128)
    )
    # What the runner and the verifier read: DDTree's options as attributes.
    view = ddtree_config.ddtree_speculative_config(spec)
    assert (view.tree_budget, view.draft_depth, view.use_ddtree()) == (32, 15, True)
    assert ddtree_config.ddtree_speculative_config(view) is view


def test_what_this_line_cannot_run_yet_is_refused_in_one_line(
    monkeypatch, dflash_setup
):
    """The measured budget policy (its schedule has no way from the worker
    to the scheduler here) stops at startup in one line; hybrid (Gated
    DeltaNet) targets are configured as dense ones are (their tree path:
    tests/in_vllm/test_ddtree_hybrid_runner_v034.py)."""
    monkeypatch.setenv(ddtree_config.ALLOW_UNVERIFIED_LINE_ENV, "1")
    message = _one_line_error(_spec(budget_policy="measured"), "'measured'")
    assert "'batch'" in message
    spec = _spec(tree_budget=8)
    spec.target_model_config = SimpleNamespace(
        is_hybrid=True, architecture="Qwen3_5ForConditionalGeneration"
    )
    _configure(spec)
    assert spec.num_speculative_tokens == 8
    assert spec.speculator_options["tree_budget"] == 8


SPECULATIVE_CONFIG_ON_CPU = """
import json, os, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.ddtree import plugin
from vllm.v1.spec_decode.ddtree.startup import ddtree_config_error_line

plugin.register()
target, drafter = sys.argv[1], sys.argv[2]
out = {}
for opt_in in ("0", "1"):
    os.environ["VLLM_DDTREE_ALLOW_UNVERIFIED_LINE"] = opt_in
    try:
        EngineArgs(
            model=target, dtype="float32", max_model_len=512,
            speculative_config={"method": "ddtree", "model": drafter,
                                "speculator_options": {"tree_budget": 8}},
        ).create_engine_config()
        out[opt_in] = "ok"
    except Exception as e:
        out[opt_in] = ddtree_config_error_line(e) or repr(e)[:500]
print("RESULT " + json.dumps(out))
"""


def test_method_ddtree_through_vllms_own_speculative_config():
    """`vllm serve`'s path on vLLM's CPU platform with the tiny pair: the
    plugin's method goes through SpeculativeConfig's custom-method branch to
    DDTree's config class, which refuses it in one line on the release-line
    guard, or opted in, builds the engine config."""
    out = run_on_cpu(SPECULATIVE_CONFIG_ON_CPU, TARGET, DRAFTER)
    assert "release line has passed its CPU checks only" in out["0"]
    # Opted in, the config is built (the runner verifies trees).
    assert out["1"] == "ok"
    assert "\n" not in out["0"]
