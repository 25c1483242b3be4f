"""The best checkpoint of a run (`checkpoints/best`), and early stop on an evaluation metric (`train.early_stop`).

RL on a small model often rises and then collapses (reward hacking, entropy collapse, length blow-up): a run that
ends on its last step can hand back a worse model than the one it started with. So whenever a run evaluates
(`eval.n > 0`), every evaluation (at step 0, every `eval.every_steps`, and the final one) is observed by a rule:

- by default (`train.keep_best = true`, no `train.early_stop`): held-out balanced accuracy,
  `eval/greedy_balanced_accuracy` when the evaluation decodes greedily (`eval.greedy`), else
  `eval/sampled_balanced_accuracy` (rollwise.metrics.prior: accuracy averaged over the distinct reference answers,
  which a policy answering the task's most common answer to everything cannot raise; equal to plain accuracy when
  every reference is distinct); higher is better, ties keep the earlier step, an evaluation after step 0 whose
  replies collapsed onto one answer (`rollwise.metrics.collapse.held_out_collapsed`) is never the best, and the
  run never stops on it;
- with `train.early_stop`: its metric, `mode`, `min_delta` and `patience`.

A new best (`mode = "max"`: above the best by more than `min_delta`; `"min"`: below it) saves the checkpoint of
that step at once (even when `run.save_every_steps` would skip it) and points `checkpoints/best` at it;
`run.keep_checkpoints` never prunes it (`rollwise.train.checkpoint`). `patience` evaluations in a row without one
stop the run (`patience = 0`, as the default rule: never stop, only keep the best).

At the end the run prints where its best is, and says so in one line when its final evaluation is below the best
by more than the noise of an accuracy on that many prompts (`rollwise.metrics.noise`); `summary()` and `best()`
go to summary.json (`early_stop`, `best`).

The state is a function of the run's eval rows: a resumed run (whose `metrics.jsonl` is cut back to its
checkpoint's step) folds them again, so it goes on counting where the checkpoint left it.

    early = EarlyStop.for_run(cfg, run_dir)
    early.observe(eval_row, save=lambda: save_run(run))   # saves and marks a new best
    while run.step < cfg.train.steps and not early.stops(run.step): ...
    for line in early.lines(run.step): print(line)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rollwise.config import Config, EarlyStopConfig
from rollwise.errors import UserError
from rollwise.evaluate import known_metric, metric_names
from rollwise.metrics.collapse import held_out_collapsed
from rollwise.metrics.noise import accuracy_noise, below_by_more_than_noise
from rollwise.metrics.sinks import read_metrics, row_kind
from rollwise.train.checkpoint import BEST, CHECKPOINTS, is_complete, mark_best

_ACCURACY = re.compile(r"(greedy_|sampled_)?(balanced_)?accuracy|(pass|avg)@\d+")  # the last part of an accuracy's key


class EarlyStopError(UserError, KeyError):
    """The metric of `train.early_stop` (or of the best checkpoint) is not in the run's evaluation rows."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def early_stop_errors(cfg: Config) -> list[str]:
    """What makes `train.early_stop` unusable with this config (checked at --dry-run)."""
    early = cfg.train.early_stop
    if early is None:
        return []
    if cfg.eval.n == 0:
        return ["train.early_stop watches evaluations: set eval.n > 0 (held-out prompts)"]
    if cfg.eval.every_steps == 0:
        return ["train.early_stop compares evaluations during the run: set eval.every_steps (e.g. 5)"]
    if not known_metric(early.metric, cfg.eval.k, cfg.eval.greedy):
        valid = ", ".join(metric_names(cfg.eval.k, cfg.eval.greedy))
        return [f"train.early_stop.metric = {early.metric!r} is not written by the evaluation with eval.k = "
                f"{cfg.eval.k}, eval.greedy = {str(cfg.eval.greedy).lower()}; valid: {valid} (or eval/<source>/"
                "<key> per source of a mixture)"]
    return []


def best_rule(cfg: Config) -> EarlyStopConfig | None:
    """The rule that picks a run's best evaluation: `train.early_stop` when set; else, when the run evaluates
    (`eval.n > 0`) and `train.keep_best`, the highest held-out balanced accuracy (greedy when the evaluation
    writes it), never stopping; else None (no best is kept)."""
    if cfg.train.early_stop is not None:
        return cfg.train.early_stop
    if cfg.eval.n == 0 or not cfg.train.keep_best:
        return None
    metric = "eval/greedy_balanced_accuracy" if cfg.eval.greedy else "eval/sampled_balanced_accuracy"
    return EarlyStopConfig(metric=metric, mode="max", patience=0, min_delta=0.0)


def is_accuracy(metric: str) -> bool:
    """Whether `metric` is a held-out accuracy (a share of prompts, so `rollwise.metrics.noise` applies to it):
    greedy or sampled accuracy, pass@j or avg@k, run-wide or per source."""
    return metric.startswith("eval/") and _ACCURACY.fullmatch(metric.rsplit("/", 1)[-1]) is not None


@dataclass
class EarlyStop:
    """The best-checkpoint and early-stop state of a run; inert (observes nothing, never stops) when `cfg` is None.

    `cfg`: the rule (`best_rule`); `explicit`: it is the user's `train.early_stop` (which may stop the run and
    writes the `early_stop` summary key). `best_value` / `best_step`: the best evaluation so far; `bad_evals`:
    evaluations since it without an improvement; `saved_step`: the step whose checkpoint `observe` saved last (so
    the loop does not save that step twice); `last_row`: the last eval row observed; `stopped_at`: the step the run
    stopped at early."""

    cfg: EarlyStopConfig | None
    run_dir: Path
    explicit: bool = False
    best_value: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    saved_step: int | None = None
    stopped_at: int | None = None
    last_row: dict[str, Any] | None = field(default=None, repr=False)
    best_row: dict[str, Any] | None = field(default=None, repr=False)
    collapsed_steps: list[int] = field(default_factory=list)

    @classmethod
    def for_run(cls, cfg: Config, run_dir: Path) -> "EarlyStop":
        """The state a run starts with: fresh, or (resumed) folded from the eval rows of its metrics.jsonl,
        with `checkpoints/best` pointed at the best step's checkpoint."""
        early = cls(best_rule(cfg), Path(run_dir), explicit=cfg.train.early_stop is not None)
        if early.cfg is None or not (early.run_dir / "metrics.jsonl").exists():
            return early
        for row in read_metrics(early.run_dir):
            if row_kind(row) == "eval" and isinstance(row.get("step"), (int, float)):
                early.count(row)
        if early.best_step is not None:
            if is_complete(early.run_dir / CHECKPOINTS / f"step-{early.best_step}"):
                mark_best(early.run_dir, early.best_step)
            else:  # another rule before (or train.keep_best = false), or rows without their checkpoint
                print(f"rollwise: the best {early.cfg.metric} so far (step {early.best_step}) has no checkpoint; "
                      "the next best evaluation from here on saves one", flush=True)
                early.best_value, early.best_step, early.bad_evals = None, None, 0
        return early

    @property
    def enabled(self) -> bool:
        """Whether the user's `train.early_stop` is on (it may stop the run)."""
        return self.cfg is not None and self.explicit

    @property
    def keeps_best(self) -> bool:
        """Whether evaluations are observed and `checkpoints/best` is kept (early stop or `train.keep_best`)."""
        return self.cfg is not None

    @property
    def should_stop(self) -> bool:
        """True once `patience` evaluations in a row brought no improvement."""
        return self.enabled and self.cfg.patience > 0 and self.bad_evals >= self.cfg.patience

    def stops(self, step: int) -> bool:
        """Whether the run stops before the step after `step` (the loop asks before each step; a run that
        reaches train.steps never asks at its end, so its final evaluation does not count as an early stop)."""
        if self.should_stop and self.stopped_at is None:
            self.stopped_at = step
        return self.should_stop

    def evaluated(self, step: int) -> bool:
        """Whether the last eval row observed (or folded from metrics.jsonl on resume) is of `step`."""
        return self.last_row is not None and self.last_row.get("step") == step

    def observe(self, row: dict[str, Any], save: Callable[[], Any]) -> bool:
        """Count one eval row; on a new best, `save()` writes the checkpoint of `row["step"]` and
        `checkpoints/best` is pointed at it. Returns whether it was a new best. EarlyStopError when the row lacks
        the metric (e.g. a per-source key of a source the prompts do not have)."""
        if not self.keeps_best:
            return False
        if self.cfg.metric not in row:
            keys = ", ".join(k for k in row if k.startswith("eval/"))
            what = "train.early_stop.metric" if self.explicit else "the best checkpoint's metric"
            raise EarlyStopError(f"{what} = {self.cfg.metric!r} is not in this run's evaluation "
                                 f"(step {row.get('step')}); it has: {keys}")
        improved = self.count(row)
        if improved:
            step = int(row["step"])
            save()
            self.saved_step = step
            mark_best(self.run_dir, step)
        return improved

    def count(self, row: dict[str, Any]) -> bool:
        """Fold one eval row into the state (no checkpoint is saved or marked); whether it is a new best."""
        value = row.get(self.cfg.metric)
        self.last_row = row
        usable = isinstance(value, (int, float)) and math.isfinite(value)  # None: every reward failed
        # the default rule never keeps a later model that answers the prior; the starting model (step 0) is always
        # eligible, so a run always holds a checkpoint no worse than where it started
        if usable and not self.explicit and int(row["step"]) > 0 and held_out_collapsed(row):
            self.collapsed_steps.append(int(row["step"]))
            usable = False
        if usable and self._better(float(value)):
            self.best_value, self.best_step, self.bad_evals = float(value), int(row["step"]), 0
            self.best_row = row
            return True
        self.bad_evals += 1
        return False

    def _better(self, value: float) -> bool:
        if self.best_value is None:
            return True
        if self.cfg.mode == "max":
            return value > self.best_value + self.cfg.min_delta
        return value < self.best_value - self.cfg.min_delta

    def lines(self, step: int) -> list[str]:
        """The lines a run prints at its end: why it stopped early (`line`), then, when the final evaluation is
        below the best by more than its noise, a warning with the commands that take the best checkpoint; else
        where the best evaluation was (`line`)."""
        best = self.best()
        below = [_below_line(best)] if best is not None and best["below_best"] else []
        if self.stopped_at is not None:
            return [self.line(step), *below]
        return below or [self.line(step)]

    def line(self, step: int) -> str:
        """Why the run stopped early, or where its best evaluation was."""
        metric = self.cfg.metric
        where = f"{self.run_dir / CHECKPOINTS / f'step-{self.best_step}'} ({CHECKPOINTS}/{BEST})"
        if self.best_step is None:
            what = "early stop: " if self.enabled else ""
            return f"rollwise: {what}no evaluation gave {metric} a value; no best checkpoint"
        if self.stopped_at is not None:
            return (f"rollwise: early stop after step {step}: {metric} has not improved on {self.best_value:.4g} "
                    f"(step {self.best_step}) for {self.bad_evals} evaluations; best checkpoint {where}")
        passed = ""
        if self.collapsed_steps:
            passed = (f"; steps {', '.join(map(str, self.collapsed_steps))} passed over: their held-out replies "
                      "answer one thing (the task's prior), whatever their accuracy")
        return f"rollwise: best {metric} {self.best_value:.4g}{self._plain()} at step {self.best_step}: {where}{passed}"

    def _plain(self) -> str:
        """The plain accuracy beside a best balanced one (` (greedy accuracy 0.54)`), else ""."""
        plain = self.cfg.metric.replace("balanced_", "")
        value = (self.best_row or {}).get(plain)
        if plain == self.cfg.metric or not isinstance(value, (int, float)):
            return ""
        return f" ({plain.removeprefix('eval/').replace('_', ' ')} {value:.4g})"

    def summary(self) -> dict[str, Any]:
        """For summary.json's `early_stop`: the metric, best step and value, and whether the run stopped early."""
        return {"metric": self.cfg.metric, "best_step": self.best_step, "best_value": self.best_value,
                "stopped_early": self.stopped_at is not None}

    def best(self) -> dict[str, Any] | None:
        """For summary.json's `best` (None without a best evaluation): the metric, the best step and value, the
        final evaluation's step and value, the noise of an accuracy on its `eval/n` prompts (None for another
        kind of metric), whether the final is below the best by more than it, the checkpoint, and the commands
        that evaluate and serve it."""
        if not self.keeps_best or self.best_step is None:
            return None
        final = self.last_row or {}
        value, n = final.get(self.cfg.metric), _prompts(final, self.cfg.metric)
        judged = is_accuracy(self.cfg.metric) and self.cfg.mode == "max" and n is not None
        usable = isinstance(value, (int, float)) and math.isfinite(value)
        pointer = self.run_dir / CHECKPOINTS / BEST
        return {
            "metric": self.cfg.metric, "step": self.best_step, "value": self.best_value,
            "plain_accuracy": (self.best_row or {}).get(self.cfg.metric.replace("balanced_", "")),
            "passed_over_steps": list(self.collapsed_steps),  # evaluations whose replies collapsed: never the best
            "final_step": final.get("step"), "final_value": value if usable else None,
            "noise": accuracy_noise(self.best_value, n) if judged else None, "n": n,
            "below_best": judged and usable and below_by_more_than_noise(value, self.best_value, n),
            "checkpoint": str(self.run_dir / CHECKPOINTS / f"step-{self.best_step}"),
            "command": f"rollwise eval --model {self.run_dir} --best", "serve_command": f"rollwise serve --model {pointer}",
        }


def _prompts(row: dict[str, Any], metric: str) -> int | None:
    """The prompts behind `metric` in an eval row: `eval/n`, or `eval/<source>/n` for a per-source key."""
    parts = metric.split("/")
    n = row.get(f"eval/{parts[1]}/n" if len(parts) == 3 else "eval/n")
    return int(n) if isinstance(n, (int, float)) and n >= 1 else None


def _below_line(best: dict[str, Any]) -> str:
    """The warning of a run whose final evaluation is below its best by more than the noise."""
    name = best["metric"].removeprefix("eval/").replace("_", " ")
    return (f"rollwise: the final {name} {best['final_value']:.3f} (step {best['final_step']}) is below the best "
            f"{best['value']:.3f} (step {best['step']}) by more than its noise (±{best['noise']:.3f} on {best['n']} "
            f"prompts); the best checkpoint is {best['checkpoint']} ({CHECKPOINTS}/{BEST}): {best['command']} "
            f"(serve it: {best['serve_command']})")
