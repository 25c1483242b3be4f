"""Importance corrections (behaviour engine vs trainer's old policy) against hand-computed values."""

import math

import torch
from torch.testing import assert_close

from rollwise import algo

# token ratios old / behaviour = [0.25, 0.5, 1, 3] (behaviour log-probs 0)
RATIOS = torch.tensor([[0.25, 0.5, 1.0, 3.0]])
OLD, BEHAVIOUR, ONES = torch.log(RATIOS), torch.zeros(1, 4), torch.ones(1, 4)


def test_none_is_all_ones():
    w, m = algo.is_weights("none", OLD, BEHAVIOUR, ONES)
    assert_close(w, torch.ones(1, 4))
    # mean |old - behaviour| = (ln 4 + ln 2 + 0 + ln 3) / 4
    assert_close(m["log_ratio_abs_mean"], torch.tensor((math.log(4) + math.log(2) + math.log(3)) / 4))


def test_tis_token_truncates_at_cap():
    w, m = algo.is_weights("tis_token", OLD, BEHAVIOUR, ONES, cap=2.0)
    assert_close(w, torch.tensor([[0.25, 0.5, 1.0, 2.0]]))  # min(ratio, 2)
    assert_close(m["truncated_frac"], torch.tensor(0.25))
    assert_close(m["weight_mean"], torch.tensor(3.75 / 4))


def test_tis_token_with_huge_cap_is_the_plain_ratio():
    gen = torch.Generator().manual_seed(0)
    old, beh = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    w, _ = algo.is_weights("tis_token", old, beh, torch.ones(4, 6), cap=1e30)
    assert_close(w, torch.exp(old - beh))


def test_mis_token_masks_outside_the_band():
    w, m = algo.is_weights("mis_token", OLD, BEHAVIOUR, ONES, low=0.5, high=2.0)
    assert_close(w, torch.tensor([[0.0, 0.5, 1.0, 0.0]]))  # 0.25 < 0.5 and 3 > 2 are dropped
    assert_close(m["masked_frac"], torch.tensor(0.5))


# two sequences: row 0 log ratios [ln 2, ln 8] -> mean ln 4 -> s = 4;
# row 1 [ln 0.5, ln 2, (untrained ln 100)] -> mean 0 -> s = 1
SEQ_OLD = torch.log(torch.tensor([[2.0, 8.0, 1.0], [0.5, 2.0, 100.0]]))
SEQ_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


def test_tis_seq_uses_the_geometric_mean():
    w, m = algo.is_weights("tis_seq", SEQ_OLD, torch.zeros(2, 3), SEQ_MASK, cap=2.0)
    # row 0: min(4, 2) = 2 on its tokens; row 1: 1; untrained positions: 1
    assert_close(w, torch.tensor([[2.0, 2.0, 1.0], [1.0, 1.0, 1.0]]))
    assert_close(m["truncated_frac"], torch.tensor(0.5))  # one sequence of two


def test_mis_seq_drops_whole_sequences():
    w, m = algo.is_weights("mis_seq", SEQ_OLD, torch.zeros(2, 3), SEQ_MASK, low=0.5, high=2.0)
    assert_close(w, torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))  # s = 4 is outside [0.5, 2]
    assert_close(m["masked_frac"], torch.tensor(0.5))


def test_sis_accepts_ratio_at_least_one_and_keeps_truncated_ratio_on_rejection():
    old = torch.log(torch.tensor([[2.0, 1.0, 1e-9]]))
    w, m = algo.is_weights("sis", old, torch.zeros(1, 3), torch.ones(1, 3), cap=2.0, seed=0)
    # ratio >= 1: accepted with probability min(1, r) = 1 -> weight 1;
    # ratio 1e-9: rejected unless the uniform draw is < 1e-9 -> weight min(1e-9, 2) = 1e-9
    assert_close(w, torch.tensor([[1.0, 1.0, 1e-9]]))
    assert_close(m["rejected_frac"], torch.tensor(1 / 3))


def test_sis_rejection_rate_cap_and_seed():
    old = torch.full((200, 500), math.log(0.3))  # ratio 0.3: accepted with probability 0.3
    beh, mask = torch.zeros(200, 500), torch.ones(200, 500)
    w, m = algo.is_weights("sis", old, beh, mask, cap=0.1, seed=3)
    w2, _ = algo.is_weights("sis", old, beh, mask, cap=0.1, seed=3)
    w3, _ = algo.is_weights("sis", old, beh, mask, cap=0.1, seed=4)
    assert torch.equal(w, w2) and not torch.equal(w, w3)
    # accepted -> 1; rejected -> min(0.3, cap 0.1) = 0.1
    rejected = w != 1.0
    assert_close(w[rejected], torch.full_like(w[rejected], 0.1))
    # 100,000 draws: std of the fraction is 0.00145, so 0.005 is > 3 sigma
    assert abs(float(m["rejected_frac"]) - 0.7) < 0.005
    assert_close(m["rejected_frac"], rejected.float().mean())


def test_weights_are_detached_and_one_outside_the_mask():
    old = torch.log(torch.tensor([[3.0, 0.1]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 0.0]])
    for name in algo.IS_CORRECTIONS.names():
        w, _ = algo.is_weights(name, old, torch.zeros(1, 2), mask)
        assert not w.requires_grad, name
        assert w[0, 1] == 1.0, name
