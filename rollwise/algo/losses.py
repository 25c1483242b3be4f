"""Policy losses, aggregations and KL estimators.

Shapes: logp, old_logp, mask: [N, T] (N responses, T response positions); mask is 1 on trained tokens.
"""

from __future__ import annotations

import torch

from rollwise.algo.registries import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast advantages [N] (outcome) or [N, T] (token-level) to [N, T]."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with DAPO's decoupled bounds (Yu et al. 2025).

    `ratio = exp(logp - old_logp)`; `loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`.
    Returns per-token loss [N, T] and metrics `clip_frac` (tokens where the clipped branch is taken,
    so their gradient is zero), `ratio_mean`.
    """
    adv = _per_token(advantages, logp)  # [N, T]
    ratio = torch.exp(logp - old_logp)  # [N, T]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)  # [N, T]
    with torch.no_grad():
        is_clipped = (clipped < unclipped).float()
        metrics = {"clip_frac": _masked_mean(is_clipped, mask), "ratio_mean": _masked_mean(ratio, mask)}
    return loss, metrics


@AGGREGATIONS.register("token_mean")
def token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """Mean over all trained tokens of the batch (DAPO's token-level loss).

    `num_tokens` overrides the denominator so that micro-batches of one batch sum to the batch mean.
    """
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=per_token_loss.dtype)
    return (per_token_loss * mask).sum() / denom.clamp(min=1)


@KL_ESTIMATORS.register("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): `exp(ref - logp) - (ref - logp) - 1` (>= 0). [N, T]."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0
