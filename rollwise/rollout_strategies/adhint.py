"""ADHint (2025; the abstract in ../shared/seeds: "Adaptive Hint with Sample Difficulty Prior", "Consistency-based
Gradient Modulation and Selective Masking for Hint Preservation"): hint prefixes (segments of a complete
solution) scheduled by each sample's difficulty under the policy, masked out of the loss, with the gradient of
hinted rollouts modulated.

Two halves, set together (`rollout.strategy = "adhint"` and `algo.method = "adhint"`; --dry-run says so):

- `ADHintStrategy` (the rollout): a prompt's difficulty prior is the policy's running accuracy on it (an
  exponential average over its past groups, `[rollout.adhint] momentum`; a prompt not seen yet takes the running
  accuracy over all prompts, 0.5 before any). Its hint ratio is `max_ratio x (1 - accuracy)`: that share
  of the hint's tokens is written at the start of the response of `[rollout.adhint] samples` samples of the group
  (half by default; loss mask 0, log-prob placeholder 0.0), and the policy continues from there with its full
  `rollout.max_new_tokens`; the group's other samples roll out without a hint. Accuracies are learned from the
  samples of the previous round once they are scored (the Score stage writes `correct` into them), from the
  unhinted samples only: the policy's own difficulty, not the hint's.
- `ADHint` (the method): the advantage of every hinted response is scaled by `[rollout.adhint] weight` (its own
  tokens; its hint tokens carry no gradient at all).

What the abstract leaves open, filled in here: the hint is `prompt.info["hint"]` (a worked solution) when the
task gives one, else "The answer is <reference>." built from the reference answer; the ratio schedule is linear
in the accuracy; "consistency-based gradient modulation" becomes one weight on the hinted responses' own tokens
(the paper modulates token gradients inside the hint by their consistency with the policy; here hint tokens are
fully masked, the brief's "selective masking" at its strongest). Not built: "advantage estimation with rollout
difficulty posterior" (the hinted and unhinted rollouts share one group baseline, as GRPO computes it).

Metrics: `adhint/ratio_mean` (over groups), `adhint/hint_tokens_mean` (per hinted response),
`adhint/accuracy_prior` (running accuracy over all prompts), from the strategy; `adhint/hinted_frac`,
`adhint/hinted_accuracy`, `adhint/unhinted_accuracy`, `adhint/advantage_scale` from the method.
"""

from __future__ import annotations

from itertools import count

from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.generate.groups import FINAL, GenerateStats, StopRule, is_complete
from rollwise.methods.base import Prepared, StepInput
from rollwise.methods.rl import RL
from rollwise.rollout_strategies import StrategyContext, continue_samples, force_tokens
from rollwise.types import Group, Prompt, SamplingParams, Status


class ADHintOptions(MethodOptions, section="rollout", name="adhint"):
    """`[rollout.adhint]`: ADHint hint prefixes (the strategy) and their gradient weight (`algo.method = "adhint"`)."""

    max_ratio: float = Field(0.5, ge=0.0, le=1.0, description="share of the hint's tokens given to a prompt the "
                             "policy never solves (the ratio falls linearly to 0 at accuracy 1)")
    samples: int | None = Field(None, ge=1, description="samples of each group that get the hint prefix (the others "
                                "roll out without it), below rollout.samples_per_prompt; None = half the group")
    weight: float = Field(0.5, ge=0.0, le=1.0, description="gradient weight of a hinted response's own tokens (its "
                          "advantage is scaled by it); 1 = no modulation")
    momentum: float = Field(0.5, ge=0.0, lt=1.0, description="running accuracy per prompt (and overall) = momentum x "
                            "old + (1 - momentum) x the new group's accuracy")

    def errors(self, cfg) -> list[str]:
        errors = []
        if (self.samples or 0) >= cfg.rollout.samples_per_prompt:
            errors.append(f"rollout.adhint.samples = {self.samples} leaves no unhinted sample of "
                          f"{cfg.rollout.samples_per_prompt} per group; set it below rollout.samples_per_prompt")
        if cfg.algo.method != "adhint":
            errors.append("rollout.strategy = 'adhint' (hint prefixes) and algo.method = 'adhint' (their gradient "
                          "modulation) go together: set both, or neither")
        return errors


def adhint_strategy(cfg, context: StrategyContext) -> "ADHintStrategy":
    o, r = ADHintOptions.of(cfg), cfg.rollout
    hinted = o.samples if o.samples is not None else max(1, r.samples_per_prompt // 2)
    return ADHintStrategy(context.tokenizer, o.max_ratio, hinted, o.momentum)


adhint_strategy.options = ADHintOptions


def hint_text(prompt: Prompt) -> str | None:
    """The full hint of `prompt`: its `info["hint"]`, else a sentence with its reference answer, else None."""
    if prompt.info.get("hint"):
        return str(prompt.info["hint"])
    return None if prompt.answer is None else f"The answer is {prompt.answer}."


def hint_ratio(accuracy: float, max_ratio: float) -> float:
    """Share of the hint's tokens given to a prompt solved with running `accuracy` (0..1)."""
    return max_ratio * (1.0 - min(1.0, max(0.0, accuracy)))


class ADHintStrategy:
    """Args:
        tokenizer: encodes the hints.
        max_ratio: hint ratio at accuracy 0.
        hinted_samples: samples of each group that get the hint prefix (the first ones of the group).
        momentum: weight of the old value in the running accuracies.
    """

    def __init__(self, tokenizer, max_ratio: float, hinted_samples: int, momentum: float):
        self.tokenizer, self.max_ratio, self.momentum = tokenizer, max_ratio, momentum
        self.hinted_samples = hinted_samples
        self.accuracy: dict[str, float] = {}  # prompt uid -> running accuracy of its unhinted samples
        self.overall = 0.5  # running accuracy over all prompts (the prior of an unseen prompt)
        self._last: list[Group] = []  # the previous round's groups, scored by the time of the next round
        self._counts = {"groups": 0, "ratio_sum": 0.0, "hinted": 0, "hint_tokens": 0}

    def prior(self, prompt: Prompt) -> float:
        return self.accuracy.get(prompt.uid, self.overall)

    def observe(self, groups: list[Group]) -> None:
        """Update the running accuracies from the scored, unhinted samples of `groups`."""
        m = self.momentum
        for g in groups:
            graded = [s for s in g.samples if s.correct is not None and not s.info.get("adhint_tokens")]
            if not graded:
                continue
            acc = sum(bool(s.correct) for s in graded) / len(graded)
            self.accuracy[g.prompt.uid] = m * self.accuracy.get(g.prompt.uid, self.overall) + (1 - m) * acc
            self.overall = m * self.overall + (1 - m) * acc

    def run(self, engine, groups: list[Group], params: SamplingParams, ids: count,
            stop: StopRule | None = None) -> GenerateStats:
        self.observe(self._last)
        self._last = list(groups)
        for g in groups:
            self._hint_group(g)
        todo = [s for g in groups for s in g.samples if s.status not in FINAL]
        continue_samples(engine, todo, params, ids, params.max_new_tokens)
        return GenerateStats(requests=len(todo), aborted=sum(s.status == Status.ABORTED for s in todo),
                             groups_completed=sum(is_complete(g) for g in groups))

    def _hint_group(self, group: Group) -> None:
        fresh = [s for s in group.samples if s.status == Status.PENDING and not s.response_ids]
        if not fresh:
            return
        text = hint_text(group.prompt)
        ratio = hint_ratio(self.prior(group.prompt), self.max_ratio) if text is not None else 0.0
        self._counts["groups"] += 1
        self._counts["ratio_sum"] += ratio
        if text is None:
            return
        hint_ids = self.tokenizer.encode(text, add_special_tokens=False)
        n = round(ratio * len(hint_ids))
        if n == 0:
            return
        for s in fresh[: self.hinted_samples]:
            force_tokens(s, hint_ids[:n])
            s.info["adhint_tokens"], s.info["adhint_ratio"] = n, ratio
            self._counts["hinted"] += 1
            self._counts["hint_tokens"] += n

    def metrics(self) -> dict[str, float]:
        c, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return {
            "adhint/ratio_mean": c["ratio_sum"] / max(1, c["groups"]),
            "adhint/hint_tokens_mean": c["hint_tokens"] / max(1, c["hinted"]),
            "adhint/accuracy_prior": self.overall,
        }

    def state_dict(self) -> dict:
        """The running accuracies, with the last round's (already scored) samples folded in: the next `run`
        would fold them first anyway, so a resumed run hints as the uninterrupted one does."""
        self.observe(self._last)
        self._last = []
        return {"accuracy": dict(self.accuracy), "overall": self.overall}

    def load_state_dict(self, state: dict) -> None:
        self.accuracy, self.overall = dict(state["accuracy"]), float(state["overall"])


class ADHint(RL):
    """The method half of ADHint: the advantage of a hinted response is scaled by `[rollout.adhint] weight`
    (then the plain RL step, with its SFT mixing if set). Its options are the strategy's, `[rollout.adhint]`."""

    @classmethod
    def checks(cls, cfg) -> list[str]:
        if cfg.rollout.strategy != "adhint":
            return ["rollout.strategy = 'adhint' (hint prefixes) and algo.method = 'adhint' (their gradient "
                    "modulation) go together: set both, or neither"]
        return super().checks(cfg)

    def prepare(self, step: StepInput) -> Prepared:
        weight = ADHintOptions.of(self.setup.cfg).weight
        hinted = [s for s in step.samples if s.info.get("adhint_tokens")]
        plain = [s for s in step.samples if not s.info.get("adhint_tokens")]
        for s in hinted:
            s.advantage *= weight
        prepared = super().prepare(step)
        prepared.metrics.update({
            "adhint/hinted_frac": len(hinted) / max(1, len(step.samples)),
            "adhint/hinted_accuracy": sum(bool(s.correct) for s in hinted) / max(1, len(hinted)),
            "adhint/unhinted_accuracy": sum(bool(s.correct) for s in plain) / max(1, len(plain)),
            "adhint/advantage_scale": weight,
        })
        return prepared
