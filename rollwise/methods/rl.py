"""`rl`: the plain RL step (GRPO, PPO, DAPO, ... by `[algo]`), optionally with SFT on its correct samples.

With `distill.sft_coef > 0` the NLL of the correct sampled responses is mixed into the loss
(`sft_coef x agg(-logp)`), on a `distill.sft_schedule`: constant, linear decay to 0 over the stage, or `gac`,
scaled by the batch's failure rate (more imitation while the policy fails; after GAC's adaptive SFT/RL mixing,
our form). The teacher stages (rollwise.methods.teacher) mix it the same way.
"""

from __future__ import annotations

from rollwise.distill.terms import StepMarks, StepTerms
from rollwise.methods.base import Method, Prepared, Stage, StepInput
from rollwise.types import Sample


def sft_coef_now(cfg, stage: Stage, step: int, samples: list[Sample]) -> float:
    """`distill.sft_coef` at RL step `step` (steps done before it) of `stage` (see the module docstring)."""
    coef, schedule = cfg.distill.sft_coef, cfg.distill.sft_schedule
    if coef == 0 or schedule == "constant":
        return coef
    if schedule == "linear":
        span = max(1, stage.end - stage.start)
        return coef * max(0.0, 1.0 - (step - stage.start) / span)
    graded = [s for s in samples if s.correct is not None]
    failure = 1.0 - sum(bool(s.correct) for s in graded) / len(graded) if graded else 1.0
    return coef * failure


def mark_correct_for_sft(samples: list[Sample], marks: StepMarks) -> None:
    """The SFT weight of each sample: 1 for a correct one, 0 otherwise (its other weights kept)."""
    for s in samples:
        w = marks.weight(s)
        marks.set_weights(s, (w[0], w[1], 1.0 if s.correct else 0.0))


class RL(Method):
    """GRPO/PPO: the Filter stage's advantages as they are (+ the SFT mixing of `distill.sft_coef`)."""

    def prepare(self, step: StepInput) -> Prepared:
        cfg = self.setup.cfg
        if cfg.distill.sft_coef == 0:
            return Prepared(step.samples)
        marks = StepMarks()
        mark_correct_for_sft(step.samples, marks)
        terms = StepTerms(sft_coef=sft_coef_now(cfg, step.stage, step.step, step.samples), marks=marks)
        return Prepared(step.samples, terms, record=marks.record)
