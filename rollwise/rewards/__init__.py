"""Rewards: `RewardFn(sample) -> RewardResult | float | int | bool`, the `REWARDS` registry and scoring with
counted failures (time limits and what they can stop: `rollwise.rewards.calling`).

    fn = build_reward_fn(cfg.reward, source.default_reward)   # or REWARDS.get("math"); IsolatedReward if isolate
    metrics = score_samples(samples, fn, cfg.reward.timeout_s)  # sets reward, parts, correct; FAILED on error
    guard = RewardFailureGuard(cfg.reward.max_failed_steps)    # raises when every reward fails N steps in a row
"""

from rollwise.rewards.calling import RemoteRewardError, RewardFailure, RewardTimeout, as_result, get_reward_fn
from rollwise.rewards.isolate import IsolatedReward, RewardWorkerError
from rollwise.rewards.scoring import (
    DEFAULT_TIMEOUT_S,
    RewardFailureGuard,
    RewardSettingsError,
    RewardsFailingError,
    batch_scorer,
    build_reward_fn,
    reward_metrics,
    reward_setting_errors,
    score_batch,
    score_sample,
    score_samples,
)
from rollwise.rewards.verifiers import REWARDS, RewardFn, final_integer, final_number
from rollwise.rewards import code as _code_tests  # noqa: E402,F401  (registers the code_tests reward)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "REWARDS",
    "IsolatedReward",
    "RemoteRewardError",
    "RewardFailure",
    "RewardFailureGuard",
    "RewardFn",
    "RewardTimeout",
    "RewardWorkerError",
    "RewardSettingsError",
    "RewardsFailingError",
    "as_result",
    "batch_scorer",
    "build_reward_fn",
    "final_integer",
    "final_number",
    "get_reward_fn",
    "reward_metrics",
    "reward_setting_errors",
    "score_batch",
    "score_sample",
    "score_samples",
]
