"""Config checks of methods and stages, run by `rollwise.validate` before any work (`--dry-run`).

What cannot run together among `[[stage]]`, `[teacher]`, `[distill]` and the rest of the config, from what each
stage's method declares (`uses_teacher`, `reads_demonstrations`, its own `checks`), so a plugin method is checked
the same way as a built-in one.
"""

from __future__ import annotations

from rollwise.config_distill import implicit_kind


def method_classes(cfg) -> list[tuple[str, type]]:
    """`(kind, Method class)` of every stage of the run, in order (one implicit stage without `[[stage]]`)."""
    from rollwise.methods import METHODS

    kinds = [s.kind for s in cfg.stage] or [implicit_kind(cfg.teacher, cfg.algo.method)]
    return [(kind, METHODS.get(kind)) for kind in kinds]


def method_errors(cfg) -> list[str]:
    """Every error of the run's stages and methods; the first one is reported. An unknown kind is reported by
    the names check (rollwise.names), so it is skipped here."""
    from rollwise.methods.base import Method

    try:
        classes = method_classes(cfg)
    except (KeyError, ValueError):
        return []
    if not all(isinstance(cls, type) and issubclass(cls, Method) for _, cls in classes):
        return []
    errors = stage_errors(cfg, classes)
    if cfg.algo.method != "rl" and (cfg.stage or cfg.teacher.weights is not None):
        errors.append(f"algo.method = {cfg.algo.method!r} is the method of a run without [[stage]] tables and without "
                      "a teacher; with them, name it as a stage's kind instead")
    for _, cls in classes:
        errors += [e for e in cls.checks(cfg) if e not in errors]
    return errors


def stage_errors(cfg, classes: list[tuple[str, type]]) -> list[str]:
    """What is inconsistent between `[[stage]]`, `train.steps`, `[teacher]` and the rest of `cfg` (a `Config`)."""
    stages, train_steps, teacher = cfg.stage, cfg.train.steps, cfg.teacher
    errors = []
    teacher_stage = any(cls.uses_teacher for _, cls in classes)
    distilling = bool(stages) or teacher.weights is not None or cfg.distill.sft_coef > 0
    if distilling and (cfg.train.backend != "local" or cfg.control.mode != "sync"):
        errors.append("stages, teachers and SFT terms run with train.backend = 'local' and control.mode = 'sync'")
    if cfg.distill.trb_steps > 0 or cfg.distill.teacher_rollouts_per_group > 0:
        errors += trb_errors(cfg, teacher_stage)
    if cfg.distill.routing != "none" and not teacher_stage:
        errors.append("distill.routing routes the samples of teacher stages: set teacher.weights (and a stage of kind "
                      "'opd' or 'opsd'), or distill.routing = 'none'")
    if teacher.backend == "engine":
        errors += engine_teacher_errors(cfg)
    errors += data_stage_errors(cfg, classes)
    if stages and sum(s.steps for s in stages) != train_steps:
        errors.append(f"the [[stage]] tables add up to {sum(s.steps for s in stages)} steps but train.steps = "
                      f"{train_steps}; make them equal")
    if cfg.distill.objective == "gkd" and not teacher_stage:
        errors.append("distill.objective = 'gkd' is a loss against a teacher: set teacher.weights (and a stage of kind "
                      "'opd' or 'opsd'), or remove distill.objective")
    if teacher_stage and teacher.weights is None:
        errors.append("a stage of kind 'opd' or 'opsd' needs a teacher: set teacher.weights ('base', 'live', 'ema' "
                      "or a model path)")
    if teacher.weights == "live" and teacher.context == "none" and teacher_stage:
        errors.append("teacher.weights = 'live' with teacher.context = 'none' is the student itself (the gap is "
                      "always 0): give the teacher a context, or other weights")
    return errors


def data_stage_errors(cfg, classes: list[tuple[str, type]]) -> list[str]:
    """`[[stage]] data`: demonstrations, read by SFT stages only; they carry no reward for a critic to learn from."""
    for number, (stage, (_, cls)) in enumerate(zip(cfg.stage, classes), 1):
        if stage.data is not None and not cls.reads_demonstrations:
            return [f"[[stage]] number {number} (kind {stage.kind!r}) has data = {stage.data!r}, which only an 'sft' "
                    "stage reads: remove it, or set kind = 'sft'"]
        if stage.data is not None and cfg.algo.advantage == "gae":
            return [f"[[stage]] number {number} trains demonstrations from {stage.data!r}, which have no reward for "
                    "algo.advantage = 'gae' (a critic) to learn from: use an outcome advantage (e.g. 'grpo'), or "
                    "drop data to rejection-sample"]
    return []


def trb_errors(cfg, teacher_stage: bool) -> list[str]:
    """The TRB warm-up and the rollout mixture sample in the trainer process from the policy and the teacher."""
    r = cfg.rollout
    if cfg.teacher.weights is None or not teacher_stage:
        return ["distill.trb_steps / teacher_rollouts_per_group blend the teacher into sampling: set teacher.weights "
                "(and a teacher stage)"]
    if cfg.teacher.backend == "engine":
        return ["distill.trb_steps / teacher_rollouts_per_group sample token by token from the teacher's model in the "
                "trainer process; teacher.backend = 'engine' only scores: use teacher.backend = 'trainer', or set "
                "both to 0"]
    if r.top_p < 1.0 or r.top_k > 0 or r.stop or r.temperature == 0:
        return ["distill.trb_steps > 0 samples the full mixture: set rollout.top_p = 1, top_k = 0, no rollout.stop "
                "and a temperature > 0"]
    if cfg.distill.teacher_rollouts_per_group > 0 and cfg.algo.is_correction == "none":
        return ["distill.teacher_rollouts_per_group > 0 trains on the teacher's samples: set algo.is_correction "
                "(e.g. 'tis_token') to weight them by their behaviour log-probs"]
    if cfg.distill.teacher_rollouts_per_group >= r.samples_per_prompt:
        return ["distill.teacher_rollouts_per_group must be below rollout.samples_per_prompt (the student samples too)"]
    if cfg.control.partial_rollouts or cfg.rollout.source != "local" or cfg.env.name is not None:
        return ["distill.trb_steps > 0 generates single-turn responses in this process: turn off partial rollouts, "
                "rollout.source = 'service' and env.name"]
    return []


def engine_teacher_errors(cfg) -> list[str]:
    """`teacher.backend = 'engine'`: fixed weights, scored at temperature 1 by an engine this process starts."""
    t = cfg.teacher
    if t.weights in ("live", "ema"):
        return [f"teacher.backend = 'engine' scores with fixed weights; teacher.weights = {t.weights!r} changes every "
                "step: use teacher.backend = 'trainer'"]
    if t.temperature != 1.0 or cfg.distill.objective == "gkd":
        return ["teacher.backend = 'engine' returns the sampled tokens' log-probs at temperature 1: set "
                "teacher.temperature = 1 and distill.objective = 'opd' (or use teacher.backend = 'trainer')"]
    if cfg.rollout.engine not in ("torch", "vllm") or cfg.rollout.server not in (None, "launch") or cfg.cluster.ray:
        return ["teacher.backend = 'engine' starts a torch or vLLM engine of its own in this process: use "
                "rollout.engine = 'torch' or 'vllm' (in-process or server = 'launch') without cluster.ray, or "
                "teacher.backend = 'trainer'"]
    return []
