"""Length shaping of outcome rewards:
`fn(rewards [N], lengths [N], group_ids [N], correct [N] bool, **options) -> shaped rewards [N]` float32.

`lengths` are response lengths in tokens; `correct` marks samples whose answer is right (used for solve
rates). Shaping runs on the whole batch before the advantage estimator, so batch-wide quantities are fine.
"""

from __future__ import annotations

import torch

from rollwise.algo.common import group_index, group_sum
from rollwise.algo.registries import SHAPING


def group_solve_rate(correct: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample solve rate of its group (fraction of correct samples) and group size. `[N] -> ([N], [N])`."""
    inverse, counts = group_index(group_ids)
    solved = group_sum(correct.to(torch.float32), inverse, len(counts))
    return (solved / counts)[inverse], counts[inverse].to(torch.float32)


@SHAPING.register("alp")
def alp(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    group_ids: torch.Tensor,
    correct: torch.Tensor,
    beta: float = 0.1,
    max_len: float | None = None,
    floor: bool = True,
) -> torch.Tensor:
    """Adaptive Length Penalty (Xiang et al. 2025, "Just Enough Thinking: Efficient Reasoning with Adaptive
    Length Penalties Reinforcement Learning").

    `r_i' = r_i - beta * p_g * length_i / max_len`, with `p_g` the group's online solve rate, so prompts the
    policy already solves pay most for extra tokens and unsolved ones pay little. With `floor=True` (the
    paper's form) `p_g` is replaced by `max(p_g, 1 / n_g)` (n_g = group size), keeping a small penalty on
    unsolved prompts; `floor=False` uses `p_g` as is. `max_len` is the length normaliser in tokens (set it
    to the generation budget); None uses the longest response of the batch. `beta = 0.1` is our default
    (the paper tunes it).
    """
    rate, size = group_solve_rate(correct, group_ids)
    if floor:
        rate = torch.maximum(rate, 1.0 / size)
    lengths = lengths.to(torch.float32)
    norm = float(lengths.max().clamp(min=1)) if max_len is None else float(max_len)
    return rewards.to(torch.float32) - beta * rate * lengths / norm


@SHAPING.register("overlong_soft")
def overlong_soft(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    group_ids: torch.Tensor,
    correct: torch.Tensor,
    max_len: float = 20480,
    cache_len: float = 4096,
    penalty: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
    System at Scale"). With `L_max = max_len` and `L_cache = cache_len` (tokens):

        0                                  if length <= L_max - L_cache
        (L_max - L_cache - length) / L_cache   if L_max - L_cache < length <= L_max   (from 0 down to -1)
        -1                                 if length > L_max

    times `penalty`, added to the reward. Defaults are the paper's (16384 expected + 4096 cache).
    `group_ids` and `correct` are unused.
    """
    if cache_len <= 0:
        raise ValueError(f"overlong_soft needs cache_len > 0, got {cache_len}")
    lengths = lengths.to(torch.float32)
    expected = max_len - cache_len
    ramp = (expected - lengths) / cache_len
    over = torch.where(lengths <= max_len, ramp, -torch.ones_like(ramp))
    shaped = torch.where(lengths <= expected, torch.zeros_like(ramp), over)
    return rewards.to(torch.float32) + penalty * shaped
