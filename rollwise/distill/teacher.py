"""Teachers: score the student's sampled response ids, token by token, behind the teacher's own prompt.

`Teacher.score(samples, marks)` records in the step's `StepMarks` (rollwise.distill.terms), by sample, the
teacher's log-prob of each response token at `teacher.temperature` (`[T]`) and, for GKD, its top-k
(`([T][k] log-probs, [T][k] ids)`); nothing is written on the samples. The response
ids are used exactly as sampled (never decoded and re-tokenised); only the prompt changes when the teacher has a
privileged context (`teacher.context`, on-policy self-distillation, OPSD). The responses of one prompt share one
teacher prefill: they are packed into one row behind the prompt (`rollwise.train.batching`, prompt-shared rows).

Weights (`teacher.weights`): `base` (the frozen starting model; the reference model when one is loaded),
`live` (the policy being trained), `ema` (an exponential moving average of the policy, updated after every RL
step), or a path (an HF directory, a rollwise checkpoint, or a run directory: its newest checkpoint).
"""

from __future__ import annotations

import copy
import math
import string
from dataclasses import replace
from pathlib import Path

import torch

from rollwise.errors import UserError
from rollwise.config_distill import TeacherConfig
from rollwise.data.prompts import PromptEncoder
from rollwise.distill.terms import StepMarks
from rollwise.models import model_info
from rollwise.models.arch import logit_softcap
from rollwise.perf import FlopCounter
from rollwise.train.batching import MicroBatch, collate, split_by_tokens
from rollwise.train.logprobs import response_hidden
from rollwise.train.shared_attention import NAME as SHARED_ATTENTION
from rollwise.types import Message, Prompt, Sample

CONTEXTS = {
    "hint": "{prompt} (Hint: the correct answer is {answer}.)",
    "solution": "{prompt}\n\nA worked solution:\n{solution}",
}
FIELDS = ("prompt", "answer", "solution")


class TeacherError(UserError, ValueError):
    """A teacher cannot be built or cannot score a row; the message names the key, path or row."""


def context_template(context: str) -> str | None:
    """The user-turn template of `teacher.context` (None for 'none'). A custom template without `{prompt}` is
    appended to the user turn; unknown fields fail here, before any model loads."""
    if context == "none":
        return None
    template = CONTEXTS.get(context, context)
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise TeacherError(f"teacher.context = {context!r} is not a valid template ({exc})") from None
    unknown = fields - set(FIELDS)
    if unknown or not fields:
        raise TeacherError(f"teacher.context = {context!r}: use 'none', 'hint', 'solution' or a template with the "
                           f"fields {{answer}}, {{solution}} or {{prompt}}" + (f" (unknown: {sorted(unknown)})" if unknown else ""))
    return template if "prompt" in fields else "{prompt}\n\n" + template


def privileged_messages(prompt: Prompt, template: str | None, solution_field: str = "solution") -> list[Message]:
    """The teacher's chat: the student's, with the last user turn rewritten by `template`."""
    if template is None:
        return prompt.messages
    values = {"prompt": None, "answer": prompt.answer, "solution": prompt.info.get(solution_field)}
    for name in ("answer", "solution"):
        if "{" + name + "}" in template and values[name] in (None, ""):
            key = "the answer field (data.answer_field)" if name == "answer" else f"the row key {solution_field!r}"
            raise TeacherError(f"{prompt.source or prompt.uid}: teacher.context needs {key}, which this row lacks; "
                               "add it to the data or change teacher.context")
    last = max((i for i, m in enumerate(prompt.messages) if m["role"] == "user"), default=None)
    if last is None:
        raise TeacherError(f"{prompt.source or prompt.uid}: no user turn to add the teacher's context to")
    messages = [dict(m) for m in prompt.messages]
    values["prompt"] = messages[last]["content"]
    messages[last]["content"] = template.format(**{k: "" if v is None else str(v) for k, v in values.items()})
    return messages


def check_same_tokenizer(student, teacher, where: str) -> None:
    """TeacherError unless both tokenizers map every token to the same id (and agree on EOS): distillation
    compares log-probs of the same token ids."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a == b and student.eos_token_id == teacher.eos_token_id:
        return
    if len(a) != len(b):
        detail = f"vocabularies of {len(a)} and {len(b)} tokens"
    elif a != b:
        token = next(t for t in sorted(a) if a.get(t) != b.get(t))
        detail = f"token {token!r} is id {a[token]} for the student and {b.get(token)} for the teacher"
    else:
        detail = f"EOS id {student.eos_token_id} against {teacher.eos_token_id}"
    raise TeacherError(f"teacher {where}: its tokenizer differs from the student's ({detail}); the teacher scores "
                       "the student's token ids, so it must use the same tokenizer (distill from a model of the same "
                       "family, or convert one of them)")


def resolve_teacher_path(path: str) -> str:
    """An HF model directory as given, or a run directory's newest complete checkpoint."""
    from rollwise.train.checkpoint import latest_checkpoint

    p = Path(path)
    if not p.exists():
        raise TeacherError(f"teacher.weights = {path!r}: no such directory; give 'base', 'live', 'ema', an HF model "
                           "directory or a rollwise run directory")
    if (p / "config.json").exists():
        return str(p)
    if (p / "checkpoints").is_dir():
        ckpt = latest_checkpoint(p)
        if ckpt is None:
            raise TeacherError(f"teacher.weights = {path!r}: the run has no complete checkpoint yet")
        return str(ckpt)
    raise TeacherError(f"teacher.weights = {path!r}: neither an HF model directory (config.json) nor a run "
                       "directory (checkpoints/)")


class Teacher:
    """A model in the trainer process that scores samples (see the module docstring).

    `model` is the teacher's module (the policy itself for 'live'); `encoder` renders its prompts (the run's
    system prompt and chat template, with room for the context); `autocast` is the trainer's precision context.
    """

    def __init__(self, model, cfg: TeacherConfig, encoder: PromptEncoder, pad_id: int, micro_batch_tokens: int,
                 share_prompt: bool = True, autocast=None, top_k: int = 0):
        self.model, self.cfg, self.encoder, self.pad_id = model, cfg, encoder, pad_id
        self.template = context_template(cfg.context)
        self.micro_batch_tokens, self.share_prompt, self.top_k = micro_batch_tokens, share_prompt, top_k
        self.autocast = autocast
        self.device = next(model.parameters()).device  # the teacher's model's: the trainer's device
        self.flops = FlopCounter(model_info(model))  # the teacher's own size (perf/mfu counts its pass)
        self.last_scored: list[Sample] = []  # the samples of the last `score`, behind the teacher's prompts
        if share_prompt and model.config._attn_implementation != SHARED_ATTENTION:
            model.set_attn_implementation(SHARED_ATTENTION)

    def prompt_ids(self, sample: Sample) -> list[int]:
        """The teacher's prompt ids for `sample` (its own prompt with the context; the student's without one)."""
        if self.template is None:
            return sample.prompt_ids
        # its own uid: the encoder caches ids by uid, and this chat is not the student's
        prompt = replace(sample.prompt, uid=f"{sample.prompt.uid}#teacher",
                         messages=privileged_messages(sample.prompt, self.template, self.cfg.solution_field))
        ids = self.encoder.encode(prompt)
        if ids is None:
            raise TeacherError(f"{sample.prompt.source or sample.prompt.uid}: the teacher's prompt is longer than "
                               f"{self.encoder.max_prompt_tokens} tokens; raise data.max_prompt_tokens")
        return ids

    @torch.no_grad()
    def score(self, samples: list[Sample], marks: StepMarks) -> dict[str, float]:
        """Record every sample's teacher log-probs (and top-k when `top_k`) in `marks`; returns `teacher/*`
        metrics. Nothing is recorded when a score is NaN/Inf (TeacherError)."""
        if not samples:
            return {}
        scores: dict[int, tuple] = {}
        shadows = {id(s): replace(s, prompt_ids=self.prompt_ids(s)) for s in samples}
        owner = {id(shadow): s for s, shadow in zip(samples, shadows.values())}
        was_training = self.model.training
        self.model.eval()
        try:
            for group in split_by_tokens(list(shadows.values()), self.micro_batch_tokens, self.share_prompt):
                mb = collate(group, self.pad_id, share_prompt=self.share_prompt).to(self.device)
                with self.autocast() if self.autocast else torch.autocast(self.device.type, enabled=False):
                    logp, topk = score_micro_batch(self.model, mb, self.cfg.temperature, self.top_k)
                check_finite(logp, mb)
                for b, shadow in enumerate(mb.samples):
                    n = len(shadow.response_ids)
                    scores[id(owner[id(shadow)])] = (logp[b, :n].tolist(), None if topk is None else
                                                      (topk[0][b, :n].tolist(), topk[1][b, :n].tolist()))
        finally:
            self.model.train(was_training)
        marks.hold(samples)
        for key, (logps, top) in scores.items():
            marks.logprobs[key] = logps
            if top is not None:
                marks.topk[key] = top
        self.last_scored = list(shadows.values())
        tokens = sum(len(s.response_ids) for s in samples)
        return {"teacher/tokens": float(tokens), "teacher/prompt_tokens_mean":
                sum(len(sh.prompt_ids) for sh in shadows.values()) / len(samples)}

    def after_update(self, policy) -> None:
        """Called after every optimizer update of the policy (EMA teachers move; the others do not)."""


def check_finite(logp: torch.Tensor, mb: MicroBatch) -> None:
    """TeacherError when the teacher gave a NaN/Inf log-prob to a response token (`logp [S, T]`): such a score
    would become an infinite advantage, or pass for an unscored token."""
    bad = ~torch.isfinite(logp) & mb.valid
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0])
        sample = mb.samples[row]
        raise TeacherError(f"{sample.prompt.source or sample.prompt.uid}: the teacher gave NaN/Inf log-probs to "
                           f"{int(bad.sum())} response tokens of this batch; check the teacher's weights "
                           "(teacher.weights) and teacher.temperature")


class EmaTeacher(Teacher):
    """`teacher.weights = 'ema'`: `theta_T <- d * theta_T + (1 - d) * theta_policy` after every RL step."""

    def after_update(self, policy) -> None:
        decay = self.cfg.ema_decay
        with torch.no_grad():
            for mine, theirs in zip(self.model.parameters(), policy.parameters()):
                mine.mul_(decay).add_(theirs.detach().to(mine.dtype), alpha=1.0 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)


def score_micro_batch(model, mb: MicroBatch, temperature: float, top_k: int = 0):
    """Teacher log-probs of the response tokens of `mb` at `temperature`: `logp [S, T]` and, with `top_k`,
    `(topk_logp [S, T, k], topk_ids [S, T, k])` (zeros at padded positions). Chunked over positions so no
    `[n, V]` tensor of the whole micro-batch is kept."""
    hidden = response_hidden(model, mb) / temperature  # [n, H]
    weight = model.get_output_embeddings().weight
    cap = logit_softcap(model)  # Gemma 2: cap * tanh(z / cap) / T = (cap / T) tanh((z / T) / (cap / T))
    targets = mb.targets[mb.valid]  # [n]
    logps, top_lp, top_ids = [], [], []
    for start in range(0, hidden.shape[0], 256):
        logits = (hidden[start:start + 256].to(weight.dtype) @ weight.T).float()  # [C, V]
        if cap:
            logits = torch.tanh(logits / (cap / temperature)) * (cap / temperature)
        logp_all = torch.log_softmax(logits, dim=-1)
        logps.append(logp_all.gather(-1, targets[start:start + 256, None]).squeeze(-1))
        if top_k:
            values, ids = logp_all.topk(top_k, dim=-1)
            top_lp.append(values)
            top_ids.append(ids)
    S, T = mb.targets.shape
    logp = torch.zeros(S, T, device=mb.device).masked_scatter(mb.valid, torch.cat(logps))
    if not top_k:
        return logp, None
    lp = torch.zeros(S, T, top_k, device=mb.device).masked_scatter(mb.valid[..., None].expand(S, T, top_k),
                                                                   torch.cat(top_lp))
    ids = torch.zeros(S, T, top_k, dtype=torch.long, device=mb.device).masked_scatter(mb.valid[..., None].expand(S, T, top_k),
                                                                     torch.cat(top_ids))
    return logp, (lp, ids)


class EngineTeacher(Teacher):
    """`teacher.backend = 'engine'`: prefill-only scoring on an engine of its own (`probe_logprobs`: vLLM's
    `prompt_logprobs`, or a forward pass of the torch engine), at temperature 1, one request per sample (an
    engine with prefix caching computes a prompt's prefill once for its responses)."""

    def __init__(self, engine, cfg: TeacherConfig, encoder: PromptEncoder):
        if not engine.caps.probe_logprobs:
            raise TeacherError(f"teacher.backend = 'engine' scores with probe_logprobs; {type(engine).__name__} "
                               "has none: use teacher.backend = 'trainer'")
        self.engine, self.cfg, self.encoder = engine, cfg, encoder
        self.template = context_template(cfg.context)
        self.top_k = 0

    def score(self, samples: list[Sample], marks: StepMarks) -> dict[str, float]:
        scores = {}
        for s in samples:
            ids = self.prompt_ids(s)
            logps = self.engine.probe_logprobs(ids + s.response_ids)  # [P + T - 1]: token i given those before
            scored = [float(v) for v in logps[len(ids) - 1:]]
            if len(scored) != len(s.response_ids) or not all(map(math.isfinite, scored)):
                raise TeacherError(f"{s.prompt.source or s.prompt.uid}: the engine teacher returned {len(scored)} "
                                   f"log-probs (NaN/Inf among them or not) for {len(s.response_ids)} response "
                                   "tokens; check the teacher engine")
            scores[id(s)] = scored
        marks.hold(samples)
        marks.logprobs.update(scores)
        return {"teacher/tokens": float(sum(len(s.response_ids) for s in samples))}

    def close(self) -> None:
        self.engine.close()


def build_teacher(cfg, policy, tokenizer, encoder: PromptEncoder, trainer, pad_id: int,
                  run_dir: Path | None = None) -> Teacher | None:
    """The run's teacher from `cfg.teacher` (None when teacher.weights is unset). Loads a model for 'base' (unless
    the trainer holds a reference model: that one is shared) and for a path; copies the policy for 'ema'."""
    from rollwise.models import load_model

    tcfg = cfg.teacher
    if tcfg.weights is None:
        return None
    context_template(tcfg.context)  # template errors before any model loads
    wide = PromptEncoder(tokenizer, cfg.data.system_prompt, cfg.data.max_prompt_tokens * 2)
    kind, model = tcfg.weights, None
    if kind == "live":
        model = policy
    elif kind == "ema":
        model = copy.deepcopy(policy).requires_grad_(False)
    elif kind == "base":
        model = getattr(trainer, "ref_model", None)
        if model is None:
            model, _ = load_model(cfg.model.name, dtype=torch.float32)
    else:
        path = resolve_teacher_path(kind)
        model, teacher_tokenizer = load_model(path, dtype=torch.float32)
        check_same_tokenizer(tokenizer, teacher_tokenizer, repr(kind))
    if kind != "live":  # a model of its own lives on the policy's device (train.device)
        model = model.eval().requires_grad_(False).to(next(policy.parameters()).device)
    check_vocabulary(cfg, policy, model, kind)
    if tcfg.backend == "engine":
        return _engine_teacher(cfg, model, tokenizer, wide, run_dir)
    top_k = tcfg.top_k if cfg.distill.objective == "gkd" else 0
    cls = EmaTeacher if kind == "ema" else Teacher
    return cls(model, tcfg, wide, pad_id, cfg.train.micro_batch_tokens, cfg.train.share_prompt,
               autocast=getattr(trainer, "_autocast", None), top_k=top_k)


def check_vocabulary(cfg, student, teacher, where: str) -> None:
    """TeacherError before any step when GKD or the TRB / rollout-mixture sampler cannot compare the two
    next-token distributions: `teacher.top_k` over the teacher's vocabulary, or LM heads of different sizes
    (GKD gathers the teacher's top-k ids from the student's softmax; TRB mixes the two row by row)."""
    rows_s = student.get_output_embeddings().weight.shape[0]
    rows_t = teacher.get_output_embeddings().weight.shape[0]
    d = cfg.distill
    if d.objective == "gkd" and cfg.teacher.top_k > rows_t:
        raise TeacherError(f"teacher.top_k = {cfg.teacher.top_k} is more than the teacher's {rows_t} tokens; "
                           f"lower it (at most {rows_t})")
    if d.objective == "gkd" and rows_t != rows_s:
        raise TeacherError(f"teacher {where!r}: its LM head has {rows_t} rows and the student's {rows_s}; GKD compares "
                           "the two distributions token id by token id: use distill.objective = 'opd', or a teacher "
                           "with the student's vocabulary size")
    if (d.trb_steps > 0 or d.teacher_rollouts_per_group > 0) and rows_t < rows_s:
        raise TeacherError(f"teacher {where!r}: its LM head has {rows_t} rows, fewer than the student's {rows_s}; "
                           "distill.trb_steps / teacher_rollouts_per_group sample from the mixture of the two: set "
                           "them to 0, or use a teacher whose vocabulary covers every student token id")


def _engine_teacher(cfg, model, tokenizer, encoder: PromptEncoder, run_dir: Path | None) -> EngineTeacher:
    """An engine of rollout.engine's kind holding the teacher's weights, under `run_dir/teacher`."""
    from rollwise.generate.factory import build_engine

    tcfg = cfg.teacher  # its settings were checked with the config (rollwise.methods.checks.engine_teacher_errors)
    folder = Path(run_dir or ".") / "teacher"
    return EngineTeacher(build_engine(cfg, model, tokenizer, folder), tcfg, encoder)
