"""Advantage estimators (rloo, reinforce_pp, gae) and the value loss against hand-computed values."""

import math

import pytest
import torch
from torch.testing import assert_close

from rollwise import algo


def test_rloo_leave_one_out_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    # group 0: sum 2, n 4: A = r - (2 - r) / 3 -> 1 - 1/3 = 2/3, 0 - 2/3 = -2/3
    # group 1: a single sample has no baseline -> 0
    # group 2: [3, 1] -> 3 - 1 = 2, 1 - 3 = -2
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 2.0, -2.0])
    assert_close(algo.advantage("rloo", rewards, groups), expected)


def test_rloo_is_n_over_n_minus_one_times_dr_grpo():
    rewards = torch.tensor([0.3, 1.0, 0.0, 2.0, 5.0, 1.5, -1.0, 0.25, 0.75])
    groups = torch.tensor([4, 4, 4, 4, 9, 9, 2, 2, 2])  # sizes 4, 2, 3
    n = torch.tensor([4.0, 4, 4, 4, 2, 2, 3, 3, 3])
    assert_close(algo.advantage("rloo", rewards, groups), n / (n - 1) * algo.advantage("dr_grpo", rewards, groups))


def test_reinforce_pp_group_baseline_then_batch_normalisation():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    # group means 0.5 and 1 -> x = [0.5, -0.5, 0, 0]; batch mean 0;
    # unbiased batch std = sqrt((0.25 + 0.25) / 3) = sqrt(1/6)
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0]) / (math.sqrt(1 / 6) + 1e-6)
    assert_close(algo.advantage("reinforce_pp", rewards, groups), expected)


def test_reinforce_pp_single_sample_is_zero():
    assert_close(algo.advantage("reinforce_pp", torch.tensor([3.0]), torch.tensor([0])), torch.tensor([0.0]))


def test_gae_gamma_lambda_one_is_return_minus_value():
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = algo.token_advantage("gae", torch.tensor([1.0]), values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    # outcome reward 1 on the last token, V = 0 after it: A_t = 1 - V_t, R_t = 1
    assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_discounted_with_padding():
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = algo.token_advantage("gae", torch.tensor([1.0, 0.0]), values, mask, gamma=0.9, lam=0.5)
    # row 0 (gamma * lam = 0.45):
    #   delta_2 = 1 + 0 - 0.7 = 0.3;  delta_1 = 0.9*0.7 - 0.6 = 0.03;  delta_0 = 0.9*0.6 - 0.5 = 0.04
    #   A_2 = 0.3;  A_1 = 0.03 + 0.45*0.3 = 0.165;  A_0 = 0.04 + 0.45*0.165 = 0.11425
    #   R = A + V = [0.61425, 0.765, 1.0]
    # row 1: last trained token is t=1 (the 9.0 is padding and never read), reward 0:
    #   delta_1 = 0 + 0 - 0.4 = -0.4;  delta_0 = 0.9*0.4 - 0.2 = 0.16
    #   A_1 = -0.4;  A_0 = 0.16 + 0.45*(-0.4) = -0.02;  R = [0.18, 0.0, 0 (padding)]
    assert_close(adv, torch.tensor([[0.11425, 0.165, 0.3], [-0.02, -0.4, 0.0]]))
    assert_close(ret, torch.tensor([[0.61425, 0.765, 1.0], [0.18, 0.0, 0.0]]))


def test_gae_token_rewards_and_mask_gap_are_skipped():
    values = torch.tensor([[0.5, 100.0, 0.7]])
    rewards = torch.tensor([[0.0, 5.0, 1.0]])  # the reward at the untrained position is ignored
    adv, _ = algo.token_advantage("gae", rewards, values, torch.tensor([[1.0, 0.0, 1.0]]), gamma=1.0, lam=1.0)
    # the gap is skipped: A_2 = 1 - 0.7 = 0.3;  delta_0 = 0 + 0.7 - 0.5 = 0.2;  A_0 = 0.2 + 0.3 = 0.5
    assert_close(adv, torch.tensor([[0.5, 0.0, 0.3]]))


def test_gae_through_advantage_entry_point_and_whitening():
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([1.0, 0.0])
    adv = algo.advantage("gae", rewards, torch.tensor([0, 1]), values=values, mask=mask, gamma=0.9, lam=0.5)
    assert_close(adv, algo.token_advantage("gae", rewards, values, mask, gamma=0.9, lam=0.5)[0])
    white, ret = algo.token_advantage("gae", rewards, values, mask, gamma=0.9, lam=0.5, whiten=True)
    trained = white[mask > 0]
    assert_close(trained.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    assert_close(trained.std(unbiased=False), torch.tensor(1.0), atol=1e-4, rtol=0)
    assert white[1, 2] == 0 and ret[0, 2] == 1.0  # whitening leaves padding at 0 and returns unchanged
    assert algo.is_token_advantage("gae") and not algo.is_token_advantage("grpo")
    with pytest.raises(ValueError, match="values"):
        algo.advantage("gae", rewards, torch.tensor([0, 1]))


def test_value_loss_clipped_and_gradients():
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, m = algo.value_loss(values, old, returns, mask, clip=0.2)
    # t0: (1-2)^2 = 1; V_clip = 0.5 + 0.2 = 0.7, (0.7-2)^2 = 1.69 -> 0.5 * 1.69 = 0.845 (clipped branch)
    # t1: (2-0)^2 = 4; V_clip = 1.2, 1.44 -> 0.5 * 4 = 2.0
    # t2: inside the band, V_clip = V: 0.5 * (0-1)^2 = 0.5
    assert_close(loss, torch.tensor([[0.845, 2.0, 0.5]]))
    assert_close(m["clip_frac"], torch.tensor(1 / 3))
    loss.sum().backward()
    # d/dV 0.5 (V-R)^2 = V - R where the unclipped branch counts; the clipped branch is constant in V
    assert_close(values.grad, torch.tensor([[0.0, 2.0, -1.0]]))


def test_value_loss_without_clip():
    values = torch.tensor([[1.0, 2.0, 0.0]])
    loss, m = algo.value_loss(values, values, torch.tensor([[2.0, 0.0, 1.0]]), torch.ones(1, 3))
    assert_close(loss, torch.tensor([[0.5, 2.0, 0.5]]))  # 0.5 * (V - R)^2
    assert_close(m["error_abs_mean"], torch.tensor(4 / 3))  # (1 + 2 + 1) / 3
