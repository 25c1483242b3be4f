"""Config sections of distillation and SFT (docs/distill.md): `[teacher]`, `[distill]` and `[[stage]]`.

Kept apart from `rollwise.config` for size; `Config` holds them as `teacher`, `distill` and `stage`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field



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

    kind: str = Field(description="the stage's method (rollwise.methods): rl = reward only; opd = teacher scoring "
                      "(+ reward_weight x reward); opsd = opd with a privileged teacher context; sft = NLL on "
                      "demonstrations; or a plugin 'package.module:Class'")
    steps: int = Field(gt=0, description="RL steps of this stage")
    data: str | None = Field(None, description="sft: demonstrations file (JSONL / Parquet / datasets directory) with "
                             "prompt and response; None = rejection-sampled correct responses from the engine")
    prompt_field: str = "prompt"
    response_field: str = "response"


def implicit_kind(teacher: TeacherConfig, method: str = "rl") -> str:
    """The kind of a run without `[[stage]]`: opsd with a teacher context, opd with a teacher, else `algo.method`."""
    if teacher.weights is None:
        return method
    return "opsd" if teacher.context != "none" else "opd"
