"""Early stop on an evaluation metric, keeping the checkpoint of the best evaluation (`train.early_stop`).

RL on a small model often rises and then collapses (reward hacking, entropy collapse, length blow-up): early
stopping watches a held-out metric, keeps the peak and stops once it has not improved for a while. Every evaluation of a run (at step 0, every `eval.every_steps`, and the final one) is observed:

- a new best (`mode = "max"`: above the best by more than `min_delta`; `"min"`: below it) saves the checkpoint
  of that step at once (even when `run.save_every_steps` would skip it) and points `checkpoints/best` at it;
  `run.keep_checkpoints` never prunes it (`rollwise.train.checkpoint`);
- `patience` evaluations in a row without one stop the run (`patience = 0`: never stop, only keep the best).

The state is a function of the run's eval rows: a resumed run (whose `metrics.jsonl` is cut back to its
checkpoint's step) folds them again, so it goes on counting where the checkpoint left it.

    early = EarlyStop.for_run(cfg.train.early_stop, run_dir)
    early.observe(eval_row, save=lambda: save_run(run))   # saves and marks a new best
    while run.step < cfg.train.steps and not early.stops(run.step): ...
    print(early.line(run.step))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rollwise.config import Config, EarlyStopConfig
from rollwise.errors import UserError
from rollwise.evaluate import known_metric, metric_names
from rollwise.metrics.sinks import read_metrics, row_kind
from rollwise.train.checkpoint import CHECKPOINTS, is_complete, mark_best


class EarlyStopError(UserError, KeyError):
    """`train.early_stop.metric` is not in the run's evaluation rows."""

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


@dataclass
class EarlyStop:
    """The early-stop state of a run; inert (observes nothing, never stops) when `cfg` is None.

    `best_value` / `best_step`: the best evaluation so far; `bad_evals`: evaluations since it without an
    improvement; `saved_step`: the step whose checkpoint `observe` saved last (so the loop does not save that
    step twice); `last_row`: the last eval row observed; `stopped_at`: the step the run stopped at early."""

    cfg: EarlyStopConfig | None
    run_dir: Path
    best_value: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    saved_step: int | None = None
    stopped_at: int | None = None
    last_row: dict[str, Any] | None = field(default=None, repr=False)

    @classmethod
    def for_run(cls, cfg: EarlyStopConfig | None, run_dir: Path) -> "EarlyStop":
        """The state a run starts with: fresh, or (resumed) folded from the eval rows of its metrics.jsonl,
        with `checkpoints/best` pointed at the best step's checkpoint."""
        early = cls(cfg, Path(run_dir))
        if cfg is None or not (early.run_dir / "metrics.jsonl").exists():
            return early
        for row in read_metrics(early.run_dir):
            if row_kind(row) == "eval" and isinstance(row.get("step"), (int, float)):
                early._count(row)
        if early.best_step is not None:
            if is_complete(early.run_dir / CHECKPOINTS / f"step-{early.best_step}"):
                mark_best(early.run_dir, early.best_step)
            else:  # another metric before, or rows without their checkpoint: the next best saves one
                print(f"rollwise: early stop: the best {cfg.metric} so far (step {early.best_step}) has no "
                      "checkpoint; counting starts again", flush=True)
                early.best_value, early.best_step, early.bad_evals = None, None, 0
        return early

    @property
    def enabled(self) -> bool:
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

    def observe(self, row: dict[str, Any], save: Callable[[], Any]) -> bool:
        """Count one eval row; on a new best, `save()` writes the checkpoint of `row["step"]` and
        `checkpoints/best` is pointed at it. Returns whether it was a new best. EarlyStopError when the row lacks
        the metric (e.g. a per-source key of a source the prompts do not have)."""
        if not self.enabled:
            return False
        if self.cfg.metric not in row:
            keys = ", ".join(k for k in row if k.startswith("eval/"))
            raise EarlyStopError(f"train.early_stop.metric = {self.cfg.metric!r} is not in this run's evaluation "
                                 f"(step {row.get('step')}); it has: {keys}")
        improved = self._count(row)
        if improved:
            step = int(row["step"])
            save()
            self.saved_step = step
            mark_best(self.run_dir, step)
        return improved

    def _count(self, row: dict[str, Any]) -> bool:
        value = row.get(self.cfg.metric)
        self.last_row = row
        usable = isinstance(value, (int, float)) and math.isfinite(value)  # None: every reward failed
        if usable and self._better(float(value)):
            self.best_value, self.best_step, self.bad_evals = float(value), int(row["step"]), 0
            return True
        self.bad_evals += 1
        return False

    def _better(self, value: float) -> bool:
        if self.best_value is None:
            return True
        if self.cfg.mode == "max":
            return value > self.best_value + self.cfg.min_delta
        return value < self.best_value - self.cfg.min_delta

    def line(self, step: int) -> str:
        """The one line a run prints at its end: why it stopped early, or where its best evaluation was."""
        metric = self.cfg.metric
        where = f"{self.run_dir / CHECKPOINTS / f'step-{self.best_step}'} (checkpoints/best)"
        if self.best_step is None:
            return f"rollwise: early stop: no evaluation gave {metric} a value; no best checkpoint"
        if self.stopped_at is not None:
            return (f"rollwise: early stop after step {step}: {metric} has not improved on {self.best_value:.4g} "
                    f"(step {self.best_step}) for {self.bad_evals} evaluations; best checkpoint {where}")
        return f"rollwise: best {metric} {self.best_value:.4g} at step {self.best_step}: {where}"

    def summary(self) -> dict[str, Any]:
        """For summary.json: the metric, best step and value, and whether the run stopped early."""
        return {"metric": self.cfg.metric, "best_step": self.best_step, "best_value": self.best_value,
                "stopped_early": self.stopped_at is not None}
