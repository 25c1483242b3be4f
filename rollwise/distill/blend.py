"""The Generate stage with the teacher in it: the TRB warm-up and StableOPD's rollout mixture.

`BlendedRollouts` wraps the run's rollouts (`rollwise.rollout.LocalRollouts`):
- TRB warm-up (`distill.trb_steps`, `trb_budget`): while `budget_at(version) > 0`, every pending sample is drawn
  from the per-token trust-region mixture of the policy and the teacher (`rollwise.distill.trb`);
- rollout mixture (`distill.teacher_rollouts_per_group = m`, StableOPD's rollout mixture distillation): in every
  group, m samples are drawn from the teacher alone (the mixture at weight 1), the others as usual.
Otherwise the wrapped rollouts generate (the run's engine). Blended samples are drawn in this process from the
trainer's policy and the teacher's model, behind the teacher's own prompt.

A blended sample's `behaviour_logprobs` are those of the distribution it was drawn from (the mixture, or the
teacher), so importance corrections against them are exact; its `full_logprobs` are the student's own at the
rollout temperature, so `mismatch/logprob_abs_diff_*` still compare the trainer with the policy that
generated, and `mismatch/truncation_logprob_gap_mean` shows how far sampling moved away from it.
"""

from __future__ import annotations

import math
import time

import torch

from rollwise.distill.trb import budget_at, trb_generate
from rollwise.types import Sample, Status


class BlendedRollouts:
    """See the module docstring. `student` is the trainer's policy module, `teacher` a `Teacher`."""

    def __init__(self, inner, student, teacher, tokenizer, warmup_steps: int, budget0: float,
                 teacher_per_group: int, seed: int):
        self.inner, self.student, self.teacher, self.tokenizer = inner, student, teacher, tokenizer
        self.warmup_steps, self.budget0, self.teacher_per_group, self.seed = warmup_steps, budget0, teacher_per_group, seed
        self.engine, self.stats, self.episodes, self.threads = inner.engine, inner.stats, inner.episodes, inner.threads
        self._jobs: dict[int, tuple] = {}
        self.last: dict[str, float] = {}

    def submit(self, job: int, groups, params, min_version: int = 0, stop=None) -> None:
        self._jobs[job] = (groups, params, min_version, stop)

    def wait(self, job: int):
        from rollwise.generate.groups import FINAL, GenerateStats
        from rollwise.rollout import JobResult

        groups, params, min_version, stop = self._jobs.pop(job)
        start, version = time.perf_counter(), self.inner.engine.version
        budget = budget_at(version, self.warmup_steps, self.budget0)
        pending = [[s for s in g.samples if s.status not in FINAL] for g in groups]
        from_teacher = [s for todo in pending for s in todo[len(todo) - min(self.teacher_per_group, len(todo)):]]
        lams = self._blend(from_teacher, params, math.inf, version, salt=1)
        self.last = {"rollout/teacher_samples_frac": len(from_teacher) / max(1, sum(map(len, pending)))}
        if budget > 0:
            rest = [s for g in groups for s in g.samples if s.status not in FINAL]
            lams = self._blend(rest, params, budget, version, salt=0)
            self.last.update({"trb/budget": budget, "trb/lam_mean": sum(lams) / max(1, len(lams))})
            return JobResult(version, time.perf_counter() - start, GenerateStats(len(rest), 0, len(groups)))
        self.inner.submit(job, groups, params, min_version, stop)
        result = self.inner.wait(job)
        if from_teacher:  # the teacher's samples were drawn in this call too
            result.generate_s = time.perf_counter() - start
        return result

    def _blend(self, samples: list[Sample], params, budget: float, version: int, salt: int) -> list[float]:
        """Draw `samples` from the mixture at `budget` (inf: the teacher alone) in place; the per-token weights."""
        if not samples:
            return []
        generator = torch.Generator().manual_seed((self.seed * 100_003 + version) * 2 + salt)
        was_training = self.student.training
        self.student.eval()
        try:
            with torch.no_grad():
                outs = trb_generate(self.student, self.teacher.model,
                                    [(s.prompt_ids, self.teacher.prompt_ids(s)) for s in samples],
                                    params.max_new_tokens, params.temperature or 1.0, budget,
                                    {self.tokenizer.eos_token_id}, generator)
        finally:
            self.student.train(was_training)
        lams = []
        for s, out in zip(samples, outs):
            n = len(out["response_ids"])
            s.response_ids, s.behaviour_logprobs = out["response_ids"], out["behaviour_logprobs"]
            s.full_logprobs, s.loss_mask = out["student_logprobs"], [1] * n
            s.status = Status.TRUNCATED if out["truncated"] else Status.COMPLETED
            s.version_spans = [(0, n, version)]
            s.response_text = self.tokenizer.decode(out["response_ids"], skip_special_tokens=True)
            s.info["blend"] = "teacher" if math.isinf(budget) else "trb"
            lams += out["lam"]
            self.stats.generated_tokens += n
        return lams

    def pop_metrics(self) -> dict[str, float]:
        """`trb/budget`, `trb/lam_mean` (the teacher's mean weight over sampled tokens) and
        `rollout/teacher_samples_frac` of the jobs since the last call."""
        out, self.last = self.last, {}
        return out

    def push_weights(self, state, version: int) -> None:
        self.inner.push_weights(state, version)

    def close(self) -> None:
        self.inner.close()
