# SPDX-License-Identifier: Apache-2.0
"""The verifier's post-walk work (`DDTreeVerifier.compact`) dispatches the
same work whatever the target's layer count: one KV compaction launch per
KV-cache group of its attention layers, one launch for the aux hidden
states, and for a hybrid target two launches for the committed state of all
Gated DeltaNet layers (plus one gather of the state slots when those layers
span several KV-cache groups).

Counted on CPU (dispatch_counts.py: every Triton launch, every eager torch
operator) for a target of 2 and of 6 layers of each kind: the counts must be
the stated ones and equal for both. A per-layer loop, in Triton or in torch,
makes them grow with the layer count and fails here.
"""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")

from dispatch_counts import count_dispatch  # noqa: E402
from test_ddtree_gdn_hybrid import (  # noqa: E402
    CONV_DIM,
    DEVICE,
    HV,
    make_layer,
    spec_md,
)
from verifier_fakes import (  # noqa: E402
    DEPTH,
    PARENT,
    TOKENS,
    D,
    make_verifier,
    store_trees,
)

from vllm.v1.spec_decode.ddtree import gdn_verify  # noqa: E402

# Request states 2 and 0 verify 5 rows each (root + B = 4 nodes); the walk
# accepts root -> 1 -> 4 (rows 0, 1, 4) and root -> 1 -> 2 -> 3 (rows 5..8).
SPINE = ([0, 1, 2, 1], [1, 2, 3, 2], [21, 22, 23, 24])
QUERY_START = [0, 5, 10]
SRC = [[0, 1, 4, 0], [5, 6, 7, 8]]
DST = [[0, 1, 2, 0], [5, 6, 7, 8]]
NUM_ACCEPTED = [3, 4]
# GDN state slots of the two spec rows, per KV-cache group (0: null).
GDN_SLOTS = [[5, 3], [6, 2]]
KV_BLOCKS, BLOCK_SIZE = 4, 16


def _hybrid_step(num_layers):
    """A verifier over a hybrid-like target of ``num_layers`` attention and
    ``num_layers`` GDN layers, each kind split over two KV-cache groups, with
    one step verified and walked; returns (verifier, batch, slot mappings,
    aux hidden states, the GDN layers, the KV caches)."""
    gen = torch.Generator().manual_seed(num_layers)
    verifier = make_verifier(DEVICE)
    store_trees(verifier, [2, 0], [(PARENT, DEPTH, TOKENS), SPINE], device=DEVICE)

    half = num_layers // 2
    gdn_names = [f"model.layers.{i}.linear_attn" for i in range(num_layers)]
    attn_names = [f"model.layers.{i}.self_attn" for i in range(num_layers)]
    groups = [
        gdn_names[:half] + attn_names[:half],
        gdn_names[half:] + attn_names[half:],
    ]

    gdn = gdn_verify.DDTreeGDN(
        parent_idx=verifier.req_parent_idx,
        draft_depth=D,
        max_num_reqs=4,
        max_rows=16,
        num_layers=num_layers,
        conv_dim=CONV_DIM,
        num_v_heads=HV,
        dtype=torch.float32,
        device=torch.device(DEVICE),
    )
    layers = [make_layer(100 + i, prefix=name) for i, name in enumerate(gdn_names)]
    gdn.bind_layers({layer.prefix: layer for layer in layers}, groups)
    verifier.gdn = gdn

    kv_caches = {
        name: torch.randn(KV_BLOCKS, 2, BLOCK_SIZE, 8, generator=gen).to(DEVICE)
        for name in attn_names
    }
    verifier.bind_kv_caches(kv_caches, set(), groups)
    # Each group's verify rows at its own slots.
    slots = [
        torch.randperm(KV_BLOCKS * BLOCK_SIZE, generator=gen)[:10].to(DEVICE)
        for _ in groups
    ]
    slot_mappings = {n: slots[0] for n in attn_names[:half]} | {
        n: slots[1] for n in attn_names[half:]
    }

    batch = SimpleNamespace(
        num_reqs=2,
        num_draft_tokens_per_req=np.array([4, 4], dtype=np.int32),
        num_scheduled_tokens=np.array([5, 5], dtype=np.int32),
        idx_mapping_np=np.array([2, 0], dtype=np.int32),
        query_start_loc=torch.tensor(QUERY_START, dtype=torch.int32, device=DEVICE),
    )
    gdn.prepare_step(batch)
    group_md = [spec_md(QUERY_START, s, 2, 10) for s in GDN_SLOTS]
    gdn.attach(
        {n: group_md[0] for n in groups[0]} | {n: group_md[1] for n in groups[1]}
    )
    gdn.x_buf[:, :10] = torch.randn(num_layers, 10, CONV_DIM, generator=gen)
    gdn.a_buf[:, :10] = torch.randn(num_layers, 10, HV, generator=gen)
    gdn.b_buf[:, :10] = torch.randn(num_layers, 10, HV, generator=gen)

    def as_tensor(rows, dtype):
        return torch.tensor(rows, dtype=dtype, device=DEVICE)

    verifier._walk = (
        as_tensor(NUM_ACCEPTED, torch.int32),
        as_tensor(SRC, torch.int64),
        as_tensor(DST, torch.int64),
    )
    hidden = [torch.randn(16, 24, generator=gen).to(DEVICE) for _ in range(3)]
    return verifier, batch, slot_mappings, hidden, layers, kv_caches, slots


EXPECTED_LAUNCHES = {
    "_ddtree_compact_kv_kernel": 2,  # one per KV-cache group
    "_ddtree_compact_rows_kernel": 1,  # the three aux hidden states
    "_commit_conv_kernel": 1,  # every GDN layer's conv window
    "_commit_gdn_kernel": 1,  # every GDN layer's recurrent state
}


def _compact_counts(num_layers):
    verifier, batch, slot_mappings, hidden, layers, kv_caches, slots = _hybrid_step(
        num_layers
    )
    ssm_before = [gdn_verify.gdn_layer_states(layer)[1].clone() for layer in layers]
    kv_before = {n: kv.clone() for n, kv in kv_caches.items()}
    with count_dispatch() as counts:
        verifier.compact(batch, slot_mappings, hidden)

    # The work really covered every layer: each GDN layer's committed
    # recurrent state moved in both spec rows' slots, each KV cache's
    # destination slot of the path holds its source.
    for layer, before in zip(layers, ssm_before):
        ssm = gdn_verify.gdn_layer_states(layer)[1]
        group = 0 if layer in layers[: num_layers // 2] else 1
        for slot in GDN_SLOTS[group]:
            assert not torch.equal(ssm[slot], before[slot]), layer.prefix
    for i, (name, kv) in enumerate(kv_caches.items()):
        s = slots[0 if i < num_layers // 2 else 1]
        src, dst = int(s[4]), int(s[2])  # request state 2: node 4 -> row 2
        assert torch.equal(
            kv[dst // BLOCK_SIZE, :, dst % BLOCK_SIZE],
            kv_before[name][src // BLOCK_SIZE, :, src % BLOCK_SIZE],
        ), name
    return counts


def test_compaction_and_gdn_commit_launch_a_fixed_number_of_kernels():
    few, many = _compact_counts(2), _compact_counts(6)
    assert dict(few.launches) == EXPECTED_LAUNCHES
    assert dict(many.launches) == EXPECTED_LAUNCHES
    # The eager torch work around the launches (the slot gather of the two
    # GDN groups, views) does not depend on the layer count either.
    assert many.ops == few.ops
    assert len(few.ops) <= 8, few.ops
