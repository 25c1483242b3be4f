"""Policy losses: `fn(logp [N,T], old_logp [N,T], advantages [N] or [N,T], mask [N,T], **options)
-> (per_token_loss [N,T], metrics)`.

`logp` carries the gradient; `old_logp` is the policy that the ratio is taken against (detached data).
Advantages `[N]` are broadcast over each row. The per-token loss is NOT masked: reduce it with an
aggregation (`rollwise.algo.aggregation`), which applies the mask. Every loss accepts `clip_low` and
`clip_high` (so a trainer can pass its clip options to any of them) and reports at least `clip_frac`
(the share the loss acted on: trained tokens whose gradient is zeroed or whose weight is truncated, and
for `gspo` sequences; see each entry) and `ratio_mean`. With `old_logp` equal to `logp` (one on-policy
update: one PPO epoch, one minibatch) every ratio is 1 and every `clip_frac` is 0.
"""

from __future__ import annotations

import torch

from rollwise.algo.common import masked_mean, per_token, row_mean, seeded_uniform, seq_masked_mean, valid_rows
from rollwise.algo.registries import POLICY_LOSSES

Metrics = dict[str, torch.Tensor]


def _ppo_terms(logp, old_logp, adv, clip_low, clip_high):
    """ratio, ratio * A and clip(ratio) * A, all [N, T]."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    return ratio, unclipped, clipped


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate (Schulman et al. 2017) with DAPO's decoupled bounds (Yu et al. 2025).

    `ratio = exp(logp - old_logp)`; `loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`.
    Returns per-token loss [N, T] and metrics `clip_frac` (tokens where the clipped branch is taken,
    so their gradient is zero), `ratio_mean`.
    """
    adv = per_token(advantages, logp)  # [N, T]
    ratio, unclipped, clipped = _ppo_terms(logp, old_logp, adv, clip_low, clip_high)
    loss = -torch.minimum(unclipped, clipped)  # [N, T]
    with torch.no_grad():
        is_clipped = (clipped < unclipped).float()
        metrics = {"clip_frac": masked_mean(is_clipped, mask), "ratio_mean": masked_mean(ratio, mask)}
    return loss, metrics


@POLICY_LOSSES.register("dual_clip")
def dual_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> tuple[torch.Tensor, Metrics]:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL").

    For A >= 0 this is `ppo_clip`. For A < 0 the PPO loss is also bounded above by `-clip_c * A`:
    `loss = min(-min(r A, clip(r) A), -clip_c A) = -max(min(r A, clip(r) A), clip_c A)`, so a token whose
    ratio exceeds `clip_c` (> 1) stops pushing its probability down (zero gradient).
    Metrics: `clip_frac` (trained tokens with zero gradient: the PPO clip branch or the `-clip_c A` bound
    taken), `dual_clip_frac` (the `-clip_c A` bound alone), `ratio_mean`.
    """
    if clip_c <= 1.0:
        raise ValueError(f"dual_clip needs clip_c > 1, got {clip_c}")
    adv = per_token(advantages, logp)
    ratio, unclipped, clipped = _ppo_terms(logp, old_logp, adv, clip_low, clip_high)
    ppo = -torch.minimum(unclipped, clipped)
    bound = -clip_c * adv
    negative = adv < 0
    loss = torch.where(negative, torch.minimum(ppo, bound), ppo)
    with torch.no_grad():
        dual = negative & (bound < ppo)  # the two sets are disjoint: a PPO-clipped A < 0 token has r < 1
        metrics = {
            "clip_frac": masked_mean(((clipped < unclipped) | dual).float(), mask),
            "dual_clip_frac": masked_mean(dual.float(), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token-wise form (GSPO-token).

    Sequence ratio `s_i = exp(mean_{t valid} (logp_t - old_logp_t))` (length-normalised). Every token
    carries `s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])`: its value is `s_i`, its gradient w.r.t. `logp_t`
    is `s_i`. Per-token loss `-min(s A, clip(s, 1 - clip_low, 1 + clip_high) A)`, so a sequence outside the
    band (on the side the advantage pushes to) gives zero gradient on all its tokens. Defaults 3e-4 / 4e-4
    are the paper's. With `seq_mean_token_mean` the gradient is exactly the paper's sequence-level one
    (`s_i A_i` times the mean of the row's token score functions).
    Metrics: `clip_frac` (sequence level: the mean over rows with trained tokens of the share of the row's
    trained tokens that are clipped, i.e. the fraction of clipped sequences when advantages are `[N]`),
    `clip_token_frac` (trained tokens of clipped sequences, the fraction the paper plots), `ratio_mean` (mean
    `s_i` over rows with trained tokens).
    """
    adv = per_token(advantages, logp)
    seq_ratio = torch.exp(seq_masked_mean((logp - old_logp).detach(), mask))  # [N]
    ratio = seq_ratio.unsqueeze(-1) * torch.exp(logp - logp.detach())  # [N, T], value s_i, d/dlogp_t = s_i
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        is_clipped = (clipped < unclipped).float()  # [N, T]
        rows = valid_rows(mask)  # [N]
        metrics = {
            "clip_frac": row_mean(seq_masked_mean(is_clipped, mask), rows),
            "clip_token_frac": masked_mean(is_clipped, mask),
            "ratio_mean": row_mean(seq_ratio, rows),
        }
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention").

    `loss_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A * logp_t`, `r_t = exp(logp_t - old_logp_t)`:
    the importance weight is truncated and detached, and every token keeps a gradient through `logp_t`
    (`-w_t A`). The paper sets no lower bound and tunes only the upper one; `clip_low = 1.0` (lower bound 0,
    any value >= 1 disables it) and `clip_high = 0.28` are our defaults, not values from the paper.
    Metrics: `clip_frac` (trained tokens whose weight was truncated; their gradient is NOT zero),
    `weight_mean`, `ratio_mean`.
    """
    adv = per_token(advantages, logp)
    ratio = torch.exp(logp - old_logp).detach()
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * adv * logp
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((weight != ratio).float(), mask),
            "weight_mean": masked_mean(weight, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("sao")
def sao(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, Metrics]:
    """Strict double-side token clipping from SAO (Hou, Li, Tang, Dong 2026, "Single-Rollout Asynchronous
    Optimization for Agentic Reinforcement Learning").

    `loss_t = -clip(r_t, 1 - clip_low, 1 + clip_high) * A` (no min with the unclipped term). Inside the band
    this is the plain `-r A` surrogate; a token whose ratio leaves the band on EITHER side gives zero
    gradient whatever the sign of A (PPO would still push a token back towards the band). Outside the band
    the loss value is the bound times A.
    Metrics: `clip_frac` (trained tokens outside the band), `ratio_mean`.
    """
    adv = per_token(advantages, logp)
    ratio = torch.exp(logp - old_logp)
    low, high = 1.0 - clip_low, 1.0 + clip_high
    loss = -torch.clamp(ratio, low, high) * adv
    with torch.no_grad():
        outside = ((ratio < low) | (ratio > high)).float()
        metrics = {"clip_frac": masked_mean(outside, mask), "ratio_mean": masked_mean(ratio, mask)}
    return loss, metrics


@POLICY_LOSSES.register("nsr")
def nsr(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    rescue_band: float = 0.1,
    rescue_prob: float = 0.5,
    seed: int = 0,
) -> tuple[torch.Tensor, Metrics]:
    """Near-boundary Stochastic Rescue: `ppo_clip` where some just-clipped tokens keep their gradient.

    A trained token that PPO clips (zero gradient: A > 0 and r > 1 + clip_high, or A < 0 and
    r < 1 - clip_low) and whose ratio is within `rescue_band` of the band (r <= 1 + clip_high + rescue_band,
    resp. r >= 1 - clip_low - rescue_band) is "rescued" with probability `rescue_prob`: its loss is the
    unclipped `-r A`. The draws come from a `torch.Generator` seeded with `seed`, one uniform per position
    of the `[N, T]` tensor, so equal inputs and seed give equal rescues; pass a different seed per step and
    micro-batch. From the Near-boundary Stochastic Rescue (NSR) paper (in this project's seed
    papers), which keeps slightly out-of-bound tokens stochastically instead of discarding them.
    Metrics: `clip_frac` (trained tokens left clipped after the rescue), `rescued_frac`, `ratio_mean`.
    """
    adv = per_token(advantages, logp)
    ratio, unclipped, clipped = _ppo_terms(logp, old_logp, adv, clip_low, clip_high)
    with torch.no_grad():
        is_clipped = clipped < unclipped
        near = torch.where(adv > 0, ratio <= 1.0 + clip_high + rescue_band, ratio >= 1.0 - clip_low - rescue_band)
        draw = seeded_uniform(logp, seed) < rescue_prob
        rescued = is_clipped & near & draw & (mask > 0)
    loss = torch.where(rescued, -unclipped, -torch.minimum(unclipped, clipped))
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((is_clipped & ~rescued).float(), mask),
            "rescued_frac": masked_mean(rescued.float(), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("reinforce")
def reinforce(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float | None = None,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE (Williams 1992, "Simple statistical gradient-following algorithms for connectionist RL").

    `loss_t = -A * logp_t`: the on-policy policy gradient, no ratio and no clipping (`clip_low`/`clip_high`
    are accepted and ignored). `old_logp` is used only for the `ratio_mean` metric; correct for an
    off-policy sampler with `is_weights(...)`. Metrics: `clip_frac` (always 0), `ratio_mean`.
    """
    adv = per_token(advantages, logp)
    loss = -adv * logp
    with torch.no_grad():
        ratio = torch.exp(logp - old_logp)
        metrics = {"clip_frac": torch.zeros((), device=logp.device), "ratio_mean": masked_mean(ratio, mask)}
    return loss, metrics


def entropy_bonus(entropy: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token entropy bonus term `-coef * entropy` `[N, T]` (Williams & Peng 1991; used by A3C and PPO).

    Add it to a policy loss's per-token loss before aggregation; with `coef > 0` minimising the loss raises
    the entropy. Equivalent to subtracting `coef * aggregate(name, entropy, mask, ...)` from the scalar loss.
    """
    return -coef * entropy
