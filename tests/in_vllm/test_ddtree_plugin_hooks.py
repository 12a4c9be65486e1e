# SPDX-License-Identifier: Apache-2.0
"""The generic hooks through which DDTree reaches vLLM 0.34.0 beyond the
plugin: a speculator config's engine-config checks (`verify_vllm_config`,
called from VllmConfig.__post_init__), its per-request refusals
(`unsupported_request_reason`, asked by the input processor), its
recurrent-state count (`num_draft_states`, read by the mamba layers and the
GDN metadata builder), and the CLI's one line for a config error. The
refusals themselves run through real configs in test_ddtree_refusals.py,
the GDN tree branch in test_ddtree_gdn_hybrid.py / test_ddtree_gdn_builder.py,
the state sizing in test_ddtree_hybrid_runner.py, `vllm serve` with bad
configs (through the excepthook that DDTree's general plugin installs) in
test_ddtree_serving.py; here: each hook's own contract. The CLI helper is
tested on both lines, the rest where vLLM has the speculative-method
interface."""

import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pydantic = pytest.importorskip("pydantic")

from engine_on_cpu import engine_config  # noqa: E402

from vllm.entrypoints.cli import config_errors  # noqa: E402

try:  # vLLM's speculative-method interface (0.34.0)
    from vllm.v1.worker.gpu.spec_decode import speculator_config
except ImportError:  # the 0.26.0 line
    speculator_config = None

needs_interface = pytest.mark.skipif(
    speculator_config is None,
    reason="vLLM without the speculative-method interface (the 0.26.0 line)",
)


# ------------------------------------------------------------------ CLI
@pydantic.dataclasses.dataclass
class SomeConfig:
    size: int = 1

    def __post_init__(self):
        if self.size < 0:
            raise ValueError("size must not be negative;\n  pass --size 0 or more.")


def _validation_error(**kw):
    with pytest.raises(pydantic.ValidationError) as info:
        SomeConfig(**kw)
    return info.value


def test_a_config_error_is_its_own_message_on_one_line():
    error = _validation_error(size=-1)
    line = "size must not be negative; pass --size 0 or more."
    assert config_errors.config_error_line(error) == line
    # Wrapped (raised while handling it, or from it): still found.
    try:
        try:
            raise error
        except pydantic.ValidationError as inner:
            raise RuntimeError("engine start failed") from inner
    except RuntimeError as outer:
        assert config_errors.config_error_line(outer) == line
    # A type error names its field.
    typed = config_errors.config_error_line(_validation_error(size="many"))
    assert typed is not None and typed.startswith("size: ") and "\n" not in typed
    # Anything else is not a config error.
    assert config_errors.config_error_line(ValueError("runtime")) is None
    assert config_errors.config_error_line(RuntimeError("x")) is None


def test_the_excepthook_prints_a_config_error_on_one_line(monkeypatch, capsys):
    passed_on = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: passed_on.append(exc[1]))
    config_errors.install_config_error_excepthook()
    config_errors.install_config_error_excepthook()  # once: no second wrapper
    hook = sys.excepthook
    assert getattr(hook, "prints_config_errors", False)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/vllm", "serve", "m"])
    error = _validation_error(size=-1)
    hook(type(error), error, None)
    assert capsys.readouterr().err == (
        "vllm serve: error: size must not be negative; pass --size 0 or more.\n"
    )
    assert passed_on == []
    # Anything else, and a config error of another program: the previous hook.
    other = KeyError("k")
    hook(type(other), other, None)
    monkeypatch.setattr(sys, "argv", ["script.py"])
    hook(type(error), error, None)
    assert passed_on == [other, error]
    assert capsys.readouterr().err == ""
    assert config_errors.cli_prog(["vllm"]) == "vllm"
    assert config_errors.cli_prog(["vllm", "--version"]) == "vllm"


# --------------------------------------------------- speculator config hooks
def _spec(**kw):
    return SimpleNamespace(num_speculative_tokens=8, speculator_options={}, **kw)


@needs_interface
def test_the_hooks_default_to_upstream_behaviour():
    """A speculator config that does not override them: a recurrent state per
    draft token, no per-request refusal, no engine-config change."""
    from vllm.v1.worker.gpu.spec_decode.dflash.config import DFlashSpeculatorConfig

    for config_cls in (speculator_config.SpeculatorConfig, DFlashSpeculatorConfig):
        config = config_cls(_spec())
        assert config.num_draft_states == 8
        assert config.unsupported_request_reason(object(), True) is None
        engine = SimpleNamespace()
        assert config.verify_vllm_config(engine) is None
        assert vars(engine) == {}


@needs_interface
def test_ddtree_keeps_one_recurrent_state_and_refuses_chain_only_requests():
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.spec_decode.ddtree.config import STREAMING_INPUT_ERROR
    from vllm.v1.worker.gpu.spec_decode.ddtree.config import DDTreeSpeculatorConfig

    config = DDTreeSpeculatorConfig(_spec())
    assert config.num_draft_states == 0
    plain = SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    assert config.unsupported_request_reason(plain, False) is None
    assert config.unsupported_request_reason(plain, True) == STREAMING_INPUT_ERROR
    guided = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    bad_words = SamplingParams(bad_words=["foo"])
    for params, what in ((guided, "structured outputs"), (bad_words, "bad_words")):
        reason = config.unsupported_request_reason(params, False)
        assert reason.startswith(f"DDTree does not support {what}")
        assert "\n" not in reason


@needs_interface
def test_ddtree_checks_the_engine_config(monkeypatch):
    """verify_vllm_config runs the 0.26.0 line's engine-level checks: the
    target gets TRITON_ATTN, a KV connector is refused in one line, and the
    drafter's own derived config is left alone; a config that passes them
    is accepted."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.gpu.spec_decode.ddtree.config import DDTreeSpeculatorConfig

    monkeypatch.delenv("VLLM_DDTREE_BACKEND", raising=False)
    monkeypatch.delenv("VLLM_DDTREE_TREE_ATTENTION", raising=False)
    spec = _spec(method="dflash", custom_method="ddtree")
    config = DDTreeSpeculatorConfig(spec)
    engine = engine_config()
    config.verify_vllm_config(engine)
    assert engine.attention_config.backend == AttentionBackendEnum.TRITON_ATTN

    connector = SimpleNamespace(kv_connector="ExampleConnector")
    with pytest.raises(ValueError) as info:
        config.verify_vllm_config(engine_config(kv_transfer_config=connector))
    assert str(info.value).startswith("DDTree does not support KV connectors")
    assert "\n" not in str(info.value)

    from vllm.config import AttentionConfig

    drafter = engine_config(attention_config=AttentionConfig(use_non_causal=True))
    config.verify_vllm_config(drafter)
    assert drafter.attention_config.backend is None
