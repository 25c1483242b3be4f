"""Continuous batching: more requests than slots, shared prefill, stop and continue a request."""

import torch
from torch.testing import assert_close

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate import TorchEngine
from rollwise.types import GenerationRequest, SamplingParams, Status


def _setup():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    texts = ["What is 7 + 3?", "Compute 12 - 5.", "How many letters are in the word 'banana'?", "9 + 9 = ?"]
    return tok, model, [tok(t, add_special_tokens=False).input_ids for t in texts]


def test_results_do_not_depend_on_the_number_of_slots():
    tok, model, prompts = _setup()
    params = SamplingParams(max_new_tokens=10, temperature=0)
    reqs = [GenerationRequest(i, prompts[i % 4], params) for i in range(11)]
    wide = TorchEngine(model, tok, max_batch_size=64).generate(reqs)
    narrow_engine = TorchEngine(model, tok, max_batch_size=3)
    narrow = narrow_engine.generate(reqs)
    for a, b in zip(wide, narrow):
        assert a.request_id == b.request_id and a.response_ids == b.response_ids
        assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    # 3 slots for 11 requests: slots were reused, and prompts repeated -> fewer prefills than requests
    assert narrow_engine.stats.decode_steps > 10


def test_samples_of_one_prompt_share_one_prefill():
    tok, model, prompts = _setup()
    engine = TorchEngine(model, tok)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    engine.generate([GenerationRequest(i, prompts[0], params) for i in range(8)])
    assert engine.stats.prefill_tokens == len(prompts[0])  # one prefill for 8 samples


def test_aborted_request_continues_exactly_as_uninterrupted():
    tok, model, prompts = _setup()
    params = SamplingParams(max_new_tokens=12, temperature=0)
    engine = TorchEngine(model, tok)
    (full,) = engine.generate([GenerationRequest(0, prompts[2], params)])
    assert full.status == Status.TRUNCATED  # runs the whole budget: the abort below lands mid-response
    short = SamplingParams(max_new_tokens=4, temperature=0)
    # as partial rollouts do: when one request finishes, the callback aborts the other mid-generation
    _, part = engine.generate([GenerationRequest(9, prompts[0], short), GenerationRequest(1, prompts[2], params)],
                              on_finish=lambda result: engine.abort([1]) if result.request_id == 9 else None)
    assert part.status == Status.ABORTED and 0 < len(part.response_ids) < len(full.response_ids)
    engine.version = 1  # continued under a new policy version (same weights here)
    (rest,) = engine.generate([GenerationRequest(1, prompts[2], params, part.response_ids, part.logprobs)])
    assert rest.response_ids == full.response_ids
    assert_close(torch.tensor(rest.logprobs), torch.tensor(full.logprobs))
    # the continuation records only its own span, under the new version
    assert rest.version_spans == [(len(part.response_ids), len(full.response_ids), 1)]
    assert rest.status == full.status


def test_mixed_sampling_params_share_prefill_and_keep_their_own_results():
    tok, model, prompts = _setup()
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    sampled = SamplingParams(max_new_tokens=9, temperature=1.0, seed=7)
    engine = TorchEngine(model, tok)
    mixed = engine.generate([GenerationRequest(2 * i + k, p, params)
                             for i, p in enumerate(prompts) for k, params in enumerate((sampled, greedy))])
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts)  # one prefill per prompt, both modes
    alone = TorchEngine(model, tok).generate([GenerationRequest(i, p, greedy) for i, p in enumerate(prompts)])
    for i, res in enumerate(alone):
        assert mixed[2 * i + 1].response_ids == res.response_ids  # greedy unaffected by its sampled neighbours
        assert len(mixed[2 * i].response_ids) <= 9 and len(res.response_ids) <= 6
    again = TorchEngine(model, tok).generate([GenerationRequest(2 * i + k, p, params)
                                              for i, p in enumerate(prompts) for k, params in enumerate((sampled, greedy))])
    assert [r.response_ids for r in again] == [r.response_ids for r in mixed]  # seeded: repeatable
