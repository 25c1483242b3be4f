"""MOA (Multi-Objective Alignment): advantages from several rubric rewards, each normalised within its group
before they are combined (`algo.advantage = "moa"`, `algo.moa.weights`).

    A_i = sum_k w_k * (p_k,i - mean_g(p_k)) / (std_g(p_k) + eps)

`p_k` is reward part `k` (`Sample.reward_parts`: the built-in verifiers give `correct` and `format`, a rubric
reward or judge gives one part per rubric) and `w_k` its weight; the name `reward` stands for the sample's
training reward itself (after shaping). A part that is equal across a group adds 0 for that group.

Paper: MOA, "Multi-Objective Alignment" for role-playing agents (see the seeds' abstracts): training on several
fine-grained rubrics at once with a multi-objective strategy instead of one scalar. The abstract does not give
the combination; what is chosen here, and why:
- Each objective gets its own group normalisation (GRPO's, per part), so a rubric with a small spread is not
  drowned by one with a large spread, as it is in a fixed weighted sum of raw rewards whose combined std then
  normalises everything together. The weights then say how much each rubric's *relative* standing counts.
- The weighted sum is not renormalised: with weights summing to 1 its scale matches one GRPO advantage.
- `scale=False` (`algo.scale_rewards = "none"`) drops the per-part std division (Dr. GRPO per part).
- The abstract's thought-augmented rollouts with off-policy guidance are not part of this estimator.
"""

from __future__ import annotations

import torch

from rollwise.algo.advantages import group_stats
from pydantic import Field

from rollwise.algo.registries import ADVANTAGES
from rollwise.config_methods import MethodOptions

REWARD_PART = "reward"  # the weight name that stands for the training reward itself


class MoaOptions(MethodOptions, section="algo", name="moa"):
    """`[algo.moa]` (with `algo.advantage = "moa"`)."""

    weights: dict[str, float] = Field(default_factory=dict, description="weight of each reward part (by name, "
                                      "e.g. {correct = 1.0, format = 0.5}); each part is normalised within its "
                                      "group before the weighted sum")

    def errors(self, cfg) -> list[str]:
        return moa_errors(self.weights)


def moa_errors(weights: dict[str, float]) -> list[str]:
    """What is wrong with `algo.moa.weights` for `algo.advantage = "moa"` (checked when the config loads)."""
    if not weights:
        return ["algo.advantage = 'moa' needs algo.moa.weights: name the reward parts to combine, e.g. "
                "[algo.moa] weights = {correct = 1.0, format = 0.5}"]
    bad = sorted(k for k, w in weights.items() if not (w >= 0.0 and w < float("inf")))
    if bad:
        return [f"algo.moa.weights: the weights of {bad} must be finite and >= 0"]
    if sum(weights.values()) <= 0.0:
        return ["algo.moa.weights: every weight is 0; give at least one reward part a positive weight"]
    return []


@ADVANTAGES.register("moa")
def moa(rewards: torch.Tensor, group_ids: torch.Tensor, parts: dict[str, torch.Tensor] | None = None,
        weights: dict[str, float] | None = None, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """MOA advantages (see the module docstring).

    rewards: [N] training rewards; group_ids: [N]; parts: reward parts by name, [N] each (NaN where a sample has
    no such part); weights: part name -> weight (None: {"reward": 1.0}, i.e. GRPO). Returns [N] float32. ValueError
    naming `algo.moa.weights` when a weighted part is missing from a sample or the weights are unusable."""
    weights = dict(weights or {REWARD_PART: 1.0})  # called bare (no weights): GRPO on the training reward
    errors = moa_errors(weights)
    if errors:
        raise ValueError(errors[0])
    parts = {**(parts or {}), REWARD_PART: rewards}
    total = torch.zeros(rewards.shape, dtype=torch.float64, device=rewards.device)  # [N]
    for name, weight in weights.items():
        if weight == 0.0:
            continue
        values = parts.get(name)
        if values is None or bool(torch.isnan(values.to(torch.float64)).any()):
            known = sorted(parts)
            raise ValueError(f"algo.moa.weights names reward part {name!r}, which the reward does not give every "
                             f"sample (parts given: {known}); weight the parts the reward returns")
        mean, std = group_stats(values, group_ids)
        centred = values.to(torch.float64) - mean  # [N]
        total += weight * (centred / (std + eps) if scale else centred)
    return total.to(torch.float32)


moa.options = MoaOptions  # type: ignore[attr-defined]  ([algo.moa])
