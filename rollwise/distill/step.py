"""The loop's distillation work in one RL step: teacher scoring, Self-Routing, SFT batches, terms and guards.

`rollwise.loop.rl_step` calls, in order:
- `prepare(run, stage, samples)` after the Filter stage: the teacher scores the samples of a teacher stage,
  Self-Routing sets each sample's loss weights (and drops the skipped), SFT mixing marks correct samples;
- `step_terms(run, stage, samples)` -> the trainer's `StepTerms` for this step;
- `guard_metrics(run, batch)` after the update: repetition, the collapse guard, and the EMA teacher's move.
"""

from __future__ import annotations

import math

from rollwise.distill.guards import CollapseError, CollapseGuard, repetition_rate
from rollwise.distill.stages import Stage
from rollwise.distill.terms import StepTerms
from rollwise.types import Sample, Status

# (reward advantage, teacher term, sft NLL) weights of each Self-Routing route
ROUTES = {"grpo": (1.0, 0.0, 0.0), "self_distill": (0.0, 1.0, 0.0), "regularise": (1.0, 1.0, 0.0),
          "skip": (0.0, 0.0, 0.0)}


def confidence(sample: Sample) -> float:
    """The policy's confidence in a response: its geometric-mean token probability over the trained tokens,
    `exp(mean_t logp_t)` of the untruncated sampling log-probs (1.0 for an empty response)."""
    logps = sample.full_logprobs or sample.behaviour_logprobs
    values = [lp for lp, m in zip(logps, sample.loss_mask) if m]
    return math.exp(sum(values) / len(values)) if values else 1.0


def route(sample: Sample, threshold: float) -> str:
    """Self-Routing (our rule; the paper routes by correctness and confidence): a correct and confident response
    has nothing left to teach (skip); a correct unsure one is reinforced (grpo); a wrong unsure one learns from
    the privileged teacher (self_distill); a wrong confident one gets both the reward's push and the teacher's
    pull (regularise)."""
    confident = confidence(sample) >= threshold
    if sample.correct:
        return "skip" if confident else "grpo"
    return "regularise" if confident else "self_distill"


def route_samples(samples: list[Sample], threshold: float) -> tuple[list[Sample], dict[str, float]]:
    """Route every sample, set its `loss_weights`, drop the skipped; `route/<name>_frac` of the samples."""
    counts = dict.fromkeys(ROUTES, 0)
    kept = []
    for s in samples:
        s.route = route(s, threshold)
        counts[s.route] += 1
        s.loss_weights = ROUTES[s.route]
        if s.route != "skip":
            kept.append(s)
    n = max(1, len(samples))
    return kept, {f"route/{name}_frac": c / n for name, c in counts.items()}


def sample_record(sample: Sample) -> dict:
    """What `samples/step-N.jsonl` shows of a scored sample: the mean gap between the student's own untruncated
    log-probs and the teacher's over the trained tokens (None without any), their number, the teacher's summed
    log-prob, and the Self-Routing route."""
    own = sample.full_logprobs or sample.behaviour_logprobs
    pairs = [(o, t) for o, t, m in zip(own, sample.teacher_logprobs, sample.loss_mask) if m]
    return {"teacher_gap_mean": sum(o - t for o, t in pairs) / len(pairs) if pairs else None,
            "teacher_tokens": len(pairs), "teacher_logprob_sum": sum(t for _, t in pairs),
            "route": sample.route or None}


def sft_coef_now(cfg, stage: Stage, step: int, samples: list[Sample]) -> float:
    """`distill.sft_coef` at this step: constant, linear decay to 0 over the stage, or `gac`: scaled by the
    batch's failure rate (more imitation while the policy fails; after GAC's adaptive SFT/RL mixing, our form)."""
    coef, schedule = cfg.distill.sft_coef, cfg.distill.sft_schedule
    if coef == 0 or schedule == "constant":
        return coef
    if schedule == "linear":
        span = max(1, stage.end - stage.start)
        return coef * max(0.0, 1.0 - (step - stage.start) / span)
    graded = [s for s in samples if s.correct is not None]
    failure = 1.0 - sum(bool(s.correct) for s in graded) / len(graded) if graded else 1.0
    return coef * failure


def prepare(run, stage: Stage, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
    """Teacher scoring, Self-Routing and SFT marks for the fresh samples of this step (see the module docstring)."""
    cfg, metrics = run.cfg, {}
    if stage.kind == "sft":
        for s in samples:
            s.loss_weights = (0.0, 0.0, 1.0)
        return samples, metrics
    if stage.uses_teacher and samples:
        metrics.update(run.teacher.score(samples))
        if cfg.distill.routing == "self_routing":
            samples, route_metrics = route_samples(samples, cfg.distill.confidence_threshold)
            metrics.update(route_metrics)
    if cfg.distill.sft_coef > 0:
        for s in samples:
            w = s.loss_weights
            s.loss_weights = (w[0], w[1], 1.0 if s.correct else 0.0)
    return samples, metrics


def step_terms(run, stage: Stage, samples: list[Sample]) -> StepTerms:
    """The trainer's distillation terms for this step."""
    d = run.cfg.distill
    return StepTerms(teacher=stage.uses_teacher, objective=d.objective, coef=d.coef, reward_weight=d.reward_weight,
                     gkd_beta=d.gkd_beta, temperature=run.cfg.teacher.temperature,
                     sft_coef=sft_coef_now(run.cfg, stage, run.step, samples), sft_only=stage.kind == "sft")


def rejection_sampled(groups) -> tuple[list[Sample], dict[str, float]]:
    """An SFT stage without a data file: the correct responses the engine sampled are the demonstrations."""
    scored = [s for g in groups for s in g.usable()]
    kept = [s for s in scored if s.correct and s.status == Status.COMPLETED]
    prompts = {s.group_id for s in kept}
    return kept, {"sft/demos": float(len(kept)), "sft/accepted_frac": len(kept) / max(1, len(scored)),
                  "sft/prompts_with_demo": float(len(prompts))}


def demo_batch(run, stage: Stage) -> list[Sample]:
    """An SFT stage's demonstrations for this step from its data file: `prompts_per_step x samples_per_prompt`
    rows in the file's seeded order, from the step's position in the stage (a resumed run continues exactly)."""
    from rollwise.distill.demos import demo_sample

    source = run.demo_sources[stage.index]
    n = run.cfg.rollout.prompts_per_step * run.cfg.rollout.samples_per_prompt
    position = (run.step - stage.start) * n
    samples = []
    for i, demo in enumerate(source.batch(position, n)):
        sample = demo_sample(demo, run.encoder, run.tokenizer, run.cfg.rollout.max_new_tokens, group_id=-1 - i)
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise ValueError(f"{stage.cfg.data}: no demonstration of step {run.step + 1} fits data.max_prompt_tokens="
                         f"{run.cfg.data.max_prompt_tokens}; raise it")
    return samples


def load_demo_sources(cfg, stages: list[Stage]) -> dict:
    """`stage index -> DemoSource` of every SFT stage with a data file, read now: a bad row stops the run before
    its first step, not when the stage begins."""
    from rollwise.distill.demos import DemoSource, load_demonstrations

    return {stage.index: DemoSource(load_demonstrations(stage.cfg.data, stage.cfg.prompt_field,
                                                        stage.cfg.response_field, cfg=cfg.data), cfg.train.seed)
            for stage in stages if stage.kind == "sft" and stage.cfg is not None and stage.cfg.data is not None}


class Guards:
    """Per-step guard metrics of the responses (`rollout/repetition_rate`) and the truncation-collapse alarm."""

    def __init__(self, cfg) -> None:
        d = cfg.distill
        self.collapse = CollapseGuard(window_steps=d.guard_window_steps, length_rise=d.guard_length_rise,
                                      repetition=d.guard_repetition)  # the loop stops (after a checkpoint)
        self.stop = d.guard_stop

    def check_stop(self, step: int, row: dict) -> None:
        """`distill.guard_stop`: CollapseError when this step's row raised the alarm (the loop saved first)."""
        if self.stop and row.get("distill/collapse_alarm") == 1.0:
            raise CollapseError(f"step {step}: stopped at the truncation-collapse alarm (distill.guard_stop = true; "
                                f"mean length {row.get('rollout/response_len_mean', 0):.1f}, repetition rate "
                                f"{row.get('rollout/repetition_rate', 0):.2f}); the checkpoint of this step is saved")

    def observe(self, step: int, samples: list[Sample], row: dict, alarm: bool = True) -> dict[str, float]:
        """`rollout/repetition_rate` (repeated 4-grams of the policy's tokens) of this step's responses; with
        `alarm` (teacher stages) the collapse guard's `distill/collapse_alarm` and `distill/len_rise` too."""
        responses = [[t for t, m in zip(s.response_ids, s.loss_mask) if m] for s in samples]
        rate = repetition_rate(responses, n=4)
        out = {"rollout/repetition_rate": rate}
        if alarm and samples:
            out.update(self.collapse.observe(step, row.get("rollout/response_len_mean", 0.0), rate,
                                             row.get("rollout/truncated_frac", 0.0)))
        return out

    def state_dict(self) -> dict:
        return self.collapse.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.collapse.load_state_dict(state)
