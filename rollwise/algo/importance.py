"""Importance corrections for the gap between the sampler and the trainer's old policy.

`fn(old_logp [N,T], behaviour_logp [N,T], mask [N,T], **options) -> (weights [N,T], metrics)`.
`behaviour_logp` are the log-probs of the engine that sampled the tokens, `old_logp` those of the
trainer's old policy on the same tokens; `ratio_t = exp(old_logp_t - behaviour_logp_t)`. The weights are
detached and multiply the per-token policy loss: `per_token_loss * weights`, before aggregation.
Positions outside the mask get weight 1 (they are dropped by the aggregation anyway).
Every entry reports `weight_mean` (over trained tokens) and `log_ratio_abs_mean` (mean |old - behaviour|).

Sequence-level entries use the geometric mean of the row's token ratios,
`s_i = exp(mean_{t valid}(old_logp_t - behaviour_logp_t))`, broadcast to the row's tokens; their
`*_frac` metrics count sequences (rows with trained tokens), token-level ones count trained tokens.
"""

from __future__ import annotations

import torch

from rollwise.algo.common import masked_mean, row_mean, seeded_uniform, seq_masked_mean, valid_rows
from rollwise.algo.registries import IS_CORRECTIONS

Metrics = dict[str, torch.Tensor]


def _log_ratio(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`old - behaviour` on trained tokens, 0 elsewhere (so padding never overflows). Detached [N, T]."""
    diff = (old_logp - behaviour_logp).detach().to(torch.float32)
    return torch.where(mask > 0, diff, torch.zeros_like(diff))


def _finish(
    weights: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, **extra: torch.Tensor
) -> tuple[torch.Tensor, Metrics]:
    """Set weight 1 outside the mask and add the common metrics."""
    weights = torch.where(mask > 0, weights, torch.ones_like(weights))
    metrics = {"weight_mean": masked_mean(weights, mask), "log_ratio_abs_mean": masked_mean(log_ratio.abs(), mask)}
    metrics.update(extra)
    return weights, metrics


def _seq_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Geometric mean of each row's token ratios over its trained tokens. [N]."""
    return torch.exp(seq_masked_mean(log_ratio, mask))


@IS_CORRECTIONS.register("none")
@torch.no_grad()
def no_correction(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, Metrics]:
    """No correction: every weight is 1. [N, T]."""
    log_ratio = _log_ratio(old_logp, behaviour_logp, mask)
    return _finish(torch.ones_like(log_ratio), log_ratio, mask)


@IS_CORRECTIONS.register("tis_token")
@torch.no_grad()
def tis_token(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> tuple[torch.Tensor, Metrics]:
    """Truncated importance sampling per token (Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"): `w_t = min(ratio_t, cap)`. Metric `truncated_frac`."""
    log_ratio = _log_ratio(old_logp, behaviour_logp, mask)
    ratio = torch.exp(log_ratio)
    truncated = masked_mean((ratio > cap).float(), mask)
    return _finish(torch.clamp(ratio, max=cap), log_ratio, mask, truncated_frac=truncated)


@IS_CORRECTIONS.register("mis_token")
@torch.no_grad()
def mis_token(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, low: float = 0.5, high: float = 2.0
) -> tuple[torch.Tensor, Metrics]:
    """Masked importance sampling per token (Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying
    RL Collapse from the Training-Inference Mismatch"): `w_t = ratio_t if low <= ratio_t <= high else 0`.
    Metric `masked_frac`."""
    log_ratio = _log_ratio(old_logp, behaviour_logp, mask)
    ratio = torch.exp(log_ratio)
    keep = (ratio >= low) & (ratio <= high)
    weights = torch.where(keep, ratio, torch.zeros_like(ratio))
    return _finish(weights, log_ratio, mask, masked_frac=masked_mean((~keep).float(), mask))


@IS_CORRECTIONS.register("tis_seq")
@torch.no_grad()
def tis_seq(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> tuple[torch.Tensor, Metrics]:
    """Truncated IS per sequence: `w_i = min(s_i, cap)` on every token of row i, with `s_i` the geometric
    mean of the row's token ratios. Metric `truncated_frac` (of sequences)."""
    log_ratio = _log_ratio(old_logp, behaviour_logp, mask)
    seq = _seq_ratio(log_ratio, mask)  # [N]
    weights = torch.clamp(seq, max=cap).unsqueeze(-1).expand_as(log_ratio)
    frac = row_mean((seq > cap).float(), valid_rows(mask))
    return _finish(weights, log_ratio, mask, truncated_frac=frac)


@IS_CORRECTIONS.register("mis_seq")
@torch.no_grad()
def mis_seq(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, low: float = 0.5, high: float = 2.0
) -> tuple[torch.Tensor, Metrics]:
    """Masked IS per sequence: `w_i = s_i if low <= s_i <= high else 0` on every token of row i (the whole
    sequence is dropped when outside). Metric `masked_frac` (of sequences)."""
    log_ratio = _log_ratio(old_logp, behaviour_logp, mask)
    seq = _seq_ratio(log_ratio, mask)  # [N]
    keep = (seq >= low) & (seq <= high)
    weights = torch.where(keep, seq, torch.zeros_like(seq)).unsqueeze(-1).expand_as(log_ratio)
    frac = row_mean((~keep).float(), valid_rows(mask))
    return _finish(weights, log_ratio, mask, masked_frac=frac)


@IS_CORRECTIONS.register("sis")
@torch.no_grad()
def sis(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float = 2.0, seed: int = 0
) -> tuple[torch.Tensor, Metrics]:
    """Selective importance sampling: a per-token rejection test with the behaviour policy as proposal.

    Token t is accepted with probability `min(1, ratio_t)` (a uniform draw from a `torch.Generator` seeded
    with `seed`, one per position of `[N, T]`); accepted tokens get weight 1, rejected ones keep the
    truncated ratio `min(ratio_t, cap)`. Only tokens with ratio < 1 can be rejected. This rule is defined
    in the Selective Importance Sampling (SIS) paper (in this project's seed papers), which treats
    accepted off-policy tokens as on-policy. Metric `rejected_frac`.
    """
    log_ratio = _log_ratio(old_logp, behaviour_logp, mask)
    ratio = torch.exp(log_ratio)
    accept = seeded_uniform(ratio, seed) < torch.clamp(ratio, max=1.0)
    weights = torch.where(accept, torch.ones_like(ratio), torch.clamp(ratio, max=cap))
    return _finish(weights, log_ratio, mask, rejected_frac=masked_mean((~accept).float(), mask))
