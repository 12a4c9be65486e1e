# SPDX-License-Identifier: Apache-2.0
"""CPU tests of DDTree's vLLM wiring: configuration validation and the
per-step metadata (tree positions, tree attention bias, verification walk,
KV / hidden-state compaction) that DDTreeVerifier builds around the target
forward. They import the patched vLLM, so they run where it is installed."""

import copy
import inspect
import os
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from repo_paths import HELDOUT_PROMPTS  # noqa: E402
from verifier_fakes import (  # noqa: E402
    DEPTH,
    DRAFTER,
    PARENT,
    TARGET,
    TOKENS,
    ArgmaxSampler,
    B,
    logits_for,
    make_spec,
    make_verifier,
    needs_patched_speculative_config,
    needs_runner_holding_the_verifier,
    prefill_and_tree_batch,
    prefill_and_tree_step_state,
    store_trees,
)

# ----------------------------------------------------------------- config
_spec = make_spec


@needs_patched_speculative_config
def test_ddtree_config_keeps_its_method_and_drafts_like_dflash(target_model_config):
    spec = _spec(target_model_config, method="ddtree", model=DRAFTER, tree_budget=32)
    assert spec.method == "ddtree"  # visible in the resolved config
    assert spec.use_ddtree() and spec.use_dflash() and spec.use_eagle()
    # The DFlash paths: parallel drafting, the drafter wrapped as DFlash,
    # aux hidden states from the target.
    assert spec.parallel_drafting
    assert all(a.startswith("DFlash") for a in spec.draft_model_config.architectures)
    assert spec.num_speculative_tokens == 32  # the scheduler verifies B tokens
    assert spec.draft_depth == 15  # drafter block_size 16 - 1
    # The same graph-shaping factors as DFlash with the same drafter.
    dflash = _spec(
        target_model_config, method="dflash", model=DRAFTER, num_speculative_tokens=15
    )
    assert spec.compute_hash() == dflash.compute_hash()
    spec2 = _spec(target_model_config, method="ddtree", model=DRAFTER, draft_depth=7)
    assert spec2.tree_budget == 64 and spec2.draft_depth == 7
    plain = _spec(
        target_model_config, method="dflash", model=DRAFTER, num_speculative_tokens=15
    )
    assert not plain.use_ddtree() and plain.tree_budget is None


@needs_patched_speculative_config
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tree_budget=0), "tree_budget must be a positive integer"),
        (dict(tree_budget=-3), "tree_budget must be a positive integer"),
        (dict(draft_depth=16), "exceeds the drafter's block_size - 1 = 15"),
        (dict(draft_depth=-1), "draft_depth must be a positive integer"),
        (dict(num_speculative_tokens=8), "do not set num_speculative_tokens"),
        (dict(draft_sample_method="probabilistic"), "draft_sample_method must be"),
    ],
)
def test_ddtree_config_rejects_bad_values(target_model_config, kwargs, message):
    with pytest.raises(Exception, match="DDTree") as info:
        _spec(target_model_config, method="ddtree", model=DRAFTER, **kwargs)
    assert message in str(info.value)


@needs_patched_speculative_config
def test_tree_budget_without_ddtree_method_is_refused(target_model_config):
    with pytest.raises(Exception, match="only valid with method='ddtree'"):
        _spec(
            target_model_config,
            method="dflash",
            model=DRAFTER,
            num_speculative_tokens=4,
            tree_budget=8,
        )


@needs_patched_speculative_config
def test_non_dflash_drafter_is_refused(target_model_config):
    from vllm.v1.spec_decode.ddtree.config import verify_ddtree_drafter

    spec = _spec(target_model_config, method="ddtree", model=DRAFTER)
    inner = spec.draft_model_config.hf_config.model
    saved = (inner.architectures, getattr(inner, "dflash_config", None))
    try:
        inner.architectures = ["Qwen3ForCausalLM"]
        inner.dflash_config = None
        with pytest.raises(ValueError, match="must be a DFlash drafter"):
            verify_ddtree_drafter(spec)
    finally:
        inner.architectures, inner.dflash_config = saved


@pytest.mark.parametrize(
    "architectures, message",
    [
        # As the checkpoint names it, and as EAGLEConfig renames it.
        (["DFlash2DraftModel"], "DFlash2DraftModel scores each position's"),
        (["DFlashDFlash2BeamDraftModel"], "candidate selector"),
        (["LiLiCorrDraftModel"], "LiLiCorrDraftModel scores each position's"),
        (["DFlashQwen3XPressModel"], "refines the drafted chain"),
    ],
)
def test_chain_only_dflash_drafters_are_refused(architectures, message):
    """DFlash2 / LiLiCorr (candidate selector) and XPress (chain refiner)
    drafters define no per-position distributions: one line at startup."""
    from vllm.v1.spec_decode.ddtree.config import verify_ddtree_drafter

    checkpoint = SimpleNamespace(
        architectures=["DFlashDraftModel"], dflash_config={"block_size": 16}
    )
    hf_config = SimpleNamespace(
        model=checkpoint, architectures=list(architectures), block_size=16
    )
    spec = SimpleNamespace(
        draft_model_config=SimpleNamespace(hf_config=hf_config),
        draft_depth=None,
    )
    with pytest.raises(ValueError, match="serve it with method 'dflash'") as info:
        verify_ddtree_drafter(spec)
    assert message in str(info.value) and "\n" not in str(info.value)
    # The same config with a plain DFlash drafter passes this check.
    hf_config.architectures = ["DFlashDFlashDraftModel"]
    spec.tree_budget, spec.budget_policy = 8, "fixed"
    spec.num_speculative_tokens_per_batch_size = None
    verify_ddtree_drafter(spec)
    assert spec.draft_depth == 15


def test_adaptive_verification_is_refused_under_ddtree():
    """Adaptive verification (vLLM 0.33) and DDTree's budget policy would both
    size the verified drafts: refused in one line (the field does not exist
    before vLLM 0.33, where getattr reads it as off)."""
    from vllm.v1.spec_decode.ddtree.config import resolve_ddtree_method

    def spec(**kwargs):
        return SimpleNamespace(
            method="ddtree",
            model="drafter",
            tree_budget=8,
            draft_depth=None,
            num_speculative_tokens=None,
            target_parallel_config=SimpleNamespace(pipeline_parallel_size=1),
            draft_sample_method="greedy",
            rejection_sample_method="standard",
            **kwargs,
        )

    with pytest.raises(ValueError, match="enable_adaptive_verification") as info:
        resolve_ddtree_method(spec(enable_adaptive_verification=True))
    assert "budget_policy decides" in str(info.value)
    for ok in (spec(enable_adaptive_verification=False), spec()):
        resolve_ddtree_method(ok)
        assert ok.num_speculative_tokens == 8


def test_ddtree_on_a_release_line_without_gpu_checks_is_refused(monkeypatch):
    """A build on a vLLM line whose DDTree has not passed its GPU checks
    refuses DDTree in one line unless the user opts in; this build's own
    line (0.26.0) runs."""
    import vllm.version
    from vllm.v1.spec_decode.ddtree import config

    monkeypatch.delenv(config.ALLOW_UNVERIFIED_LINE_ENV, raising=False)
    config.verify_release_line("0.26.0+ddtree.1")
    config.verify_release_line("0.26.1")
    for version in ("0.34.0+ddtree.1", "0.27.0", "dev"):
        with pytest.raises(ValueError, match="CPU checks only") as info:
            config.verify_release_line(version)
        message = str(info.value)
        assert "\n" not in message and version in message
        assert f"{config.ALLOW_UNVERIFIED_LINE_ENV}=1" in message
    monkeypatch.setenv(config.ALLOW_UNVERIFIED_LINE_ENV, "1")
    config.verify_release_line("0.34.0+ddtree.1")
    # resolve_ddtree_method checks the installed build's line.
    monkeypatch.delenv(config.ALLOW_UNVERIFIED_LINE_ENV)
    monkeypatch.setattr(vllm.version, "__version__", "0.34.0+ddtree.1")
    spec = SimpleNamespace(
        method="ddtree",
        model="drafter",
        tree_budget=8,
        draft_depth=None,
        num_speculative_tokens=None,
    )
    with pytest.raises(ValueError, match="0.34.0"):
        config.resolve_ddtree_method(spec)


def test_engine_level_checks_pick_triton_and_refuse_others():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.spec_decode.ddtree.config import verify_ddtree_vllm_config

    def fake(backend, v2=True, hybrid=False):
        return SimpleNamespace(
            use_v2_model_runner=v2,
            attention_config=SimpleNamespace(backend=backend),
            model_config=SimpleNamespace(
                is_hybrid=hybrid, uses_mrope=False, architecture="X"
            ),
        )

    cfg = fake(None)
    verify_ddtree_vllm_config(cfg)
    assert cfg.attention_config.backend == AttentionBackendEnum.TRITON_ATTN
    with pytest.raises(ValueError, match="TRITON_ATTN"):
        verify_ddtree_vllm_config(fake(AttentionBackendEnum.FLASH_ATTN))
    with pytest.raises(ValueError, match="V2 model runner"):
        verify_ddtree_vllm_config(fake(None, v2=False))
    # A hybrid whose linear-attention layers are not Gated DeltaNet (the
    # architecture "X"): refused (test_ddtree_hybrid_runner.py has the rest).
    with pytest.raises(ValueError, match="must be Gated DeltaNet"):
        verify_ddtree_vllm_config(fake(None, hybrid=True))


def test_the_drafters_derived_config_keeps_its_own_attention_backend():
    """Upstream derives the DFlash drafter's VllmConfig from the target's
    (`load_dflash_model`: ``use_non_causal`` and the drafter's backend), and
    the derived config's __post_init__ runs DDTree's checks again. The target
    gets TRITON_ATTN; the drafter keeps what it asked for (None: chosen
    automatically, FlashAttention on an H100/H200, as in the chain), and an
    explicit drafter backend is not refused."""
    import inspect
    from dataclasses import replace

    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.spec_decode.ddtree.config import verify_ddtree_vllm_config
    from vllm.v1.worker.gpu.spec_decode.dflash import utils as dflash_utils

    # The derivation this relies on (a rebase that drops it fails here).
    source = inspect.getsource(dflash_utils.load_dflash_model)
    assert "use_non_causal=" in source
    assert "backend=speculative_config.attention_backend" in source

    def config(attention_config):
        return SimpleNamespace(
            use_v2_model_runner=True,
            attention_config=attention_config,
            model_config=None,
            speculative_config=SimpleNamespace(max_num_new_slots_for_drafting=0),
            scheduler_config=SimpleNamespace(
                max_num_seqs=8,
                max_num_batched_tokens=8192,
                max_num_scheduled_tokens=None,
            ),
        )

    target = AttentionConfig()
    verify_ddtree_vllm_config(config(target))
    assert target.backend == AttentionBackendEnum.TRITON_ATTN
    drafter = replace(target, use_non_causal=True, backend=None)
    verify_ddtree_vllm_config(config(drafter))
    assert drafter.backend is None
    flash = replace(
        target, use_non_causal=True, backend=AttentionBackendEnum.FLASH_ATTN
    )
    verify_ddtree_vllm_config(config(flash))
    assert flash.backend == AttentionBackendEnum.FLASH_ATTN
    # The target itself is still refused another backend.
    with pytest.raises(ValueError, match="TRITON_ATTN"):
        verify_ddtree_vllm_config(
            config(AttentionConfig(backend=AttentionBackendEnum.FLASH_ATTN))
        )


def test_drafting_slots_that_leave_no_room_fail_in_one_line():
    """`vllm serve` on an H200 defaults to 1024 sequences and 8192 batched
    tokens: 1024 x 14 drafting slots leave nothing to schedule. DDTree says
    so in one line with the knobs, before upstream's multi-line error."""
    from vllm.v1.spec_decode.ddtree.config import verify_ddtree_vllm_config

    def fake(max_num_seqs, batched=8192, scheduled=None):
        return SimpleNamespace(
            use_v2_model_runner=True,
            attention_config=SimpleNamespace(backend=None),
            model_config=None,
            speculative_config=SimpleNamespace(max_num_new_slots_for_drafting=14),
            scheduler_config=SimpleNamespace(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=batched,
                max_num_scheduled_tokens=scheduled,
            ),
        )

    with pytest.raises(ValueError) as info:
        verify_ddtree_vllm_config(fake(1024))
    message = str(info.value)
    assert "\n" not in message and message.startswith("DDTree:")
    assert "--max-num-seqs (at most 585; e.g. 256)" in message
    assert "--max-num-batched-tokens" in message
    verify_ddtree_vllm_config(fake(585))  # 585 x 14 = 8190 < 8192
    with pytest.raises(ValueError):
        verify_ddtree_vllm_config(fake(586))
    verify_ddtree_vllm_config(fake(1024, batched=16384))
    # The example never exceeds what fits: 2048 tokens fit 146 requests.
    with pytest.raises(ValueError, match=r"\(at most 146; e\.g\. 146\)"):
        verify_ddtree_vllm_config(fake(256, batched=2048))
    # A user-set max_num_scheduled_tokens is upstream's to check.
    verify_ddtree_vllm_config(fake(1024, scheduled=4096))


# --------------------------------------------------- verifier metadata
_verifier = make_verifier


def _store_one_tree(verifier, req_state=2):
    return store_trees(verifier, [req_state], [(PARENT, DEPTH, TOKENS)])


def _masked_out(words, num_nodes):
    """[N, ceil(N / 32)] int32 mask words -> [N, N] bool, True where bit
    j % 32 of word j // 32 is set (node i may not see node j)."""
    cols = torch.arange(num_nodes)
    w = words.cpu().to(torch.int64) & 0xFFFFFFFF
    return ((w[:, cols // 32] >> (cols % 32)) & 1).bool()


def test_prepare_verify_writes_tree_positions_and_bias():
    verifier = _verifier()
    _store_one_tree(verifier)
    batch = prefill_and_tree_batch()
    # One int32 word of mask bits per node: 5 nodes.
    assert verifier.attn_bias.dtype == torch.int32
    assert verifier.attn_bias.shape == (4, B + 1, 1)
    verifier.attn_bias.fill_(7)  # stale values must not survive
    verifier.prepare_verify(batch)
    # Root at 20, nodes at 20 + depth; the prefill rows are untouched.
    assert batch.positions.tolist() == [0, 1, 2, 20, 21, 21, 22, 22, 0, 0]
    assert torch.all(verifier.attn_bias[0] == 0)  # prefill request: no tree
    visible = (~_masked_out(verifier.attn_bias[1], B + 1)).int().tolist()
    assert visible == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ]


_ArgmaxSampler = ArgmaxSampler
_logits_for = logits_for


def _compact_batch(verifier, batch):
    """Run compact() on prefill_and_tree_batch()'s 8 tokens with that step's
    hidden states and KV cache (prefill_and_tree_step_state()). Returns
    (hidden, slots, kv_cache) after the compaction."""
    hidden, kv_cache, slots = prefill_and_tree_step_state()
    verifier.bind_kv_caches({"layer": kv_cache}, set())
    verifier.compact(batch, {"layer": slots}, [hidden])
    return hidden, slots, kv_cache


def test_sample_walks_the_tree_and_compaction_moves_the_path():
    verifier = _verifier()
    draft_tokens = _store_one_tree(verifier)
    batch = prefill_and_tree_batch()
    verifier.prepare_verify(batch)
    # Target tokens per logit row: prefill row -> 5; tree: root says 11
    # (node 1 accepted), node 1 says 14 (node 4 accepted, not the spine's 13),
    # node 4 says 9 (bonus).
    logits = _logits_for([5, 11, 14, 30, 30, 9])
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32)
    out = verifier.sample(_ArgmaxSampler(), logits, batch, draft_tokens, prefill_len)
    assert out.num_sampled.tolist() == [1, 3]
    assert out.num_rejected.tolist() == [0, 2]
    assert out.sampled_token_ids[0, :1].tolist() == [5]
    assert out.sampled_token_ids[1, :3].tolist() == [11, 14, 9]

    hidden, slots, kv_cache = _compact_batch(verifier, batch)
    # Accepted path root(3) -> node1(4) -> node4(7): rows 3, 4, 5 hold 3, 4, 7.
    assert hidden[:, 0].tolist() == [0, 10, 20, 30, 40, 70, 60, 70, 80, 90]
    got = [
        float(kv_cache[int(slots[t]) // 16, 0, int(slots[t]) % 16, 0]) for t in range(8)
    ]
    assert got == [0, 1, 2, 3, 4, 7, 6, 7]
    # Sequential positions are back for the DFlash context.
    assert batch.positions.tolist() == [0, 1, 2, 20, 21, 22, 23, 24, 0, 0]


def _random_walk(gen, num_reqs, depth, budget):
    """Walk outputs as `ddtree_walk` writes them: per request an accepted
    path of verify indices 0 = a_0 < a_1 < ... (a_k >= k), flat rows
    ``row0 + a_k`` moved to ``row0 + k``, root self-copies past the path;
    one request accepts only its root."""
    rows0 = [r * (1 + budget) for r in range(num_reqs)]
    src = torch.zeros(num_reqs, depth + 1, dtype=torch.int64)
    dst = torch.zeros_like(src)
    num_accepted = torch.zeros(num_reqs, dtype=torch.int32)
    for r, row0 in enumerate(rows0):
        n = 1 if r == 1 else int(torch.randint(2, depth + 2, (1,), generator=gen))
        nodes = [0] + sorted(
            torch.randperm(budget, generator=gen)[: n - 1].add(1).tolist()
        )
        src[r] = row0
        dst[r] = row0
        src[r, :n] = torch.tensor(nodes) + row0
        dst[r, :n] = torch.arange(n) + row0
        num_accepted[r] = n
    return src, dst, num_accepted, num_reqs * (1 + budget)


def _torch_move(kv, slots, src, dst):
    """The per-layer torch compaction (gather, then scatter)."""
    s = slots[src.view(-1)].long()
    d = slots[dst.view(-1)].long()
    bs = kv.shape[2]
    kv[d // bs, :, d % bs] = kv[s // bs, :, s % bs]


def test_compaction_moves_each_kv_cache_group_with_its_slot_mapping():
    """A fake hybrid-like target: attention layers in two KV-cache groups
    with different slot mappings and layouts (one launch per group), a
    drafter layer and a KV-sharing layer (moved once, through its target),
    GDN state lists (left alone); aux hidden states of two dtypes. Every
    tensor must equal the per-layer torch compaction."""
    gen = torch.Generator().manual_seed(0)
    depth, budget, num_reqs = 4, 7, 3
    src, dst, num_accepted, T = _random_walk(gen, num_reqs, depth, budget)

    def kv(blocks, heads, row, dtype):
        # vLLM's NHD view: (blocks, heads, slots, row), slots outermost.
        x = torch.randn(blocks, 16, heads, row, generator=gen).to(dtype)
        return x.permute(0, 2, 1, 3)

    caches = {
        "l0.attn": kv(12, 2, 8, torch.bfloat16),
        "l2.attn": kv(12, 2, 8, torch.bfloat16),
        "l5.attn": kv(10, 1, 16, torch.float32),
        "l7.attn": kv(10, 1, 16, torch.float32),
        "draft.attn": kv(12, 2, 8, torch.bfloat16),
        "l1.gdn": [torch.zeros(3, 4), torch.zeros(3, 4)],
    }
    caches["l9.attn"] = caches["l2.attn"]  # KV sharing: in no group
    groups = [["l0.attn", "l2.attn", "draft.attn"], ["l1.gdn"], ["l5.attn", "l7.attn"]]
    # Each group's verify rows at its own slots (a permutation of blocks).
    slots0 = torch.randperm(12 * 16, generator=gen)[:T].to(torch.int32)
    slots1 = torch.randperm(10 * 16, generator=gen)[:T].to(torch.int64)
    by_layer = {n: slots0 for n in groups[0]} | {n: slots1 for n in groups[2]}
    hidden = [torch.randn(T, 40, generator=gen).to(torch.bfloat16) for _ in range(3)]
    hidden.append(torch.randn(T, 24, generator=gen))

    expected = {n: t.clone() for n, t in caches.items() if torch.is_tensor(t)}
    for name in ("l0.attn", "l2.attn"):
        _torch_move(expected[name], slots0, src, dst)
    for name in ("l5.attn", "l7.attn"):
        _torch_move(expected[name], slots1, src, dst)
    expected["l9.attn"] = expected["l2.attn"]
    expected_hidden = [h.clone() for h in hidden]
    for h in expected_hidden:
        h[dst.view(-1)] = h[src.view(-1)].clone()

    verifier = _verifier()
    verifier.bind_kv_caches(caches, {"draft.attn"}, groups)
    assert [n for n, _ in verifier.kv_compactors] == ["l0.attn", "l5.attn"]
    assert [c.num_layers for _, c in verifier.kv_compactors] == [2, 2]
    verifier._walk = (num_accepted, src, dst)
    verifier.compact(SimpleNamespace(), by_layer, hidden)

    for name, ref in expected.items():
        assert torch.equal(caches[name], ref), name
    for h, ref in zip(hidden, expected_hidden):
        assert torch.equal(h, ref)


def test_compaction_refuses_layouts_it_cannot_move_at_startup():
    verifier = _verifier()
    a = torch.zeros(4, 2, 16, 8)
    with pytest.raises(ValueError, match="group 0: target KV caches of one group"):
        verifier.bind_kv_caches(
            {"a": a, "b": torch.zeros(4, 1, 16, 8)}, set(), [["a", "b"]]
        )
    with pytest.raises(ValueError, match="is not \\(num_blocks"):
        verifier.bind_kv_caches({"a": torch.zeros(4, 2, 2, 16, 8)}, set(), [["a"]])
    with pytest.raises(ValueError, match="in no KV-cache group"):
        verifier.bind_kv_caches({"a": a, "b": a.clone()}, set(), [["a"]])
    # One line each (the startup error a user sees).
    try:
        verifier.bind_kv_caches(
            {"a": a, "b": torch.zeros(4, 1, 16, 8)}, set(), [["a", "b"]]
        )
    except ValueError as e:
        assert "\n" not in str(e)


@needs_runner_holding_the_verifier
def test_the_runner_binds_the_verifier_with_its_kv_cache_groups():
    """The runner hook passes the KV-cache groups (their slot mappings and
    GDN state slots are per group)."""
    import ast
    import inspect
    import textwrap

    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    source = textwrap.dedent(inspect.getsource(GPUModelRunner.initialize_kv_cache))
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.ddtree.bind"
    ]
    assert len(calls) == 1 and len(calls[0].args) == 4
    assert "self.kv_cache_config.kv_cache_groups" in ast.unparse(calls[0].args[3])


def test_partially_scheduled_tree_never_accepts_unscheduled_nodes():
    verifier = _verifier()
    draft_tokens = _store_one_tree(verifier)
    batch = prefill_and_tree_batch()
    # Only root + 2 nodes scheduled for request state 2 (query 3..5).
    batch.cu_num_logits = torch.tensor([0, 1, 4], dtype=torch.int32)
    batch.logits_indices = torch.tensor([2, 3, 4, 5])
    batch.expanded_idx_mapping = torch.tensor([0, 2, 2, 2], dtype=torch.int32)
    batch.expanded_local_pos = torch.tensor([0, 0, 1, 2], dtype=torch.int32)
    batch.num_draft_tokens = 2
    verifier.prepare_verify(batch)
    logits = _logits_for([5, 11, 14, 30])  # node 4 (unscheduled) would match
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32)
    out = verifier.sample(_ArgmaxSampler(), logits, batch, draft_tokens, prefill_len)
    assert out.num_sampled.tolist() == [1, 2]
    assert out.sampled_token_ids[1, :2].tolist() == [11, 14]


def test_a_smaller_next_budget_verifies_the_prefix_of_the_stored_tree():
    """The 0.33 runner, when the next step drafts fewer tokens than
    ``num_speculative_steps`` (a smaller budget for the batch size), sets the
    proposal's other columns to -1 before DDTree stores the trees. The
    scheduler then schedules that many nodes: the stored tree's first ``b``
    nodes (the optimal ``b``-node tree; parents precede children) are
    verified and walked, the -1 nodes never run, match or get emitted."""
    verifier = _verifier()
    b = 2
    spec_tokens = torch.tensor([TOKENS])
    spec_tokens[:, b:] = -1  # the runner's write, on the proposal
    spec = SimpleNamespace(
        tree_parent_idx=torch.tensor([PARENT]),
        tree_depth=torch.tensor([DEPTH]),
        tree_valid=torch.ones(1, B, dtype=torch.bool),
        draft_tokens=spec_tokens,
    )
    draft_tokens = torch.zeros(4, B, dtype=torch.int64)
    verifier.store_trees(torch.tensor([2], dtype=torch.int32), spec, draft_tokens)
    assert draft_tokens[2].tolist() == TOKENS[:b] + [-1] * (B - b)
    batch = prefill_and_tree_batch()
    # The scheduler's b placeholders: root + nodes 1, 2 of request state 2.
    batch.num_tokens = 6
    batch.cu_num_logits = torch.tensor([0, 1, 4], dtype=torch.int32)
    batch.logits_indices = torch.tensor([2, 3, 4, 5])
    batch.expanded_idx_mapping = torch.tensor([0, 2, 2, 2], dtype=torch.int32)
    batch.expanded_local_pos = torch.tensor([0, 0, 1, 2], dtype=torch.int32)
    batch.query_start_loc = torch.tensor([0, 3, 6], dtype=torch.int32)
    batch.seq_lens = torch.tensor([3, 23], dtype=torch.int32)
    batch.seq_lens_cpu_upper_bound = batch.seq_lens.clone()
    batch.num_draft_tokens = b
    verifier.prepare_verify(batch)
    # The root's row takes node 1 (11); node 1's row says 14, the token of
    # node 4, which was not scheduled (its stored token is -1): a bonus token.
    logits = _logits_for([5, 11, 14, 30])
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32)
    out = verifier.sample(_ArgmaxSampler(), logits, batch, draft_tokens, prefill_len)
    assert out.num_sampled.tolist() == [1, 2]
    assert out.sampled_token_ids[1, :2].tolist() == [11, 14]
    assert -1 not in out.sampled_token_ids[1, :2].tolist()


def test_resumed_request_never_reads_the_stale_tree_of_its_slot():
    """Preemption: a preempted request's tree stays in its request-state slot
    (nothing clears it); the request, or another one, that takes the slot
    again starts with a prefill (one logit row), so that tree must not shape
    its positions, its attention bias, its sampled tokens or the compaction.
    Request state 0 holds such a stale tree here, and the target's token at
    the prefill row is the stale tree's first node: read as a tree, it would
    be accepted."""
    verifier = _verifier()
    stale_tokens = store_trees(verifier, [0], [(PARENT, DEPTH, TOKENS)])
    draft_tokens = _store_one_tree(verifier) + stale_tokens
    batch = prefill_and_tree_batch()
    verifier.attn_bias.fill_(7)
    verifier.prepare_verify(batch)
    assert batch.positions[:3].tolist() == [0, 1, 2]
    assert torch.all(verifier.attn_bias[0] == 0)
    # The prefill row's target token equals the stale tree's first node.
    logits = _logits_for([TOKENS[0], 11, 14, 30, 30, 9])
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32)
    out = verifier.sample(_ArgmaxSampler(), logits, batch, draft_tokens, prefill_len)
    assert out.num_sampled.tolist() == [1, 3]
    assert out.num_rejected.tolist() == [0, 2]
    assert out.sampled_token_ids[0, :1].tolist() == [TOKENS[0]]
    hidden, slots, kv_cache = _compact_batch(verifier, batch)
    # The prefill rows (hidden states, KV, positions) are untouched.
    assert hidden[:3, 0].tolist() == [0, 10, 20]
    assert [float(kv_cache[0, 0, t, 0]) for t in range(3)] == [0, 1, 2]
    assert batch.positions[:3].tolist() == [0, 1, 2]


def test_resolving_an_already_resolved_config_is_a_no_op():
    from vllm.v1.spec_decode.ddtree.config import resolve_ddtree_method

    spec = SimpleNamespace(
        method="ddtree", tree_budget=16, num_speculative_tokens=16, model="x"
    )
    resolve_ddtree_method(spec)  # a copy of a resolved config: no error
    assert spec.method == "ddtree" and spec.num_speculative_tokens == 16


def test_attach_bias_points_triton_metadata_at_the_buffer():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    verifier = _verifier()
    md_a = object.__new__(TritonAttentionMetadata)
    md_b = object.__new__(TritonAttentionMetadata)
    verifier.attach_bias({"l0": md_a, "l1": md_a, "l2": md_b})
    assert md_a.tree_attn_bias is verifier.attn_bias
    assert md_b.tree_attn_bias is verifier.attn_bias

    class FlashMetadata:
        pass

    with pytest.raises(ValueError, match="TRITON_ATTN"):
        verifier.attach_bias({"l0": FlashMetadata()})


def test_a_step_without_drafts_marks_the_split_attention_no_tree():
    """prepare_verify marks the step's split tree attention metadata (kept by
    attach_bias, one per KV-cache group) when no request verifies a tree,
    and leaves it unmarked when one does."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata
    from vllm.v1.spec_decode.ddtree.tree_attention import (
        SplitTreeAttentionMetadata,
    )

    def attach(verifier):
        splits = []
        metadata = {}
        for name in ("l0", "l1"):
            md = object.__new__(TritonAttentionMetadata)
            md.tree_split = SplitTreeAttentionMetadata(
                prefix_lens=torch.zeros(4, dtype=torch.int32)
            )
            splits.append(md.tree_split)
            metadata[name] = md
        verifier.attach_bias(metadata)
        return splits

    verifier = _verifier()
    _store_one_tree(verifier)
    splits = attach(verifier)
    verifier.prepare_verify(prefill_and_tree_batch())
    assert not any(split.no_tree for split in splits)

    splits = attach(verifier)
    batch = prefill_and_tree_batch()
    batch.num_draft_tokens = 0
    verifier.prepare_verify(batch)
    assert all(split.no_tree for split in splits)


def test_bind_refuses_model_states_without_the_hook():
    verifier = _verifier()
    with pytest.raises(ValueError, match="dense decoder targets"):
        verifier.bind(object(), {"l0": torch.zeros(2, 1, 16, 4)}, set())
    state = SimpleNamespace(attn_metadata_hook=None)
    kv = {"t0": torch.zeros(2, 1, 16, 4), "d0": torch.zeros(2, 1, 16, 4)}
    verifier.bind(state, kv, {"d0"})
    assert state.attn_metadata_hook == verifier.attach_bias
    assert list(verifier.target_kv_caches) == ["t0"]


# ------------------------------------------------------ startup memory line
def persistent_buffers(*objects):
    """Every tensor held by ``objects`` (attributes, lists / tuples of
    tensors in attributes, and the tensors of attributes that are DDTree
    objects themselves, such as the walk's buffers), each counted once."""
    found = {}
    for obj in objects:
        for value in vars(obj).values():
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                if isinstance(item, torch.Tensor):
                    found[id(item)] = item
                elif type(item).__module__.startswith(
                    "vllm.v1.worker.gpu.spec_decode.ddtree"
                ):
                    for t in persistent_buffers(item):
                        found[id(t)] = t
    return list(found.values())


class _LogRecorder:
    def __init__(self):
        self.lines = []

    def info_once(self, msg, *args, **kwargs):
        self.lines.append(msg % args)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _drafter_trees(max_reqs, budget):
    """DDTreeSpeculator.tree_buffers() without a drafter: the speculator's
    own method on the buffers its __init__ allocates."""
    from vllm.v1.worker.gpu.spec_decode.ddtree.speculator import DDTreeSpeculator

    speculator = object.__new__(DDTreeSpeculator)
    speculator.tree_parent_idx = torch.zeros(max_reqs, budget, dtype=torch.int64)
    speculator.tree_depth = torch.zeros(max_reqs, budget, dtype=torch.int64)
    speculator.tree_valid = torch.zeros(max_reqs, budget, dtype=torch.bool)
    assert speculator.tree_buffers() == (
        speculator.tree_parent_idx,
        speculator.tree_depth,
        speculator.tree_valid,
    )
    return speculator


def _memory_verifier(monkeypatch, max_reqs, budget, max_tokens, speculator):
    import vllm.v1.worker.gpu.spec_decode.ddtree.verifier as verifier_module

    recorder = _LogRecorder()
    monkeypatch.setattr(verifier_module, "logger", recorder)
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(
            use_ddtree=lambda: True, tree_budget=budget, draft_depth=15
        ),
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_reqs, max_num_batched_tokens=max_tokens
        ),
        max_concurrent_batches=2,
    )
    verifier = verifier_module.DDTreeVerifier(cfg, torch.device("cpu"), speculator)
    return verifier, recorder.lines


# (max_num_seqs, tree_budget) -> the line, at max_num_batched_tokens=8192.
MEMORY_LINES = {
    (1024, 64): (
        "DDTree: extra GPU memory for max_num_seqs=1024, tree_budget=64: "
        "4.6 MiB = tree attention bias 0.8 MiB (1024 x 65 nodes x 3 int32 "
        "words, 1 bit per node pair) + tree/walk/compaction buffers 3.8 MiB "
        "(parents, depths and valid flags of 1024 x 64 nodes per request and "
        "per batch row; the walk's paths and scratch, its tokens and counts "
        "for 2 steps in flight; tree positions of max_num_batched_tokens=8192 "
        "logits rows)."
    ),
    (1024, 256): (
        "DDTree: extra GPU memory for max_num_seqs=1024, tree_budget=256: "
        "22.2 MiB = tree attention bias 9.0 MiB (1024 x 257 nodes x 9 int32 "
        "words, 1 bit per node pair) + tree/walk/compaction buffers 13.2 MiB "
        "(parents, depths and valid flags of 1024 x 256 nodes per request and "
        "per batch row; the walk's paths and scratch, its tokens and counts "
        "for 2 steps in flight; tree positions of max_num_batched_tokens=8192 "
        "logits rows)."
    ),
}


@pytest.mark.parametrize("max_reqs, budget", sorted(MEMORY_LINES))
def test_startup_line_states_the_extra_memory(monkeypatch, max_reqs, budget):
    speculator = _drafter_trees(max_reqs, budget)
    verifier, lines = _memory_verifier(monkeypatch, max_reqs, budget, 8192, speculator)
    words = (budget + 32) // 32
    assert verifier.attn_bias.shape == (max_reqs, budget + 1, words)
    assert verifier.attn_bias.dtype == torch.int32
    # The counted bytes are the buffers' own: every tensor the verifier
    # holds, plus the speculator's trees (its only tensors here).
    buffers = persistent_buffers(verifier, speculator)
    sizes = verifier.memory_bytes
    assert sizes == verifier.buffer_bytes()
    assert sizes["bias"] == verifier.attn_bias.nbytes
    assert sizes["bias"] == max_reqs * (budget + 1) * words * 4
    assert sizes["gdn"] == 0
    assert sum(sizes.values()) == sum(t.nbytes for t in buffers)
    assert sizes["tree"] == sum(
        t.nbytes for t in buffers if t is not verifier.attn_bias
    )
    # One line, with those numbers.
    assert lines == [MEMORY_LINES[max_reqs, budget]]
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    total = sum(sizes.values())
    assert f"{mib(total)} = tree attention bias {mib(sizes['bias'])}" in lines[0]
    assert f"tree/walk/compaction buffers {mib(sizes['tree'])}" in lines[0]


def test_startup_line_without_the_speculator(monkeypatch):
    verifier, lines = _memory_verifier(monkeypatch, 4, B, 64, None)
    assert sum(verifier.memory_bytes.values()) == sum(
        t.nbytes for t in persistent_buffers(verifier)
    )
    assert len(lines) == 1 and "of 4 x 4 nodes per request;" in lines[0]


# ------------------------------------------------------------ budget policy
def test_budget_schedule_shrinks_with_batch_and_keeps_a_floor():
    from vllm.v1.spec_decode.ddtree.config import budget_schedule

    schedule = budget_schedule(64, 15, 512)
    assert schedule == [(1, 7, 64), (8, 15, 32), (16, 1024, 15)]
    dense = {}
    for lo, hi, budget in budget_schedule(256, 15, 512):
        for batch in range(lo, hi + 1):
            dense[batch] = budget
    assert sorted(dense) == list(range(1, 1025))  # every batch size covered
    budgets = [dense[b] for b in range(1, 1025)]
    assert budgets == sorted(budgets, reverse=True)  # never grows with the batch
    for batch, budget in dense.items():
        # Within the token cap (vLLM's largest CUDA graph by default), unless
        # at the floor: the chain's size, draft_depth nodes.
        assert (1 + budget) * batch <= 512 or budget == 15
    # A batch of 32 verifies 512 tokens, as the chain of 15 does: 16-node
    # trees (544 tokens) fell out of the captured CUDA graphs.
    assert dense[32] == 15 and dense[31] == 15
    assert budget_schedule(16, 15, 512) == [(1, 30, 16), (31, 1024, 15)]
    assert budget_schedule(1, 15, 512) == [(1, 1024, 1)]
    # The default cap: 64 nodes for one request, the floor from four on.
    assert budget_schedule(64, 15, 128) == [(1, 1, 64), (2, 3, 32), (4, 1024, 15)]


@needs_patched_speculative_config
def test_batch_policy_schedule_and_fixed_pins_the_budget(target_model_config):
    fixed = _spec(
        target_model_config,
        method="ddtree",
        model=DRAFTER,
        tree_budget=64,
        budget_policy="fixed",
    )
    assert fixed.num_speculative_tokens_per_batch_size is None
    batch = _spec(
        target_model_config,
        method="ddtree",
        model=DRAFTER,
        tree_budget=64,
        budget_policy="batch",
    )
    assert batch.budget_policy == "batch"
    assert batch.num_speculative_tokens_per_batch_size == [
        (1, 1, 64),
        (2, 3, 32),
        (4, 1024, 15),
    ]
    assert batch.num_speculative_tokens == 64  # the most a step verifies
    own = _spec(
        target_model_config,
        method="ddtree",
        model=DRAFTER,
        tree_budget=64,
        num_speculative_tokens_per_batch_size=[(1, 4, 64), (5, 256, 8)],
    )
    assert own.num_speculative_tokens_per_batch_size == [(1, 4, 64), (5, 256, 8)]
    with pytest.raises(Exception, match="verify_tokens_per_step"):
        _spec(
            target_model_config,
            method="ddtree",
            model=DRAFTER,
            budget_policy="batch",
            verify_tokens_per_step=0,
        )


def test_the_pair_the_tests_load_is_in_the_checkout():
    """The configs, weights and tokenizer that these tests and
    test_gpu_greedy_exact.py load are committed (bench/pairs/models): a clone
    runs every test, and a missing file fails here by name."""
    for model in (TARGET, DRAFTER):
        for name in ("config.json", "model.safetensors"):
            assert os.path.isfile(os.path.join(model, name)), (model, name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(TARGET, name)), name
    assert HELDOUT_PROMPTS.is_file()


def test_every_block_width_of_the_drafters_input_kernel_is_compiled_at_warm_up(
    monkeypatch,
):
    """The DFlash input kernel takes a block width from the step's longest
    query (upstream's `prepare_dflash_inputs`). The first warm-up run of the
    DDTree drafter runs it at every width, by upstream's own rule, so that no
    step while serving stalls for a compile; later runs, the memory profile's
    run and real steps run once."""
    import vllm.v1.worker.gpu.spec_decode.dflash.speculator as dflash
    from vllm.v1.worker.gpu.spec_decode.ddtree import speculator as ddtree

    widths = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, BLOCK_SIZE, **kw: widths.append(BLOCK_SIZE)

    monkeypatch.setattr(dflash, "_prepare_dflash_inputs_kernel", Kernel())
    buffers = SimpleNamespace(
        input_ids=None,
        positions=None,
        is_padding=None,
        query_start_loc=None,
        seq_lens=None,
    )
    # By name: vLLM 0.33 adds the drafter's sampling and context-parallel
    # arguments to upstream's function.
    values = dict(
        input_buffers=buffers,
        block_table=torch.zeros(2, 4),
        block_size=16,
        cp_rank=0,
        cp_size=1,
        cp_interleave=1,
        parallel_drafting_token_id=0,
        num_query_per_req=16,
        num_speculative_steps=15,
        max_num_reqs=8,
        max_num_tokens=64,
        max_model_len=64,
    )
    required = [
        name
        for name, p in inspect.signature(
            dflash.prepare_dflash_inputs
        ).parameters.items()
        if p.default is inspect.Parameter.empty
    ]

    def upstream_width(batch):
        widths.clear()
        batch.positions = batch.query_start_loc = batch.idx_mapping = None
        kwargs = {name: values.get(name) for name in required}
        dflash.prepare_dflash_inputs(**{**kwargs, "input_batch": batch})
        return widths[0]

    longest = SimpleNamespace(num_reqs=1, num_scheduled_tokens=np.array([4000]))
    shortest = SimpleNamespace(num_reqs=1, num_scheduled_tokens=np.array([1]))
    if upstream_width(longest) == upstream_width(shortest):
        pytest.skip("upstream's DFlash input kernel has one block width (0.34+)")
    calls = []

    def propose(self, input_batch, *args, dummy_run=False, **kwargs):
        calls.append((upstream_width(copy.copy(input_batch)), dummy_run))
        return "drafts"

    monkeypatch.setattr(dflash.DFlashSpeculator, "propose", propose)
    speculator = object.__new__(ddtree.DDTreeSpeculator)
    speculator.num_query_per_req = 16
    speculator.draft_next_step = True
    speculator.dflash_input_blocks_compiled = False
    decode = SimpleNamespace(num_reqs=2, num_scheduled_tokens=np.array([16, 16]))
    args = [None] * 10

    # The memory profile's run (no attention) does not count as warm-up.
    speculator.propose(decode, *args, dummy_run=True, skip_attn_for_dummy_run=True)
    assert calls == [(32, True)]
    calls.clear()
    speculator.propose(decode, *args, dummy_run=True)
    assert calls == [(64, True), (128, True), (256, True), (32, True)]
    assert (decode.num_scheduled_tokens == 16).all()  # the batch is untouched
    calls.clear()
    speculator.propose(decode, *args, dummy_run=True)
    speculator.propose(decode, *args)
    assert calls == [(32, True), (32, False)]
    # Without a dummy run that runs attention (no FlashInfer autotuning), the
    # V2 runner's warm-up steps are real ones: the first of them compiles.
    calls.clear()
    speculator.dflash_input_blocks_compiled = False
    speculator.propose(decode, *args)
    assert calls == [(64, False), (128, False), (256, False), (32, False)]
    calls.clear()
    speculator.propose(decode, *args)
    assert calls == [(32, False)]
    # A longer query reaches the widest block; 17 + 16 tokens the next one.
    prefill = SimpleNamespace(num_reqs=1, num_scheduled_tokens=np.array([4000]))
    assert upstream_width(prefill) == ddtree.DFLASH_INPUTS_MAX_BLOCK
    assert [
        upstream_width(b) for b in ddtree.dflash_input_block_batches(prefill, 16)
    ] == [32, 64, 128]
