"""Metrics: sinks (`metrics.jsonl` always, TensorBoard optional), console progress, HTML run report."""

from rollwise.metrics.console import ConsoleView, print_summary, summary_table
from rollwise.metrics.report import ReportError, summarize, write_report
from rollwise.metrics.sinks import MetricsWriter, MultiSink, TensorBoardSink, build_sinks, read_metrics, truncate_after

__all__ = [
    "ConsoleView",
    "MetricsWriter",
    "MultiSink",
    "ReportError",
    "TensorBoardSink",
    "build_sinks",
    "print_summary",
    "read_metrics",
    "summarize",
    "summary_table",
    "truncate_after",
    "write_report",
]
