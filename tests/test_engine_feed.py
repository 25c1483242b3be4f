"""The torch engine's request feed: requests added while `generate` runs join the running batch
(rollwise.generate.feed, `caps.request_feed`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.testing import assert_close

from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate import TorchEngine
from rollwise.generate.feed import RequestFeed
from rollwise.types import GenerationRequest, SamplingParams, Status

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
TEXTS = ["What is 7 + 3?", "Compute 12 - 5.", "How many letters are in the word 'banana'?", "9 + 9 = ?"]


def _setup():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=4, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok, model, [tok(t, add_special_tokens=False).input_ids for t in TEXTS]


def _alone(engine, request):
    """The request run by itself, in a call of its own (no feed)."""
    return engine.generate([request])[0]


def test_fed_requests_join_the_running_batch_and_match_running_alone():
    tok, model, prompts = _setup()
    engine = TorchEngine(model, tok, max_batch_size=8)
    first = [GenerationRequest(0, prompts[0], SamplingParams(max_new_tokens=64, temperature=0))]
    # longer than the first request's context (the cache grows columns) and more than its one slot
    long_prompt = prompts[2] * 6
    fed = [GenerationRequest(1, long_prompt, GREEDY), GenerationRequest(2, prompts[1], GREEDY),
           GenerationRequest(3, prompts[3], GREEDY)]
    feed, finished = RequestFeed(), {}

    def producer():
        while engine.stats.decode_steps < 3:  # the call is under way
            time.sleep(0.001)
        for r in fed:
            feed.put(r)
        feed.close()

    thread = threading.Thread(target=producer)
    thread.start()
    out = engine.generate(first, on_finish=lambda r: finished.__setitem__(r.request_id, r), feed=feed)
    thread.join()
    assert [r.request_id for r in out] == [0]  # the call returns its own requests; fed ones reach on_finish
    assert sorted(finished) == [0, 1, 2, 3]
    assert finished[0].status == Status.TRUNCATED  # request 0 ran 64 steps: the fed ones came while it ran
    assert engine.stats.active_slot_steps > engine.stats.decode_steps  # ... and decoded beside it
    reference = TorchEngine(model, tok, max_batch_size=8)
    for r in first + fed:
        want = _alone(reference, r)
        assert finished[r.request_id].response_ids == want.response_ids
        assert_close(torch.tensor(finished[r.request_id].logprobs), torch.tensor(want.logprobs))
        assert finished[r.request_id].status in (Status.COMPLETED, Status.TRUNCATED)


def test_an_idle_engine_waits_for_the_feed_and_returns_when_it_is_closed():
    tok, model, prompts = _setup()
    engine = TorchEngine(model, tok)
    feed, finished = RequestFeed(), []

    def producer():
        time.sleep(0.3)  # the engine has nothing to do meanwhile: it must wait, not return
        feed.put(GenerationRequest(7, prompts[1], GREEDY))
        time.sleep(0.3)
        feed.close()

    thread = threading.Thread(target=producer)
    start = time.perf_counter()
    thread.start()
    assert engine.generate([], on_finish=finished.append, feed=feed) == []
    thread.join()
    assert time.perf_counter() - start >= 0.6
    assert [r.request_id for r in finished] == [7] and finished[0].response_ids


def test_a_failed_feed_raises_in_generate():
    tok, model, prompts = _setup()
    engine = TorchEngine(model, tok)
    feed = RequestFeed()
    feed.fail(RuntimeError("the producer crashed"))
    with pytest.raises(RuntimeError, match="the producer crashed"):
        engine.generate([GenerationRequest(0, prompts[0], GREEDY)], feed=feed)
    with pytest.raises(RuntimeError, match="after close"):
        feed.put(GenerationRequest(1, prompts[0], GREEDY))


def test_aborting_a_fed_request_before_it_runs_returns_it_at_once():
    tok, model, prompts = _setup()
    engine = TorchEngine(model, tok)
    feed, finished = RequestFeed(), {}
    engine.abort([5])
    feed.put(GenerationRequest(5, prompts[0], GREEDY, response_ids=[11, 12], response_logprobs=[-1.0, -2.0]))
    feed.close()
    engine.generate([GenerationRequest(4, prompts[1], GREEDY)], on_finish=lambda r: finished.update({r.request_id: r}),
                    feed=feed)
    assert finished[5].status == Status.ABORTED and finished[5].response_ids == [11, 12]
    assert finished[4].status in (Status.COMPLETED, Status.TRUNCATED)
