"""Critic-side math: token-level advantages (GAE) and the PPO value loss.

`TOKEN_ADVANTAGES` entries: `fn(rewards [N] or [N,T], values [N,T], mask [N,T], **options)
-> (advantages [N,T], returns [N,T])`. A reward `[N]` is an outcome reward placed on each row's last
trained token. Positions outside the mask get advantage 0 and return 0. Inputs are treated as data
(no gradient flows through values here); the value head is trained by `value_loss` on the returns.
"""

from __future__ import annotations

import torch

from rollwise.algo.common import masked_mean
from rollwise.algo.registries import TOKEN_ADVANTAGES


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last trained position of each row (0 for a row without any). `[N, T] -> [N]` long."""
    T = mask.shape[-1]
    flipped = torch.flip((mask > 0).to(torch.int8), dims=[-1])
    return (T - 1 - flipped.argmax(dim=-1)).clamp(min=0)


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place an outcome reward `[N]` on each row's last trained token: `[N], [N, T] -> [N, T]`.

    Rows without any trained token receive nothing.
    """
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has_token = (mask > 0).any(dim=-1)
    rows = torch.arange(mask.shape[0], device=mask.device)
    out[rows, last_token_index(mask)] = rewards.to(torch.float32) * has_token
    return out


@TOKEN_ADVANTAGES.register("gae")
@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman, Moritz, Levine, Jordan, Abbeel 2016,
    "High-Dimensional Continuous Control Using Generalized Advantage Estimation").

    Over each row's trained positions t (masked positions are skipped, so a gap in the mask does not
    break the recursion), with V = 0 after the last trained token (the episode ends there):
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t        (the value-loss target, before any whitening)
    rewards: [N] (outcome, placed on the last trained token) or [N, T]; values, mask: [N, T].
    `whiten=True` normalises the advantages over the batch's trained tokens:
    `(A - mean) / (std + eps)` (returns are unaffected). Returns (advantages [N,T], returns [N,T]) float32,
    both 0 outside the mask.
    """
    maskf = (mask > 0).to(torch.float32)
    values = values.detach().to(torch.float32)
    token_rewards = outcome_token_rewards(rewards, mask) if rewards.dim() == 1 else rewards.to(torch.float32)
    token_rewards = token_rewards * maskf
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # [N] V after the current position (0 past the end)
    next_adv = torch.zeros_like(values[:, 0])  # [N]
    for t in reversed(range(values.shape[-1])):
        on = maskf[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(on, a_t, torch.zeros_like(a_t))
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, a_t, next_adv)
    returns = (adv + values) * maskf
    if whiten:
        mean = masked_mean(adv, maskf)
        var = masked_mean((adv - mean) ** 2, maskf)
        adv = (adv - mean) / (var.sqrt() + eps) * maskf
    return adv, returns


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss with optional clipping around the old values (as in the PPO reference code;
    studied by Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients").

        clip is None:  loss_t = 0.5 * (V_t - R_t)^2
        otherwise:     V_clip = old_V_t + clamp(V_t - old_V_t, -clip, +clip)
                       loss_t = 0.5 * max((V_t - R_t)^2, (V_clip - R_t)^2)
    values: [N, T] (with grad), old_values, returns, mask: [N, T]. `clip` is in the units of the values.
    Returns (per-token loss [N, T], metrics): reduce it with `aggregate(...)` like the policy loss.
    Metrics: `clip_frac` (trained tokens where the clipped branch is strictly larger, so their gradient
    is zero), `error_abs_mean` (mean |V - R|), `values_mean`, `returns_mean`.
    """
    returns = returns.detach()
    err = (values - returns) ** 2
    loss = 0.5 * err
    clipped_branch = torch.zeros_like(err, dtype=torch.bool)
    if clip is not None:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clip = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(err, err_clip)
        clipped_branch = err_clip > err
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(clipped_branch.float(), mask),
            "error_abs_mean": masked_mean((values - returns).abs(), mask),
            "values_mean": masked_mean(values, mask),
            "returns_mean": masked_mean(returns, mask),
        }
    return loss, metrics
