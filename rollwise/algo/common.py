"""Small tensor helpers shared by the algorithm modules (masked means, per-sequence reductions, groups).

Conventions: `[N, T]` tensors hold N responses (rows) by T response positions; `mask` is 1 on trained
tokens and 0 on padding. A "sequence" is one row.
"""

from __future__ import annotations

import torch


def per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast advantages `[N]` (one per sequence) or `[N, T]` (one per token) to the shape of `like`."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is 1 (0 when the mask is empty). Scalar.

    Positions outside the mask are ignored even when they hold inf or nan.
    """
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum() / mask.sum().clamp(min=1)


def seq_token_counts(mask: torch.Tensor) -> torch.Tensor:
    """Number of trained tokens of each row. `[N, T] -> [N]`."""
    return mask.sum(dim=-1)


def seq_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of `x` over the row's trained tokens (0 for a row without any). `[N, T] -> [N]`."""
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum(dim=-1) / seq_token_counts(mask).clamp(min=1)


def valid_rows(mask: torch.Tensor) -> torch.Tensor:
    """Float `[N]`: 1 for rows with at least one trained token, else 0."""
    return (seq_token_counts(mask) > 0).to(mask.dtype if mask.is_floating_point() else torch.float32)


def row_mean(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mean of the per-row values `x [N]` over the rows where `rows [N]` is 1 (0 when none). Scalar."""
    return (x * rows).sum() / rows.sum().clamp(min=1)


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense group index of every sample and the size of every group.

    group_ids: `[N]` ints (any values). Returns (inverse `[N]` in `0..G-1`, counts `[G]`).
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def group_sum(x: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum of `x [N]` over each group. Returns `[G]` in the dtype of `x`."""
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def seeded_uniform(like: torch.Tensor, seed: int) -> torch.Tensor:
    """Uniform [0, 1) draws shaped like `like`, from a fresh generator seeded with `seed` (reproducible)."""
    generator = torch.Generator(device=like.device)
    generator.manual_seed(int(seed))
    return torch.rand(like.shape, generator=generator, device=like.device, dtype=torch.float32)
