"""Length shaping of outcome rewards (ALP, DAPO soft overlong punishment) against hand-computed values."""

import pytest
import torch
from torch.testing import assert_close

from rollwise import algo

CORRECT = torch.tensor([True, True, True, False, False, False])
REWARDS = CORRECT.float()
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1])
LENGTHS = torch.tensor([100, 200, 300, 400, 500, 1000])


def test_alp_with_the_papers_floor():
    shaped = algo.shape_rewards("alp", REWARDS, LENGTHS, GROUPS, CORRECT, beta=0.1, max_len=1000)
    # group 0 solve rate 3/4: penalty 0.1 * 0.75 * len / 1000 -> 0.0075, 0.015, 0.0225, 0.03
    # group 1 solve rate 0, floored to 1/n = 1/2: penalty 0.1 * 0.5 * len / 1000 -> 0.025, 0.05
    expected = torch.tensor([1 - 0.0075, 1 - 0.015, 1 - 0.0225, -0.03, -0.025, -0.05])
    assert_close(shaped, expected)


def test_alp_without_floor_leaves_unsolved_prompts_alone():
    shaped = algo.shape_rewards("alp", REWARDS, LENGTHS, GROUPS, CORRECT, beta=0.1, max_len=1000, floor=False)
    assert_close(shaped[4:], torch.tensor([0.0, 0.0]))  # p = 0: no penalty
    assert_close(shaped[:4], torch.tensor([1 - 0.0075, 1 - 0.015, 1 - 0.0225, -0.03]))


def test_alp_default_normaliser_is_the_longest_response_and_easy_prompts_pay_more():
    default = algo.shape_rewards("alp", REWARDS, LENGTHS, GROUPS, CORRECT, beta=0.1)
    assert_close(default, algo.shape_rewards("alp", REWARDS, LENGTHS, GROUPS, CORRECT, beta=0.1, max_len=1000))
    # same length, same reward: the group that solves more pays more
    easy = algo.shape_rewards("alp", torch.zeros(4), torch.full((4,), 500), torch.tensor([0, 0, 1, 1]),
                              torch.tensor([True, True, True, False]), beta=0.1, max_len=1000, floor=False)
    assert easy[0] < easy[2] < 0  # p = 1 -> -0.05; p = 1/2 -> -0.025
    assert_close(easy, torch.tensor([-0.05, -0.05, -0.025, -0.025]))


def test_overlong_soft_piecewise():
    lengths = torch.tensor([50, 80, 90, 100, 101, 150])
    rewards = torch.ones(6)
    shaped = algo.shape_rewards("overlong_soft", rewards, lengths, torch.arange(6), torch.ones(6, dtype=torch.bool),
                                max_len=100, cache_len=20)
    # expected length 100 - 20 = 80: <= 80 -> 0; 90 -> (80 - 90) / 20 = -0.5; 100 -> -1; > 100 -> -1
    assert_close(shaped, torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0, 0.0]))
    half = algo.shape_rewards("overlong_soft", rewards, lengths, torch.arange(6), torch.ones(6, dtype=torch.bool),
                              max_len=100, cache_len=20, penalty=0.5)
    assert_close(half, torch.tensor([1.0, 1.0, 0.75, 0.5, 0.5, 0.5]))


def test_overlong_soft_defaults_are_dapos_and_cache_must_be_positive():
    lengths = torch.tensor([16384, 18432, 20480, 20481])  # 16384 + 4096 = 20480
    never = torch.zeros(4, dtype=torch.bool)
    shaped = algo.shape_rewards("overlong_soft", torch.zeros(4), lengths, torch.arange(4), never)
    assert_close(shaped, torch.tensor([0.0, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="cache_len"):
        algo.shape_rewards("overlong_soft", torch.zeros(1), torch.ones(1), torch.zeros(1), torch.zeros(1), cache_len=0)
