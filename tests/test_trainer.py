"""Trainer: PPO's old log-probs come from the engine by default, and the mismatch is measured."""

import math
import random

import torch
from torch.testing import assert_close

from helpers_model import tiny_llama
from rollwise.config import AlgoConfig, TrainConfig
from rollwise.train.batching import collate
from rollwise.train.logprobs import token_logprobs
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt, Sample, Status

VOCAB = 97


def _samples(model, offset: float) -> list[Sample]:
    """Two groups of positive-advantage samples whose behaviour logprobs = trainer logprobs - offset."""
    rng = random.Random(0)
    out = []
    for g in range(2):
        prompt = [rng.randrange(3, VOCAB) for _ in range(5)]
        for _ in range(3):
            resp = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))]
            out.append(Sample(Prompt(str(g), []), prompt, resp, [0.0] * len(resp), [1] * len(resp),
                              Status.COMPLETED, g, advantage=1.0))
    mb = collate(out, pad_id=0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb)
    for row, sample in enumerate(mb.samples):
        n = len(sample.response_ids)
        sample.behaviour_logprobs = (logp[row, :n] - offset).tolist()
    return out


def _step(old_logprobs: str, offset: float):
    model = tiny_llama(VOCAB, seed=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, TrainConfig(lr=1e-2, old_logprobs=old_logprobs), AlgoConfig(clip_high=0.28), pad_id=0)
    metrics = trainer.step(_samples(model, offset))
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())
    return metrics, moved


def test_behaviour_logprobs_are_the_old_policy_and_clip_the_update():
    # ratio = exp(logp - behaviour) = exp(log 2) = 2 > 1 + clip_high on every token, advantage > 0:
    # every token is clipped, so no gradient reaches the weights.
    metrics, moved = _step("behaviour", offset=math.log(2.0))
    assert moved == 0.0
    assert_close(metrics["mismatch/logprob_abs_diff_mean"], math.log(2.0), rtol=1e-5, atol=1e-6)


def test_recomputed_old_logprobs_ignore_the_engine_numbers():
    # old = the trainer's own (detached) logp: ratio 1, nothing clipped, the weights move;
    # the mismatch is still reported against the engine's numbers.
    metrics, moved = _step("recompute", offset=math.log(2.0))
    assert moved > 0.0
    assert_close(metrics["mismatch/logprob_abs_diff_mean"], math.log(2.0), rtol=1e-5, atol=1e-6)


def test_matching_behaviour_logprobs_give_the_on_policy_update():
    # with no mismatch, using the engine's logprobs as old equals the on-policy update
    a, moved_a = _step("behaviour", offset=0.0)
    b, moved_b = _step("recompute", offset=0.0)
    assert moved_a > 0.0
    assert_close(moved_a, moved_b, rtol=1e-4, atol=1e-7)
    assert_close(a["train/loss"], b["train/loss"], rtol=1e-4, atol=1e-6)
