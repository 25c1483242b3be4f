"""Self-contained HTML run report (`report.html`) built from `metrics.jsonl`: inline SVG plots, no scripts.

Plots over `step`: reward, accuracy (train line plus eval markers), response length, KL, entropy, logprob
mismatch, throughput, off-policy token share and staleness, batch control (rounds, drops, carry-over), and the
time split per stage (every `perf/time/<stage>_s` key, stacked); for a mixture (`[[data.mix]]`) each source's
accuracy (train and held-out) and mean reward. Tables: first and last eval, total time per stage, and the best
checkpoint (summary.json's `best`: its step and value, the final value and the noise, and a warning with the
command that evaluates it when the run ended below it). The resolved `config.toml`, when present, is shown verbatim.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from rollwise.errors import UserError
from rollwise.metrics import svg
from rollwise.metrics.sinks import METRICS_FILE, read_metrics, row_kind

REPORT_FILE = "report.html"
TIME_KEY = re.compile(r"^perf/time/(.+)_s$")
STAGE_ORDER = ["rollout", "reward", "filter", "replay", "reference", "train", "optimizer", "sync", "eval", "checkpoint", "other"]


class ReportError(UserError, ValueError):
    """The run directory holds nothing to report; the message names the file."""


@dataclass(frozen=True)
class PlotSpec:
    """One chart: training-row keys drawn as lines, eval-row keys drawn as markers."""

    title: str
    subtitle: str
    lines: tuple[str, ...]
    markers: tuple[str, ...] = ()
    y_range: tuple[float, float] | None = None
    log_y: bool | str = False


PLOTS = (
    PlotSpec("Reward", "mean reward of the step's rollouts", ("reward/mean",)),
    PlotSpec(
        "Accuracy",
        "train rollouts (line) and held-out eval (markers)",
        ("reward/accuracy",),
        ("eval/sampled_accuracy", "eval/greedy_accuracy", "eval/greedy_balanced_accuracy"),
        y_range=(0.0, 1.0),
    ),
    PlotSpec("Answers", "share of the step's responses giving its most common answer (warning at 0.9: "
             "rollwise.metrics.collapse)", ("rollout/answer_mode_frac",), y_range=(0.0, 1.0)),
    PlotSpec("Response length", "mean response tokens per rollout", ("rollout/response_len_mean",)),
    PlotSpec("KL", "policy vs reference, per token", ("train/kl",)),
    PlotSpec("Entropy", "policy entropy per response token (nats)", ("train/entropy",)),
    PlotSpec(
        "Logprob mismatch",
        "engine (behaviour) vs trainer logprobs of the sampled tokens",
        ("mismatch/logprob_abs_diff_mean", "mismatch/k3"),
        log_y="auto",
    ),
    PlotSpec("Throughput", "tokens per second", ("perf/rollout_tokens_per_s", "perf/train_tokens_per_s")),
    PlotSpec(
        "Off-policy tokens",
        "share of trained tokens sampled by an older policy, and replayed samples",
        ("control/off_policy_token_frac", "replay/replayed_frac"),
        y_range=(0.0, 1.0),
    ),
    PlotSpec(
        "Staleness",
        "policy versions between a trained token and the trainer (token mean and max)",
        ("control/staleness_mean", "control/staleness_max"),
    ),
    PlotSpec(
        "Batch control",
        "generation rounds, groups dropped by filters, groups carried to the next step",
        ("control/sampling_rounds", "filter/zero_variance_frac", "control/groups_carried"),
    ),
)
TIME_TITLE = "Time split"


def _num(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and value == value and abs(value) != float("inf") else None


def by_step(rows: list[dict[str, Any]], key: str, kind: str | None = None) -> dict[float, float | None]:
    """`step -> value` of `key` over rows of `kind` (any kind when None), sorted by step; later rows win."""
    out: dict[float, float | None] = {}
    for row in rows:
        step = _num(row.get("step"))
        if step is None or key not in row or (kind is not None and row_kind(row) != kind):
            continue
        out[step] = _num(row[key])
    return dict(sorted(out.items()))


def _series(rows: list[dict[str, Any]], key: str, kind: str, markers: bool) -> svg.Series:
    values = by_step(rows, key, kind)
    return svg.Series(key, list(values), list(values.values()), markers_only=markers)


def plot_svg(rows: list[dict[str, Any]], spec: PlotSpec) -> str:
    """The SVG chart for `spec` (a `no data` chart when none of its keys has a value)."""
    series = [_series(rows, key, "train", False) for key in spec.lines]
    series += [_series(rows, key, "eval", True) for key in spec.markers]
    return svg.line_plot(spec.title, spec.subtitle, series, y_range=spec.y_range, log_y=spec.log_y)


def time_stages(rows: list[dict[str, Any]]) -> list[str]:
    """Stage names of every `perf/time/<stage>_s` key, in pipeline order, unknown stages last."""
    stages = {m.group(1) for row in rows for key in row if (m := TIME_KEY.match(key))}
    known = [s for s in STAGE_ORDER if s in stages]
    return known + sorted(stages - set(known))


def time_split(rows: list[dict[str, Any]]) -> tuple[list[float], dict[str, list[float | None]]]:
    """Steps and, per stage, seconds at each step (train and eval rows of one step are added)."""
    per_stage: dict[str, dict[float, float]] = {}
    for stage in time_stages(rows):
        key, merged = f"perf/time/{stage}_s", {}
        for kind in ("train", "eval"):
            for step, value in by_step(rows, key, kind).items():
                merged[step] = merged.get(step, 0.0) + (value or 0.0)
        per_stage[stage] = merged
    steps = sorted({step for merged in per_stage.values() for step in merged})
    return steps, {stage: [merged.get(s) for s in steps] for stage, merged in per_stage.items()}


def time_svg(rows: list[dict[str, Any]]) -> str:
    steps, stages = time_split(rows)
    return svg.stacked_bars(TIME_TITLE, "seconds per step by stage (perf/time/<stage>_s)", steps, list(stages.items()))


def eval_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Eval rows in file order."""
    return [row for row in rows if row_kind(row) == "eval"]


def _last_train_step(rows: list[dict[str, Any]]) -> int:
    steps = [_num(r.get("step")) for r in rows if row_kind(r) == "train"]
    return int(max((s for s in steps if s is not None), default=0))


def _total(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [v for v in by_step(rows, key, "train").values() if v is not None]
    return sum(values) if values else None


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """First and last eval rows and run totals, in the shape `console.print_summary` takes.

    Totals come from training rows when they carry them: `wall_s` = last `perf/elapsed_s` (else the sum of
    `perf/step_s`), `tokens_generated` = sum of `rollout/tokens`, `tokens_trained` = sum of `train/tokens`.
    """
    rows = _load(Path(run_dir))
    evals = eval_rows(rows)
    elapsed = [v for v in by_step(rows, "perf/elapsed_s").values() if v is not None]
    return {
        "run_dir": str(run_dir),
        "steps": _last_train_step(rows),
        "eval_before": evals[0] if evals else {},
        "eval_after": evals[-1] if evals else {},
        "wall_s": elapsed[-1] if elapsed else _total(rows, "perf/step_s"),
        "tokens_generated": _total(rows, "rollout/tokens"),
        "tokens_trained": _total(rows, "train/tokens"),
    }


def _load(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    try:
        rows = read_metrics(run_dir)
    except FileNotFoundError as exc:
        raise ReportError(f"cannot report: metrics file not found: {path}") from exc
    if not rows:
        raise ReportError(f"cannot report: {path} holds no metric rows")
    return rows


def _cell(value: Any) -> str:
    v = _num(value)
    if v is None:
        return "-" if value is None else escape(str(value))
    return f"{v:.4g}" if not float(v).is_integer() else f"{int(v)}"


def eval_table_html(rows: list[dict[str, Any]]) -> str:
    """First vs last eval row, one line per `eval/` key."""
    evals = eval_rows(rows)
    if not evals:
        return "<p class='muted'>no eval rows</p>"
    first, last = evals[0], evals[-1]
    keys = list(dict.fromkeys(k for row in (first, last) for k in row if k.startswith("eval/")))
    head = (
        f"<tr><th>eval</th><th>first (step {_cell(first.get('step'))})</th>"
        f"<th>last (step {_cell(last.get('step'))})</th></tr>"
    )
    body = "".join(
        f"<tr><td>{escape(k)}</td><td>{_cell(first.get(k))}</td><td>{_cell(last.get(k))}</td></tr>" for k in keys
    )
    return f"<table>{head}{body}</table>"


def time_table_html(rows: list[dict[str, Any]]) -> str:
    """Total seconds and share per stage over the run."""
    _, stages = time_split(rows)
    totals = {stage: sum(v or 0.0 for v in values) for stage, values in stages.items()}
    grand = sum(totals.values())
    if grand <= 0:
        return "<p class='muted'>no perf/time/&lt;stage&gt;_s keys</p>"
    body = "".join(
        f"<tr><td>{escape(stage)}</td><td>{total:.1f}</td><td>{100 * total / grand:.1f}%</td></tr>"
        for stage, total in totals.items()
    )
    return f"<table><tr><th>stage</th><th>total s</th><th>share</th></tr>{body}</table>"


CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:22px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px}
.muted,.meta{color:#777;font-size:13px} .warn{color:#a40;font-size:13px;max-width:520px}
.tables{display:flex;gap:32px;flex-wrap:wrap;align-items:flex-start}
table{border-collapse:collapse;font-size:13px;background:#fff}
th,td{border:1px solid #ddd;padding:4px 10px;text-align:right} th:first-child,td:first-child{text-align:left}
th{background:#f0f0f0}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(530px,1fr));gap:12px}
figure{margin:0;background:#fff;border:1px solid #e3e3e3;border-radius:4px;padding:4px}
pre{background:#fff;border:1px solid #e3e3e3;padding:12px;font-size:12px;overflow:auto}
"""


EPISODE_PREFIX = "episode/"
EPISODE_PLOTS = (
    PlotSpec("Turns per episode", "assistant turns per episode (mean)", ("episode/turns_mean",)),
    PlotSpec("Tool calls per episode", "parsed tool calls per episode (mean)", ("episode/tool_calls_mean",)),
    PlotSpec("Tool errors", "tool calls that failed (unknown tool, bad arguments, the tool raised)",
             ("episode/tool_errors",)),
    PlotSpec("Parse failures", "attempted tool calls that could not be parsed", ("episode/parse_failures",)),
    PlotSpec("Tool time", "seconds in tools and, of those, in the sandbox", ("episode/tool_s", "episode/sandbox_s")),
    PlotSpec("Episode length", "tokens per episode after the prompt (policy and tool)", ("episode/tokens_mean",)),
    PlotSpec("Retokenize mismatch", "episodes whose tokens differ from a canonical render of the transcript",
             ("episode/retokenize_mismatch",)),
)


def episodes_html(rows: list[dict[str, Any]]) -> str:
    """The "Episodes" panel of multi-turn runs (`EPISODE_PLOTS`: turns, tool calls, tool errors, parse failures,
    tool and sandbox time, episode tokens, retokenize mismatches); empty when no row has an `episode/*` key."""
    if not any(key.startswith(EPISODE_PREFIX) for row in rows for key in row):
        return ""
    figures = "".join(f"<figure>{plot_svg(rows, spec)}</figure>" for spec in EPISODE_PLOTS)
    return f"<h2>Episodes</h2><div class='plots'>{figures}</div>"


DISTILL_PREFIX = "distill/"
DISTILL_PLOTS = (
    PlotSpec("Teacher KL", "sampled KL(student || teacher) per trained token", ("distill/teacher_kl",)),
    PlotSpec("Collapse guards", "repeated 4-grams and truncated responses (StableOPD's truncation collapse)",
             ("rollout/repetition_rate", "rollout/truncated_frac"), y_range=(0.0, 1.0)),
    PlotSpec("Gap by position", "logp_student - logp_teacher by quarter of the response",
             ("distill/gap_pos_q1", "distill/gap_pos_q2", "distill/gap_pos_q3", "distill/gap_pos_q4")),
    PlotSpec("Entropy at the gap", "student entropy: all tokens, and the 10% with the largest gap",
             ("distill/entropy_mean", "distill/entropy_at_top_gap")),
)


def distill_html(rows: list[dict[str, Any]]) -> str:
    """The "Distillation" panel (`DISTILL_PLOTS`); empty when no row has a `distill/*` key."""
    if not any(key.startswith(DISTILL_PREFIX) for row in rows for key in row):
        return ""
    figures = "".join(f"<figure>{plot_svg(rows, spec)}</figure>" for spec in DISTILL_PLOTS)
    return f"<h2>Distillation</h2><div class='plots'>{figures}</div>"


SOURCE_KEY = re.compile(r"^(?:reward|eval)/([^/]+)/(?:accuracy|mean|sampled_accuracy|greedy_accuracy)$")
NOT_SOURCES = {"part"}  # reward/part/<part> are reward parts, not mixture sources


def sources(rows: list[dict[str, Any]]) -> list[str]:
    """The mixture sources (`[[data.mix]]` names) with `reward/<source>/*` or `eval/<source>/*` keys, sorted."""
    found = {m.group(1) for row in rows for key in row if (m := SOURCE_KEY.match(key))}
    return sorted(found - NOT_SOURCES)


def source_plots(names: list[str]) -> list[PlotSpec]:
    """One accuracy chart per source (its training rollouts as a line, its held-out eval as markers), then every
    source's mean reward in one chart."""
    specs = [PlotSpec(f"Accuracy: {name}", f"source {name}: train rollouts (line) and held-out eval (markers)",
                      (f"reward/{name}/accuracy",), (f"eval/{name}/sampled_accuracy", f"eval/{name}/greedy_accuracy"),
                      y_range=(0.0, 1.0)) for name in names]
    specs.append(PlotSpec("Reward by source", "mean reward of each source's rollouts",
                          tuple(f"reward/{name}/mean" for name in names)))
    return specs


def sources_html(rows: list[dict[str, Any]]) -> str:
    """The "Sources" panel of a mixture run (`source_plots`); empty when no row has a per-source key."""
    names = sources(rows)
    if not names:
        return ""
    figures = "".join(f"<figure>{plot_svg(rows, spec)}</figure>" for spec in source_plots(names))
    return f"<h2>Sources</h2><div class='plots'>{figures}</div>"


PASS_KEY = re.compile(r"^eval/(pass|avg)@(\d+)$")


def pass_at_k_html(rows: list[dict[str, Any]]) -> str:
    """The "pass@k" panel of runs with eval.k > 1: each evaluation's pass@j (unbiased, Chen et al. 2021) and
    avg@k as markers; empty when no row has them."""
    found = {m.groups(): key for row in rows for key in row if (m := PASS_KEY.match(key))}
    if not found:
        return ""
    keys = tuple(found[g] for g in sorted(found, key=lambda g: (g[0] == "avg", int(g[1]))))
    spec = PlotSpec("pass@k", "held-out pass@j and avg@k at each evaluation", (), keys, y_range=(0.0, 1.0))
    return f"<h2>pass@k</h2><div class='plots'><figure>{plot_svg(rows, spec)}</figure></div>"


def saved_best(run_dir: Path) -> dict[str, Any] | None:
    """summary.json's `best` (the run's best checkpoint), None when the run has no summary or no best."""
    try:
        best = json.loads((run_dir / "summary.json").read_text(encoding="utf-8")).get("best")
    except (OSError, ValueError, AttributeError):
        return None
    return best if isinstance(best, dict) and best.get("step") is not None else None


def best_html(run_dir: Path) -> str:
    """The "Best checkpoint" table: best and final value of its metric, the noise, the checkpoint, and a warning
    with the commands that take it when the run ended below it by more than the noise; empty without one."""
    best = saved_best(run_dir)
    if best is None:
        return ""
    cells = [("metric", escape(str(best.get("metric")))),
             ("best", f"{_cell(best.get('value'))} at step {_cell(best.get('step'))}"),
             ("final", f"{_cell(best.get('final_value'))} at step {_cell(best.get('final_step'))}"),
             ("noise", "-" if best.get("noise") is None else f"±{_cell(best['noise'])} on {_cell(best.get('n'))} "
                       "prompts"),
             ("checkpoint", escape(str(best.get("checkpoint"))))]
    body = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in cells)
    warning = ""
    if best.get("below_best"):
        warning = (f"<p class='warn'>The final evaluation is below the best by more than its noise: "
                   f"<code>{escape(str(best.get('command')))}</code>, "
                   f"<code>{escape(str(best.get('serve_command')))}</code></p>")
    return f"<div><h2>Best checkpoint</h2><table>{body}</table>{warning}</div>"


def render_html(run_dir: Path, rows: list[dict[str, Any]]) -> str:
    """The report page for `rows` of the run in `run_dir`."""
    figures = [plot_svg(rows, spec) for spec in PLOTS] + [time_svg(rows)]
    config_path = run_dir / "config.toml"
    config = escape(config_path.read_text(encoding="utf-8", errors="replace")) if config_path.exists() else None
    n_train = len({s for s in by_step(rows, "step", "train")})
    meta = (
        f"{n_train} training steps logged (last step {_last_train_step(rows)}), {len(eval_rows(rows))} evals;"
        f" from {escape(str(run_dir / METRICS_FILE))}"
    )
    parts = [
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>rollwise report: {escape(run_dir.name)}"
        f"</title><style>{CSS}</style></head><body>",
        f"<h1>rollwise run {escape(run_dir.name)}</h1><p class='meta'>{meta}</p>",
        f"<div class='tables'><div><h2>Eval</h2>{eval_table_html(rows)}</div>"
        f"<div><h2>Time per stage</h2>{time_table_html(rows)}</div>{best_html(run_dir)}</div>",
        "<h2>Plots</h2><div class='plots'>" + "".join(f"<figure>{f}</figure>" for f in figures) + "</div>",
        sources_html(rows),
        pass_at_k_html(rows),
        episodes_html(rows),
        distill_html(rows),
        f"<h2>Config</h2><pre>{config}</pre>" if config is not None else "",
        "</body></html>\n",
    ]
    return "\n".join(parts)


def write_report(run_dir: str | Path) -> Path:
    """Write `run_dir/report.html` atomically and return its path. Raises ReportError without metric rows."""
    run_dir = Path(run_dir)
    html = render_html(run_dir, _load(run_dir))
    path = run_dir / REPORT_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(html, encoding="utf-8")
    os.replace(tmp, path)
    return path
