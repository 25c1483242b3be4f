"""The in-process engine: HF-equivalent greedy decoding, behaviour logprobs, stops, aborts."""

import torch
from torch.testing import assert_close

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate import TorchEngine
from rollwise.generate.sampling import filter_logits, sample_tokens
from rollwise.train.batching import collate
from rollwise.train.logprobs import token_logprobs
from rollwise.types import GenerationRequest, Prompt, Sample, SamplingParams, Status


def _setup(seed=0):
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=seed, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok, model


def _prompts(tok):
    texts = ["What is 7 + 3?", "Compute 12 - 5.", "How many letters are in the word 'banana'?"]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def test_greedy_matches_hf_generate_with_left_padding():
    tok, model = _setup()
    prompts = _prompts(tok)
    engine = TorchEngine(model, tok)
    res = engine.generate([GenerationRequest(i, p, SamplingParams(max_new_tokens=12, temperature=0)) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, res):  # one at a time through HF: no padding involved
        out = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert r.response_ids == out[: len(r.response_ids)]
        assert r.status in (Status.COMPLETED, Status.TRUNCATED)
        assert len(r.logprobs) == len(r.response_ids)


def test_truncated_status_and_version_spans():
    tok, model = _setup()
    engine = TorchEngine(model, tok)
    engine.version = 3
    (res,) = engine.generate([GenerationRequest(0, _prompts(tok)[0], SamplingParams(max_new_tokens=5, temperature=1.0))])
    if res.status == Status.TRUNCATED:
        assert len(res.response_ids) == 5
    assert res.version_spans == [(0, len(res.response_ids), 3)]


def test_behaviour_logprobs_match_trainer_fp32():
    tok, model = _setup(seed=1)
    engine = TorchEngine(model, tok)
    prompts = _prompts(tok)
    temperature = 0.8
    reqs = [GenerationRequest(i, p, SamplingParams(max_new_tokens=16, temperature=temperature)) for i, p in enumerate(prompts * 2)]
    res = engine.generate(reqs)
    samples = [
        Sample(Prompt(str(i), []), q.prompt_ids, r.response_ids, r.logprobs, [1] * len(r.response_ids), r.status, i)
        for i, (q, r) in enumerate(zip(reqs, res))
    ]
    mb = collate(samples, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb, temperature=temperature)
    diff = ((logp - mb.behaviour_logp).abs() * mb.loss_mask).sum() / mb.loss_mask.sum()
    assert float(diff) <= 1e-3


def test_stop_string_and_abort():
    tok, model = _setup()
    engine = TorchEngine(model, tok)
    prompt = _prompts(tok)[0]
    (free,) = engine.generate([GenerationRequest(0, prompt, SamplingParams(max_new_tokens=20, temperature=0))])
    text = free.text
    if len(text) > 3:
        stop = text[1:3]
        (stopped,) = engine.generate([GenerationRequest(1, prompt, SamplingParams(max_new_tokens=20, temperature=0, stop=(stop,)))])
        assert stopped.status == Status.COMPLETED
        assert stop not in stopped.text and len(stopped.response_ids) <= len(free.response_ids)
    engine.abort([7])  # aborted before it was admitted: returns at once, with the tokens it came with
    (aborted,) = engine.generate([GenerationRequest(7, prompt, SamplingParams(max_new_tokens=20, temperature=1.0),
                                                    response_ids=[5, 6], response_logprobs=[-1.0, -2.0])])
    assert aborted.status == Status.ABORTED and aborted.response_ids == [5, 6] and aborted.logprobs == [-1.0, -2.0]
    assert aborted.version_spans == []  # no token of this call


def test_seeded_requests_repeat_exactly():
    tok, model = _setup()
    engine = TorchEngine(model, tok)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
    a = engine.generate([GenerationRequest(0, _prompts(tok)[1], params)])[0]
    b = engine.generate([GenerationRequest(0, _prompts(tok)[1], params)])[0]
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # top-p 0.7: keep 0.5 and 0.3 (mass before 0.15 is 0.8 >= 0.7)
    kept = torch.isfinite(filter_logits(logits, 1.0, 0, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, 1.0, 3, 1.0))
    assert kept.tolist() == [[True, True, True, False]]
    # sampled logprob is under the renormalised distribution: 0.5 / 0.8
    tok, lp = sample_tokens(logits, 1.0, top_p=0.7, generator=torch.Generator().manual_seed(0))
    assert int(tok) in (0, 1)
    assert_close(lp, torch.log(torch.tensor([[0.5, 0.3]]) / 0.8)[0, tok])


def test_sampling_frequencies_follow_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).expand(20000, 3)
    tokens, _ = sample_tokens(logits, 1.0, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    assert_close(freq, probs, atol=0.015, rtol=0)
