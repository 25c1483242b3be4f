"""Distillation objectives (rollwise.algo.distillation) against hand-computed values and torch's own KL."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rollwise.algo.distillation import distill, gkd, kl

MASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_opd_advantage_by_hand():
    student = torch.tensor([[-1.0, -2.0, -9.0]])
    teacher = torch.tensor([[-0.5, -3.0, 5.0]])
    adv, metrics = distill("opd", student, teacher, MASK, reward_advantage=torch.tensor([0.25]), coef=2.0)
    # A_t = 0.25 - 2 * (s - t): token 0: 0.25 - 2 * (-0.5) = 1.25; token 1: 0.25 - 2 * 1.0 = -1.75; token 2 masked
    assert_close(adv, torch.tensor([[1.25, -1.75, 0.0]]))
    assert_close(metrics["teacher_kl"], torch.tensor(0.25))  # mean of (-0.5, 1.0)
    pure, _ = distill("opd", student, teacher, MASK)  # reward weight 0: pure OPD
    assert_close(pure, torch.tensor([[0.5, -1.0, 0.0]]))
    same, m = distill("opd", student, student.clone(), MASK)
    assert torch.equal(same, torch.zeros_like(same)) and float(m["teacher_kl"]) == 0.0


def test_gkd_two_token_vocab_by_hand():
    # student p = (0.5, 0.5), teacher q = (0.9, 0.1) at one position
    s = torch.log(torch.tensor([[[0.5, 0.5]]]))
    t = torch.log(torch.tensor([[[0.9, 0.1]]]))
    mask = torch.ones(1, 1)
    forward = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # KL(T || S)
    reverse = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # KL(S || T)
    assert_close(gkd(s, t, mask, beta=0.0)[0], torch.tensor([[forward]]))
    assert_close(gkd(s, t, mask, beta=1.0)[0], torch.tensor([[reverse]]))
    m = (0.7, 0.3)  # beta 0.5: M = (S + T) / 2
    js = 0.5 * (0.9 * math.log(0.9 / m[0]) + 0.1 * math.log(0.1 / m[1])) \
        + 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))
    assert_close(gkd(s, t, mask, beta=0.5)[0], torch.tensor([[js / 0.25]]))  # normalised by beta (1 - beta)


S3, T3 = (0.2, 0.5, 0.3), (0.6, 0.3, 0.1)  # student and teacher over a 3-token vocabulary


def _three_tokens(beta: float) -> float:
    s, t = torch.log(torch.tensor([[list(S3)]])), torch.log(torch.tensor([[list(T3)]]))
    return float(gkd(s, t, torch.ones(1, 1), beta=beta)[0])


def _kl_chi2(p: tuple, q: tuple) -> tuple[float, float]:
    """KL(P || Q) and the chi-square divergence sum (p - q)^2 / q."""
    return sum(a * math.log(a / b) for a, b in zip(p, q)), sum((a - b) ** 2 / b for a, b in zip(p, q))


def test_gkd_at_half_on_three_tokens_by_hand():
    m = [(a + b) / 2 for a, b in zip(S3, T3)]  # (0.4, 0.4, 0.2)
    jsd = 0.5 * _kl_chi2(T3, m)[0] + 0.5 * _kl_chi2(S3, m)[0]  # GKD's JSD at beta 0.5 = 0.0969...
    assert _three_tokens(0.5) == pytest.approx(jsd / (0.5 * 0.5), rel=1e-6)


def test_a_gkd_beta_sweep_is_continuous_at_both_ends():
    # f(beta) = JSD_beta / (beta (1 - beta)) = KL(T||S) + beta (KL(T||S) - chi2(T||S) / 2) + O(beta^2) near 0, and
    # KL(S||T) + eps (KL(S||T) - chi2(S||T) / 2) + O(eps^2) at beta = 1 - eps. With beta = eps = 1e-4 the two
    # values may differ by about 1e-4 x |KL - chi2 / 2| (1.1e-5 and 3.5e-6 here); we allow twice that plus 1e-6
    # for float32 rounding of values near 0.5. The unnormalised JSD would be 1e-4 x KL: off by ~0.5, not 1e-5.
    eps = 1e-4
    forward, chi2_forward = _kl_chi2(T3, S3)
    reverse, chi2_reverse = _kl_chi2(S3, T3)
    assert _three_tokens(0.0) == pytest.approx(forward, rel=1e-6)
    assert _three_tokens(1.0) == pytest.approx(reverse, rel=1e-6)
    assert abs(_three_tokens(eps) - _three_tokens(0.0)) <= 2 * eps * abs(forward - chi2_forward / 2) + 1e-6
    assert abs(_three_tokens(1 - eps) - _three_tokens(1.0)) <= 2 * eps * abs(reverse - chi2_reverse / 2) + 1e-6
    # and the first-order term itself, where float32 still resolves it (beta = 1e-2: 1.1e-3 from the limit)
    assert _three_tokens(1e-2) - forward == pytest.approx(1e-2 * (forward - chi2_forward / 2), rel=0.05)
    sweep = [_three_tokens(b / 100) for b in range(101)]  # no jump anywhere: neighbours within 0.05
    assert max(abs(a - b) for a, b in zip(sweep, sweep[1:])) < 0.05


def test_gkd_limits_equal_torch_kl_div_in_each_direction():
    torch.manual_seed(0)
    s, t = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    mask = torch.ones(2, 3)
    log_s, log_t = F.log_softmax(s, -1), F.log_softmax(t, -1)
    forward = F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)  # KL(T || S)
    reverse = F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)  # KL(S || T)
    assert_close(gkd(s, t, mask, beta=0.0)[0], forward)
    assert_close(gkd(s, t, mask, beta=1.0)[0], reverse)
    assert_close(kl(log_t, log_s), forward)
    # temperature divides both sides' logits
    assert_close(gkd(s, t, mask, beta=0.0, temperature=2.0)[0],
                 F.kl_div(F.log_softmax(s / 2, -1), F.log_softmax(t / 2, -1), reduction="none",
                          log_target=True).sum(-1))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gkd_is_zero_for_an_equal_teacher_and_trains_only_the_student(beta):
    torch.manual_seed(1)
    s = torch.randn(2, 3, 7, requires_grad=True)
    t = torch.randn(2, 3, 7, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    zero, _ = gkd(s, s.detach().clone(), mask, beta=beta)
    assert_close(zero, torch.zeros_like(zero), atol=1e-6, rtol=0)
    loss, metrics = gkd(s, t, mask, beta=beta)
    assert bool((loss[mask == 0] == 0).all()) and float(metrics["gkd"]) > 0
    loss.sum().backward()
    assert t.grad is None  # the teacher is detached
    assert s.grad.abs().sum() > 0 and bool((s.grad[mask == 0] == 0).all())  # masked positions get nothing
    with pytest.raises(ValueError, match="beta"):
        gkd(s, t, mask, beta=1.5)


def test_sft_is_masked_negative_log_likelihood():
    logp = torch.tensor([[-0.5, -2.0, -7.0]], requires_grad=True)
    per_token, metrics = distill("sft", logp, None, MASK)
    assert_close(per_token, torch.tensor([[0.5, 2.0, 0.0]]))
    assert_close(metrics["nll"], torch.tensor(1.25))
    per_token.sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))
    with pytest.raises(KeyError, match="unknown distillation objective 'nope'"):
        distill("nope", logp, None, MASK)
