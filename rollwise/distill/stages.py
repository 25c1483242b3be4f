"""Stages: a run as a list of `[[stage]]` tables (`kind`, `steps`), e.g. SFT then GRPO, or Search-E1's
GRPO rounds interleaved with OPSD rounds; a recipe, not code.

The stage of an RL step is a function of the step number alone, so a run resumed mid-stage continues in it.
A run without `[[stage]]` is one stage whose kind follows `[teacher]` (`config_distill.implicit_kind`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rollwise.config_distill import TEACHER_KINDS, StageConfig, implicit_kind


@dataclass(frozen=True)
class Stage:
    """One stage: steps `start + 1 .. end` of the run (1-based, as logged), `index` of `count` stages."""

    kind: str
    start: int
    end: int
    index: int
    count: int
    cfg: StageConfig | None = None

    @property
    def uses_teacher(self) -> bool:
        return self.kind in TEACHER_KINDS

    def describe(self) -> str:
        return f"stage {self.index + 1}/{self.count} ({self.kind}, steps {self.start + 1}-{self.end})"


class StagePlan:
    """The stages of a run of `train_steps` steps (`[[stage]]` in order, or one implicit stage)."""

    def __init__(self, stages: list[StageConfig], train_steps: int, teacher_cfg) -> None:
        if not stages:
            self.stages = [Stage(implicit_kind(teacher_cfg), 0, train_steps, 0, 1)]
            return
        self.stages, start = [], 0
        for i, s in enumerate(stages):
            self.stages.append(Stage(s.kind, start, start + s.steps, i, len(stages), s))
            start += s.steps

    def at(self, completed_steps: int) -> Stage:
        """The stage of the step after `completed_steps` (the last stage once the plan is over)."""
        for stage in self.stages:
            if completed_steps < stage.end:
                return stage
        return self.stages[-1]

    def starts_now(self, completed_steps: int) -> bool:
        """True when the next step is the first of a stage (and there is more than one stage)."""
        return len(self.stages) > 1 and any(s.start == completed_steps for s in self.stages)

    @property
    def uses_teacher(self) -> bool:
        return any(s.uses_teacher for s in self.stages)

    def metrics(self, completed_steps: int) -> dict[str, float]:
        """`stage/index` (0-based) and `stage/step` (steps done in it, this one included) of the next step."""
        stage = self.at(completed_steps)
        return {"stage/index": float(stage.index), "stage/step": float(completed_steps - stage.start + 1)}
