# SPDX-License-Identifier: Apache-2.0
"""CPU tests of DDTree sampling inside the patched vLLM: request validation
(structured outputs and bad_words refused), tree-correct penalties wired
through DDTreeVerifier.sample, logprobs of the emitted tokens, and seeded
draws keyed by (seed, tree position)."""

import inspect
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from test_ddtree_runner import (  # noqa: E402
    PARENT,
    TOKENS,
    B,
    _store_one_tree,
    _verifier,
)
from verifier_fakes import prefill_and_tree_batch  # noqa: E402

VOCAB = 32


# ------------------------------------------------------------ validation
# vLLM's speculative-method interface (0.34.0): the input processor asks the
# speculator config; the 0.26.0 line's patched SamplingParams asks use_ddtree.
try:
    from vllm.v1.worker.gpu.spec_decode import speculator_config
except ImportError:  # the 0.26.0 line
    speculator_config = None


def _ddtree_spec(on=True):
    spec = SimpleNamespace(use_ddtree=lambda: on, num_speculative_tokens=8)
    if speculator_config is not None:
        from vllm.v1.worker.gpu.spec_decode.ddtree.config import (
            DDTreeSpeculatorConfig,
        )
        from vllm.v1.worker.gpu.spec_decode.dflash.config import (
            DFlashSpeculatorConfig,
        )

        config_cls = DDTreeSpeculatorConfig if on else DFlashSpeculatorConfig
        spec.speculator_config = config_cls(spec)
    return spec


def _validate(params, spec):
    """The line's per-request checks of a spec-decode request."""
    if speculator_config is not None:
        reason = spec.speculator_config.unsupported_request_reason(params, False)
        if reason is not None:
            raise ValueError(reason)
    params._validate_spec_decode(spec)


def test_structured_outputs_are_refused_with_ddtree():
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    with pytest.raises(ValueError, match="DDTree does not support structured"):
        _validate(params, _ddtree_spec())
    with pytest.raises(ValueError, match="method='dflash'"):
        _validate(params, _ddtree_spec())
    _validate(params, _ddtree_spec(on=False))  # chain: upstream's


def test_bad_words_are_refused_and_the_rest_is_accepted():
    from vllm.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="DDTree does not support bad_words"):
        _validate(SamplingParams(bad_words=["foo"]), _ddtree_spec())
    _validate(
        SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            seed=3,
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            logprobs=2,
        ),
        _ddtree_spec(),
    )


@pytest.mark.skipif(
    speculator_config is not None,
    reason="vLLM 0.34.0 refuses min_p and logit_bias for every speculative "
    "method (SamplingParams has no per-method hook on that line)",
)
def test_min_p_and_logit_bias_are_accepted_under_ddtree():
    from vllm.sampling_params import SamplingParams

    # min_p and logit_bias apply per tree row (Sampler.sample); the chain
    # methods keep upstream's refusal.
    chain_only = SamplingParams(min_p=0.1, logit_bias={3: 1.0})
    chain_only._validate_spec_decode(_ddtree_spec())
    # Upstream's own error: a ValueError on vLLM 0.26, a VLLMValidationError
    # on 0.33.
    import vllm.exceptions

    upstream_error = getattr(vllm.exceptions, "VLLMValidationError", ValueError)
    with pytest.raises((ValueError, upstream_error), match="min_p and logit_bias"):
        chain_only._validate_spec_decode(_ddtree_spec(on=False))


# ------------------------------------------------------------ fakes
def _chain_penalties(
    logits, eim, input_ids, local_pos, rep, freq, pres, prompt_mask, counts
):
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


def _penalties(rep, freq, pres, counts, prompt_mask):
    """The verifier's real TreePenaltiesState (upstream's state and Triton
    penalties kernel underneath) holding these per-state penalties, history
    counts and prompt tokens."""
    from verifier_fakes import tree_penalties

    state = tree_penalties(VOCAB)
    for uva, values in (
        (state.repetition_penalty, rep),
        (state.frequency_penalty, freq),
        (state.presence_penalty, pres),
    ):
        uva.np[:] = values.numpy()
        uva.copy_to_uva()
    state.use_penalty[:] = [
        (r != 1) or f != 0 or p != 0
        for r, f, p in zip(rep.tolist(), freq.tolist(), pres.tolist())
    ]
    state.output_bin_counts.copy_(counts)
    state.prompt_bin_mask.copy_(_pack(prompt_mask))
    return state


def _no_penalties():
    return _penalties(
        torch.tensor([1.0] * 4),
        torch.zeros(4),
        torch.zeros(4),
        torch.zeros(4, VOCAB, dtype=torch.int32),
        torch.zeros(4, VOCAB, dtype=torch.bool),
    )


def _apply_penalties(state, logits, eim, idx_mapping_np, input_ids, local_pos):
    """``state``'s penalties on ``logits`` in place, through the entry point
    the release's sampler calls: `apply(logits, LogitsContext)` of a logits
    processor (vLLM 0.33+) or `apply_penalties` (0.26)."""
    from vllm.v1.worker.gpu.spec_decode.ddtree.sampling import (
        PENALTIES_ARE_LOGITS_PROCESSOR,
    )

    if not PENALTIES_ARE_LOGITS_PROCESSOR:
        state.apply_penalties(logits, eim, idx_mapping_np, input_ids, local_pos)
        return
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

    ctx = LogitsContext(
        expanded_idx_mapping=eim,
        idx_mapping=torch.from_numpy(idx_mapping_np),
        idx_mapping_np=idx_mapping_np,
        expanded_local_pos=local_pos,
        input_ids=input_ids,
        pos=torch.zeros_like(local_pos),  # not read by the penalties
        seq_lens_upper_bound_np=np.zeros_like(idx_mapping_np),  # nor this
    )
    assert state.apply(logits, ctx) is logits


def _sample_arguments(logits, batch, pos, input_ids):
    """Positional arguments of upstream's `Sampler.sample` for ``batch``, in
    the release's order (vLLM 0.33 adds idx_mapping and the host
    sequence-length bound)."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    values = dict(
        logits=logits,
        expanded_idx_mapping=batch.expanded_idx_mapping,
        idx_mapping=batch.idx_mapping,
        idx_mapping_np=batch.idx_mapping_np,
        pos=pos,
        input_ids=input_ids,
        expanded_local_pos=batch.expanded_local_pos,
        seq_lens_upper_bound_np=batch.seq_lens_cpu_upper_bound.numpy(),
    )
    names = list(inspect.signature(Sampler.sample).parameters)[1:]
    return [values[name] for name in names if name != "return_logprobs"]


class _FakeSampler:
    """Greedy after the real penalties state: records the processed logits
    (the logprobs test swaps compute_topk_scores for a torch twin). Its
    logprobs queries and `sample`'s arguments are upstream's `Sampler`'s."""

    def __init__(self, penalties, logprobs=False):
        from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

        self.penalties_state = penalties
        self.logprobs_mode = "processed_logprobs"
        num_logprobs = 2 if logprobs else NO_LOGPROBS
        self.sampling_states = SimpleNamespace(max_num_logprobs=lambda _: num_logprobs)
        self.logprob_token_ids_state = SimpleNamespace(max_num_token_ids=lambda _: 0)

    def returns_logprobs(self, idx_mapping_np):  # vLLM 0.26
        from vllm.v1.worker.gpu.sample.sampler import Sampler

        return Sampler.returns_logprobs(self, idx_mapping_np)

    def get_logprobs_dims(self, idx_mapping_np):  # vLLM 0.33+
        from vllm.v1.worker.gpu.sample.sampler import Sampler

        return Sampler.get_logprobs_dims(self, idx_mapping_np)

    def sample(self, *args, **kwargs):
        from vllm.v1.worker.gpu.sample.sampler import Sampler

        arg = inspect.signature(Sampler.sample).bind(self, *args, **kwargs).arguments
        logits = arg["logits"].clone()
        _apply_penalties(
            self.penalties_state,
            logits,
            arg["expanded_idx_mapping"],
            arg["idx_mapping_np"],
            arg["input_ids"],
            arg["expanded_local_pos"],
        )
        self.processed = logits.clone()
        return logits.argmax(dim=-1), logits


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
    batch = prefill_and_tree_batch()
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
    sampler = _FakeSampler(_penalties(rep, freq, pres, counts, prompt))
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32)
    verifier.sample(sampler, logits, batch, draft_tokens, prefill_len)

    expected = logits.clone()
    for row in range(1, 6):  # the tree rows: node = row - 1
        ctx = counts.clone()
        for t in _node_path(row - 1):
            ctx[2, t] += 1
        one = expected[row : row + 1].clone()
        _chain_penalties(
            one,
            torch.tensor([2]),
            None,
            torch.tensor([0]),
            rep,
            freq,
            pres,
            prompt,
            ctx,
        )
        expected[row] = one[0]
    torch.testing.assert_close(sampler.processed, expected, rtol=1e-6, atol=1e-6)
    # Outside a tree step the state is upstream's: chain penalties.
    state = sampler.penalties_state
    plain = logits.clone()
    _apply_penalties(
        state,
        plain,
        torch.tensor([2] * 6, dtype=torch.int32),
        np.array([2]),
        batch.input_ids[2:8],
        torch.arange(6, dtype=torch.int32),
    )
    chain = logits.clone()
    _chain_penalties(
        chain,
        torch.tensor([2] * 6),
        batch.input_ids[2:8],
        torch.arange(6),
        rep,
        freq,
        pres,
        prompt,
        counts,
    )
    torch.testing.assert_close(plain, chain, rtol=1e-6, atol=1e-6)


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
    batch = prefill_and_tree_batch()
    batch.cu_num_logits_np = np.array([0, 1, 6])
    verifier.prepare_verify(batch)
    # Root draws 11 (node 1), node 1 draws 14 (node 4), node 4 draws 9.
    logits = torch.full((6, VOCAB), -2.0)
    for row, tok in enumerate([5, 11, 14, 30, 30, 9]):
        logits[row, tok] = 3.0
    logits[2, 13] = 2.5  # node 1's row: 13 is its second choice
    sampler = _FakeSampler(_no_penalties(), logprobs=True)
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
def _real_sampler(seeds):
    """The V2 Sampler of vLLM with requests at temperature 1 and ``seeds`` (request
    state -> seed), bound to a verifier as the model runner binds it. fp64
    Gumbel noise: the fp32 path's log1p is a libdevice call that the Triton
    interpreter does not have."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.states import RequestState

    device = torch.device("cpu")
    req_states = RequestState(
        max_num_reqs=4,
        max_model_len=64,
        max_num_batched_tokens=64,
        num_speculative_steps=B,
        vocab_size=VOCAB,
        device=device,
    )
    kwargs = dict(
        max_num_reqs=4,
        vocab_size=VOCAB,
        device=device,
        req_states=req_states,
        num_speculative_tokens=B + 1,
        use_fp64_gumbel=True,
    )
    if "vllm_config" in inspect.signature(Sampler).parameters:
        # vLLM 0.33+: the sampler reads the reasoning config (none here).
        kwargs["vllm_config"] = SimpleNamespace(reasoning_config=None)
    sampler = Sampler(**kwargs)
    sampler.use_flashinfer = False
    verifier = _verifier()
    verifier.bind_sampler(sampler)
    # vLLM 0.26: add_request(req_idx, prompt_len, params); 0.33: no prompt_len.
    takes_prompt_len = "prompt_len" in inspect.signature(sampler.add_request).parameters
    for state, seed in seeds.items():
        params = SamplingParams(temperature=1.0, seed=seed)
        if takes_prompt_len:
            sampler.add_request(state, 3, params)
        else:
            sampler.add_request(state, params)
    sampler.apply_staged_writes()
    return verifier, sampler


def _seeded_run(seed, monkeypatch):
    verifier, sampler = _real_sampler({0: 11, 2: seed})
    draft_tokens = _store_one_tree(verifier)
    batch = prefill_and_tree_batch()
    verifier.prepare_verify(batch)
    logits = torch.zeros(6, VOCAB)  # uniform: the noise alone decides
    seen = {}
    real_sample = sampler.sample

    def recording_sample(*args, **kwargs):
        sampled, processed = real_sample(*args, **kwargs)
        pos = inspect.signature(real_sample).bind(*args, **kwargs).arguments["pos"]
        seen.update(pos=pos.clone(), draws=sampled.clone())
        return sampled, processed

    monkeypatch.setattr(sampler, "sample", recording_sample)
    prefill_len = torch.tensor([3, 0, 10, 0], dtype=torch.int32)
    out = verifier.sample(sampler, logits, batch, draft_tokens, prefill_len)
    return seen["pos"].tolist(), seen["draws"].tolist(), out, real_sample, batch


def test_seeded_draws_are_keyed_by_tree_position_and_reproducible(monkeypatch):
    """The real sampler (penalties state, temperature, Gumbel kernel) draws
    every tree row with the request's seed at the row's tree position."""
    pos, draws, out, real_sample, batch = _seeded_run(42, monkeypatch)
    # The sampler saw tree positions: root 20, depth-1 nodes 21, depth-2 22.
    assert pos == [2, 20, 21, 21, 22, 22]
    # Siblings share their position's noise: identical logits, same draw.
    assert draws[2] == draws[3] and draws[4] == draws[5]
    # The same draws as the sampler's own call at those positions.
    again, _ = real_sample(
        *_sample_arguments(
            torch.zeros(6, VOCAB),
            batch,
            torch.tensor(pos),
            batch.input_ids[batch.logits_indices],
        )
    )
    assert again.tolist() == draws
    # The emitted tokens follow the draws from the root.
    assert out.sampled_token_ids[1, 0].item() == draws[1]
    assert out.sampled_token_ids[0, 0].item() == draws[0]
    # Run to run the same; another seed, other draws.
    assert _seeded_run(42, monkeypatch)[1] == draws
    assert _seeded_run(43, monkeypatch)[1][1:] != draws[1:]
