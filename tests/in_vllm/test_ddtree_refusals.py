# SPDX-License-Identifier: Apache-2.0
"""What the tree path would get wrong or crash on, refused at startup in one
line (or per request): targets whose attention masks or biases are computed
from KV slot offsets (sliding windows, chunked local attention, ALiBi),
pipeline parallelism, KV-cache dtypes the tree kernels do not take, KV
connectors and KV offloading, a bad VLLM_DDTREE_BACKEND or
VLLM_DDTREE_TREE_ATTENTION (and a split tree attention that FA3 cannot run),
streaming-input requests. The real configs are built as `vllm serve` builds them
(EngineArgs -> create_engine_config on vLLM's CPU platform, in a
subprocess); test_ddtree_serving.py runs some of them through the CLI."""

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from engine_on_cpu import run_on_cpu  # noqa: E402
from verifier_fakes import DRAFTER, TARGET  # noqa: E402

from vllm.v1.spec_decode.ddtree import config as ddtree_config  # noqa: E402

try:  # vLLM's speculative-method interface (0.34.0); not the 0.26.0 line
    from vllm.v1.worker.gpu.spec_decode.ddtree import (
        config as ddtree_speculator_config,
    )
except ImportError:
    ddtree_speculator_config = None

ENGINE_CONFIGS_ON_CPU = """
import json, os, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.ddtree.startup import ddtree_config_error_line

target, drafter, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {}
for name, case in cases.items():
    env = case.pop("env", {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    kw = dict(model=target, dtype="float32", max_model_len=512,
              speculative_config={"method": "ddtree", "model": drafter})
    kw.update(case)
    try:
        config = EngineArgs(**kw).create_engine_config()
        out[name] = ["ok", config.cache_config.cache_dtype]
    except Exception as e:
        out[name] = ["error", ddtree_config_error_line(e) or repr(e)[:500]]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
print("RESULT " + json.dumps(out))
"""

# name -> (EngineArgs keywords, expected: "ok" or the exact one-line error)
SWA_256 = (
    "DDTree cannot verify trees on Qwen3ForCausalLM: its sliding-window "
    "attention (sliding_window=256) is shorter than max_model_len=512, and the "
    "window is measured in KV slots, where tree nodes do not sit at their "
    "positions; pass --max-model-len 256 (or less), or use method='dflash'."
)
CHUNKED = (
    "DDTree cannot verify trees on Qwen3ForCausalLM: its chunked local "
    "attention ({}) splits the sequence by KV slot, where tree nodes do not "
    "sit at their positions; use method='dflash' (or no speculative decoding)."
)
ALIBI = (
    "DDTree cannot verify trees on Qwen3ForCausalLM: its ALiBi position bias "
    "is computed from KV slot distances, where tree nodes do not sit at their "
    "positions; use method='dflash' (or no speculative decoding)."
)
KV_DTYPE = (
    "DDTree does not support kv_cache_dtype={!r} ({}); pass --kv-cache-dtype "
    "auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, int8_per_token_head or "
    "fp8_per_token_head, or use method='dflash'."
)
PP = (
    "DDTree does not support pipeline parallelism (pipeline_parallel_size=2): "
    "only the last stage verifies the tree, the others would attend over its "
    "nodes as a chain; use --tensor-parallel-size instead of "
    "--pipeline-parallel-size."
)
KV_CONNECTOR = (
    "DDTree does not support KV connectors (kv_transfer_config with "
    "kv_connector='ExampleConnector'): none has been checked against the "
    "tree's KV compaction (a per-layer saver sends a verify step's KV, the "
    "whole tree, before the accepted path is compacted); remove "
    "--kv-transfer-config, or use method='dflash'."
)
KV_OFFLOADING = (
    "DDTree does not support KV offloading (kv_offloading_size=1.0, backend "
    "'native'): it runs as a KV connector, and none has been checked against "
    "the tree's KV compaction; remove --kv-offloading-size, or use "
    "method='dflash'."
)
BAD_BACKEND = (
    "DDTree: VLLM_DDTREE_BACKEND='cuda' is not a tree-build backend; set it to "
    "'auto', 'torch' or 'triton', or unset it."
)

SPLIT_NEEDS = "DDTree: VLLM_DDTREE_TREE_ATTENTION=split needs FlashAttention 3, "
BAD_TREE_ATTENTION = (
    "DDTree: VLLM_DDTREE_TREE_ATTENTION='flash' is not a tree attention mode; "
    "set it to 'auto', 'unified' or 'split', or unset it."
)
SPLIT_FLOAT32 = (
    SPLIT_NEEDS + "which takes float16 or bfloat16, got dtype=float32; pass "
    "--dtype bfloat16 or unset VLLM_DDTREE_TREE_ATTENTION."
)
SPLIT_NO_FA3 = (
    SPLIT_NEEDS + "which is not available here (it needs an NVIDIA GPU of "
    "compute capability 9.x, this platform is cpu); unset "
    "VLLM_DDTREE_TREE_ATTENTION (the unified Triton kernel runs everywhere)."
)

ENGINE_CASES = {
    "plain": ({}, "ok"),
    "swa": ({"hf_overrides": {"sliding_window": 256}}, SWA_256),
    # A window at least max_model_len never binds: allowed.
    "swa_at_max_len": ({"hf_overrides": {"sliding_window": 512}}, "ok"),
    "swa_per_layer": (
        {"hf_overrides": {"interleaved_sliding_window": [128, None]}},
        SWA_256.replace("sliding_window=256", "interleaved_sliding_window=128").replace(
            "--max-model-len 256", "--max-model-len 128"
        ),
    ),
    "chunk_size": (
        {"hf_overrides": {"attention_chunk_size": 128}},
        CHUNKED.format("attention_chunk_size=128"),
    ),
    "chunk_layers": (
        {"hf_overrides": {"layer_types": ["chunked_attention"] * 6}},
        CHUNKED.format("layer_types 'chunked_attention'"),
    ),
    "alibi": ({"hf_overrides": {"position_encoding_type": "alibi"}}, ALIBI),
    "int4": (
        {"kv_cache_dtype": "int4_per_token_head"},
        KV_DTYPE.format(
            "int4_per_token_head",
            "its packed INT4 attention kernel takes no per-request tree bias",
        ),
    ),
    "nvfp4": (
        {"kv_cache_dtype": "nvfp4"},
        KV_DTYPE.format(
            "nvfp4", "the TRITON_ATTN backend that verifies the tree does not take it"
        ),
    ),
    "fp8": ({"kv_cache_dtype": "fp8"}, "ok"),
    "int8_pth": ({"kv_cache_dtype": "int8_per_token_head"}, "ok"),
    "fp8_pth": ({"kv_cache_dtype": "fp8_per_token_head"}, "ok"),
    "pp2": ({"pipeline_parallel_size": 2}, PP),
    "kv_connector": (
        {
            "kv_transfer_config": {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
            }
        },
        KV_CONNECTOR,
    ),
    "kv_offloading": ({"kv_offloading_size": 1.0}, KV_OFFLOADING),
    "bad_backend": ({"env": {"VLLM_DDTREE_BACKEND": "cuda"}}, BAD_BACKEND),
    "torch_backend": ({"env": {"VLLM_DDTREE_BACKEND": "torch"}}, "ok"),
    "bad_tree_attention": (
        {"env": {"VLLM_DDTREE_TREE_ATTENTION": "flash"}},
        BAD_TREE_ATTENTION,
    ),
    "unified_tree_attention": (
        {"env": {"VLLM_DDTREE_TREE_ATTENTION": "unified"}},
        "ok",
    ),
    "split_float32": ({"env": {"VLLM_DDTREE_TREE_ATTENTION": "split"}}, SPLIT_FLOAT32),
    # This CPU host: no FA3, refused rather than run unified.
    "split_no_fa3": (
        {"env": {"VLLM_DDTREE_TREE_ATTENTION": "split"}, "dtype": "bfloat16"},
        SPLIT_NO_FA3,
    ),
}


@pytest.fixture(scope="module")
def engine_configs():
    """Every case's engine config, built in one subprocess (one vLLM import)."""
    cases = {name: kw for name, (kw, _) in ENGINE_CASES.items()}
    return run_on_cpu(
        ENGINE_CONFIGS_ON_CPU,
        TARGET,
        DRAFTER,
        json.dumps(cases),
        unset=("VLLM_DDTREE_BACKEND", "VLLM_DDTREE_TREE_ATTENTION"),
    )


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_engine_config_refusals(engine_configs, name):
    status, detail = engine_configs[name]
    expected = ENGINE_CASES[name][1]
    if expected == "ok":
        assert status == "ok", detail
    else:
        assert status == "error" and detail == expected, detail
        assert "\n" not in detail and len(detail) < 380


# ------------------------------------------------ target layers, once built
def _attention_layer(
    sliding_window=None, alibi=False, chunk_lookback=-1, chunk=None, kind="decoder"
):
    from torch import nn

    from vllm.model_executor.layers.attention.attention import Attention

    layer = object.__new__(Attention)
    nn.Module.__init__(layer)
    layer.sliding_window = sliding_window
    layer.attn_type = kind
    layer.impl = SimpleNamespace(
        alibi_slopes=torch.ones(2) if alibi else None, chunk_lookback=chunk_lookback
    )
    if chunk is not None:
        layer.attention_chunk_size = chunk
    return layer


def _built(layers, max_model_len=512):
    return SimpleNamespace(
        model_config=SimpleNamespace(
            architecture="SomeForCausalLM", max_model_len=max_model_len
        ),
        compilation_config=SimpleNamespace(static_forward_context=layers),
    )


def test_built_target_layers_are_checked_again():
    """What a model sets in its code, not in its config: refused when the
    target's layers exist, before the drafter loads."""
    check = ddtree_config.verify_ddtree_target_layers
    full = {"model.layers.0.self_attn.attn": _attention_layer()}
    check(_built(full))
    # A window that never binds, a non-attention module, an encoder's window.
    check(
        _built(
            {
                **full,
                "model.layers.1.self_attn.attn": _attention_layer(sliding_window=512),
                "model.layers.2.linear_attn": torch.nn.Linear(2, 2),
                "vision.blocks.0.attn": _attention_layer(
                    sliding_window=64, kind="encoder"
                ),
            }
        )
    )
    with pytest.raises(ValueError) as info:
        check(_built({**full, "l.1.attn": _attention_layer(sliding_window=128)}))
    assert str(info.value) == (
        "DDTree cannot verify trees on SomeForCausalLM: its sliding-window "
        "attention (layer l.1.attn: sliding_window=128) is shorter than "
        "max_model_len=512, and the window is measured in KV slots, where tree "
        "nodes do not sit at their positions; pass --max-model-len 128 (or "
        "less), or use method='dflash'."
    )
    with pytest.raises(ValueError, match="its ALiBi position bias"):
        check(_built({"l.0.attn": _attention_layer(alibi=True)}))
    with pytest.raises(ValueError, match=r"chunked local attention \(layer l.0.attn\)"):
        check(_built({"l.0.attn": _attention_layer(chunk_lookback=1)}))
    with pytest.raises(ValueError, match=r"\(layer l.0.attn, chunk 8192\)"):
        check(_built({"l.0.attn": _attention_layer(chunk=8192)}))


def test_ddtree_speculator_checks_the_target_before_loading_the_drafter(
    monkeypatch,
):
    """The target's layers before the drafter loads; the tree attention (its
    sinks check and its log line) once every layer is built."""
    import vllm.v1.worker.gpu.spec_decode.ddtree.speculator as speculator_module
    from vllm.v1.worker.gpu.spec_decode.ddtree.speculator import DDTreeSpeculator
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    loaded = []
    monkeypatch.setattr(
        DFlashSpeculator,
        "load_model",
        lambda self, target: loaded.append(("drafter", target)),
    )
    monkeypatch.setattr(
        speculator_module,
        "verify_tree_attention_layers",
        lambda config: loaded.append(("tree attention", config)),
    )
    speculator = object.__new__(DDTreeSpeculator)
    speculator.vllm_config = _built({"l.0.attn": _attention_layer(sliding_window=64)})
    with pytest.raises(ValueError, match="sliding_window=64"):
        speculator.load_model("target")
    assert loaded == []
    speculator.vllm_config = _built({"l.0.attn": _attention_layer()})
    speculator.load_model("target")
    assert loaded == [
        ("drafter", "target"),
        ("tree attention", speculator.vllm_config),
    ]


# ------------------------------------------------------ tree-build backend
def test_triton_backend_without_triton_is_refused_at_startup(monkeypatch):
    import importlib.util

    check = ddtree_config._verify_tree_build_backend
    monkeypatch.delenv("VLLM_DDTREE_BACKEND", raising=False)
    check()
    monkeypatch.setenv("VLLM_DDTREE_BACKEND", "triton")
    check()  # Triton is installed here.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" else real_find_spec(name, *a),
    )
    with pytest.raises(ValueError) as info:
        check()
    assert str(info.value) == (
        "DDTree: VLLM_DDTREE_BACKEND='triton' but Triton is not importable "
        "here; unset it (the torch backend builds the same tree)."
    )
    monkeypatch.setenv("VLLM_DDTREE_BACKEND", "torch")
    check()


# ------------------------------------------------------- KV-cache dtypes
def _triton_kv_caches(name, dtype, blocks, block_size, heads, head_size):
    """Two TRITON_ATTN layers' KV caches of kv-cache dtype ``name`` (element
    type ``dtype``) as the release's runner makes them, logical order
    (blocks, heads, block_size, row): ``[(layout, [kv0, kv1])]``.

    vLLM 0.26: one contiguous tensor per layer, of the backend's
    `get_kv_cache_shape`. vLLM 0.33+: per-layer views over one int8
    allocation (`create_kv_cache_views`), in every `KVCacheLayout` (the
    backend takes any), pages sized by its `customize_spec`."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    if hasattr(TritonAttentionBackend, "get_kv_cache_shape"):
        shape = TritonAttentionBackend.get_kv_cache_shape(
            blocks, block_size, heads, head_size, name
        )
        return [("contiguous", [torch.empty(shape, dtype=dtype) for _ in range(2)])]
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
        get_kv_quant_mode,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = TritonAttentionBackend.customize_spec(
        FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=heads,
            head_size=head_size,
            dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(name),
        )
    )
    out = []
    for layout in KVCacheLayout:
        layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks, 2, layout)
        size = 2 * blocks * spec.page_size_bytes
        tensor = KVCacheTensor(
            size=size,
            layers=["l0", "l1"],
            layer_stride=layer_stride,
            block_stride=block_stride,
        )
        raw = torch.zeros(size, dtype=torch.int8)
        out.append(
            (layout.name, create_kv_cache_views(raw, spec, blocks, layout, tensor))
        )
    return out


def test_accepted_kv_cache_dtypes_are_triton_attn_dtypes_the_compactor_moves():
    """Every accepted dtype is one TRITON_ATTN takes, and the compaction
    copies its whole (block, head, slot) row: for the per-token-head dtypes
    the row holds the inline float32 scales after the quantised data. Two
    layers in one launch, in each layout the release's runner may give them."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.worker.gpu.spec_decode.ddtree.kernels import KVCompactor

    supported = TritonAttentionBackend.supported_kv_cache_dtypes
    accepted = ddtree_config.DDTREE_KV_CACHE_DTYPES
    assert set(accepted) <= set(supported)
    assert set(supported) - set(accepted) == {"int4_per_token_head"}
    blocks, block_size, heads, head_size = 4, 16, 2, 32
    slots = torch.arange(2 * block_size)
    # One request, root at slot 3, accepted nodes at verify rows 2 and 5.
    src = torch.tensor([[3, 5, 8]])
    dst = torch.tensor([[3, 4, 5]])
    for name in accepted:
        dtype = torch.float32 if name == "auto" else STR_DTYPE_TO_TORCH_DTYPE[name]
        layouts = _triton_kv_caches(name, dtype, blocks, block_size, heads, head_size)
        for layout, kvs in layouts:
            shape = kvs[0].shape
            assert shape[:3] == (blocks, heads, block_size), (name, layout)
            if name.endswith("_per_token_head"):
                assert shape[-1] > 2 * head_size  # inline scales
            expected = []
            for i, kv in enumerate(kvs):
                values = (torch.arange(kv.numel()) + 31 * i) % 97
                kv.copy_(values.to(dtype).view(shape))
                want = kv.clone()
                want[0, :, 4] = kv[0, :, 5]
                want[0, :, 5] = kv[0, :, 8]
                expected.append(want)
            KVCompactor(kvs)(slots, src, dst, torch.tensor([3], dtype=torch.int32))
            for kv, want in zip(kvs, expected):
                assert torch.equal(kv, want), (name, layout)


def test_int4_kernel_takes_no_per_request_bias():
    """Why int4_per_token_head is refused: the packed INT4 path of
    `unified_attention` asserts on a per-sequence (or packed) qq_bias."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    q = torch.zeros(4, 2, 32)
    with pytest.raises(AssertionError, match="only a shared float"):
        unified_attention(
            q=q,
            k=None,
            v=None,
            out=torch.zeros_like(q),
            cu_seqlens_q=None,
            max_seqlen_q=4,
            seqused_k=None,
            max_seqlen_k=4,
            softmax_scale=1.0,
            causal=True,
            window_size=(-1, -1),
            block_table=None,
            softcap=0,
            q_descale=None,
            k_descale=None,
            v_descale=None,
            qq_bias=torch.zeros(1, 4, 4),
            kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD,
        )


# ------------------------------------------------------- streaming input
def test_streaming_input_requests_are_refused_under_ddtree():
    """A resumable (streaming-input) request under DDTree: refused in
    InputProcessor.process_inputs before anything else; ordinary requests
    and other methods go on to the usual validation."""
    from vllm.v1.engine.input_processor import InputProcessor

    class Validated(Exception):
        pass

    def processor(method):
        spec = SimpleNamespace(
            use_ddtree=lambda: method == "ddtree", num_speculative_tokens=8
        )
        if ddtree_speculator_config is not None:
            # vLLM 0.34.0: the input processor asks the speculator config.
            from vllm.v1.worker.gpu.spec_decode.dflash.config import (
                DFlashSpeculatorConfig,
            )

            spec.speculator_config = (
                ddtree_speculator_config.DDTreeSpeculatorConfig
                if method == "ddtree"
                else DFlashSpeculatorConfig
            )(spec)
        stub = SimpleNamespace(speculative_config=spec)

        def validate(params, supported_tasks):
            raise Validated

        stub._validate_params = validate
        return stub

    def run(stub, resumable):
        return InputProcessor.process_inputs(
            stub, "r", {"prompt_token_ids": [1]}, None, (), resumable=resumable
        )

    # A ValueError on the 0.26.0 line, vLLM's VLLMValidationError (an HTTP
    # 400) where the input processor asks the speculator config (0.34.0).
    import vllm.exceptions

    upstream_error = getattr(vllm.exceptions, "VLLMValidationError", ValueError)
    with pytest.raises((ValueError, upstream_error)) as info:
        run(processor("ddtree"), resumable=True)
    assert str(info.value) == (
        "DDTree does not support streaming input (resumable requests): a "
        "session's next input can be scheduled with the previous turn's draft "
        "tokens, which the tree verification cannot take; use method='dflash' "
        "or no speculative decoding for streaming sessions."
    )
    with pytest.raises(Validated):
        run(processor("ddtree"), resumable=False)
    with pytest.raises(Validated):
        run(processor("dflash"), resumable=True)
    stub = processor("ddtree")
    stub.speculative_config = None
    with pytest.raises(Validated):
        run(stub, resumable=True)


# ------------------------------------------------------ docs/configuration.md
def _message(check, *args) -> str:
    with pytest.raises(ValueError) as info:
        check(*args)
    return str(info.value)


def test_docs_list_every_refusal_with_its_message(monkeypatch):
    """The startup-error examples of docs/configuration.md are the code's
    messages."""
    from pathlib import Path

    docs = (
        Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    ).read_text()
    c = ddtree_config

    def cfg(**kw):
        return SimpleNamespace(**kw)

    monkeypatch.setenv("VLLM_DDTREE_BACKEND", "cuda")
    bad_backend = _message(c._verify_tree_build_backend)
    monkeypatch.setenv("VLLM_DDTREE_BACKEND", "triton")
    monkeypatch.setattr(c.importlib.util, "find_spec", lambda name: None)
    no_triton = _message(c._verify_tree_build_backend)
    startup = [
        c.sliding_window_error(
            "MistralForCausalLM", "sliding_window=4096", 4096, 32768
        ),
        c.chunked_attention_error(
            "Llama4ForConditionalGeneration", "attention_chunk_size=8192"
        ),
        c.alibi_error("BloomForCausalLM"),
        _message(c._verify_pipeline_parallel_size, 2),
        _message(
            c._verify_kv_cache_dtype,
            cfg(cache_config=cfg(cache_dtype="int4_per_token_head")),
        ),
        _message(c._verify_kv_cache_dtype, cfg(cache_config=cfg(cache_dtype="nvfp4"))),
        _message(
            c._verify_kv_transfer,
            cfg(kv_transfer_config=cfg(kv_connector="NixlConnector")),
        ),
        _message(
            c._verify_kv_transfer,
            cfg(
                kv_transfer_config=None,
                cache_config=cfg(
                    kv_offloading_size=8.0, kv_offloading_backend="native"
                ),
            ),
        ),
        bad_backend,
        no_triton,
    ]
    startup += tree_attention_refusals(monkeypatch)
    for message in startup:
        assert f"    vllm serve: error: {message}\n" in docs, message
    streaming = _message(c.verify_ddtree_streaming_input)
    assert f"    {streaming}\n" in docs


def tree_attention_refusals(monkeypatch) -> list[str]:
    """The documented VLLM_DDTREE_TREE_ATTENTION lines, from the code: a bad
    value, a float32 model, an FP8 KV cache, an A100 (no FA3)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.spec_decode.ddtree import tree_attention as ta

    def cfg(dtype=torch.bfloat16, cache_dtype="auto"):
        return SimpleNamespace(
            model_config=SimpleNamespace(dtype=dtype, get_head_size=lambda: 128),
            cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        )

    monkeypatch.setenv(ta.TREE_ATTENTION_ENV, "flash")
    messages = [_message(ta.verify_tree_attention, cfg())]
    monkeypatch.setenv(ta.TREE_ATTENTION_ENV, "split")
    messages.append(_message(ta.verify_tree_attention, cfg(dtype=torch.float32)))
    messages.append(_message(ta.verify_tree_attention, cfg(cache_dtype="fp8")))
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(
        current_platform, "is_device_capability_family", lambda family: False
    )
    monkeypatch.setattr(
        current_platform, "get_device_capability", lambda: DeviceCapability(8, 0)
    )
    messages.append(_message(ta.verify_tree_attention, cfg()))
    return messages
