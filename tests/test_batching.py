"""Micro-batching and prompt-shared packing: same log-probabilities and gradients as plain rows."""

import random

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
    assert shared_mb.input_ids.shape[0] == 3 and plain_mb.input_ids.shape[0] == 12  # one row per prompt
    assert shared_mb.real_tokens < plain_mb.real_tokens  # each prompt computed once
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
            assert mb.computed_tokens <= 40 or mb.input_ids.shape[0] == 1


def test_block_attention_for_shared_rows_matches_plain_rows():
    from rollwise.train.shared_attention import NAME

    model = tiny_llama(VOCAB, seed=0)
    samples = _samples(n_prompts=3, per_prompt=5, seed=3)
    logp_plain, grads_plain, _ = _grads(model, samples, share=False)
    model.set_attn_implementation(NAME)
    logp_block, grads_block, mb = _grads(model, samples, share=True)
    assert mb.layout is not None and len(mb.layout) == 3  # one row per prompt, block attention used
    assert_close(logp_block, logp_plain)
    for name, grad in grads_plain.items():
        assert_close(grads_block[name], grad, rtol=1e-4, atol=1e-5)
