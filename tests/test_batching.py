"""Micro-batching and prompt-shared packing: same log-probabilities and gradients as plain rows."""

import random

import pytest
import torch
from torch.testing import assert_close

from helpers_model import tiny_llama
from rollwise.train.batching import collate, split_by_tokens
from rollwise.train.logprobs import token_logprobs
from rollwise.types import Prompt, Sample, Status

VOCAB = 97


def _samples(n_prompts=3, per_prompt=4, seed=0):
    rng = random.Random(seed)
    out = []
    for g in range(n_prompts):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 9))]
        for _ in range(per_prompt):
            n = rng.randint(1, 7)
            resp = [rng.randrange(3, VOCAB) for _ in range(n)]
            out.append(Sample(Prompt(str(g), []), prompt, resp, [0.0] * n, [1] * n, Status.COMPLETED, g,
                              advantage=rng.uniform(-1, 1)))
    return out


def _grads(model, samples, share):
    model.zero_grad()
    mb = collate(samples, pad_id=0, share_prompt=share)
    logp, ent = token_logprobs(model, mb, temperature=0.9)
    order = [samples.index(s) for s in mb.samples]
    (logp * mb.advantages[:, None] * mb.loss_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    back = torch.empty_like(logp)
    back[torch.tensor(order)] = logp.detach()
    return back, grads, mb


def test_shared_prompt_packing_matches_plain_rows():
    model = tiny_llama(VOCAB, seed=3).train()
    samples = _samples()
    plain_logp, plain_grads, plain_mb = _grads(model, samples, share=False)
    shared_logp, shared_grads, shared_mb = _grads(model, samples, share=True)
    assert shared_mb.input_ids.shape[0] == 1 and plain_mb.input_ids.shape[0] == 12  # one packed row
    assert shared_mb.real_tokens < plain_mb.real_tokens  # each prompt computed once
    assert shared_mb.computed_tokens == shared_mb.real_tokens  # no padding
    assert shared_mb.attention_mask is None  # a model on plain SDPA gets the layout's dense mask
    assert_close(shared_logp, plain_logp)
    for name in plain_grads:
        assert_close(shared_grads[name], plain_grads[name], msg=name)


def test_pred_index_points_at_previous_token():
    samples = _samples(1, 2)
    mb = collate(samples, pad_id=0, share_prompt=True)
    flat = mb.input_ids.reshape(-1)
    P = len(samples[0].prompt_ids)
    for k, s in enumerate(mb.samples):
        n = len(s.response_ids)
        idx = mb.pred_index[k, :n]
        assert int(idx[0]) == P - 1  # first token predicted from the last prompt token
        # later tokens: predicted from the previous response token
        assert flat[idx[1:]].tolist() == s.response_ids[:-1]


def test_split_by_tokens_respects_budget_and_keeps_every_sample():
    samples = _samples(5, 6, seed=1)
    for share in (False, True):
        batches = split_by_tokens(samples, max_tokens=40, share_prompt=share)
        assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in samples)
        for b in batches:
            mb = collate(b, 0, share_prompt=share)
            one_unit = len({tuple(s.prompt_ids) for s in b}) == 1 if share else len(b) == 1
            assert mb.computed_tokens <= 40 or one_unit


@pytest.mark.parametrize("form", ["split", "prefix"])
def test_block_attention_for_shared_rows_matches_plain_rows(form, monkeypatch):
    """Both segment forms (split: the CPU's; prefix: CUDA's) give the plain rows' log-probs and gradients."""
    from rollwise.train import shared_attention

    monkeypatch.setattr(shared_attention, "FORCE_FORM", form)
    model = tiny_llama(VOCAB, seed=0)
    samples = _samples(n_prompts=3, per_prompt=5, seed=3)
    logp_plain, grads_plain, _ = _grads(model, samples, share=False)
    model.set_attn_implementation(shared_attention.NAME)
    logp_block, grads_block, mb = _grads(model, samples, share=True)
    assert mb.layout.prefix.gather.shape[0] == 15 and mb.layout.split.queries.shape[0] == 15  # one per response
    assert mb.layout.split.prompts.shape[0] == 3  # one per prompt
    assert_close(logp_block, logp_plain, rtol=1e-5, atol=1e-5)
    for name, grad in grads_plain.items():
        assert_close(grads_block[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("form", ["split", "prefix"])
def test_packed_row_with_empty_responses_matches_plain_rows(form, monkeypatch):
    """A response of length 0, and a prompt whose every response is empty (no response segment)."""
    from rollwise.train import shared_attention

    monkeypatch.setattr(shared_attention, "FORCE_FORM", form)
    samples = _samples(n_prompts=3, per_prompt=3, seed=5)
    for s in samples[:2] + samples[3:6]:  # prompt 1: all three empty; prompt 0: two of three
        s.response_ids, s.behaviour_logprobs, s.loss_mask = [], [], []
    model = tiny_llama(VOCAB, seed=1)
    logp_plain, grads_plain, _ = _grads(model, samples, share=False)
    model.set_attn_implementation(shared_attention.NAME)
    logp_block, grads_block, mb = _grads(model, samples, share=True)
    assert mb.computed_tokens == mb.real_tokens
    assert_close(logp_block, logp_plain, rtol=1e-5, atol=1e-5)
    for name, grad in grads_plain.items():
        assert_close(grads_block[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_segment_layout_by_hand():
    """Two units packed: [p p r r r | q q q s], prompts of 2 and 3 tokens, one response each (3 and 1 tokens)."""
    from rollwise.train.segments import SegmentLayout

    layout = SegmentLayout.build([(0, 2, [(2, 3)]), (5, 3, [(8, 1)])], 9)
    prefix, split = layout.prefix, layout.split
    assert prefix.gather.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 8]]  # short segments repeat their last
    assert prefix.scatter.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # W = 5: each token its own slot here
    assert split.prompts.tolist() == [[0, 1, 1], [5, 6, 7]]  # P_max = 3
    assert split.queries.tolist() == [[2, 3, 4], [8, 8, 8]]  # L_r = 3
    assert split.keys.tolist() == [[0, 1, 1, 2, 3, 4], [5, 6, 7, 8, 8, 8]]
    assert split.mask[0, 0].tolist() == [[True, True, False, True, False, False],  # prompt padding hidden
                                         [True, True, False, True, True, False],
                                         [True, True, False, True, True, True]]
    # outputs: prompts [2 x 3] first, then responses [2 x 3]
    assert split.scatter.tolist() == [0, 1, 6, 7, 8, 3, 4, 5, 9]
    assert split.key_pos.tolist()[1] == [0, 1, 2, 3, 4, 5] and split.query_pos.tolist()[0] == [2, 3, 4]
    mask = layout.dense_mask()[0, 0]
    assert mask[8].tolist() == [False] * 5 + [True] * 4  # the second unit sees only itself
    assert mask[4].tolist() == [True] * 5 + [False] * 4


def test_split_packs_units_up_to_the_budget_without_padding():
    samples = _samples(6, 4, seed=2)
    budget = 60
    batches = split_by_tokens(samples, max_tokens=budget, share_prompt=True)
    for b in batches:
        mb = collate(b, 0, share_prompt=True)
        assert mb.computed_tokens == mb.real_tokens
        assert mb.computed_tokens <= budget or len({tuple(s.prompt_ids) for s in b}) == 1
    assert len(batches) < len({tuple(s.prompt_ids) for s in samples})  # several units share a micro-batch
