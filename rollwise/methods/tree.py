"""`tree`: the RL step trained on the step values of tree-search rollouts (rStar-Math, Guan et al. 2025; MedS3,
Jiang et al. 2025), with `rollout.strategy = "tree"` (rollwise/rollout_strategies/tree.py).

The strategy writes `Sample.info["step_values"]` = [(start, end, Q)] over response positions (Q = the mean
outcome reward of the search's completions below that step: a Monte-Carlo process reward) and
`info["root_value"]` = Q(root). The terms give every token of step k the step advantage

    A_t = (1 - algo.tree.value_coef) x A_outcome + algo.tree.value_coef x (Q(k) - Q(k - 1)),   Q(-1) = Q(root)

so a step that raised the chance of a correct completion is reinforced and one that lowered it is pushed down,
inside responses that share the same outcome reward (which a GRPO outcome advantage cannot tell apart). The
step differences telescope: over a response they sum to (last step's value - Q(root)).
Departures: rStar-Math and MedS3 train the policy by SFT on the best searched trajectories and a separate
process reward model on the Q values; here the Q values are the advantage of an RL update of the policy itself
(no reward model is trained). A sample without step values (one that did not come from the tree search) keeps
its outcome advantage and is counted in `tree/samples_without_values`.
Logged: `tree/step_adv_abs_mean` (|Q(k) - Q(k-1)| per trained token), `tree/samples_without_values`.
"""

from __future__ import annotations

import torch

from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.methods.base import Method, Prepared, StepInput, outcome_advantage_errors
from rollwise.train.batching import MicroBatch
from rollwise.train.terms import PolicyTerms


def step_advantages(samples, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, T] Q(k(t)) - Q(k(t) - 1) from each sample's step values (0 past them) and [S] whether it had any."""
    out = torch.zeros(len(samples), length)
    has = torch.zeros(len(samples), dtype=torch.bool)
    for i, s in enumerate(samples):
        steps = s.info.get("step_values")
        if not steps:
            continue
        has[i] = True
        previous = float(s.info.get("root_value", 0.0))
        for start, end, q in steps:
            out[i, start:min(end, length)] = float(q) - previous
            previous = float(q)
    return out, has


class TreeTerms(PolicyTerms):
    """Token advantages mixing the outcome advantage with the search's step advantage (module docstring)."""

    def __init__(self, coef: float) -> None:
        self.coef = coef
        self.sums: dict[str, float] = {}
        self.seen: set[int] = set()

    def start(self) -> None:
        self.sums, self.seen = {}, set()

    def advantages(self, own_logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None) -> torch.Tensor:
        steps, has = step_advantages(mb.samples, mb.loss_mask.shape[1])
        steps = steps.to(mb.advantages.device, mb.advantages.dtype)
        outcome = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None].expand_as(steps)
        mixed = (1 - self.coef) * outcome + self.coef * steps
        adv = torch.where(has.to(steps.device)[:, None], mixed, outcome)
        if id(mb) not in self.seen:  # several epochs read the same micro-batch: count it once
            self.seen.add(id(mb))
            mask = mb.loss_mask.float()
            for key, value in (("tokens", mask[has].sum()), ("step_abs", (steps.abs() * mask)[has].sum()),
                               ("without", (~has).sum())):
                self.sums[key] = self.sums.get(key, 0.0) + float(value)
        return adv

    def metrics(self) -> dict[str, float]:
        return {"tree/step_adv_abs_mean": self.sums.get("step_abs", 0.0) / max(1.0, self.sums.get("tokens", 0.0)),
                "tree/samples_without_values": self.sums.get("without", 0.0)}


class TreeValueOptions(MethodOptions, section="algo", name="tree"):
    """`[algo.tree]` (with `rollout.strategy = "tree"`, whose search is `[rollout.tree]`)."""

    value_coef: float = Field(1.0, ge=0.0, le=1.0, description="a token's advantage = (1 - coef) x the outcome "
                              "advantage + coef x (Q(its step) - Q(the step before)), Q from the tree search; 1 = "
                              "step values only")


class Tree(Method):
    """The plain RL step with the tree search's step values as token advantages."""

    options = TreeValueOptions

    @classmethod
    def checks(cls, cfg) -> list[str]:
        errors = []
        if cfg.rollout.strategy != "tree":
            errors.append("algo.method = 'tree' trains on the step values of tree-search rollouts: set "
                          "rollout.strategy = 'tree'")
        return errors + outcome_advantage_errors("tree", cfg, "mixes step values with an outcome advantage")

    def prepare(self, step: StepInput) -> Prepared:
        return Prepared(step.samples, TreeTerms(self.opts.value_coef))
