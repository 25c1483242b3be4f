"""The run report (rollwise/metrics/report.py) written from real metric rows on disk."""

from __future__ import annotations

import re
from pathlib import Path

from rollwise.metrics import MetricsWriter, write_report
from rollwise.metrics.report import EPISODE_PLOTS, PLOTS


def figure(html: str, title: str) -> str:
    """The SVG chart titled `title` in the page."""
    match = re.search(rf'<svg[^>]*aria-label="{re.escape(title)}".*?</svg>', html, re.DOTALL)
    assert match, f"no chart titled {title!r}"
    return match.group(0)


def episode_row(step: int) -> dict:
    return {"kind": "train", "step": step, "reward/mean": 0.1 * step, "episode/turns_mean": 1.0 + 0.25 * step,
            "episode/tool_calls_mean": 0.5 * step, "episode/tool_errors": float(step % 2),
            "episode/parse_failures": 3.0 - step, "episode/tool_s": 0.01 * step, "episode/sandbox_s": 0.004 * step,
            "episode/tokens_mean": 40.0 + step}


def test_report_plots_episode_metrics(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        for step in (1, 2, 3):
            writer.write(episode_row(step))
        writer.write({"kind": "eval", "step": 3, "eval/greedy_accuracy": 0.5})
    html = write_report(tmp_path).read_text()
    assert "<h2>Episodes</h2>" in html
    assert html.count("<svg") == len(PLOTS) + 1 + len(EPISODE_PLOTS)  # run plots, time split, episode panel
    assert html.index("<h2>Plots</h2>") < html.index("<h2>Episodes</h2>")
    for spec in EPISODE_PLOTS:
        chart = figure(html, spec.title)
        if spec.lines == ("episode/retokenize_mismatch",):  # not among the rows written
            assert "no data" in chart
            continue
        assert "no data" not in chart, spec.title
        for key in spec.lines:
            assert key in chart, (spec.title, key)  # each key is a legend entry, so its series was drawn
    both = figure(html, "Tool time")
    assert "episode/tool_s" in both and "episode/sandbox_s" in both


def test_report_without_episode_keys_has_no_episode_panel(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        writer.write({"kind": "train", "step": 1, "reward/mean": 0.5})
    html = write_report(tmp_path).read_text()
    assert "Episodes" not in html and html.count("<svg") == len(PLOTS) + 1
