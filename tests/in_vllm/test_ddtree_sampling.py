# SPDX-License-Identifier: Apache-2.0
"""CPU tests of DDTree sampling inside the patched vLLM: request validation
(structured outputs and bad_words refused), tree-correct penalties wired
through DDTreeVerifier.sample, logprobs of the emitted tokens, and seeded
draws keyed by (seed, tree position)."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from test_ddtree_runner import (  # noqa: E402
    PARENT,
    TOKENS,
    _batch,
    _store_one_tree,
    _verifier,
)

VOCAB = 32


# ------------------------------------------------------------ validation
def _ddtree_spec(on=True):
    return SimpleNamespace(use_ddtree=lambda: on)


def test_structured_outputs_are_refused_with_ddtree():
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    with pytest.raises(ValueError, match="DDTree does not support structured"):
        params._validate_spec_decode(_ddtree_spec())
    with pytest.raises(ValueError, match="method='dflash'"):
        params._validate_spec_decode(_ddtree_spec())
    params._validate_spec_decode(_ddtree_spec(on=False))  # chain: upstream's


def test_bad_words_are_refused_and_the_rest_is_accepted():
    from vllm.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="DDTree does not support bad_words"):
        SamplingParams(bad_words=["foo"])._validate_spec_decode(_ddtree_spec())
    SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, seed=3, repetition_penalty=1.2,
        frequency_penalty=0.5, presence_penalty=0.3, logprobs=2,
    )._validate_spec_decode(_ddtree_spec())
    # min_p and logit_bias apply per tree row (Sampler.sample); the chain
    # methods keep upstream's refusal.
    chain_only = SamplingParams(min_p=0.1, logit_bias={3: 1.0})
    chain_only._validate_spec_decode(_ddtree_spec())
    with pytest.raises(ValueError, match="min_p and logit_bias"):
        chain_only._validate_spec_decode(_ddtree_spec(on=False))


# ------------------------------------------------------------ fakes
def _chain_penalties(logits, eim, input_ids, local_pos, rep, freq, pres,
                     prompt_mask, counts):
    """Torch twin of upstream's penalties kernel (history + the draft
    tokens of the rows before, as a chain)."""
    for t in range(logits.shape[0]):
        s = int(eim[t])
        c = counts[s].clone()
        p = int(local_pos[t])
        for prev in range(p):
            c[int(input_ids[t - p + prev + 1])] += 1
        x = logits[t].float()
        present = c > 0
        scale = torch.where(prompt_mask[s] | present, rep[s], torch.ones(()))
        x = x * torch.where(x > 0, 1.0 / scale, scale)
        x = x - freq[s] * c.float() - pres[s] * present.float()
        logits[t] = x


def _pack(mask):
    bits = torch.zeros(mask.shape[0], 1, dtype=torch.int64)
    for j in range(mask.shape[1]):
        bits[:, 0] |= mask[:, j].long() << j
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return bits.to(torch.int32)


class _FakePenalties:
    def __init__(self, rep, freq, pres, counts, prompt_mask):
        self.rep, self.freq, self.pres = rep, freq, pres
        self.repetition_penalty = SimpleNamespace(gpu=rep)
        self.frequency_penalty = SimpleNamespace(gpu=freq)
        self.presence_penalty = SimpleNamespace(gpu=pres)
        self.output_bin_counts = counts
        self.prompt_mask = prompt_mask
        self.prompt_bin_mask = _pack(prompt_mask)
        self.use_penalty = np.array(
            [(r != 1) or f != 0 or p != 0
             for r, f, p in zip(rep.tolist(), freq.tolist(), pres.tolist())]
        )
        self.calls = 0

    def apply_penalties(self, logits, eim, idx_mapping_np, input_ids, local_pos):
        self.calls += 1
        _chain_penalties(logits, eim, input_ids, local_pos, self.rep, self.freq,
                         self.pres, self.prompt_mask, self.output_bin_counts)


class _FakeSampler:
    """Upstream's Sampler.sample order (penalties, temperature 1, Gumbel keyed
    by (seed, position)); records what it saw."""

    def __init__(self, penalties, seeds=None, logprobs=False):
        self.penalties_state = penalties
        self.seeds = seeds
        self.logprobs = logprobs
        self.logprobs_mode = "processed_logprobs"
        self.sampling_states = SimpleNamespace(max_num_logprobs=lambda _: 2)
        self.logprob_token_ids_state = SimpleNamespace(
            max_num_token_ids=lambda _: 0
        )

    def returns_logprobs(self, idx_mapping_np):
        return self.logprobs

    def sample(self, logits, eim, idx_mapping_np, pos, input_ids, local_pos,
               return_logprobs=False):
        logits = logits.clone()
        self.penalties_state.apply_penalties(
            logits, eim, idx_mapping_np, input_ids, local_pos
        )
        self.processed = logits.clone()
        self.pos = pos.clone()
        if self.seeds is None:
            return logits.argmax(dim=-1), logits
        noise = torch.stack([
            _gumbel(int(self.seeds[int(s)]), int(p))
            for s, p in zip(eim.tolist(), pos.tolist())
        ])
        return (logits + noise).argmax(dim=-1), logits


def _gumbel(seed, pos):
    gen = torch.Generator().manual_seed(seed * 1_000_003 + pos)
    u = torch.rand(VOCAB, generator=gen).clamp_min(1e-12)
    return -torch.log(-torch.log(u))


def _node_path(node):
    out = []
    while node != 0:
        out.append(TOKENS[node - 1])
        node = PARENT[node - 1]
    return out


# ------------------------------------------------------------ penalties
def test_verifier_penalties_count_each_nodes_ancestor_path():
    verifier = _verifier()
    draft_tokens = _store_one_tree(verifier)
    batch = _batch()
    # Query tokens: prefill chunk 0..2 (state 0), then root 7, nodes 11..14.
    batch.input_ids = torch.tensor([0, 1, 2, 7] + TOKENS + [0, 0])
    verifier.prepare_verify(batch)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    logits[:, [7, 11, 12, 13, 14]] += 2.0  # positive and negative logits
    rep = torch.tensor([1.0, 1.0, 1.5, 1.0])
    freq = torch.tensor([0.0, 0.0, 0.4, 0.0])
    pres = torch.tensor([0.0, 0.0, 0.7, 0.0])
    counts = torch.zeros(4, VOCAB, dtype=torch.int32)
    counts[2, 7] = 1  # the root: already an output token
    counts[2, 14] = 2
    prompt = torch.zeros(4, VOCAB, dtype=torch.bool)
    prompt[2, [3, 12]] = True
    sampler = _FakeSampler(_FakePenalties(rep, freq, pres, counts, prompt))
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32)
    verifier.sample(sampler, logits, batch, draft_tokens, prefill_len)

    expected = logits.clone()
    for row in range(1, 6):  # the tree rows: node = row - 1
        ctx = counts.clone()
        for t in _node_path(row - 1):
            ctx[2, t] += 1
        one = expected[row:row + 1].clone()
        _chain_penalties(one, torch.tensor([2]), None, torch.tensor([0]),
                         rep, freq, pres, prompt, ctx)
        expected[row] = one[0]
    torch.testing.assert_close(sampler.processed, expected, rtol=0, atol=0)
    # The wrapper stays installed but is inert outside a tree step.
    wrapped = sampler.penalties_state
    assert wrapped._paths_fn is None and wrapped.output_bin_counts is counts
    plain = logits.clone()
    wrapped.apply_penalties(plain, torch.tensor([2] * 6), np.array([2]),
                            batch.input_ids[2:8], torch.arange(6))
    chain = logits.clone()
    _chain_penalties(chain, torch.tensor([2] * 6), batch.input_ids[2:8],
                     torch.arange(6), rep, freq, pres, prompt, counts)
    torch.testing.assert_close(plain, chain, rtol=0, atol=0)


# ------------------------------------------------------------ logprobs
def test_logprobs_rows_are_the_emitted_tokens(monkeypatch):
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.worker.gpu.spec_decode.ddtree import sampling

    def topk_scores(logits, num_logprobs, sampled, cu_num_logits, **kw):
        lp = torch.log_softmax(logits.float(), dim=-1)
        ids = torch.cat([sampled[:, None], lp.topk(num_logprobs).indices], 1)
        ranks = (lp >= lp.gather(1, sampled[:, None])).sum(1)
        return LogprobsTensors(ids, lp.gather(1, ids), ranks, cu_num_logits)

    monkeypatch.setattr(sampling, "compute_topk_scores", topk_scores)
    verifier = _verifier()
    draft_tokens = _store_one_tree(verifier)
    batch = _batch()
    batch.cu_num_logits_np = np.array([0, 1, 6])
    verifier.prepare_verify(batch)
    # Root draws 11 (node 1), node 1 draws 14 (node 4), node 4 draws 9.
    logits = torch.full((6, VOCAB), -2.0)
    for row, tok in enumerate([5, 11, 14, 30, 30, 9]):
        logits[row, tok] = 3.0
    logits[2, 13] = 2.5  # node 1's row: 13 is its second choice
    none = _FakePenalties(*(torch.tensor([1.0] * 4), torch.zeros(4),
                            torch.zeros(4)), torch.zeros(4, VOCAB, dtype=torch.int32),
                          torch.zeros(4, VOCAB, dtype=torch.bool))
    sampler = _FakeSampler(none, logprobs=True)
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32)
    out = verifier.sample(sampler, logits, batch, draft_tokens, prefill_len)
    lp = out.logprobs_tensors
    assert lp is not None and lp.cu_num_generated_tokens == [0, 1, 6]
    emitted = out.sampled_token_ids[1, :3].tolist()
    assert emitted == [11, 14, 9]
    # Rows 1..3 of request 1 = root, node 1, node 4: their own draws.
    assert lp.logprob_token_ids[1:4, 0].tolist() == emitted
    assert lp.logprob_token_ids[2, 1:].tolist() == [14, 13]
    assert lp.logprob_token_ids[0, 0].tolist() == 5
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(lp.logprobs[3, 0], ref[5, 9])  # node 4's row
    assert lp.selected_token_ranks[1:4].tolist() == [1, 1, 1]


# ------------------------------------------------------------ seeds
def _seeded_run(seed):
    verifier = _verifier()
    draft_tokens = _store_one_tree(verifier)
    batch = _batch()
    verifier.prepare_verify(batch)
    logits = torch.zeros(6, VOCAB)  # uniform: the noise alone decides
    none = _FakePenalties(*(torch.tensor([1.0] * 4), torch.zeros(4),
                            torch.zeros(4)), torch.zeros(4, VOCAB, dtype=torch.int32),
                          torch.zeros(4, VOCAB, dtype=torch.bool))
    sampler = _FakeSampler(none, seeds=[11, 0, seed, 0])
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32)
    out = verifier.sample(sampler, logits, batch, draft_tokens, prefill_len)
    draws = torch.stack([
        (logits[r] + _gumbel(int(s), int(p))).argmax()
        for r, (s, p) in enumerate(zip([11, seed, seed, seed, seed, seed],
                                       sampler.pos.tolist()))
    ])
    return sampler.pos.tolist(), draws.tolist(), out.sampled_token_ids.tolist()


def test_seeded_draws_are_keyed_by_tree_position_and_reproducible():
    pos, draws, out = _seeded_run(seed=42)
    # The sampler saw tree positions: root 20, depth-1 nodes 21, depth-2 22.
    assert pos == [2, 20, 21, 21, 22, 22]
    # Siblings share their position's noise: identical logits, same draw.
    assert draws[2] == draws[3] and draws[4] == draws[5]
    assert _seeded_run(seed=42) == (pos, draws, out)  # run to run
    assert _seeded_run(seed=43)[1] != draws  # another seed, other draws
