"""Advantage estimators for outcome rewards: `fn(rewards [N], group_ids [N], **options) -> [N]`."""

from __future__ import annotations

import torch

from rollwise.algo.registries import ADVANTAGES


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and unbiased std of the sample's group.

    rewards: [N] float; group_ids: [N] int (any values). Returns (mean [N], std [N]);
    the std of a single-sample group is 0.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    rewards = rewards.to(torch.float64)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, rewards)  # [G]
    means = sums / counts  # [G]
    sq = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
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
