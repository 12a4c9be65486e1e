# SPDX-License-Identifier: Apache-2.0
"""DDTree on a hybrid (Gated DeltaNet + attention) target through the vLLM
0.34.0 line's hooks: the hybrid model state's own `prepare_attn`
(`MambaHybridModelState`, its spec-decode row rule) builds the step's
metadata with upstream's real TRITON_ATTN and GDN metadata builders, the
TRITON_ATTN builder's ``metadata_hook`` attaches the tree bias (the
drafter's builders have none), the real GDN layer's `_forward_core` runs its
spec rows through DDTree's tree path, the runner's own `sample` walks the
tree, and the speculator's `propose` commits each GDN state along its
accepted path. The reference is upstream's own layer code: the accepted
path replayed as single-token decode steps from a copy of the committed
states (test_ddtree_gdn_hybrid.py). Skipped where the runner has no
speculator verifier hooks (the 0.26.0 line: test_ddtree_hybrid_runner.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from verifier_fakes import (  # noqa: E402
    B,
    D,
    logits_for,
    skip_module_without_speculator_hooks,
)

skip_module_without_speculator_hooks()

from speculator_fakes import (  # noqa: E402
    DRAFT_LAYER,
    TARGET_LAYER,
    common_metadata,
    fake_dflash_propose,
    fake_dflash_set_attn,
    make_speculator,
    propose_after_the_walk,
    sample_through_the_runner,
    triton_builder,
)
from test_ddtree_gdn_builder import builder as gdn_builder  # noqa: E402
from test_ddtree_gdn_builder import stub_prefill_kernels  # noqa: E402
from test_ddtree_gdn_hybrid import (  # noqa: E402
    CONV_DIM,
    HV,
    PREFIX,
    assert_slot_is_replay,
    gdn_context,
    make_layer,
    run_core,
)

from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.triton_attn import (  # noqa: E402
    TritonAttentionBackend,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.worker.gpu.model_states.mamba_hybrid import (  # noqa: E402
    MambaHybridModelState,
)
from vllm.v1.worker.gpu.spec_decode.ddtree import config as ddtree_v034  # noqa: E402
from vllm.v1.worker.utils import AttentionGroup  # noqa: E402

# GDN state slot of each request state (its mamba block).
SLOT = {0: 3, 1: 7, 2: 5}


@pytest.fixture(autouse=True)
def _no_pinned_memory(monkeypatch):
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.attention.backends.utils as backend_utils

    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    monkeypatch.setattr(backend_utils, "PIN_MEMORY", False)


class HybridStep:
    """A hybrid target of one attention layer (KV-cache group 0) and one GDN
    layer (group 1) with DDTree's speculator set on it as the runner does,
    and the hybrid model state's own `prepare_attn`."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.speculator = speculator = make_speculator()
        self.verifier = verifier = speculator.verifier
        verifier.gdn = gdn_context(verifier.req_parent_idx, D, 4)
        self.layer = make_layer(11)
        stub_prefill_kernels(monkeypatch, self.layer)
        self.committed = [t.clone() for t in self.layer.kv_cache]
        self.kv_cache = torch.zeros(32, 1, 16, 2)
        speculator.vllm_config = SimpleNamespace(
            compilation_config=SimpleNamespace(
                static_forward_context={
                    TARGET_LAYER: SimpleNamespace(kv_cache=self.kv_cache),
                    PREFIX: self.layer,
                    DRAFT_LAYER: SimpleNamespace(kv_cache=torch.zeros(4, 1, 16, 2)),
                }
            )
        )
        self.kv_cache_config = SimpleNamespace(
            kv_cache_groups=[
                SimpleNamespace(layer_names=[TARGET_LAYER]),
                SimpleNamespace(layer_names=[PREFIX]),
            ]
        )
        speculator.kv_cache_config = self.kv_cache_config
        self.triton = triton_builder()
        self.draft_triton = triton_builder()
        self.groups = [
            [
                AttentionGroup(
                    TritonAttentionBackend,
                    [TARGET_LAYER],
                    FullAttentionSpec(
                        block_size=16,
                        num_kv_heads=1,
                        head_size=2,
                        dtype=torch.float32,
                    ),
                    0,
                    metadata_builders=[self.triton],
                )
            ],
            [
                AttentionGroup(
                    GDNAttentionBackend,
                    [PREFIX],
                    None,
                    1,
                    metadata_builders=[gdn_builder(0)],
                )
            ],
        ]
        self.groups[1][0].kv_cache_spec = (
            self.groups[1][0].metadata_builders[0].kv_cache_spec
        )
        fake_dflash_set_attn(monkeypatch, self.draft_triton)
        speculator.set_attn(
            "model_state", self.kv_cache_config, "block_tables", "bufs", self.groups
        )
        self.model_state = SimpleNamespace(
            max_model_len=64,
            vllm_config=SimpleNamespace(num_speculative_tokens=B),
            num_accepted_tokens_gpu=torch.ones(4, dtype=torch.int32),
            _align_mode=False,
            _use_flashinfer_replayssm=False,
            recoverssm=None,
        )

    def prepare_attn(self, batch):
        req = batch.idx_mapping.tolist()
        block_tables = (
            torch.tensor([[20 * r] for r in req], dtype=torch.int32),
            torch.tensor([[SLOT[r]] for r in req], dtype=torch.int32),
        )
        slot_mappings = torch.zeros(2, batch.num_tokens, dtype=torch.int64)
        return MambaHybridModelState.prepare_attn(
            self.model_state,
            batch,
            CUDAGraphMode.NONE,
            block_tables,
            slot_mappings,
            self.groups,
            self.kv_cache_config,
        )

    def forward(self, attn_metadata, num_tokens, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(num_tokens, CONV_DIM, generator=gen)
        b = torch.randn(num_tokens, HV, generator=gen)
        a = torch.randn(num_tokens, HV, generator=gen)
        run_core(
            self.monkeypatch, self.layer, attn_metadata[PREFIX], x, b, a, num_tokens
        )
        return x, b, a

    def propose(self, batch, attn_metadata, num_sampled, num_rejected, **kwargs):
        slots = torch.arange(batch.num_tokens) + 16
        return propose_after_the_walk(
            self.speculator,
            batch,
            attn_metadata,
            {TARGET_LAYER: slots},
            torch.zeros(batch.num_tokens, 2),
            None,
            num_sampled,
            num_rejected,
            **kwargs,
        )

    def assert_replay(self, req_state, x, b, a, rows):
        assert_slot_is_replay(
            self.monkeypatch,
            self.layer,
            self.committed,
            SLOT[req_state],
            x[rows],
            b[rows],
            a[rows],
        )


def _batch(num_scheduled, drafts, prefilling, idx_mapping, positions, seq_lens):
    """A V2 input batch (the fields the model state, the verifier and the
    runner's `sample` read) of one logits row per token of a tree row and
    one per other row."""
    num_scheduled = np.array(num_scheduled, dtype=np.int32)
    drafts = np.array(drafts, dtype=np.int32)
    num_reqs = len(num_scheduled)
    qsl = np.zeros(num_reqs + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(num_scheduled)
    num_logits = 1 + drafts
    logits_indices, expanded_idx, local_pos = [], [], []
    for r in range(num_reqs):
        last = qsl[r + 1] - num_logits[r]
        logits_indices += list(range(last, qsl[r + 1]))
        expanded_idx += [idx_mapping[r]] * int(num_logits[r])
        local_pos += list(range(num_logits[r]))
    cu_num_logits = np.zeros(num_reqs + 1, dtype=np.int32)
    cu_num_logits[1:] = np.cumsum(num_logits)
    return SimpleNamespace(
        num_reqs=num_reqs,
        num_tokens=int(qsl[-1]),
        num_tokens_after_padding=int(qsl[-1]),
        num_draft_tokens=int(drafts.sum()),
        num_draft_tokens_per_req=drafts if drafts.any() else None,
        num_scheduled_tokens=num_scheduled,
        is_prefilling_np=np.array(prefilling),
        prefill_runs_as_decode_np=None,
        max_query_len=int(num_scheduled.max()),
        query_start_loc_np=qsl,
        query_start_loc=torch.from_numpy(qsl.copy()),
        positions=torch.tensor(positions, dtype=torch.int64),
        input_ids=torch.arange(int(qsl[-1]), dtype=torch.int64),
        logits_indices=torch.tensor(logits_indices),
        expanded_idx_mapping=torch.tensor(expanded_idx, dtype=torch.int32),
        expanded_local_pos=torch.tensor(local_pos, dtype=torch.int32),
        idx_mapping=torch.tensor(idx_mapping, dtype=torch.int32),
        idx_mapping_np=np.array(idx_mapping, dtype=np.int32),
        cu_num_logits=torch.from_numpy(cu_num_logits),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        dcp_local_seq_lens=None,
        prompt_lens=None,
    )


def test_hybrid_targets_are_configured_like_dense_ones():
    """The 0.34.0 line's one-line refusal of hybrid targets is gone."""
    assert not hasattr(ddtree_v034, "hybrid_target_unported_error")


def test_a_hybrid_tree_step_through_the_model_states_own_code(monkeypatch):
    """Batch row 0: request state 2 verifies its 4-node tree (root + 4
    nodes); row 1: request state 0's first prefill chunk (3 tokens); row 2:
    request state 1 decodes one token without drafts, which vLLM 0.34's
    hybrid model state still makes a GDN spec row. After the walk and
    propose, each spec row's GDN state is upstream's decode replay of its
    accepted path (state 2: root -> node 1 -> node 4; state 1: its token),
    the prefill row's is the forward's own."""
    step = HybridStep(monkeypatch)
    speculator, verifier, layer = step.speculator, step.verifier, step.layer
    # set_attn hooked the target's TRITON_ATTN builder, not the drafter's,
    # and made DDTree the GDN layer's tree verifier.
    assert step.draft_triton.metadata_hook is None
    assert layer.tree_verifier is verifier.gdn

    batch = _batch(
        [1 + B, 3, 1],
        [B, 0, 0],
        [False, True, False],
        [2, 0, 1],
        [20, 21, 22, 23, 24, 0, 1, 2, 9],
        [25, 3, 10],
    )
    attn_metadata = step.prepare_attn(batch)
    # The tree bias reaches the target's attention metadata (through the
    # builder's hook), never a drafter build.
    assert attn_metadata[TARGET_LAYER].tree_attn_bias is verifier.attn_bias
    draft_meta = step.draft_triton.build(0, common_metadata([1 + B, 3, 1], [25, 3, 10]))
    assert draft_meta.tree_attn_bias is None
    # The model state's rule: rows 0 (drafts) and 2 (a decode without) are
    # GDN spec rows; the verifier's tables agree.
    gdn_md = attn_metadata[PREFIX]
    assert gdn_md.num_spec_decodes == 2 and gdn_md.num_prefills == 1
    speculator.prepare_verify(batch, batch.positions)
    assert verifier.gdn.num_spec == 2
    assert verifier.gdn.tree_rows[:2].tolist() == [2, 1]
    assert verifier.gdn.spec_batch_rows[:2].tolist() == [0, 2]
    assert batch.positions.tolist() == [20, 21, 21, 22, 22, 0, 1, 2, 9]

    x, b, a = step.forward(attn_metadata, batch.num_tokens, seed=3)
    after_forward = [t.clone() for t in layer.kv_cache]
    # The tree path leaves the spec rows' committed states alone.
    for r in (1, 2):
        for state, committed in zip(layer.kv_cache, step.committed):
            assert torch.equal(state[SLOT[r]], committed[SLOT[r]])

    # The runner's own sample(): state 2 accepts root -> node 1 -> node 4.
    hidden = torch.zeros(batch.num_tokens, 32)
    hidden[batch.logits_indices] = logits_for([11, 14, 30, 30, 9, 5, 7])
    out, num_sampled, num_rejected = sample_through_the_runner(
        speculator, hidden, batch
    )
    assert num_sampled.tolist() == [3, 1, 1]
    assert out.sampled_token_ids[0, :3].tolist() == [11, 14, 9]

    fake_dflash_propose(monkeypatch, next_tree_row=0)
    step.propose(batch, attn_metadata, num_sampled, num_rejected)

    step.assert_replay(2, x, b, a, [0, 1, 4])
    step.assert_replay(1, x, b, a, [8])
    # The prefill row's state is its own forward's (the stand-in's mark).
    assert torch.all(layer.kv_cache[1][SLOT[0]] == 7.0)
    for state, forward_state in zip(layer.kv_cache, after_forward):
        assert torch.equal(state[SLOT[0]], forward_state[SLOT[0]])
    assert not verifier.gdn.commit_pending


def test_a_step_without_drafts_commits_each_decode_rows_token(monkeypatch):
    """No request has drafts (the runner samples without the walk), yet the
    hybrid model state runs the decode rows as GDN spec rows, through the
    tree path, which writes no state: propose commits each row's one token
    (its root), once; a dummy run after it commits nothing."""
    step = HybridStep(monkeypatch)
    layer = step.layer
    batch = _batch([1, 1], [0, 0], [False, False], [2, 1], [30, 9], [31, 10])
    attn_metadata = step.prepare_attn(batch)
    assert attn_metadata[PREFIX].num_spec_decodes == 2
    step.speculator.prepare_verify(batch, batch.positions)
    x, b, a = step.forward(attn_metadata, batch.num_tokens, seed=5)
    for r in (2, 1):
        assert torch.equal(layer.kv_cache[1][SLOT[r]], step.committed[1][SLOT[r]])

    fake_dflash_propose(monkeypatch)
    ones = torch.ones(2, dtype=torch.int32)
    step.propose(batch, attn_metadata, ones, ones * 0)
    step.assert_replay(2, x, b, a, [0])
    step.assert_replay(1, x, b, a, [1])
    committed = [t.clone() for t in layer.kv_cache]
    step.propose(batch, attn_metadata, ones, ones * 0, dummy_run=True)
    for state, before in zip(layer.kv_cache, committed):
        assert torch.equal(state, before)
