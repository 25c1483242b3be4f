"""GRPO math against hand-computed values (advantages, clipped surrogate, aggregation, KL)."""

import math

import torch
from torch.testing import assert_close

from rollwise import algo


def test_grpo_advantage_group_normalised():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])
    adv = algo.advantage("grpo", rewards, groups)
    # group 7: mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.577350; 0.5 / (0.577350 + 1e-6) = 0.866024
    # group 3: all equal -> 0 (std 0, numerator 0)
    expected = torch.tensor([0.866024, -0.866024, -0.866024, 0.866024, 0, 0, 0, 0])
    assert_close(adv, expected, atol=1e-6, rtol=0)


def test_grpo_advantage_uneven_rewards():
    rewards = torch.tensor([2.0, 0.0, 1.0])
    adv = algo.advantage("grpo", rewards, torch.tensor([0, 0, 0]))
    # mean 1, unbiased std = sqrt((1 + 1 + 0) / 2) = 1 -> (r - 1) / (1 + 1e-6)
    assert_close(adv, torch.tensor([1.0, -1.0, 0.0]) / (1 + 1e-6))


def test_dr_grpo_is_unscaled_and_grpo_scale_false_matches():
    rewards = torch.tensor([3.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1])
    # group 0 mean 2 -> [1, -1]; group 1 mean 0.5 -> [0, 0]
    expected = torch.tensor([1.0, -1.0, 0.0, 0.0])
    assert_close(algo.advantage("dr_grpo", rewards, groups), expected)
    assert_close(algo.advantage("grpo", rewards, groups, scale=False), expected)


def test_ppo_clip_asymmetric_bounds():
    # ratios: [[1.5, 1.5], [0.5, 0.5]]; advantages per sequence [+1, -1] then [+1, -1] by column
    logp = torch.log(torch.tensor([[1.5, 1.5], [0.5, 0.5]]))
    old = torch.zeros(2, 2)
    adv = torch.tensor([[1.0, -1.0], [1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = algo.policy_loss("ppo_clip", logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # r=1.5, A=+1: min(1.5, 1.28) = 1.28 -> -1.28 (clipped)
    # r=1.5, A=-1: min(-1.5, -1.28) = -1.5 -> 1.5
    # r=0.5, A=+1: min(0.5, 0.8) = 0.5 -> -0.5
    # r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> 0.8 (clipped, masked out)
    assert_close(loss, torch.tensor([[-1.28, 1.5], [-0.5, 0.8]]))
    assert_close(m["clip_frac"], torch.tensor(1 / 3))  # of the 3 unmasked tokens, one is clipped
    # token mean over the mask: (-1.28 + 1.5 - 0.5) / 3
    assert_close(algo.aggregate("token_mean", loss, mask), torch.tensor(-0.28 / 3))
    # a micro-batch normalised by the whole batch's token count
    assert_close(algo.aggregate("token_mean", loss, mask, num_tokens=6), torch.tensor(-0.28 / 6))


def test_ppo_clip_sequence_advantages_broadcast():
    logp = torch.zeros(2, 3)
    loss, _ = algo.policy_loss("ppo_clip", logp, logp, torch.tensor([2.0, -1.0]), torch.ones(2, 3))
    # ratio 1 everywhere: loss = -A on every token of the sequence
    assert_close(loss, torch.tensor([[-2.0] * 3, [1.0] * 3]))


def test_ppo_clip_gradients():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.0, 1.5, 0.5, 0.5])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0])
    loss, _ = algo.policy_loss("ppo_clip", logp[None], old[None], adv[None], torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    loss.sum().backward()
    # d(-r*A)/dlogp = -r*A where unclipped; clipped tokens (r=1.5 with A>0, r=0.5 with A<0) give exactly 0
    assert_close(logp.grad, torch.tensor([-1.0, 0.0, 0.0, -0.5]))
    # positive advantage, unclipped: gradient descent raises the sampled token's logprob
    assert logp.grad[0] < 0 and logp.grad[3] < 0


def test_k3_estimator():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-2.0, -2.0, -0.1]])
    # log_ratio = ref - logp = [-1, 0, 0.4]; k3 = e^x - x - 1
    expected = torch.tensor([[math.exp(-1) + 1 - 1, 0.0, math.exp(0.4) - 0.4 - 1]])
    assert_close(algo.kl("k3", logp, ref), expected)
    assert bool((algo.kl("k3", logp, ref) >= 0).all())
