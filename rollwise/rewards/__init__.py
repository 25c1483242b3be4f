"""Rewards: `RewardFn(sample) -> RewardResult`, the `REWARDS` registry and scoring with counted failures.

    fn = build_reward_fn(cfg.reward, source.default_reward)   # or REWARDS.get("math")
    metrics = score_samples(samples, fn)                        # sets reward, parts, correct; FAILED on error
"""

from rollwise.rewards.scoring import (
    DEFAULT_TIMEOUT_S,
    RewardFailure,
    RewardTimeout,
    build_reward_fn,
    get_reward_fn,
    reward_metrics,
    score_sample,
    score_samples,
)
from rollwise.rewards.verifiers import REWARDS, RewardFn, final_integer, final_number

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "REWARDS",
    "RewardFailure",
    "RewardFn",
    "RewardTimeout",
    "build_reward_fn",
    "final_integer",
    "final_number",
    "get_reward_fn",
    "reward_metrics",
    "score_sample",
    "score_samples",
]
