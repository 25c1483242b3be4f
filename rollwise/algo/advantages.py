"""Advantage estimators for outcome rewards: `fn(rewards [N], group_ids [N], **options) -> [N]` float32.

Samples with the same group id answer the same prompt. Arithmetic runs in float64 and the result is
returned as float32. Token-level estimators (GAE) live in `rollwise.algo.value`.
"""

from __future__ import annotations

import torch

from rollwise.algo.common import group_index, group_sum
from rollwise.algo.registries import ADVANTAGES


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and unbiased std of the sample's group.

    rewards: [N] float; group_ids: [N] int (any values). Returns (mean [N], std [N]) in float64;
    the std of a single-sample group is 0.
    """
    inverse, counts = group_index(group_ids)
    rewards = rewards.to(torch.float64)
    means = group_sum(rewards, inverse, len(counts)) / counts  # [G]
    sq = group_sum((rewards - means[inverse]) ** 2, inverse, len(counts))  # [G]
    var = sq / (counts - 1).clamp(min=1)  # [G] unbiased (Bessel), as torch.std
    return means[inverse], var.sqrt()[inverse]


@ADVANTAGES.register("grpo")
def grpo(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (DeepSeekMath, Shao et al. 2024): `A_i = (r_i - mean_g) / (std_g + eps)`.

    The std is the unbiased group std (as in the reference implementations). `scale=False` drops
    the division, which is Dr. GRPO's advantage (Liu et al. 2025, "Understanding R1-Zero-like training").
    rewards: [N], group_ids: [N] -> [N] float32.
    """
    mean, std = group_stats(rewards, group_ids)
    adv = rewards.to(torch.float64) - mean
    if scale:
        adv = adv / (std + eps)
    return adv.to(torch.float32)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): `A_i = r_i - mean_g`, no std normalisation. [N] -> [N]."""
    return grpo(rewards, group_ids, scale=False)


@ADVANTAGES.register("rloo")
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

    Baseline of sample i = mean reward of the OTHER samples of its group:
    `A_i = r_i - (sum_g - r_i) / (n_g - 1) = n_g / (n_g - 1) * (r_i - mean_g)`.
    A group of one sample has no baseline and gets advantage 0. [N] -> [N] float32.
    """
    inverse, counts = group_index(group_ids)
    rewards64 = rewards.to(torch.float64)
    sums = group_sum(rewards64, inverse, len(counts))[inverse]  # [N] sum of the sample's group
    n = counts[inverse].to(torch.float64)  # [N]
    baseline = (sums - rewards64) / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, rewards64 - baseline, torch.zeros_like(rewards64))
    return adv.to(torch.float32)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu et al. 2025, "REINFORCE++"; the "-baseline" variant).

    `x_i = r_i - mean_g`, then normalised over the whole batch:
    `A_i = (x_i - mean(x)) / (std(x) + eps)` with the unbiased batch std (0 when N = 1).
    The batch mean of `x` is 0 up to rounding; it is subtracted anyway, as in the paper.
    [N] -> [N] float32.
    """
    mean_g, _ = group_stats(rewards, group_ids)
    x = rewards.to(torch.float64) - mean_g
    std = x.std() if x.numel() > 1 else torch.zeros((), dtype=torch.float64, device=x.device)
    return ((x - x.mean()) / (std + eps)).to(torch.float32)
