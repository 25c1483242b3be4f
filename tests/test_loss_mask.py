"""Every loss path multiplies the loss mask: tokens the policy did not sample (tool results, template tokens of
multi-turn episodes) get no gradient, and their stored log-prob placeholders change nothing.

Two checks per configuration, on episode-shaped samples (mask 1 1 0 0 0 1 1 ...):
- the gradient reaching the trainer's log-probs and entropies at mask-0 positions is exactly zero;
- filling the mask-0 behaviour / untruncated log-probs with garbage gives bit-identical weights after a step.
A loss that ignored the mask fails one of them (the control test shows the checks are sensitive).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from helpers_model import tiny_llama
from rollwise.algo.registries import AGGREGATIONS, IS_CORRECTIONS, POLICY_LOSSES
from rollwise.config import AlgoConfig, TrainConfig
from rollwise.train.batching import collate
from rollwise.train.logprobs import token_logprobs
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt, Sample, Status

VOCAB = 97
MASK = [1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1]


def episode_samples(model, garbage: bool, seed: int = 0) -> list[Sample]:
    """Two groups of 3 samples; behaviour log-probs near the trainer's on policy tokens; rewards differ."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [rng.randrange(3, VOCAB) for _ in range(5)]
        for k in range(3):
            n = len(MASK) - k
            resp = [rng.randrange(3, VOCAB) for _ in range(n)]
            s = Sample(Prompt(str(g), []), prompt, resp, [0.0] * n, MASK[:n], Status.COMPLETED, g,
                       advantage=(k - 1.0), reward=float(k), train_reward=float(k))
            s.version_spans = [(0, n, 0)]
            out.append(s)
    mb = collate(out, pad_id=0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb)
    offsets, junk = random.Random(99), random.Random(7)  # separate streams: the garbage never shifts the offsets
    for row, s in enumerate(mb.samples):
        n = len(s.response_ids)
        lp = logp[row, :n].tolist()
        off = [0.05 * offsets.random() for _ in range(n)]
        s.behaviour_logprobs = [v - o if m else (junk.uniform(-40.0, 3.0) if garbage else 0.0)
                                for v, o, m in zip(lp, off, s.loss_mask)]
        s.full_logprobs = [v if m else (junk.uniform(-40.0, 3.0) if garbage else 0.0) for v, m in zip(lp, s.loss_mask)]
    return out


def train_once(algo: AlgoConfig, train: TrainConfig, garbage: bool, ignore_mask: bool = False):
    """One trainer step; returns (weights after + loss + grad norm, sum |grad| at mask-0 positions of logp and
    entropy, number of hooked tensors)."""
    torch.manual_seed(0)
    model = tiny_llama(VOCAB, seed=4)
    ref = copy.deepcopy(model).requires_grad_(False) if algo.kl_coef > 0 else None
    samples = episode_samples(model, garbage)
    trainer = Trainer(model, train, algo, pad_id=0, ref_model=ref)
    leaks: list[float] = []
    real = trainer._logprobs

    def watched(m, mb, with_entropy=True, hidden_out=None):
        logp, entropy = real(m, mb, with_entropy=with_entropy, hidden_out=hidden_out)
        outside = (mb.loss_mask == 0) & (mb.targets != 0)  # real tokens the policy did not sample
        for t in (logp, entropy):
            if t is not None and t.requires_grad:
                t.register_hook(lambda grad: leaks.append(float(grad[outside].abs().sum())))
        return logp, entropy

    trainer._logprobs = watched
    if ignore_mask:  # a deliberately broken aggregation that trains every token (the control below)
        aggregate = trainer.objective.aggregate
        trainer.objective.aggregate = lambda per_token, mask, *rest: aggregate(per_token, torch.ones_like(mask), *rest)
    metrics = trainer.step(samples, version=0)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Adam's first step is about lr * sign(grad): the loss and gradient norm show any change of magnitude
    state["loss"] = torch.tensor(metrics["train/loss"])
    state["grad_norm"] = torch.tensor(metrics["train/grad_norm"])
    return state, max(leaks, default=0.0), len(leaks)


CASES = (
    [dict(loss=name) for name in POLICY_LOSSES.names()]
    + [dict(aggregation=name) for name in AGGREGATIONS.names()]
    + [dict(kl_coef=0.1), dict(kl_coef=0.1, kl_estimator="k1"), dict(entropy_coef=0.05)]
    + [dict(is_correction=name, _recompute=True) for name in IS_CORRECTIONS.names() if name != "none"]
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items() if k[0] != "_"))
def test_no_loss_path_reads_tokens_outside_the_mask(case):
    case = dict(case)
    recompute = case.pop("_recompute", False)
    algo = AlgoConfig(**case)
    train = TrainConfig(lr=1e-2, share_prompt=False, old_logprobs="recompute" if recompute else "behaviour")
    clean, leak, hooks = train_once(algo, train, garbage=False)
    dirty, _, _ = train_once(algo, train, garbage=True)
    assert hooks > 0
    assert leak == 0.0, f"gradient reaches mask-0 tokens: {leak}"
    for name in clean:
        assert torch.equal(clean[name], dirty[name]), f"{name} depends on masked placeholders"


def test_both_checks_catch_a_loss_that_ignores_the_mask():
    """Control: with an aggregation that trains every token, the gradient check and the placeholder check fail."""
    algo, train = AlgoConfig(), TrainConfig(lr=1e-2, share_prompt=False, old_logprobs="behaviour")
    clean, leak, _ = train_once(algo, train, garbage=False, ignore_mask=True)
    dirty, _, _ = train_once(algo, train, garbage=True, ignore_mask=True)
    assert leak > 0.0
    assert any(not torch.equal(clean[n], dirty[n]) for n in clean)
