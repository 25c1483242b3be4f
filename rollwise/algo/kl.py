"""KL estimators `fn(logp [N,T], ref_logp [N,T]) -> [N,T]` and the KL-in-reward penalty.

All estimate KL(pi || ref) per sampled token from the two log-probabilities of that token (Schulman 2020,
"Approximating KL Divergence"); with samples from pi, `k1` and `k3` are unbiased, `k2` is biased but
low-variance, `abs` is a non-negative proxy.
"""

from __future__ import annotations

import torch

from rollwise.algo.registries import KL_ESTIMATORS


@KL_ESTIMATORS.register("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """`logp - ref_logp` (unbiased, can be negative per token). [N, T]."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """`0.5 * (logp - ref_logp)^2` (>= 0; its gradient is the gradient of the true KL). [N, T]."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): `exp(ref - logp) - (ref - logp) - 1` (>= 0). [N, T]."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


@KL_ESTIMATORS.register("abs")
def abs_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """`|logp - ref_logp|` (>= 0). [N, T]."""
    return (logp - ref_logp).abs()


def kl_reward_penalty(
    name: str,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    per_sequence: bool = False,
) -> torch.Tensor:
    """KL as a reward penalty (InstructGPT, Ouyang et al. 2022; REINFORCE++, Hu et al. 2025).

    Per token: `-coef * k(logp, ref_logp)` on trained tokens, 0 elsewhere, `[N, T]`, to be added to token
    rewards (e.g. before `gae`). With `per_sequence=True` the row sums `[N]`, to be added to outcome rewards
    before an outcome advantage estimator. `logp` should be the sampling (or old) policy's log-probs; the
    result is detached: a reward penalty carries no gradient (unlike `kl_coef * aggregate(kl(...))` in the
    loss).
    """
    with torch.no_grad():
        k = KL_ESTIMATORS.get(name)(logp, ref_logp)
        penalty = torch.where(mask > 0, -coef * k, torch.zeros_like(k))
    return penalty.sum(dim=-1) if per_sequence else penalty
