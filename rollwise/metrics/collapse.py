"""Collapse, seen and named (issue 31): per-step answer metrics and two warnings that say what went wrong.

A small model trained with GRPO on a new task often collapses onto the task's most common answer (answering "1"
to almost every letter-counting prompt): the training reward rises while held-out accuracy falls. Seen here as:

- `answer_metrics(samples)`: over the step's scored responses, `rollout/answer_mode_frac` (the share giving the
  step's most common answer), `rollout/answer_entropy` (nats, of the answers' distribution),
  `rollout/answer_distinct` (how many distinct answers) and `rollout/answer_mode` (that answer, cut to 40
  characters). A response's answer is what its reward extracted (`Sample.info["answer"]`, see
  `rollwise.rewards.verifiers.answer_info`), else its last non-empty line; both lowercased, whitespace collapsed,
  a final period dropped; "" for a response without text.
- `CollapseWatch`: observes each train and eval row and adds `train/entropy_ratio` (the step's `train/entropy`
  over the mean of the first ENTROPY_BASELINE_STEPS steps'), `collapse/answer_alarm` and
  `collapse/eval_drop_alarm` (1 while its condition holds, else 0). Each condition prints one line
  (`rollwise: step N: ...`) when it starts, and again only after it has cleared:
  a) answer collapse: `rollout/answer_mode_frac >= MODE_FRAC_ALARM` while `reward/accuracy <= ACCURACY_CEILING`;
  b) held-out drop: the held-out accuracy below its best so far by more than its noise
     (`rollwise.metrics.noise.accuracy_noise` of the best on `eval/n` prompts) for DROP_EVALS evaluations in a
     row; the accuracy is `eval/greedy_balanced_accuracy` (rollwise.metrics.prior: what a constant answer cannot
     buy), else `eval/greedy_accuracy`, else their sampled forms;
  c) held-out answer collapse: the held-out replies give one answer (`eval/greedy_answer_mode_frac`, else the
     sampled one) at least MODE_FRAC_ALARM of the time, PRIOR_GAP or more above the share of the references
     that have their most common answer (`eval/reference_mode_frac`): the model answers the prior, whatever
     the training step's own share says (flag `collapse/eval_answer_alarm`).

The state is a function of the run's rows: a resumed run folds its `metrics.jsonl` again (`for_run`), silently,
so it goes on where the checkpoint left it, and `summary()` lists every warning of the run.

    watch = CollapseWatch.for_run(run_dir)
    row.update(watch.observe(row))      # before the row is written; train and eval rows alike
    summary["warnings"] = watch.summary()
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from rollwise.metrics.noise import accuracy_noise, below_by_more_than_noise
from rollwise.metrics.sinks import METRICS_FILE, as_number, read_metrics, row_kind, row_step
from rollwise.types import Sample, Status

MODE_FRAC_ALARM = 0.9  # answer collapse: this share of the step's responses give one answer ...
ACCURACY_CEILING = 0.8  # ... while at most this share is correct
ENTROPY_BASELINE_STEPS = 3  # train/entropy_ratio: over the mean entropy of the run's first steps
ENTROPY_COLLAPSE_RATIO = 0.5  # a held-out drop with entropy below this share of the baseline: entropy collapse
PRIOR_GAP = 0.2  # held-out answer collapse: replies this much more often on one answer than the references are
DROP_EVALS = 2  # held-out drop: evaluations in a row below the best by more than the noise
# the held-out accuracy the drop rule compares, the first an eval row has (rollwise.metrics.prior for balanced)
HELD_OUT_KEYS = ("eval/greedy_balanced_accuracy", "eval/greedy_accuracy", "eval/sampled_balanced_accuracy",
                 "eval/sampled_accuracy")
MODE_CHARS = 40  # rollout/answer_mode is cut to this many characters
KNOBS = ("lower train.lr; algo.kl_coef > 0 (e.g. 0.02); algo.clip_high above algo.clip_low (clip-higher, e.g. "
         "0.28); control.dynamic_sampling = true; train.early_stop (stop at the peak)")


def normalise_answer(text: str) -> str:
    """Lowercased, whitespace collapsed, one final period dropped: 'The  Answer is 3.' -> 'the answer is 3'."""
    return " ".join(str(text).lower().split()).removesuffix(".").rstrip()


def sample_answer(sample: Sample) -> str:
    """The answer a response gave (module docstring): its reward's `info["answer"]`, else its last non-empty line."""
    answer = sample.info.get("answer")
    if answer is None:
        lines = [line for line in sample.response_text.splitlines() if line.strip()]
        answer = lines[-1] if lines else ""
    return normalise_answer(answer)


def answer_metrics(samples: Iterable[Sample]) -> dict[str, float | str]:
    """`rollout/answer_mode_frac`, `rollout/answer_entropy` (nats), `rollout/answer_distinct` and
    `rollout/answer_mode` over the samples not FAILED; {} when there are none. Ties for the most common answer go
    to the one seen first. Answers a, a, a, b: mode 'a', 0.75, entropy -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.5623."""
    answers = [sample_answer(s) for s in samples if s.status != Status.FAILED]
    if not answers:
        return {}
    counts = Counter(answers)
    mode, top = counts.most_common(1)[0]
    n = len(answers)
    entropy = -sum(c / n * math.log(c / n) for c in counts.values())
    return {"rollout/answer_mode_frac": top / n, "rollout/answer_entropy": abs(entropy),  # abs: no -0.0
            "rollout/answer_distinct": float(len(counts)), "rollout/answer_mode": mode[:MODE_CHARS]}


def _finite(value: Any) -> float | None:
    number = as_number(value)
    return number if number is not None and math.isfinite(number) else None


def _answer_mode(row: dict[str, Any]) -> str:
    return "greedy" if _finite(row.get("eval/greedy_answer_mode_frac")) is not None else "sampled"


def held_out_collapsed(row: dict[str, Any]) -> bool:
    """Rule c) of the module docstring: the eval row's replies give one (non-empty) answer at least
    MODE_FRAC_ALARM of the time, PRIOR_GAP or more above the references' own most common share. Such an
    evaluation never becomes the run's best checkpoint (rollwise.early_stop): its model answers the prior."""
    mode = _answer_mode(row)
    share, prior = _finite(row.get(f"eval/{mode}_answer_mode_frac")), _finite(row.get("eval/reference_mode_frac"))
    answer = str(row.get(f"eval/{mode}_answer_mode", ""))
    # replies without an answer are another failure (truncation, format), not a prior
    return share is not None and prior is not None and share >= MODE_FRAC_ALARM and share - prior >= PRIOR_GAP \
        and answer != ""


@dataclass
class CollapseWatch:
    """The collapse warnings of a run (module docstring). `entropies`: the first steps' `train/entropy` (the
    baseline); `last_train`: what the last train row said (answer share, answer, entropy ratio); `best_value` /
    `best_step`: the best held-out accuracy so far; `below`: evaluations in a row below it by more than the
    noise; `answer_on` / `drop_on`: whether each condition holds now; `warnings`: every line raised."""

    run_dir: Path | None = None
    entropies: list[float] = field(default_factory=list)
    last_train: dict[str, Any] = field(default_factory=dict)
    best_value: float | None = None
    best_step: int | None = None
    below: int = 0
    answer_on: bool = False
    drop_on: bool = False
    eval_answer_on: bool = False
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def for_run(cls, run_dir: str | Path) -> "CollapseWatch":
        """The watch a run starts with: fresh, or (resumed) folded silently from the rows of its metrics.jsonl."""
        watch = cls(Path(run_dir))
        if (watch.run_dir / METRICS_FILE).exists():
            for row in read_metrics(watch.run_dir):
                watch.observe(row, echo=False)
        return watch

    def observe(self, row: dict[str, Any], echo: bool = True) -> dict[str, float]:
        """The keys this row gets (`train/entropy_ratio`, `collapse/*_alarm`); a warning that starts with this
        row is printed (`echo`) and kept for `summary()`."""
        if row_kind(row) == "eval":
            return self._observe_eval(row, echo)
        return self._observe_train(row, echo)

    def summary(self) -> list[str]:
        """Every warning line raised in the run (for summary.json)."""
        return list(self.warnings)

    def _warn(self, line: str, echo: bool) -> None:
        self.warnings.append(line)
        if echo:
            print(line, flush=True)

    def _entropy_ratio(self, entropy: float | None) -> float | None:
        """The step's entropy over the mean of the first ENTROPY_BASELINE_STEPS steps' (those so far while fewer)."""
        if entropy is None:
            return None
        if len(self.entropies) < ENTROPY_BASELINE_STEPS:
            self.entropies.append(entropy)
        baseline = sum(self.entropies) / len(self.entropies)
        return entropy / baseline if baseline > 0 else None

    def _observe_train(self, row: dict[str, Any], echo: bool) -> dict[str, float]:
        out: dict[str, float] = {}
        ratio = self._entropy_ratio(_finite(row.get("train/entropy")))
        if ratio is not None:
            out["train/entropy_ratio"] = ratio
        share, accuracy = _finite(row.get("rollout/answer_mode_frac")), _finite(row.get("reward/accuracy"))
        answer = str(row.get("rollout/answer_mode", ""))
        self.last_train = {"share": share, "answer": answer, "entropy_ratio": ratio}
        holds = share is not None and accuracy is not None and share >= MODE_FRAC_ALARM and accuracy <= ACCURACY_CEILING
        if holds and not self.answer_on:
            self._warn(f"rollwise: step {row_step(row)}: answer collapse: {share:.0%} of this step's responses answer "
                       f"{answer!r} while {accuracy:.0%} are correct; likely cause: the policy collapsed onto the "
                       f"task's majority answer (training reward can still rise while held-out accuracy falls). "
                       f"Try: {KNOBS}", echo)
        self.answer_on = holds
        out["collapse/answer_alarm"] = float(holds)
        return out

    def _observe_eval(self, row: dict[str, Any], echo: bool) -> dict[str, float]:
        out = {"collapse/eval_answer_alarm": self._eval_answer(row, echo)}
        key = next((k for k in HELD_OUT_KEYS if _finite(row.get(k)) is not None), HELD_OUT_KEYS[-1])
        value, n = _finite(row.get(key)), int(_finite(row.get("eval/n")) or 0)
        if value is None or n <= 0:  # every reward failed, or no prompts: nothing to compare, the state stands
            return {**out, "collapse/eval_drop_alarm": 0.0}
        below = self.best_value is not None and below_by_more_than_noise(value, self.best_value, n)
        self.below = self.below + 1 if below else 0
        holds = self.below >= DROP_EVALS
        if holds and not self.drop_on:
            self._warn(self._drop_line(row_step(row), key, value, n), echo)
        self.drop_on = holds
        if self.best_value is None or value > self.best_value:
            self.best_value, self.best_step = value, row_step(row)
        return {**out, "collapse/eval_drop_alarm": float(holds)}

    def _eval_answer(self, row: dict[str, Any], echo: bool) -> float:
        """Rule c) of the module docstring on one eval row: 1.0 while it holds, else 0.0."""
        holds = held_out_collapsed(row)
        if holds and not self.eval_answer_on:
            mode = _answer_mode(row)
            share, prior = row[f"eval/{mode}_answer_mode_frac"], row["eval/reference_mode_frac"]
            answer = str(row.get(f"eval/{mode}_answer_mode", ""))
            where = self.run_dir if self.run_dir is not None else "RUN_DIR"
            cause = ("the starting model already gives one answer to most prompts, so plain accuracy measures the "
                     "prior more than the task" if row_step(row) == 0 else "the policy learned the task's majority "
                     "answer, not the task (plain accuracy can still rise)")
            self._warn(f"rollwise: step {row_step(row)}: held-out answer collapse: {share:.0%} of the held-out "
                       f"{mode} replies answer {answer!r}, while only {prior:.0%} of the references share their "
                       f"most common answer; likely cause: {cause}. The best checkpoint is chosen by balanced "
                       f"accuracy, which a constant answer cannot raise: rollwise eval --model {where} --best. "
                       f"Try: {KNOBS}", echo)
        self.eval_answer_on = holds
        return float(holds)

    def _drop_line(self, step: int, key: str, value: float, n: int) -> str:
        noise = accuracy_noise(self.best_value, n)
        where = self.run_dir if self.run_dir is not None else "RUN_DIR"
        return (f"rollwise: step {step}: held-out drop: {key} {value:.3f} is below its best {self.best_value:.3f} "
                f"(step {self.best_step}) by more than its noise (±{noise:.3f} on {n} prompts) for {self.below} "
                f"evaluations in a row; likely cause: {self._cause()}. Try: {KNOBS}. The best checkpoint: "
                f"rollwise eval --model {where} --best")

    def _cause(self) -> str:
        share, ratio = self.last_train.get("share"), self.last_train.get("entropy_ratio")
        if share is not None and share >= MODE_FRAC_ALARM:
            return (f"answer collapse (the last step gave {self.last_train['answer']!r} as {share:.0%} of its "
                    "answers)")
        if ratio is not None and ratio < ENTROPY_COLLAPSE_RATIO:
            return f"entropy collapse (policy entropy at {ratio:.2f} x its first steps')"
        return "the policy drifted"
