"""Metrics sinks, console and report on real files under tmp_path."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console

from rollwise.metrics import (
    ConsoleView,
    MetricsWriter,
    ReportError,
    build_sinks,
    print_summary,
    read_metrics,
    summarize,
    truncate_after,
    write_report,
)
from rollwise.metrics.report import PLOTS, TIME_TITLE
from rollwise.metrics.svg import fmt_num, linear_ticks


def train_row(step: int) -> dict:
    """A plausible training row; the reward climbs with the step."""
    acc = min(1.0, 0.2 + 0.02 * step)
    return {
        "kind": "train",
        "step": step,
        "reward/mean": acc,
        "reward/accuracy": acc,
        "rollout/response_len_mean": 30.0 - 0.3 * step,
        "rollout/answer_mode_frac": 0.3,
        "rollout/tokens": 1000 + step,
        "train/tokens": 1500,
        "train/kl": 0.001 * step,
        "train/entropy": 1.2 - 0.01 * step,
        "mismatch/logprob_abs_diff_mean": 1e-3,
        "mismatch/k3": 1e-7 * (1 + step),
        "perf/rollout_tokens_per_s": 300.0 + step,
        "perf/train_tokens_per_s": 900.0,
        "perf/time/rollout_s": 8.0,
        "perf/time/reward_s": 0.1,
        "perf/time/train_s": 4.0,
        "perf/step_s": 12.1,
        "control/off_policy_token_frac": 0.3,
        "control/staleness_mean": 0.3,
        "control/staleness_max": 1.0,
        "replay/replayed_frac": 0.1,
        "control/sampling_rounds": 1.0 + step % 2,
        "filter/zero_variance_frac": 0.25,
        "control/groups_carried": 2.0,
    }


def eval_row(step: int, sampled: float, greedy: float) -> dict:
    return {
        "kind": "eval",
        "step": step,
        "eval/sampled_accuracy": sampled,
        "eval/greedy_accuracy": greedy,
        "eval/response_len_mean": 25.0,
        "eval/n": 64,
        "perf/time/eval_s": 5.0,
    }


def write_run(run_dir: Path, steps: int = 30) -> None:
    with MetricsWriter(run_dir) as writer:
        writer.write(eval_row(0, 0.125, 0.25))
        for step in range(1, steps + 1):
            writer.write(train_row(step))
            if step % 10 == 0:
                writer.write(eval_row(step, 0.125 + 0.01 * step, 0.25 + 0.01 * step))


def test_writer_round_trip_nonfinite_is_a_string_not_null(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        writer.write({"kind": "train", "step": 1, "reward/mean": 0.5, "train/kl": math.nan, "x": math.inf,
                      "y": -math.inf, "z": None})
        writer.write({"kind": "eval", "step": 1, "eval/greedy_accuracy": 0.75, "note": "ok"})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert "NaN" not in lines[0] and "Infinity" not in lines[0]
    assert json.loads(lines[0]) == {"kind": "train", "step": 1, "reward/mean": 0.5, "train/kl": "nan", "x": "inf",
                                    "y": "-inf", "z": None}  # null stays "not measured"
    train, evaluation = read_metrics(tmp_path)
    assert math.isnan(train.pop("train/kl"))
    assert train == {"kind": "train", "step": 1, "reward/mean": 0.5, "x": math.inf, "y": -math.inf, "z": None}
    assert evaluation == {"kind": "eval", "step": 1, "eval/greedy_accuracy": 0.75, "note": "ok"}


def test_truncate_after_keeps_nonfinite_values_spelled_out(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        writer.write({"step": 1, "train/loss": math.nan})
        writer.write({"step": 2, "train/loss": math.inf})
    assert truncate_after(tmp_path, 1) == 1
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step":1,"train/loss":"nan"}\n'


def test_report_summary_and_console_skip_nonfinite_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with MetricsWriter(tmp_path) as writer:
        writer.write(eval_row(0, math.nan, 0.25))
        for step in (1, 2, 3):
            writer.write({**train_row(step), "train/kl": math.nan if step == 2 else 0.5, "perf/step_s": math.inf})
        writer.write(eval_row(3, 0.5, math.nan))
    html = write_report(tmp_path).read_text()
    plots = html.split("<svg")[1:]
    assert not any(re.search(r"\b(nan|inf)\b", plot, re.IGNORECASE) for plot in plots)  # no NaN coordinates
    kl_plot = next(plot for plot in plots if 'aria-label="KL"' in plot)
    assert "no data" not in kl_plot  # steps 1 and 3 still plot; step 2 is a gap
    assert "<td>eval/greedy_accuracy</td><td>0.25</td><td>nan</td>" in html  # shown as nan, not as "-"
    assert summarize(tmp_path)["eval_before"]["eval/greedy_accuracy"] == 0.25
    rows = read_metrics(tmp_path)
    with ConsoleView(total_steps=3, enabled=False) as view:
        view.update(2, rows[2])
        view.eval(rows[-1])
    out = capsys.readouterr().out
    assert "step 2/3" in out and "greedy acc -" in out


def test_torn_last_line_is_skipped_and_next_write_starts_a_new_line(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        writer.write({"step": 1, "reward/mean": 0.1})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "reward/me')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    with MetricsWriter(tmp_path) as writer:
        writer.write({"step": 2, "reward/mean": 0.2})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_truncate_after_keeps_exactly_steps_up_to_n(tmp_path: Path) -> None:
    write_run(tmp_path, steps=15)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 16, "rew')
    dropped = truncate_after(tmp_path, 10)
    rows = read_metrics(tmp_path)
    assert dropped == 5  # train rows of steps 11..15; the torn line is not a row
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0)] + [("train", s) for s in range(1, 11)] + [
        ("eval", 10)
    ]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_report_has_every_plot_and_the_eval_values(tmp_path: Path) -> None:
    write_run(tmp_path)
    (tmp_path / "config.toml").write_text('[model]\nname = "smollm2-135m-instruct"\n')
    path = write_report(tmp_path)
    html = path.read_text()
    titles = [spec.title for spec in PLOTS] + [TIME_TITLE]
    assert html.count("<svg") == len(titles)
    for title in titles:
        assert f'aria-label="{title}"' in html
    assert "no data" not in html
    assert "0.125" in html and "0.55" in html  # first sampled, last greedy accuracy
    assert "smollm2-135m-instruct" in html
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")


def test_report_tolerates_missing_keys_nulls_and_single_points(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        writer.write({"kind": "train", "step": 1, "reward/mean": None, "train/kl": 0.5})
        writer.write({"kind": "eval", "step": 1, "eval/greedy_accuracy": 0.5})
    html = write_report(tmp_path).read_text()
    assert html.count("no data") == len(PLOTS) + 1 - 2  # only KL and accuracy have a value


@pytest.mark.parametrize("content", [None, "", '{"step": 1, "rew'])
def test_report_without_rows_names_the_file(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(ReportError, match="metrics.jsonl"):
        write_report(tmp_path)


def test_summarize_gives_first_and_last_eval_and_totals(tmp_path: Path) -> None:
    write_run(tmp_path, steps=20)
    summary = summarize(tmp_path)
    assert summary["steps"] == 20
    assert summary["eval_before"]["eval/greedy_accuracy"] == 0.25
    assert summary["eval_after"]["step"] == 20
    assert summary["tokens_trained"] == 20 * 1500
    assert summary["wall_s"] == pytest.approx(20 * 12.1)


def test_console_plain_mode_prints_a_line_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    with ConsoleView(total_steps=3, enabled=False) as view:
        for step in range(1, 4):
            view.update(step, train_row(step))
        view.eval(eval_row(3, 0.5, 0.625))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:3]] == [["step", "1/3"], ["step", "2/3"], ["step", "3/3"]]
    assert "reward 0.22 acc 0.22 len 29.7 tok/s 301 step 12.1s" in lines[0]
    assert lines[3].startswith("eval step 3") and "greedy acc 0.625" in lines[3]


def test_summary_table_renders_before_and_after() -> None:
    console = Console(record=True, width=100)
    summary = {
        "eval_before": eval_row(0, 0.125, 0.25),
        "eval_after": eval_row(30, 0.5, 0.625),
        "wall_s": 372.0,
        "tokens_generated": 31000,
        "tokens_trained": None,
        "steps": 30,
        "run_dir": "runs/x",
    }
    print_summary(summary, console=console)
    text = console.export_text()
    assert "0.125" in text and "0.625" in text and "+0.375" in text and "6m12s" in text and "31,000" in text


def test_build_sinks_always_has_jsonl_and_rejects_unknown(tmp_path: Path) -> None:
    with build_sinks([], tmp_path) as sinks:
        sinks.write({"step": 1, "reward/mean": 0.5})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward/mean": 0.5}
    with pytest.raises(ValueError, match="valid sinks: jsonl, tensorboard, wandb, mlflow"):
        build_sinks(["neptune"], tmp_path)


def test_ticks_and_labels() -> None:
    assert linear_ticks(0.03, 0.97) == (0.0, 1.0, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert [fmt_num(v, 0.2) for v in (0.0, 0.4, 1.0)] == ["0", "0.4", "1.0"]
    assert fmt_num(12000) == "12k" and fmt_num(1.2e-7) == "1.2e-7"
