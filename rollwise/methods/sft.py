"""`sft`: supervised fine-tuning steps, the NLL of demonstrations alone (no policy loss, no advantage).

Demonstrations come from the stage's data file (`[[stage]] data`: JSONL, Parquet or a datasets directory with a
prompt and a response; `rollwise.distill.demos`), `prompts_per_step x samples_per_prompt` rows per step in the
file's seeded order from the step's position in the stage (a resumed run continues exactly), or, without a file,
by rejection sampling: the correct, completed responses the engine just sampled. Groups whose rewards are all
equal are kept (every correct response is a demonstration); nothing is replayed.
"""

from __future__ import annotations

from rollwise.distill.terms import StepMarks, StepTerms
from rollwise.methods.base import Method, Prepared, Stage, StepInput
from rollwise.types import Group, Sample, Status


def rejection_sampled(groups: list[Group]) -> tuple[list[Sample], dict[str, float]]:
    """The correct, completed responses among `groups`; `sft/*` counts."""
    scored = [s for g in groups for s in g.usable()]
    kept = [s for s in scored if s.correct and s.status == Status.COMPLETED]
    prompts = {s.group_id for s in kept}
    return kept, {"sft/demos": float(len(kept)), "sft/accepted_frac": len(kept) / max(1, len(scored)),
                  "sft/prompts_with_demo": float(len(prompts))}


class SFT(Method):
    """See the module docstring."""

    keeps_uniform_groups = True
    replays = False
    reads_demonstrations = True

    @classmethod
    def checks(cls, cfg) -> list[str]:
        if cfg.replay.kind != "none":
            return ["an SFT stage trains demonstrations, which have no advantage to replay: set replay.kind = 'none'"]
        return []

    def generates(self, stage: Stage) -> bool:
        return stage.cfg is None or stage.cfg.data is None

    def prepare(self, step: StepInput) -> Prepared:
        if self.generates(step.stage):
            samples, metrics = rejection_sampled(step.groups)
        else:
            samples, metrics = self.demonstrations(step.stage, step.step), {}
        marks = StepMarks()
        for s in samples:
            marks.set_weights(s, (0.0, 0.0, 1.0))
        return Prepared(samples, StepTerms(sft_only=True, marks=marks), metrics, record=marks.record)

    def demonstrations(self, stage: Stage, step: int) -> list[Sample]:
        """The stage file's demonstrations of RL step `step` (steps done before it)."""
        from rollwise.distill.demos import demo_sample

        setup, cfg = self.setup, self.setup.cfg
        n = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
        samples = []
        for i, demo in enumerate(setup.demo_sources[stage.index].batch((step - stage.start) * n, n)):
            sample = demo_sample(demo, setup.encoder, setup.tokenizer, cfg.rollout.max_new_tokens, group_id=-1 - i)
            if sample is not None:
                samples.append(sample)
        if not samples:
            raise ValueError(f"{stage.cfg.data}: no demonstration of step {step + 1} fits data.max_prompt_tokens="
                             f"{cfg.data.max_prompt_tokens}; raise it")
        return samples


def load_demo_sources(cfg, stages: list[Stage]) -> dict:
    """`stage index -> DemoSource` of every stage whose method reads a data file, read now: a bad row stops the
    run before its first step, not when the stage begins."""
    from rollwise.distill.demos import DemoSource, load_demonstrations
    from rollwise.methods import METHODS

    return {stage.index: DemoSource(load_demonstrations(stage.cfg.data, stage.cfg.prompt_field,
                                                        stage.cfg.response_field, cfg=cfg.data), cfg.train.seed)
            for stage in stages if stage.cfg is not None and stage.cfg.data is not None
            and METHODS.get(stage.kind).reads_demonstrations}
