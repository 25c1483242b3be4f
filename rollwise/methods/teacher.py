"""`opd` and `opsd`: on-policy distillation from a teacher that scores every token the student sampled.

`prepare` has the teacher score the step's fresh samples (`rollwise.distill.teacher`; OPSD's teacher sees a
privileged context), routes them with Self-Routing when `distill.routing = "self_routing"`
(`rollwise.distill.routing`), marks correct ones for the SFT mixing of `distill.sft_coef`, and hands the trainer
`StepTerms` with the OPD token advantage or the GKD loss term (`distill.objective`, rollwise.distill.terms).
Everything it decides lives in the step's `StepMarks`; a replayed sample is not re-scored and gets no teacher
term. Groups whose rewards are all equal are kept: the teacher's signal needs no reward variance.
"""

from __future__ import annotations

from rollwise.distill.routing import route_samples
from rollwise.distill.terms import StepMarks, StepTerms
from rollwise.methods.base import Method, Prepared, StepInput
from rollwise.methods.rl import mark_correct_for_sft, sft_coef_now
from rollwise.models.arch import logit_softcap


class OPD(Method):
    """On-policy distillation (`teacher.weights` scores; `distill.reward_weight` keeps the reward's share)."""

    uses_teacher = True
    keeps_uniform_groups = True

    def prepare(self, step: StepInput) -> Prepared:
        cfg, marks, metrics = self.setup.cfg, StepMarks(), {}
        samples = step.samples
        if samples:
            metrics.update(self.setup.teacher.score(samples, marks))
            if cfg.distill.routing == "self_routing":
                samples, route_metrics = route_samples(samples, cfg.distill.confidence_threshold, marks)
                metrics.update(route_metrics)
        if cfg.distill.sft_coef > 0:
            mark_correct_for_sft(samples, marks)
        d = cfg.distill
        terms = StepTerms(teacher=True, objective=d.objective, coef=d.coef, reward_weight=d.reward_weight,
                          gkd_beta=d.gkd_beta, temperature=cfg.teacher.temperature,
                          sft_coef=sft_coef_now(cfg, step.stage, step.step, samples), marks=marks,
                          softcap=logit_softcap(self.setup.policy) if self.setup.policy is not None else None)
        return Prepared(samples, terms, metrics, record=marks.record)

    def after_update(self, policy) -> None:
        self.setup.teacher.after_update(policy)  # an EMA teacher follows the policy


class OPSD(OPD):
    """On-policy self-distillation: OPD whose teacher sees privileged context (`teacher.context`)."""

    @classmethod
    def checks(cls, cfg) -> list[str]:
        if cfg.teacher.context == "none":
            return ["a stage of kind 'opsd' is self-distillation with privileged context: set teacher.context "
                    "('hint', 'solution' or a template with {answer})"]
        return super().checks(cfg)
