"""A method added the way a user adds one: this file, named by a `[[stage]] kind` (`toy_method:Sharpen`).

`Sharpen` is the plain RL step plus a teacher-free loss term: the NLL of the correct sampled responses,
`coef x agg(-logp)` over their tokens, and a `toy/correct_nll` metric. Nothing in the loop, session or trainer
knows it exists.
"""

from __future__ import annotations

import torch

from rollwise.methods import Method, Prepared, StepInput
from rollwise.train.terms import PolicyTerms

COEF = 0.5


class SharpenTerms(PolicyTerms):
    """The policy loss as it is, plus `COEF x agg(-logp)` on the tokens of the samples in `correct`."""

    def __init__(self, correct: set[int]) -> None:
        self.correct, self.sums = correct, [0.0, 0.0]

    def start(self) -> None:
        self.sums = [0.0, 0.0]

    def extra_loss(self, logp, hidden, head, mb, aggregate, entropy=None) -> torch.Tensor:
        rows = torch.tensor([[1.0] if id(s) in self.correct else [0.0] for s in mb.samples])  # [S, 1]
        mask = mb.loss_mask * rows  # [S, T]
        self.sums[0] += float((-logp.detach() * mask).sum())
        self.sums[1] += float(mask.sum())
        return COEF * aggregate(-logp * mask, mb.loss_mask)

    def metrics(self) -> dict[str, float]:
        return {"toy/correct_nll": self.sums[0] / self.sums[1]} if self.sums[1] else {}


class Sharpen(Method):
    """The plain RL step that also imitates its own correct responses."""

    def prepare(self, step: StepInput) -> Prepared:
        correct = {id(s) for s in step.samples if s.correct}
        return Prepared(step.samples, SharpenTerms(correct), {"toy/correct_samples": float(len(correct))})
