# SPDX-License-Identifier: Apache-2.0
"""DDTree for hybrid / M-RoPE targets, CPU side: startup checks (refusals,
the startup warning, real ModelConfig / SpeculativeConfig of a hand-written
tiny Qwen3-Next), the mamba state sizing under DDTree, the M-RoPE position
rewrite, and the verifier driving the GDN path through a whole step (prepare_verify ->
GDN forward -> walk -> compact)."""

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from dispatch_counts import count_dispatch  # noqa: E402
from test_ddtree_step_ops import VIEW_OPS  # noqa: E402
from verifier_fakes import (  # noqa: E402
    DEPTH,
    DRAFTER,
    PARENT,
    TARGET,
    TOKENS,
    ArgmaxSampler,
    B,
    D,
    logits_for,
    make_spec,
    make_verifier,
    on_device,
    prefill_and_tree_batch,
    store_trees,
)

from vllm.v1.spec_decode.ddtree.config import (  # noqa: E402
    is_ddtree,
    mamba_num_spec_tokens,
    verify_ddtree_vllm_config,
)

try:  # vLLM's speculative-method interface (0.34.0): DDTree is a plugin
    from vllm.v1.spec_decode.ddtree import plugin
    from vllm.v1.worker.gpu.spec_decode import speculator_config  # noqa: F401
except ImportError:  # the 0.26.0 line: its patched SpeculativeConfig
    plugin = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 384,
    "intermediate_size": 1152,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "vocab_size": 8192,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention"] * 3
    + ["full_attention"]
    + ["linear_attention"] * 3
    + ["full_attention"],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


# ------------------------------------------------------------------ config
def fake_config(
    hybrid=True,
    mrope=False,
    architecture="Qwen3_5ForConditionalGeneration",
    mamba_cache_mode="none",
    prefix_caching=False,
    pp=1,
):
    return SimpleNamespace(
        use_v2_model_runner=True,
        attention_config=SimpleNamespace(backend=None),
        model_config=SimpleNamespace(
            is_hybrid=hybrid, uses_mrope=mrope, architecture=architecture
        ),
        cache_config=SimpleNamespace(
            mamba_cache_mode=mamba_cache_mode, enable_prefix_caching=prefix_caching
        ),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
    )


def test_hybrid_and_mrope_targets_start_with_a_warning(monkeypatch):
    # No opt-in: a Gated DeltaNet hybrid or an M-RoPE target starts, and says
    # once (a warning) how far the path has been checked. (vLLM's loggers do
    # not propagate to pytest's caplog: record the module logger's calls.)
    from vllm.v1.spec_decode.ddtree import config as ddtree_config

    said = []
    monkeypatch.setattr(
        ddtree_config.logger, "warning", lambda msg, *args: said.append(msg % args)
    )
    verify_ddtree_vllm_config(fake_config())
    verify_ddtree_vllm_config(fake_config(hybrid=False, mrope=True, architecture="X"))
    assert len(said) == 2
    assert said[0].startswith(
        "DDTree: hybrid Gated DeltaNet path for Qwen3_5ForConditionalGeneration"
    )
    assert said[1].startswith("DDTree: M-RoPE path for X")
    assert all("not with real weights" in line for line in said)
    # Dense 1-D RoPE targets: no warning.
    verify_ddtree_vllm_config(fake_config(hybrid=False))
    assert len(said) == 2


def test_gated_deltanet_hybrids_only():
    for arch in (
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3NextForCausalLM",
    ):
        verify_ddtree_vllm_config(fake_config(architecture=arch, mrope=True))
    verify_ddtree_vllm_config(fake_config(hybrid=False, mrope=True, architecture="X"))
    with pytest.raises(ValueError, match="must be Gated DeltaNet"):
        verify_ddtree_vllm_config(fake_config(architecture="NemotronHForCausalLM"))
    with pytest.raises(ValueError, match="no-enable-prefix-caching"):
        verify_ddtree_vllm_config(
            fake_config(mamba_cache_mode="align", prefix_caching=True)
        )
    with pytest.raises(ValueError, match="pipeline parallelism"):
        verify_ddtree_vllm_config(fake_config(pp=2))
    # Several problems: one line, all of them.
    with pytest.raises(ValueError) as info:
        verify_ddtree_vllm_config(
            fake_config(architecture="JambaForCausalLM", prefix_caching=True)
        )
    message = str(info.value)
    assert "\n" not in message
    assert "Gated DeltaNet" in message and "prefix caching" in message


@pytest.fixture(scope="module")
def hybrid_model_config(tmp_path_factory):
    from vllm.config import ModelConfig

    path = tmp_path_factory.mktemp("tiny_qwen3_next")
    with open(path / "config.json", "w") as f:
        json.dump(TINY_QWEN3_NEXT, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TARGET, name), path / name)
    return ModelConfig(model=str(path), dtype="float32", max_model_len=2048)


def _spec(model_config, **kw):
    if plugin is not None and kw.get("method") == "ddtree":
        # DDTree's options are speculator_options on vLLM's interface.
        plugin.register()
        options = ("tree_budget", "budget_policy", "verify_tokens_per_step")
        kw["speculator_options"] = {k: kw.pop(k) for k in options if k in kw}
    return make_spec(model_config, model=DRAFTER, **kw)


def test_real_hybrid_config_is_accepted(hybrid_model_config):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert hybrid_model_config.is_hybrid
    spec = _spec(hybrid_model_config, method="ddtree", tree_budget=16)
    assert is_ddtree(spec)
    cfg = SimpleNamespace(
        use_v2_model_runner=True,
        attention_config=SimpleNamespace(backend=None),
        model_config=hybrid_model_config,
        cache_config=SimpleNamespace(
            mamba_cache_mode="none", enable_prefix_caching=False
        ),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        speculative_config=spec,
    )
    verify_ddtree_vllm_config(cfg)
    assert cfg.attention_config.backend == AttentionBackendEnum.TRITON_ATTN


def test_mamba_state_is_sized_for_one_committed_state_under_ddtree(
    hybrid_model_config,
):
    from vllm.config import CacheConfig, ParallelConfig
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    ddtree = _spec(hybrid_model_config, method="ddtree", tree_budget=16)
    chain = _spec(hybrid_model_config, method="dflash", num_speculative_tokens=15)
    assert mamba_num_spec_tokens(ddtree) == 0
    assert mamba_num_spec_tokens(chain) == 15
    assert mamba_num_spec_tokens(None) == 0

    def vllm_config(spec):
        return SimpleNamespace(
            model_config=hybrid_model_config,
            parallel_config=ParallelConfig(),
            speculative_config=spec,
            cache_config=CacheConfig(mamba_block_size=2048, mamba_cache_mode="none"),
        )

    def conv_columns(spec):
        conv_shape, _ = Qwen3NextForCausalLM.get_mamba_state_shape_from_config(
            vllm_config(spec)
        )
        return conv_shape[1] if is_conv_state_dim_first() else conv_shape[0]

    assert conv_columns(ddtree) == 3  # linear_conv_kernel_dim - 1
    assert conv_columns(chain) == 3 + 15

    # A MambaBase: upstream's defaults for what the test does not set (vLLM
    # 0.33's MambaSpec takes the layer's is_kv_cache_tp_replicated).
    class FakeMamba(MambaBase):
        mamba_type = MambaAttentionBackendEnum.GDN_ATTN

        def get_state_shape(self):
            return ((3, 8), (4, 32, 32))

        def get_state_dtype(self):
            return (torch.float32, torch.float32)

    def spec_blocks(spec):
        kv_spec = FakeMamba().get_kv_cache_spec(vllm_config(spec))
        return kv_spec.num_speculative_blocks

    assert spec_blocks(ddtree) == 0
    assert spec_blocks(chain) == 15


# ----------------------------------------------------------------- verifier
def _verifier(max_reqs=4, max_tokens=64):
    return make_verifier(DEVICE, max_reqs, max_tokens)


def _store_trees(verifier, req_states, trees):
    return store_trees(verifier, req_states, trees, DEVICE)


def test_mrope_positions_get_the_tree_shift_in_every_section():
    verifier = _verifier()
    _store_trees(verifier, [2], [(PARENT, DEPTH, TOKENS)])
    batch = prefill_and_tree_batch(DEVICE)
    verifier.prepare_verify(batch)
    # M-RoPE positions as the model state writes them after prepare_verify:
    # [3, padded tokens], text tokens = position + per-request delta; the
    # prefill row's sections differ (an image), padding rows are zero.
    mrope = torch.zeros(3, 11, dtype=torch.int64, device=DEVICE)
    mrope[:, :3] = torch.tensor([[0, 1, 2], [0, 5, 5], [0, 6, 7]], device=DEVICE)
    mrope[:, 3:8] = torch.arange(20, 25, device=DEVICE) + 100
    before = mrope.clone()
    view = mrope[:, :10]
    with count_dispatch() as shifted:
        verifier.prepare_model_positions(view)
    # One launch for every section and row, no torch operator.
    assert dict(shifted.launches) == {"_ddtree_shift_model_positions_kernel": 1}
    assert [op for op in shifted.ops if op not in VIEW_OPS] == [], shifted.ops
    # Tree rows: root + depth (+ delta), in all three sections.
    expected_tree = torch.tensor([20, 21, 21, 22, 22]) + 100
    for section in range(3):
        assert mrope[section, 3:8].tolist() == expected_tree.tolist()
    assert torch.equal(mrope[:, :3], before[:, :3])
    assert torch.equal(mrope[:, 8:], before[:, 8:])
    # 1-D positions were shifted by prepare_verify; 1-D input is a no-op.
    assert batch.positions[3:8].tolist() == [20, 21, 21, 22, 22]
    verifier.prepare_model_positions(batch.positions)
    assert batch.positions[3:8].tolist() == [20, 21, 21, 22, 22]
    # compact puts both back, one launch each.
    with count_dispatch() as restored:
        verifier.compact(batch, None, None)
    assert torch.equal(mrope, before)
    assert dict(restored.launches) == {
        "_ddtree_tree_positions_kernel": 1,
        "_ddtree_shift_model_positions_kernel": 1,
    }
    assert [op for op in restored.ops if op not in VIEW_OPS] == [], restored.ops
    assert batch.positions.tolist() == [0, 1, 2, 20, 21, 22, 23, 24, 0, 0]


def test_mrope_rewrite_is_a_no_op_without_trees():
    verifier = _verifier()
    batch = prefill_and_tree_batch(DEVICE)
    batch.num_draft_tokens = 0
    verifier.prepare_verify(batch)
    mrope = torch.arange(30, dtype=torch.int64, device=DEVICE).view(3, 10)
    before = mrope.clone()
    verifier.prepare_model_positions(mrope)
    verifier.compact(batch, None, None)
    assert torch.equal(mrope, before)


_ArgmaxSampler = ArgmaxSampler


def _logits_for(targets, vocab=32):
    return logits_for(targets, vocab, DEVICE)


def test_one_verifier_step_advances_the_gdn_states_along_the_walk(monkeypatch):
    """Two tree rows (request states 2 and 0, batch order 0 <- state 2):
    prepare_verify -> the layer's DDTree branch -> sample (walk) -> compact.
    The GDN states must equal upstream's decode replay of each walk path."""
    from test_ddtree_gdn_hybrid import (
        CONV_DIM,
        HV,
        assert_slot_is_replay,
        gdn_context,
        make_layer,
        run_core,
        spec_md,
    )

    verifier = _verifier()
    # State 2: the tree above; state 0: a spine root -> 1 -> 2 -> 3, 1 -> 4.
    spine = ([0, 1, 2, 1], [1, 2, 3, 2], [21, 22, 23, 24])
    draft_tokens = _store_trees(verifier, [2, 0], [(PARENT, DEPTH, TOKENS), spine])
    ctx = gdn_context(verifier.req_parent_idx, D, 4)
    layer = make_layer(11)
    ctx.bind_layers({layer.prefix: layer})
    verifier.gdn = ctx
    committed = [t.clone() for t in layer.kv_cache]

    positions = torch.tensor([30, 31, 32, 33, 34, 8, 9, 10, 11, 12, 0, 0])
    batch = on_device(
        SimpleNamespace(
            num_reqs=2,
            num_tokens=10,
            num_tokens_after_padding=12,
            num_draft_tokens=2 * B,
            positions=positions,
            input_ids=torch.arange(12, dtype=torch.int64),
            logits_indices=torch.arange(10),
            expanded_idx_mapping=torch.tensor([2] * 5 + [0] * 5, dtype=torch.int32),
            expanded_local_pos=torch.tensor(list(range(5)) * 2, dtype=torch.int32),
            idx_mapping=torch.tensor([2, 0], dtype=torch.int32),
            idx_mapping_np=np.array([2, 0], dtype=np.int32),
            cu_num_logits=torch.tensor([0, 5, 10], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 5, 10], dtype=torch.int32),
            seq_lens=torch.tensor([35, 13], dtype=torch.int32),
            num_draft_tokens_per_req=np.array([B, B], dtype=np.int32),
            num_scheduled_tokens=np.array([1 + B, 1 + B], dtype=np.int32),
        ),
        DEVICE,
    )
    # vLLM 0.33+: the sampler's per-request sequence-length bound, a host
    # tensor.
    batch.seq_lens_cpu_upper_bound = torch.tensor([35, 13], dtype=torch.int32)
    verifier.prepare_verify(batch)
    assert ctx.num_spec == 2
    assert ctx.tree_rows[:2].tolist() == [2, 0]

    gen = torch.Generator().manual_seed(3)
    mixed_qkv = torch.randn(12, CONV_DIM, generator=gen).to(DEVICE)
    a = torch.randn(12, HV, generator=gen).to(DEVICE)
    b = torch.randn(12, HV, generator=gen).to(DEVICE)
    slots = [5, 3]
    md = spec_md([0, 5, 10], slots, 2, 12)
    verifier.attach_bias(
        {layer.prefix: md, "attn": SimpleNamespace(tree_attn_bias=None)}
    )
    run_core(monkeypatch, layer, md, mixed_qkv, b, a, 12)

    # Walk: state 2 accepts root -> 1 -> 4 (node 1 says 14, not 13);
    # state 0 accepts root -> 1 -> 2 -> 3 (the spine).
    logits = _logits_for([11, 14, 30, 30, 9, 21, 22, 23, 5, 30])
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32, device=DEVICE)
    out = verifier.sample(_ArgmaxSampler(), logits, batch, draft_tokens, prefill_len)
    assert out.num_sampled.tolist() == [3, 4]
    verifier.compact(batch, None, None)

    for slot, rows in ((5, [0, 1, 4]), (3, [5, 6, 7, 8])):
        assert_slot_is_replay(
            monkeypatch, layer, committed, slot, mixed_qkv[rows], b[rows], a[rows]
        )


def test_verifier_sizes_the_gdn_buffers_from_the_hybrid_config(
    hybrid_model_config, monkeypatch
):
    import vllm.v1.worker.gpu.spec_decode.ddtree.verifier as verifier_module
    from vllm.config import ParallelConfig
    from vllm.v1.worker.gpu.spec_decode.ddtree.verifier import DDTreeVerifier

    lines = []
    monkeypatch.setattr(
        verifier_module,
        "logger",
        SimpleNamespace(info_once=lambda msg, *args: lines.append(msg % args)),
    )

    spec = _spec(hybrid_model_config, method="ddtree", tree_budget=16)
    cfg = SimpleNamespace(
        model_config=hybrid_model_config,
        parallel_config=ParallelConfig(),
        speculative_config=spec,
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=256),
        max_concurrent_batches=2,
    )
    verifier = DDTreeVerifier(cfg, torch.device(DEVICE))
    gdn = verifier.gdn
    assert gdn is not None
    # 6 linear-attention layers; conv dim 2 * 2 * 32 + 4 * 32; 4 value
    # heads; rows: min(256 batched tokens, 4 requests x (1 + 16)).
    assert gdn.x_buf.shape == (6, 68, 256)
    assert gdn.a_buf.shape == gdn.b_buf.shape == (6, 68, 4)
    assert gdn.x_buf.dtype == torch.float32
    assert gdn.parent_idx is verifier.req_parent_idx
    # The startup line counts the GDN buffers: all of the GDN object's
    # tensors (each storage once: the spec-row tables are views of one
    # buffer) but the verifier's parent table.
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in vars(gdn).values()
        if isinstance(t, torch.Tensor) and t is not gdn.parent_idx
    }
    gdn_bytes = sum(storages.values())
    # x, a, b: 6 layers x 68 rows; tree_rows, spec_batch_rows and
    # spec_query_start (int32) per request, one more query start.
    assert gdn_bytes == (6 * 68 * (256 + 2 * 4) + 3 * 4 + 1) * 4
    assert verifier.memory_bytes["gdn"] == gdn_bytes
    sizes = verifier.memory_bytes
    assert len(lines) == 1
    assert lines[0].startswith(
        "DDTree: extra GPU memory for max_num_seqs=4, tree_budget=16: "
        f"{sum(sizes.values()) / 2**20:.1f} MiB = tree attention bias "
    )
    assert lines[0].endswith(
        f" + Gated DeltaNet verify buffers {gdn_bytes / 2**20:.1f} MiB (6 layers "
        "x 68 rows x (conv dim 256 + 2 x 4 value heads) float32; rows = "
        "min(max_num_batched_tokens, max_num_seqs + the sum over b = 1 .. "
        "max_num_seqs of the largest tree budget of a batch of b or more "
        "requests: by the budget schedule, tree_budget without a fixed one))."
    )
    cfg.scheduler_config.max_num_batched_tokens = 32
    assert DDTreeVerifier(cfg, torch.device(DEVICE)).gdn.x_buf.shape[1] == 32


# The "batch" policy's schedule for tree_budget 64, the drafter's 15
# positions and 128 verified tokens a step (the default).
BATCH_POLICY_SCHEDULE = [(1, 1, 64), (2, 3, 32), (4, 1024, 15)]


def _verifier_for(hybrid_model_config, monkeypatch, max_num_seqs, **spec_kw):
    import vllm.v1.worker.gpu.spec_decode.ddtree.verifier as verifier_module
    from vllm.config import ParallelConfig
    from vllm.v1.worker.gpu.spec_decode.ddtree.verifier import DDTreeVerifier

    lines = []
    monkeypatch.setattr(
        verifier_module,
        "logger",
        SimpleNamespace(info_once=lambda msg, *args: lines.append(msg % args)),
    )
    spec = _spec(hybrid_model_config, method="ddtree", tree_budget=64, **spec_kw)
    cfg = SimpleNamespace(
        model_config=hybrid_model_config,
        parallel_config=ParallelConfig(),
        speculative_config=spec,
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=8192
        ),
        max_concurrent_batches=2,
    )
    return DDTreeVerifier(cfg, torch.device(DEVICE)), spec, lines


def _decode_step(drafts):
    """Every request decodes and verifies ``drafts[r]`` tree nodes."""
    drafts = np.array(drafts, dtype=np.int32)
    num_reqs = len(drafts)
    batch = SimpleNamespace(
        num_reqs=num_reqs,
        num_draft_tokens_per_req=drafts,
        num_scheduled_tokens=drafts + 1,
        idx_mapping_np=np.arange(num_reqs, dtype=np.int32),
    )
    if plugin is not None:
        # vLLM 0.34's batch: the hybrid model state's decode-row rule.
        batch.is_prefilling_np = np.zeros(num_reqs, dtype=bool)
        batch.prefill_runs_as_decode_np = None
    return batch


def test_gdn_buffers_follow_the_batch_policys_schedule(
    hybrid_model_config, monkeypatch
):
    """Under the "batch" policy (the 0.34.0 line's default) a step verifies
    what the schedule gives its requests: 64 requests hold at most
    64 + 2 x 32 + 61 x 15 draft rows (`policy.max_spec_rows_per_step`), not
    64 x 64. The scheduler's own lookup turns the schedule into budgets."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    kw = {} if plugin is not None else {"budget_policy": "batch"}
    verifier, spec, lines = _verifier_for(hybrid_model_config, monkeypatch, 64, **kw)
    assert spec.num_speculative_tokens_per_batch_size == BATCH_POLICY_SCHEDULE
    gdn = verifier.gdn
    assert gdn.max_rows == 64 + 64 + 2 * 32 + 61 * 15 == 1107
    assert gdn.x_buf.shape[1] == gdn.a_buf.shape[1] == gdn.b_buf.shape[1] == 1107
    assert " x 1107 rows x " in lines[0]

    lookup = build_dynamic_sd_schedule_lookup(
        spec.num_speculative_tokens_per_batch_size,
        vllm_max_batch_size=64,
        vllm_num_speculative_tokens=spec.num_speculative_tokens,
    )
    # A step of the schedule's largest batch: 64 trees of 15 nodes.
    gdn.prepare_step(_decode_step([lookup[64]] * 64))
    assert gdn.num_spec == 64 and gdn.num_spec_tokens == 64 * 16
    # The most a step can carry: request j drafted at a batch of j or more
    # (those before it scheduled with it, those after it passed over since).
    worst = [max(lookup[j:]) for j in range(1, 65)]
    gdn.prepare_step(_decode_step(worst))
    assert gdn.num_spec_tokens == gdn.max_rows
    worst[-1] += 1
    with pytest.raises(ValueError, match="exceed the GDN verify buffers"):
        gdn.prepare_step(_decode_step(worst))


@pytest.mark.parametrize("policy", ["fixed", "measured"])
def test_gdn_buffers_hold_a_whole_tree_per_request_without_a_fixed_schedule(
    hybrid_model_config, monkeypatch, policy
):
    """No schedule ("fixed"), or one the policy re-plans at runtime
    ("measured", the 0.26.0 line only): every request may verify
    tree_budget nodes."""
    if policy == "measured" and plugin is not None:
        pytest.skip("the 0.34.0 line refuses the measured policy")
    verifier, _, _ = _verifier_for(
        hybrid_model_config, monkeypatch, 8, budget_policy=policy
    )
    assert verifier.gdn.max_rows == 8 * (1 + 64)
