"""The Filter stage's training rewards and outcome advantages of a step's kept groups.

`assign_advantages(groups, cfg, trainer)` sets each usable sample's `train_reward` (the reward after
`algo.shaping` and, with `algo.kl_in_reward`, the KL penalty) and, for an outcome estimator, its `advantage`
(`algo.advantage`, by name from the registry). Token-level estimators (`gae`) get their advantages in the
trainer, from the value head. The run's `algo.scale_rewards` goes to every estimator that takes a `scale`
keyword (GRPO's std normalisation); no estimator is special-cased by name.
"""

from __future__ import annotations


import torch

from rollwise import algo
from rollwise.config import Config
from rollwise.algo.options import estimator_options
from rollwise.types import Group, Sample

CPU = torch.device("cpu")  # a step's rewards and advantages are a few numbers per sample: computed here


def shaped_rewards(samples: list[Sample], cfg: Config, trainer=None) -> tuple[torch.Tensor, dict[str, float]]:
    """`[N]` training rewards of `samples` (shaping, then the KL penalty) and their `reward/*` metrics."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=CPU)  # [N]
    metrics: dict[str, float] = {}
    if cfg.algo.shaping:
        group_ids = torch.tensor([s.group_id for s in samples], device=CPU)  # [N]
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32, device=CPU)
        correct = torch.tensor([bool(s.correct) for s in samples], device=CPU)
        names = sorted({k for s in samples for k in s.reward_parts})
        parts = {k: torch.tensor([s.reward_parts.get(k, 0.0) for s in samples], dtype=torch.float32, device=CPU)
                 for k in names}
        for name, options in cfg.algo.shaping.items():
            options = {"max_len": cfg.rollout.max_new_tokens, **options}
            rewards = algo.shape_rewards(name, rewards, lengths, group_ids, correct, parts=parts, **options)
        metrics["reward/shaped_mean"] = float(rewards.mean())
    if cfg.algo.kl_coef > 0 and cfg.algo.kl_in_reward and trainer is not None:
        penalty = torch.tensor(trainer.kl_penalties(samples), dtype=torch.float32, device=CPU)  # [N], <= 0
        rewards = rewards + penalty
        metrics["reward/kl_penalty_mean"] = float(penalty.mean())
    return rewards, metrics


def assign_advantages(groups: list[Group], cfg: Config, trainer=None) -> tuple[list[Sample], dict[str, float]]:
    """Set training rewards and outcome advantages (see the module docstring); returns the usable samples and
    the `reward/*` metrics of the shaping."""
    samples = [s for g in groups for s in g.usable()]
    if not samples:
        return [], {}
    rewards, metrics = shaped_rewards(samples, cfg, trainer)
    for s, r in zip(samples, rewards.tolist()):
        s.train_reward = r
    if algo.is_token_advantage(cfg.algo.advantage):
        return samples, metrics
    group_ids = torch.tensor([s.group_id for s in samples], device=CPU)  # [N]
    advantages = algo.advantage(cfg.algo.advantage, rewards, group_ids, **estimator_options(cfg, samples))  # [N]
    for s, a in zip(samples, advantages.tolist()):
        s.advantage = a
    return samples, metrics
