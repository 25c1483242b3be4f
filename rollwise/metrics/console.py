"""Console progress: a live rich bar on a terminal, one plain line per step elsewhere (CI, pipes, files).

Reads these keys from a training row (any may be missing; shown as `-`): `reward/mean`, `reward/accuracy`,
`rollout/response_len_mean`, `perf/rollout_tokens_per_s`, `perf/step_s`. From an eval row:
`eval/sampled_accuracy`, `eval/greedy_accuracy`, `eval/response_len_mean`, `eval/n`.
"""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.table import Table


def fmt(value: Any, spec: str = ".2f") -> str:
    """`value` formatted with `spec`, or `-` when missing or not finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    return format(value, spec)


def fmt_duration(seconds: float | None) -> str:
    """Seconds as `42s`, `5m12s` or `2h03m`; `-` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def step_fields(row: dict[str, Any]) -> str:
    """The per-step figures of a training row, compactly."""
    return (
        f"reward {fmt(row.get('reward/mean'))} acc {fmt(row.get('reward/accuracy'))}"
        f" len {fmt(row.get('rollout/response_len_mean'), '.1f')}"
        f" tok/s {fmt(row.get('perf/rollout_tokens_per_s'), '.0f')}"
        f" step {fmt(row.get('perf/step_s'), '.1f')}s"
    )


def eval_fields(row: dict[str, Any]) -> str:
    """The figures of an eval row, compactly (pass@K and avg@K of the largest K when eval.k > 1)."""
    n = row.get("eval/n")
    top = pass_keys(row)[-1:]
    return (
        f"sampled acc {fmt(row.get('eval/sampled_accuracy'), '.3f')}"
        f" greedy acc {fmt(row.get('eval/greedy_accuracy'), '.3f')}"
        + (f" balanced {fmt(row['eval/greedy_balanced_accuracy'], '.3f')}"
           if row.get("eval/greedy_balanced_accuracy") is not None else "")
        + "".join(f" {key.removeprefix('eval/')} {fmt(row.get(key), '.3f')}"
                  for key in top + [k.replace("pass@", "avg@") for k in top])
        + f" len {fmt(row.get('eval/response_len_mean'), '.1f')}" + (f" n {n}" if n is not None else "")
    )


def pass_keys(row: dict[str, Any]) -> list[str]:
    """The row's run-wide `eval/pass@j` keys, by j."""
    found = [key for key in row if key.startswith("eval/pass@") and key[len("eval/pass@"):].isdigit()]
    return sorted(found, key=lambda key: int(key[len("eval/pass@"):]))


class ConsoleView:
    """Progress of a run. Use as `with ConsoleView(total) as view: view.update(step, row)`.

    `start_step` is the step a resumed run starts after, so that the ETA counts only steps run here.
    """

    def __init__(self, total_steps: int, enabled: bool = True, *, start_step: int = 0, console: Console | None = None):
        self.total_steps = total_steps
        self.start_step = start_step
        self.console = console or Console()
        self.live = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._t0_s = time.monotonic()
        self._eval_acc = "-"

    def start(self) -> None:
        """Begin timing; on a terminal, show the live bar."""
        self._t0_s = time.monotonic()
        if not self.live or self._progress is not None:
            return
        self._progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("eta {task.fields[eta]}"),
            TextColumn("{task.fields[stats]}"),
            console=self.console,
        )
        self._task = self._progress.add_task(
            "train", total=self.total_steps, completed=self.start_step, eta="-", stats=""
        )
        self._progress.start()

    def eta_s(self, step: int) -> float | None:
        """Seconds left, from the mean wall time of the steps run since `start()`."""
        done = step - self.start_step
        if done <= 0:
            return None
        return (time.monotonic() - self._t0_s) / done * max(self.total_steps - step, 0)

    def update(self, step: int, row: dict[str, Any]) -> None:
        """Show training row `row` of step `step`."""
        eta = fmt_duration(self.eta_s(step))
        if self._progress is None or self._task is None:
            print(f"step {step}/{self.total_steps} {step_fields(row)} eta {eta}", flush=True)
            return
        stats = f"{step_fields(row)} eval acc {self._eval_acc}"
        self._progress.update(self._task, completed=step, eta=eta, stats=stats)

    def eval(self, row: dict[str, Any]) -> None:
        """Show an eval row: a line of its own, kept above the live bar."""
        self._eval_acc = fmt(row.get("eval/sampled_accuracy"), ".3f")
        line = f"eval step {row.get('step', '-')} {eval_fields(row)}"
        if self._progress is None:
            print(line, flush=True)
        else:
            self._progress.console.print(line, highlight=False, markup=False)

    def stop(self) -> None:
        """Remove the live bar (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> ConsoleView:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _eval_row(table: Table, label: str, key: str, before: dict, after: dict, spec: str) -> None:
    b, a = before.get(key), after.get(key)
    change = "-"
    if all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b)):
        change = format(a - b, "+" + spec)
    table.add_row(label, fmt(b, spec), fmt(a, spec), change)


def summary_table(summary: dict[str, Any]) -> Table:
    """Final table: eval accuracy before and after (sampled, greedy), length, wall time, tokens, steps, run dir.

    `summary` keys: `eval_before`, `eval_after` (eval rows), `wall_s`, `tokens_generated`, `tokens_trained`,
    `steps`, `run_dir`, `best` (the best checkpoint: rollwise.early_stop), `early_stop`; any may be missing.
    A run that ended below its best by more than the noise says so under the table, with the command.
    """
    before = summary.get("eval_before") or {}
    after = summary.get("eval_after") or {}
    table = Table(title="rollwise run", show_header=True, header_style="bold")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    table.add_column("change", justify="right")
    _eval_row(table, "sampled accuracy", "eval/sampled_accuracy", before, after, ".3f")
    _eval_row(table, "greedy accuracy", "eval/greedy_accuracy", before, after, ".3f")
    balanced = "eval/greedy_balanced_accuracy" if "eval/greedy_balanced_accuracy" in after else \
        "eval/sampled_balanced_accuracy"
    if balanced in after or balanced in before:  # rollwise.metrics.prior
        _eval_row(table, balanced.removeprefix("eval/").replace("_", " "), balanced, before, after, ".3f")
    for key in pass_keys({**before, **after}):  # eval.k > 1
        _eval_row(table, key.removeprefix("eval/"), key, before, after, ".3f")
    avg = [k for k in {**before, **after} if k.startswith("eval/avg@")]
    for key in avg:
        _eval_row(table, key.removeprefix("eval/"), key, before, after, ".3f")
    _eval_row(table, "response length (tokens)", "eval/response_len_mean", before, after, ".1f")
    n = after.get("eval/n", before.get("eval/n"))
    if n is not None:
        table.add_row("eval prompts", str(before.get("eval/n", "-")), str(after.get("eval/n", "-")), "")
    table.add_section()
    table.add_row("steps", "", str(summary.get("steps", "-")), "")
    table.add_row("wall time", "", fmt_duration(summary.get("wall_s")), "")
    table.add_row("tokens generated", "", fmt(summary.get("tokens_generated"), ",.0f"), "")
    table.add_row("tokens trained", "", fmt(summary.get("tokens_trained"), ",.0f"), "")
    _best_rows(table, summary)
    if summary.get("run_dir"):
        table.caption = f"run dir: {summary['run_dir']}"
    best = summary.get("best") or {}
    if best.get("below_best"):
        table.caption = "\n".join(filter(None, [table.caption, below_best_note(best)]))
    return table


def _best_rows(table: Table, summary: dict[str, Any]) -> None:
    """Where checkpoints/best points (`best`, else an older summary's `early_stop`), and the final evaluation's
    distance from it with its noise."""
    early = summary.get("early_stop") or {}
    stopped = " (stopped early)" if early.get("stopped_early") else ""
    best = summary.get("best")
    if best is None and early.get("best_step") is not None:
        best = {"metric": early["metric"], "step": early["best_step"], "value": early["best_value"]}
    if not best:
        return
    name = str(best["metric"]).removeprefix("eval/").replace("_", " ")
    table.add_row(f"best {name}", "", f"{fmt(best['value'], '.3f')} at step {best['step']}{stopped}", "")
    final, noise = best.get("final_value"), best.get("noise")
    if isinstance(final, (int, float)) and isinstance(best["value"], (int, float)) and noise is not None:
        verdict = "below, > noise" if best.get("below_best") else "within noise" if final < best["value"] else ""
        table.add_row("final vs best", "", f"{final - best['value']:+.3f} (±{noise:.3f})", verdict)


def below_best_note(best: dict[str, Any]) -> str:
    """One sentence for a run whose final evaluation is below its best by more than noise, with the command that
    evaluates the best checkpoint (summary.json's `best`)."""
    return f"the final evaluation is below the best (step {best['step']}) by more than its noise: {best['command']}"


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """Print `summary_table(summary)`."""
    (console or Console()).print(summary_table(summary))
