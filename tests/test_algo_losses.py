"""Policy losses, aggregations, KL estimators and the entropy bonus against hand-computed values."""

import math

import pytest
import torch
from torch.testing import assert_close

from rollwise import algo


def _logp_for(ratios, old=None):
    """Log-probs (leaf, with grad) whose ratio to `old` (default 0) is `ratios`."""
    old = torch.zeros(torch.tensor(ratios).shape) if old is None else old
    return (torch.log(torch.tensor(ratios)) + old).requires_grad_(True), old


def _grad(name, logp, old, adv, mask, **options):
    loss, metrics = algo.policy_loss(name, logp, old, adv, mask, **options)
    (loss * mask).sum().backward()
    return loss, metrics, logp.grad


# ---- dual_clip -----------------------------------------------------------------------------------------


def test_dual_clip_bounds_negative_advantages():
    logp, old = _logp_for([[0.5, 1.0, 2.0, 4.0]])
    adv = torch.tensor([-1.0])
    loss, m, grad = _grad("dual_clip", logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.2, clip_c=3.0)
    # A = -1; PPO loss -min(r A, clip(r, 0.8, 1.2) A) = max(r, clip(r)):
    #   r=0.5: max(0.5, 0.8) = 0.8 (clipped);  r=1: 1;  r=2: max(2, 1.2) = 2;  r=4: 4
    # dual bound -clip_c * A = 3: min(ppo, 3) -> [0.8, 1, 2, 3]
    assert_close(loss, torch.tensor([[0.8, 1.0, 2.0, 3.0]]))
    # gradient of -r A w.r.t. logp is -A r = r where active; PPO clip (r=0.5) and the dual bound (r=4) give 0
    assert_close(grad, torch.tensor([[0.0, 1.0, 2.0, 0.0]]))
    assert_close(m["dual_clip_frac"], torch.tensor(0.25))  # r=4
    assert_close(m["clip_frac"], torch.tensor(0.5))  # every zero-gradient token: r=0.5 (PPO clip) and r=4 (dual)


def test_dual_clip_equals_ppo_clip_for_positive_advantages():
    logp = torch.log(torch.tensor([[0.5, 1.0, 2.0, 4.0]]))
    adv = torch.tensor([[1.0, 2.0, 0.5, 0.0]])
    ppo, _ = algo.policy_loss("ppo_clip", logp, torch.zeros(1, 4), adv, torch.ones(1, 4))
    dual, _ = algo.policy_loss("dual_clip", logp, torch.zeros(1, 4), adv, torch.ones(1, 4))
    assert_close(dual, ppo)
    with pytest.raises(ValueError, match="clip_c"):
        algo.policy_loss("dual_clip", logp, torch.zeros(1, 4), adv, torch.ones(1, 4), clip_c=1.0)


# ---- gspo ----------------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_clip_and_gradients():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, -0.1, 0.3], [0.0, 0.0002, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, m, grad = _grad("gspo", logp, old, adv, mask)  # default band [1 - 3e-4, 1 + 4e-4]
    s0 = math.exp((0.1 - 0.1 + 0.3) / 3)  # = e^0.1 = 1.10517, above 1.0004 with A > 0 -> clipped
    s1 = math.exp((0.0 + 0.0002) / 2)  # = e^0.0001 = 1.0001 (the padded 5.0 is ignored), inside the band
    # row 0: -min(s A, 1.0004 A) = -1.0004 on every token; row 1: -(s1 * -1) = s1 on every token
    assert_close(loss, torch.tensor([[-1.0004] * 3, [s1] * 3]))
    # d loss_t / d logp_t = -A * s_i for unclipped sequences, 0 for clipped ones (masked token: 0)
    assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [s1, s1, 0.0]]))
    assert_close(m["ratio_mean"], torch.tensor((s0 + s1) / 2))
    assert_close(m["clip_frac"], torch.tensor(1 / 2))  # sequence level: row 0 of the 2 rows
    assert_close(m["clip_token_frac"], torch.tensor(3 / 5))  # the 3 trained tokens of row 0, of 5


def test_gspo_clip_frac_with_token_advantages_is_a_mean_over_sequences():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, -0.1, 0.3], [0.0, 0.0002, 5.0]])  # s0 = e^0.1 (above the band), s1 inside
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0], [1.0, -1.0, 1.0]])
    _, m = algo.policy_loss("gspo", logp, old, adv, mask)
    # row 0: s0 > 1 + 4e-4 clips the two A > 0 tokens, not the A < 0 one (-min(-s, -1.0004) = s): 2/3 of it;
    # row 1: nothing clipped. Sequence level: (2/3 + 0) / 2 = 1/3; tokens: 2 of 5.
    assert_close(m["clip_frac"], torch.tensor(1 / 3))
    assert_close(m["clip_token_frac"], torch.tensor(2 / 5))


def test_gspo_equals_ppo_clip_on_one_token_sequences():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(16, 1, generator=gen) * 0.3
    base = old + torch.randn(16, 1, generator=gen) * 0.3  # ratios spread across both clip bounds
    adv = torch.randn(16, generator=gen)
    mask = torch.ones(16, 1)
    out = {}
    for name in ("gspo", "ppo_clip"):
        logp = base.clone().requires_grad_(True)
        loss, m, grad = _grad(name, logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
        out[name] = (loss, grad, m["clip_frac"])
    for a, b in zip(out["gspo"], out["ppo_clip"]):
        assert_close(a, b)
    assert 0 < out["ppo_clip"][2] < 1  # the comparison covers clipped and unclipped tokens


def test_gspo_with_seq_mean_token_mean_gives_sequence_gradient():
    old = torch.zeros(1, 4)
    logp = torch.tensor([[0.01, -0.01, 0.02, 0.0]], requires_grad=True)
    loss, _ = algo.policy_loss("gspo", logp, old, torch.tensor([2.0]), torch.ones(1, 4), clip_low=0.2, clip_high=0.2)
    algo.aggregate("seq_mean_token_mean", loss, torch.ones(1, 4)).backward()
    s = math.exp(0.02 / 4)  # mean log-ratio 0.005
    # GSPO: grad = -A * s * (1/|y|) * d(sum_t logp_t) -> -2 * s / 4 on each token
    assert_close(logp.grad, torch.full((1, 4), -2 * s / 4))


# ---- cispo ---------------------------------------------------------------------------------------------


def test_cispo_truncated_detached_weight():
    logp, old = _logp_for([[0.5, 1.0, 1.5]])
    loss, m, grad = _grad("cispo", logp, old, torch.tensor([2.0]), torch.ones(1, 3))
    # defaults clip_low 1.0 (no lower bound), clip_high 0.28: w = clip(r, 0, 1.28) = [0.5, 1.0, 1.28]
    # loss = -w A logp = [-0.5*2*ln0.5, 0, -1.28*2*ln1.5] = [0.693147, 0, -1.037990]
    assert_close(loss, torch.tensor([[0.5 * 2 * math.log(2), 0.0, -1.28 * 2 * math.log(1.5)]]))
    # gradient -w A on every token: truncated tokens keep a gradient (unlike PPO)
    assert_close(grad, torch.tensor([[-1.0, -2.0, -2.56]]))
    assert_close(m["clip_frac"], torch.tensor(1 / 3))


def test_cispo_lower_bound():
    logp, old = _logp_for([[0.5]])
    _, _, grad = _grad("cispo", logp, old, torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28)
    assert_close(grad, torch.tensor([[-0.8]]))  # w = clip(0.5, 0.8, 1.28) = 0.8
    logp, old = _logp_for([[0.5]])
    _, _, grad = _grad("cispo", logp, old, torch.tensor([1.0]), torch.ones(1, 1), clip_low=5.0, clip_high=0.28)
    assert_close(grad, torch.tensor([[-0.5]]))  # a large clip_low disables the lower bound


# ---- sao -----------------------------------------------------------------------------------------------


def test_sao_zeroes_both_sides_for_both_signs():
    logp, old = _logp_for([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    adv = torch.tensor([1.0, -1.0])
    loss, m, grad = _grad("sao", logp, old, adv, torch.ones(2, 3), clip_low=0.2, clip_high=0.2)
    # loss = -clip(r, 0.8, 1.2) A: A=+1 -> [-0.8, -1, -1.2]; A=-1 -> [0.8, 1, 1.2]
    assert_close(loss, torch.tensor([[-0.8, -1.0, -1.2], [0.8, 1.0, 1.2]]))
    # only r = 1 (inside the band) has a gradient, -r A
    assert_close(grad, torch.tensor([[0.0, -1.0, 0.0], [0.0, 1.0, 0.0]]))
    assert_close(m["clip_frac"], torch.tensor(4 / 6))
    # PPO would still move the two "recovering" tokens (A>0, r=0.5 and A<0, r=1.5)
    logp2, _ = _logp_for([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    _, _, ppo_grad = _grad("ppo_clip", logp2, old, adv, torch.ones(2, 3), clip_low=0.2, clip_high=0.2)
    assert_close(ppo_grad, torch.tensor([[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]]))


# ---- nsr -----------------------------------------------------------------------------------------------

_NSR_RATIOS = [[1.25, 1.5, 1.1], [0.75, 0.5, 0.9]]  # per row: near the band, far outside, inside


def test_nsr_rescues_near_boundary_tokens():
    logp, old = _logp_for(_NSR_RATIOS)
    adv = torch.tensor([1.0, -1.0])
    loss, m, grad = _grad("nsr", logp, old, adv, torch.ones(2, 3), clip_low=0.2, clip_high=0.2,
                          rescue_band=0.1, rescue_prob=1.0)
    # A=+1: r=1.25 in (1.2, 1.3] rescued -> -r A = -1.25; r=1.5 stays clipped -> -1.2; r=1.1 -> -1.1
    # A=-1: r=0.75 in [0.7, 0.8) rescued -> 0.75; r=0.5 stays clipped -> 0.8; r=0.9 -> 0.9
    assert_close(loss, torch.tensor([[-1.25, -1.2, -1.1], [0.75, 0.8, 0.9]]))
    assert_close(grad, torch.tensor([[-1.25, 0.0, -1.1], [0.75, 0.0, 0.9]]))  # rescued tokens: -A r != 0
    assert_close(m["rescued_frac"], torch.tensor(2 / 6))
    assert_close(m["clip_frac"], torch.tensor(2 / 6))


def test_nsr_without_rescue_is_ppo_clip():
    logp, old = _logp_for(_NSR_RATIOS)
    adv = torch.tensor([1.0, -1.0])
    nsr, _, nsr_grad = _grad("nsr", logp, old, adv, torch.ones(2, 3), rescue_prob=0.0)
    logp2, _ = _logp_for(_NSR_RATIOS)
    ppo, _, ppo_grad = _grad("ppo_clip", logp2, old, adv, torch.ones(2, 3))
    assert_close(nsr, ppo)
    assert_close(nsr_grad, ppo_grad)


def test_nsr_rescue_is_seeded_and_has_the_requested_rate():
    ratios = torch.full((200, 500), 1.25)  # every token is a rescue candidate (A > 0, 1.2 < r <= 1.3)
    logp, old, adv, mask = torch.log(ratios), torch.zeros(200, 500), torch.ones(200), torch.ones(200, 500)
    a, ma = algo.policy_loss("nsr", logp, old, adv, mask, rescue_prob=0.3, seed=7)
    b, _ = algo.policy_loss("nsr", logp, old, adv, mask, rescue_prob=0.3, seed=7)
    c, _ = algo.policy_loss("nsr", logp, old, adv, mask, rescue_prob=0.3, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # 100,000 Bernoulli(0.3) draws: std of the fraction is 0.00145, so 0.005 is > 3 sigma
    assert abs(float(ma["rescued_frac"]) - 0.3) < 0.005
    assert_close(ma["rescued_frac"], (a == -1.25).float().mean())


# ---- reinforce, entropy --------------------------------------------------------------------------------


def test_reinforce_is_minus_advantage_times_logp():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, m, grad = _grad("reinforce", logp, torch.zeros(1, 2), torch.tensor([3.0]), torch.ones(1, 2), clip_low=0.2)
    assert_close(loss, torch.tensor([[3.0, 6.0]]))  # -3 * -1, -3 * -2
    assert_close(grad, torch.tensor([[-3.0, -3.0]]))  # positive advantage raises logp
    assert m["clip_frac"] == 0


def test_positive_advantage_raises_logprob_unless_clipped():
    for name in ("ppo_clip", "dual_clip", "gspo", "cispo", "sao", "nsr", "reinforce"):
        logp, old = _logp_for([[1.0]])
        _, _, grad = _grad(name, logp, old, torch.tensor([1.0]), torch.ones(1, 1))
        assert grad[0, 0] < 0, name  # ratio 1 is inside every band: descent raises the sampled token's logp


CLIPPING_LOSSES = ("ppo_clip", "dual_clip", "gspo", "cispo", "sao", "nsr")


@pytest.mark.parametrize("name", CLIPPING_LOSSES)
def test_clip_frac_is_zero_on_policy_and_counts_what_the_loss_acts_on(name):
    # one on-policy update (old = logp): every ratio is exactly 1, inside every band, so nothing is clipped
    logp = torch.log(torch.tensor([[0.5, 0.9, 1.1, 5.0], [1.0, 1.0, 1.0, 1.0]]))  # 2 rows, row 1 has 2 tokens
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    _, on_policy = algo.policy_loss(name, logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.2)
    assert float(on_policy["clip_frac"]) == 0.0
    # against old = 0, row 0's ratios are [0.5, 0.9, 1.1, 5.0] with A = +1, row 1's are 1 with A = -1.
    # ppo_clip / nsr (no rescue) zero r = 5 (1 of 6 tokens); dual_clip the same (A > 0: no dual bound);
    # sao zeroes both sides, r = 0.5 and 5 (2 of 6); cispo truncates both (2 of 6, lower bound 0.8 given);
    # gspo: s0 = exp(mean log r) = (0.5 * 0.9 * 1.1 * 5) ** (1/4) = 1.2543 > 1.2 clips row 0: 1 of 2 rows.
    expected = {"ppo_clip": 1 / 6, "dual_clip": 1 / 6, "nsr": 1 / 6, "sao": 2 / 6, "cispo": 2 / 6, "gspo": 1 / 2}
    options = {"rescue_prob": 0.0} if name == "nsr" else {}
    _, off_policy = algo.policy_loss(name, logp, torch.zeros(2, 4), adv, mask, clip_low=0.2, clip_high=0.2,
                                     **options)
    assert_close(off_policy["clip_frac"], torch.tensor(expected[name]))


def test_entropy_bonus():
    assert_close(algo.entropy_bonus(torch.tensor([[0.5, 1.0]]), 0.01), torch.tensor([[-0.005, -0.01]]))


# ---- aggregations --------------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [5.0, 6.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_aggregations_by_hand():
    # token sums per row: 6, 4, 11 (total 21); token counts 3, 1, 2 (total 6)
    assert_close(algo.aggregate("token_mean", LOSS, MASK), torch.tensor(21 / 6))
    assert_close(algo.aggregate("seq_mean_token_mean", LOSS, MASK), torch.tensor((2 + 4 + 5.5) / 3))
    assert_close(algo.aggregate("seq_mean_token_sum", LOSS, MASK), torch.tensor(21 / 3))
    assert_close(algo.aggregate("seq_mean_token_sum_norm", LOSS, MASK, norm_tokens=8), torch.tensor(21 / (3 * 8)))
    # without norm_tokens the constant is the tensor width T = 4
    assert_close(algo.aggregate("seq_mean_token_sum_norm", LOSS, MASK), torch.tensor(21 / (3 * 4)))


def test_seq_mean_token_sum_norm_is_token_sum_over_seqs_times_constant():
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(5, 7, generator=gen)
    mask = (torch.rand(5, 7, generator=gen) > 0.3).float()
    mask[:, 0] = 1
    expected = (loss * mask).sum() / (5 * 1024)
    assert_close(algo.aggregate("seq_mean_token_sum_norm", loss, mask, norm_tokens=1024), expected)


def test_rows_without_tokens_are_not_sequences():
    loss = torch.cat([LOSS, torch.tensor([[7.0, 7.0, 0.0, 0.0]])])
    mask = torch.cat([MASK, torch.zeros(1, 4)])
    for name in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        assert_close(algo.aggregate(name, loss, mask), algo.aggregate(name, LOSS, MASK))


def test_micro_batches_sum_to_the_batch():
    parts = [(LOSS[:1], MASK[:1]), (LOSS[1:, :2], MASK[1:, :2])]  # the second micro-batch is narrower
    norms = algo.batch_normalisers([m for _, m in parts])
    assert norms == {"num_tokens": 6.0, "num_seqs": 3.0}
    for name in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        options = {"norm_tokens": 16} if name == "seq_mean_token_sum_norm" else {}
        whole = algo.aggregate(name, LOSS, MASK, **options)
        summed = sum(algo.aggregate(name, l, m, **norms, **options) for l, m in parts)
        assert_close(summed, whole)


# ---- KL ------------------------------------------------------------------------------------------------


def test_kl_estimators():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-2.0, -2.0, -0.1]])
    # logp - ref = [1, 0, -0.4]
    assert_close(algo.kl("k1", logp, ref), torch.tensor([[1.0, 0.0, -0.4]]))
    assert_close(algo.kl("k2", logp, ref), torch.tensor([[0.5, 0.0, 0.08]]))  # 0.5 * x^2
    assert_close(algo.kl("abs", logp, ref), torch.tensor([[1.0, 0.0, 0.4]]))


def test_kl_reward_penalty():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [0.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -2.0, -0.1], [0.0, -1.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # k1 = [[1, 0, -0.4], [0, 0.5, (8, untrained)]] -> -0.1 * k1 on trained tokens
    per_token = algo.kl_reward_penalty("k1", logp, ref, mask, coef=0.1)
    assert_close(per_token, torch.tensor([[-0.1, 0.0, 0.04], [0.0, -0.05, 0.0]]))
    assert not per_token.requires_grad
    per_seq = algo.kl_reward_penalty("k1", logp, ref, mask, coef=0.1, per_sequence=True)
    assert_close(per_seq, torch.tensor([-0.06, -0.05]))
