"""The run as stages: which method runs each RL step (`[[stage]]` tables in order, or one implicit stage).

The stage of a step is a function of the step number alone, so a run resumed mid-stage continues in it. A run
without `[[stage]]` is one stage whose kind follows `[teacher]` (`config_distill.implicit_kind`). Each kind's
method is built once and serves every stage of that kind.
"""

from __future__ import annotations

from rollwise.config_distill import StageConfig, implicit_kind
from rollwise.methods.base import Method, MethodSetup, Stage


def plan_stages(stages: list[StageConfig], train_steps: int, teacher_cfg, method: str = "rl") -> list[Stage]:
    """The `Stage`s of a run of `train_steps` steps (`method`: `algo.method`, the kind without `[[stage]]`)."""
    if not stages:
        return [Stage(implicit_kind(teacher_cfg, method), 0, train_steps, 0, 1)]
    out, start = [], 0
    for i, s in enumerate(stages):
        out.append(Stage(s.kind, start, start + s.steps, i, len(stages), s))
        start += s.steps
    return out


class MethodPlan:
    """The stages of a run and the method of each. `setup` is what the methods are built with; the teacher it
    holds is shared by every teacher stage, saved once (`state_dict`) and closed once (`close`)."""

    def __init__(self, stages: list[Stage], setup: MethodSetup) -> None:
        from rollwise.methods import METHODS

        self.stages, self.setup = stages, setup
        self.methods: dict[str, Method] = {}
        for stage in stages:
            if stage.kind not in self.methods:
                self.methods[stage.kind] = METHODS.get(stage.kind)(setup)

    @property
    def uses_teacher(self) -> bool:
        return any(m.uses_teacher for m in self.methods.values())

    def at(self, completed_steps: int) -> tuple[Stage, Method]:
        """The stage and method of the step after `completed_steps` (the last stage once the plan is over)."""
        stage = next((s for s in self.stages if completed_steps < s.end), self.stages[-1])
        return stage, self.methods[stage.kind]

    def starts_now(self, completed_steps: int) -> bool:
        """True when the next step is the first of a stage (and there is more than one stage)."""
        return len(self.stages) > 1 and any(s.start == completed_steps for s in self.stages)

    def metrics(self, completed_steps: int) -> dict[str, float]:
        """`stage/index` (0-based) and `stage/step` (steps done in it, this one included) of the next step."""
        stage, _ = self.at(completed_steps)
        return {"stage/index": float(stage.index), "stage/step": float(completed_steps - stage.start + 1)}

    def state_dict(self) -> dict:
        """What a resumed run needs: the teacher's state (an EMA teacher's weights) and each method's own."""
        teacher = self.setup.teacher
        return {"teacher": teacher.state_dict() if hasattr(teacher, "state_dict") else None,
                "methods": {k: m.state_dict() for k, m in self.methods.items() if m.state_dict() is not None}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("teacher") is not None:
            self.setup.teacher.load_state_dict(state["teacher"])
        for kind, method_state in (state.get("methods") or {}).items():
            if kind in self.methods:
                self.methods[kind].load_state_dict(method_state)

    def close(self) -> None:
        close = getattr(self.setup.teacher, "close", None)
        if close is not None:
            close()
