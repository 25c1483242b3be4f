"""Config sections of distillation and SFT (docs/distill.md): `[teacher]`, `[distill]` and `[[stage]]`.

Kept apart from `rollwise.config` for size; `Config` holds them as `teacher`, `distill` and `stage`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

StageKind = Literal["rl", "opd", "opsd", "sft"]
TEACHER_KINDS = ("opd", "opsd")  # stages whose samples the teacher scores


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TeacherConfig(_Section):
    """The model that scores the student's responses token by token (OPD, OPSD, GKD)."""

    weights: str | None = Field(None, description="None = no teacher; 'base' = the frozen starting model, 'live' = "
                                "the current policy, 'ema' = an EMA of the policy, or a PATH: an HF model directory, "
                                "a rollwise checkpoint (checkpoints/step-N) or a run directory (its newest one)")
    context: str = Field("none", description="what the teacher sees beyond the student's prompt: 'none', 'hint' "
                         "(the row's answer in the user turn), 'solution' (the row's worked solution), or a template "
                         "with {answer} / {solution} (appended to the user turn) or {prompt} (replaces it)")
    temperature: float = Field(1.0, gt=0.0, description="the teacher's softmax temperature (set it to the rollout "
                               "temperature for a KL between like distributions)")
    top_k: int = Field(16, ge=1, description="distill.objective = 'gkd': the teacher's top-k log-probs kept per "
                       "token (the rest of the vocabulary is one tail bucket)")
    ema_decay: float = Field(0.99, gt=0.0, lt=1.0, description="teacher.weights = 'ema': decay per RL step")
    solution_field: str = Field("solution", description="row key of the worked solution (context 'solution')")
    backend: Literal["trainer", "engine"] = Field(
        "trainer", description="trainer = a model in the trainer process; engine = prefill-only scoring on an engine "
        "of rollout.engine's kind (vLLM prompt_logprobs), for teachers too big for the trainer")


class DistillConfig(_Section):
    """How teacher stages use the teacher, SFT mixing, routing, the TRB warm-up and the collapse guard."""

    objective: Literal["opd", "gkd"] = Field(
        "opd", description="opd = the teacher gap as a token advantage (any policy loss); gkd = a generalized JSD "
        "loss term over the teacher's top-k + tail")
    coef: float = Field(1.0, ge=0.0, description="opd: weight of (logp_student - logp_teacher) in the token "
                        "advantage; gkd: weight of the loss term")
    reward_weight: float = Field(1.0, ge=0.0, description="weight of the outcome advantage in teacher stages "
                                 "(0 = pure distillation)")
    gkd_beta: float = Field(0.5, ge=0.0, le=1.0, description="gkd: 0 = forward KL(T||S), 1 = reverse KL(S||T), "
                            "between: GKD's JSD / (beta (1 - beta)), continuous in beta (4x GKD's JSD at 0.5)")
    sft_coef: float = Field(0.0, ge=0.0, description="rl/opd stages: weight of the NLL of correct sampled responses "
                            "mixed into the loss (0 = off)")
    sft_schedule: Literal["constant", "linear", "gac"] = Field(
        "constant", description="sft_coef over the run: constant, linear decay to 0, or gac (scaled by the batch's "
        "failure rate, after GAC's adaptive mixing)")
    routing: Literal["none", "self_routing"] = Field(
        "none", description="self_routing = each sample to grpo, self_distill, regularise or skip by correctness "
        "and the policy's confidence (teacher stages)")
    confidence_threshold: float = Field(0.7, gt=0.0, lt=1.0, description="self_routing: a response is confident "
                                        "when its mean token probability is at least this")
    trb_steps: int = Field(0, ge=0, description="TRB warm-up: the first N steps sample from the student-teacher "
                           "mixture inside a KL trust region (torch engine; 0 = off)")
    trb_budget: float = Field(0.1, ge=0.0, description="TRB: KL(mixture || student) per token at step 0, annealed "
                              "linearly to 0 at trb_steps")
    teacher_rollouts_per_group: int = Field(0, ge=0, description="rollout mixture (StableOPD): samples per group "
                                            "drawn from the teacher instead of the policy (needs algo.is_correction)")
    guard_window_steps: int = Field(5, ge=1, description="collapse guard: steps whose mean length is the baseline")
    guard_length_rise: float = Field(0.5, gt=0.0, description="collapse guard: mean length this much above the "
                                     "baseline (0.5 = +50%) ...")
    guard_repetition: float = Field(0.2, gt=0.0, lt=1.0, description="... with this share of repeated 4-grams")
    guard_stop: bool = Field(False, description="stop the run (after a checkpoint) when the guard alarms")



class StageConfig(_Section):
    """One `[[stage]]`: `steps` RL steps of one kind. The stages run in order and add up to train.steps."""

    kind: StageKind = Field(description="rl = reward only; opd = teacher scoring (+ reward_weight x reward); "
                            "opsd = opd with a privileged teacher context; sft = NLL on demonstrations")
    steps: int = Field(gt=0, description="RL steps of this stage")
    data: str | None = Field(None, description="sft: demonstrations file (JSONL / Parquet / datasets directory) with "
                             "prompt and response; None = rejection-sampled correct responses from the engine")
    prompt_field: str = "prompt"
    response_field: str = "response"


def stage_errors(cfg) -> list[str]:
    """What is inconsistent between `[[stage]]`, `train.steps`, `[teacher]` and the rest of `cfg` (a `Config`)."""
    stages, train_steps, teacher = cfg.stage, cfg.train.steps, cfg.teacher
    errors = []
    kinds = [s.kind for s in stages] or [implicit_kind(teacher)]
    distilling = bool(stages) or teacher.weights is not None or cfg.distill.sft_coef > 0
    if distilling and (cfg.train.backend != "local" or cfg.control.mode != "sync"):
        errors.append("stages, teachers and SFT terms run with train.backend = 'local' and control.mode = 'sync'")
    if cfg.distill.trb_steps > 0 or cfg.distill.teacher_rollouts_per_group > 0:
        errors += trb_errors(cfg, kinds)
    if cfg.distill.routing != "none" and not any(k in TEACHER_KINDS for k in kinds):
        errors.append("distill.routing routes the samples of teacher stages: set teacher.weights (and a stage of kind "
                      "'opd' or 'opsd'), or distill.routing = 'none'")
    if teacher.backend == "engine":
        errors += engine_teacher_errors(cfg)
    if any(s.kind == "sft" for s in stages) and cfg.replay.kind != "none":
        errors.append("an SFT stage trains demonstrations, which have no advantage to replay: set replay.kind = 'none'")
    errors += data_stage_errors(cfg)
    if stages and sum(s.steps for s in stages) != train_steps:
        errors.append(f"the [[stage]] tables add up to {sum(s.steps for s in stages)} steps but train.steps = "
                      f"{train_steps}; make them equal")
    if cfg.distill.objective == "gkd" and not any(k in TEACHER_KINDS for k in kinds):
        errors.append("distill.objective = 'gkd' is a loss against a teacher: set teacher.weights (and a stage of kind "
                      "'opd' or 'opsd'), or remove distill.objective")
    if any(k in TEACHER_KINDS for k in kinds) and teacher.weights is None:
        errors.append("a stage of kind 'opd' or 'opsd' needs a teacher: set teacher.weights ('base', 'live', 'ema' "
                      "or a model path)")
    if "opsd" in kinds and teacher.context == "none":
        errors.append("a stage of kind 'opsd' is self-distillation with privileged context: set teacher.context "
                      "('hint', 'solution' or a template with {answer})")
    if teacher.weights == "live" and teacher.context == "none" and any(k in TEACHER_KINDS for k in kinds):
        errors.append("teacher.weights = 'live' with teacher.context = 'none' is the student itself (the gap is "
                      "always 0): give the teacher a context, or other weights")
    return errors


def data_stage_errors(cfg) -> list[str]:
    """`[[stage]] data`: demonstrations, read by SFT stages only; they carry no reward for a critic to learn from."""
    for number, stage in enumerate(cfg.stage, 1):
        if stage.data is not None and stage.kind != "sft":
            return [f"[[stage]] number {number} (kind {stage.kind!r}) has data = {stage.data!r}, which only an 'sft' "
                    "stage reads: remove it, or set kind = 'sft'"]
        if stage.data is not None and cfg.algo.advantage == "gae":
            return [f"[[stage]] number {number} trains demonstrations from {stage.data!r}, which have no reward for "
                    "algo.advantage = 'gae' (a critic) to learn from: use an outcome advantage (e.g. 'grpo'), or "
                    "drop data to rejection-sample"]
    return []


def trb_errors(cfg, kinds: list[str]) -> list[str]:
    """The TRB warm-up and the rollout mixture sample in the trainer process from the policy and the teacher."""
    r = cfg.rollout
    if cfg.teacher.weights is None or not any(k in TEACHER_KINDS for k in kinds):
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


def implicit_kind(teacher: TeacherConfig) -> str:
    """The kind of a run without `[[stage]]`: opsd with a teacher context, opd with a teacher, else rl."""
    if teacher.weights is None:
        return "rl"
    return "opsd" if teacher.context != "none" else "opd"
