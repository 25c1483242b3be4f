"""Command line: `rollwise train | eval | report | config | ...`."""

from __future__ import annotations

# First, before torch loads: this snapshot of the CPU counters starts the window over which the CPU other
# processes use is measured (the thread count, rollwise/hardware.py); the imports below fill that window.
import rollwise.hardware  # noqa: F401  (isort: skip)

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from rollwise.config import ConfigError
from rollwise.config_toml import to_toml
from rollwise.validate import load
from rollwise.errors import guard, one_line

def _quiet_libraries() -> None:
    """Keep the console for rollwise's own progress: no per-file progress bars from transformers."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


app = typer.Typer(add_completion=False, no_args_is_help=True, help="RL post-training of language models, CPU first.")

DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "quickstart.toml"


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {one_line(message)}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=code)


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """First argument may be a recipe file; the rest are `section.key=value` overrides."""
    recipe = None
    if args and "=" not in args[0]:
        recipe, args = args[0], args[1:]
    bad = [a for a in args if "=" not in a]
    if bad:
        _fail(f"expected section.key=value overrides, got {bad}")
    return recipe, args


@app.command(context_settings={"allow_extra_args": False})
def train(
    args: Optional[list[str]] = typer.Argument(None, help="[RECIPE.toml] [section.key=value ...]"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="run directory (default runs/<name>)"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="continue the run in this directory"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved config and exit"),
    debug: bool = typer.Option(False, "--debug", help="print the full traceback of an error"),
) -> None:
    """Train with GRPO-style RL (default recipe: recipes/quickstart.toml)."""
    recipe, overrides = _split_args(list(args or []))
    if resume is not None:
        if recipe is not None:
            _fail("--resume takes the recipe from the run directory; give only overrides")
        recipe = str(resume / "config.toml")
        run_dir = resume
    elif recipe is None and DEFAULT_RECIPE.exists():
        recipe = str(DEFAULT_RECIPE)
    try:
        cfg = load(recipe, overrides)
    except ConfigError as exc:
        _fail(str(exc))
    for note in cfg._load_notes:  # a task other than the recipe's (rollwise.config_tasks)
        typer.echo(f"rollwise: {note}", err=True)
    if dry_run:
        from rollwise.hardware import resolve_device, slow_bf16_warning

        warning = slow_bf16_warning(cfg.model.dtype, cfg.train.precision, resolve_device(cfg.train.device).type)
        if warning:
            typer.echo(warning, err=True)
        typer.echo(to_toml(cfg))
        _memory_check(cfg, show=True)
        return
    if int(os.environ.get("RANK", "0")) > 0:  # torchrun: ranks > 0 are FSDP2 trainer workers of rank 0's loop
        from rollwise.train.launch import worker_main_from_env

        _exit_after(lambda: worker_main_from_env(cfg))
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(cfg.run.root) / (f"{cfg.run.name}-{stamp}" if cfg.run.name else stamp)
    if resume is None and any((run_dir / f).exists() for f in ("checkpoints", "metrics.jsonl", "config.toml")):
        _fail(f"{run_dir} already holds a run; use --resume {run_dir} or another --run-dir")
    _quiet_libraries()
    _memory_check(cfg)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's rank 0
        _exit_after(lambda: _guarded_training(cfg, run_dir, resume, debug))
    _guarded_training(cfg, run_dir, resume, debug)


def _memory_check(cfg, show: bool = False) -> None:
    """The run's memory estimate against its device (rollwise/train/memory_config.py), printed as TOML comments
    with `show` (--dry-run); a run that cannot fit stops here, before any work, in one line (exit 2)."""
    from rollwise.train.memory_config import memory_report

    lines, refusal = memory_report(cfg)
    if show:
        typer.echo("\n".join(f"# {line}" for line in lines))
    if refusal:
        _fail(refusal)


def _guarded_training(cfg, run_dir: Path, resume, debug: bool) -> None:
    from rollwise.loop import train as run_training

    with guard(run_dir, debug):
        run_training(cfg, run_dir, resume=resume is not None)


def _exit_after(command) -> None:
    """Run `command`, then end the process at once with its exit code: under torchrun, the process group's C++
    threads still alive at interpreter teardown abort it ("terminate called without an active exception")."""
    code = 0
    try:
        command()
    except typer.Exit as exc:
        code = exc.exit_code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


DEVICE_HELP = "where the torch engine decodes: auto, cpu, cuda or cuda:N (default train.device of the run)"
ENGINE_HELP = "rollout engine: torch or vllm (default rollout.engine of the run)"


@app.command("eval")
def eval_cmd(
    model: str = typer.Option(..., "--model", help="model name, HF directory, checkpoint or run directory"),
    task: Optional[str] = typer.Option(None, "--task", help="task (default: the run's, else arith)"),
    n: int = typer.Option(500, "--n", help="held-out prompts"),
    temperature: float = typer.Option(0.7, "--temperature"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens"),
    data: Optional[str] = typer.Option(None, "--data", help="JSONL of rows with 'prompt' and 'answer', run in "
                                       "the task's environment (instead of its held-out split)"),
    out: Optional[str] = typer.Option(None, "--out", help="write one JSON line per episode: prompt, answer, "
                                      "transcript, final, correct"),
    k: Optional[int] = typer.Option(None, "--k", min=1, help="sampled responses per prompt (default eval.k of the run, "
                                    "else 1): with K > 1, unbiased pass@j for j = 1, 2, 4, ... < K and K, and avg@K"),
    greedy: bool = typer.Option(True, "--greedy/--no-greedy", help="also one greedy response per prompt"),
    decode: str = typer.Option("plain", "--decode", help="'deeplook': also decode with confidence-triggered "
                               "lookahead and voting (eval.deeplook_* keys), reported as deeplook_* with tokens spent"),
    best: bool = typer.Option(False, "--best", help="with a run directory: its best checkpoint "
                              "(checkpoints/best, kept whenever the run evaluates) instead of its newest"),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    engine: Optional[str] = typer.Option(None, "--engine", help=ENGINE_HELP),
    overrides: Optional[list[str]] = typer.Argument(None, help="section.key=value (e.g. data.system_prompt=...)"),
    debug: bool = typer.Option(False, "--debug", help="print the full traceback of an error"),
) -> None:
    """Accuracy (and pass@k with --k) on a task's held-out split (or on --data): prints one JSON object."""
    _quiet_libraries()
    from rollwise.evaluate_cli import run_eval_command

    with guard(None, debug):
        result = run_eval_command(model, task, n, temperature, max_new_tokens, list(overrides or []),
                                  data=data, out=out, k=k, greedy=greedy, best=best, decode=decode,
                                  device=device, engine=engine)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


@app.command()
def serve(
    args: Optional[list[str]] = typer.Argument(None, help="[CONFIG.toml] [section.key=value ...]"),
    host: Optional[str] = typer.Option(None, "--host", help="bind address (default serve.host, 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, "--port", help="port (default serve.port; 0 = a free one)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Bearer token (default serve.api_key, else "
                                          "$ROLLWISE_SERVE_API_KEY, else a generated one, printed); prefer the "
                                          "variable: other local users see command lines"),
    model: Optional[str] = typer.Option(None, "--model", help="model, checkpoint or run directory to serve "
                                        "(default model.name); a run's own config.toml when no CONFIG is given"),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    engine: Optional[str] = typer.Option(None, "--engine", help=ENGINE_HELP),
    api: str = typer.Option("rollwise", "--api", help="rollwise: OpenAI completions + episodes + weights "
                            "(docs/serve.md); tinker: the Tinker training API for the tinker SDK (docs/tinker.md)"),
    debug: bool = typer.Option(False, "--debug", help="print the full traceback of an error"),
) -> None:
    """Serve the policy over HTTP (OpenAI completions + episodes + weights; or, with --api tinker, the Tinker
    training API) until Ctrl-C (docs/serve.md, docs/tinker.md)."""
    config, overrides = _split_args(list(args or []))
    _quiet_libraries()
    from rollwise.serve.cli import serve_command, tinker_serve_command

    with guard(None, debug):
        if api == "tinker":
            tinker_serve_command(config, overrides, host, port, api_key, model, device=device, engine=engine)
        elif api == "rollwise":
            serve_command(config, overrides, host, port, api_key, model, device=device, engine=engine)
        else:
            raise typer.BadParameter(f"--api must be rollwise or tinker, got {api!r}")


@app.command()
def extrapolate(
    run_dir: Path = typer.Argument(..., help="run directory: its checkpoints are the observation window"),
    to: int = typer.Option(..., "--to", min=1, help="the RL step to extrapolate to"),
    observe: Optional[int] = typer.Option(None, "--observe", min=1, help="use the checkpoints up to this step "
                                          "(default: all of them)"),
    out: Optional[Path] = typer.Option(None, "--out", help="where to write (default RUN/extrapolated/step-N)"),
    debug: bool = typer.Option(False, "--debug", help="print the full traceback of an error"),
) -> None:
    """RELEX: rank-1 extrapolation of RUN's checkpoints to step --to, written as a model directory to evaluate."""
    _quiet_libraries()
    from rollwise.relex import extrapolate_run

    with guard(None, debug):
        typer.echo(str(extrapolate_run(run_dir, to, observe=observe, out=out)))


@app.command()
def trajval(
    args: Optional[list[str]] = typer.Argument(None, help="RECIPE.toml (with [[data.mix]]) [section.key=value ...]"),
    probe_steps: int = typer.Option(..., "--probe-steps", min=1, help="steps of the probe run"),
    floor: float = typer.Option(0.05, "--floor", help="learnability credited to a flat source (keeps it sampled)"),
    metric: str = typer.Option("sampled", "--metric", help="held-out accuracy read: sampled or greedy"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="the probe's run directory (default "
                                           "runs/trajval-<time>)"),
    debug: bool = typer.Option(False, "--debug", help="print the full traceback of an error"),
) -> None:
    """TrajVal: each mixture source's learnability from a probe run; writes the weights (rollwise/trajval.py)."""
    recipe, overrides = _split_args(list(args or []))
    if recipe is None:
        _fail("rollwise trajval needs a recipe with [[data.mix]] tables: rollwise trajval RECIPE --probe-steps N")
    try:
        cfg = load(recipe, overrides)
    except ConfigError as exc:
        _fail(str(exc))
    run_dir = run_dir or Path(cfg.run.root) / f"trajval-{time.strftime('%Y%m%d-%H%M%S')}"
    if (run_dir / "metrics.jsonl").exists():
        _fail(f"{run_dir} already holds a run; give another --run-dir")
    _quiet_libraries()
    from rollwise.trajval import run_trajval

    with guard(run_dir, debug):
        record = run_trajval(cfg, probe_steps, run_dir, floor=floor, metric=metric)
    typer.echo(record["mix_tables"].rstrip())
    typer.echo(f"# weights: {run_dir / 'trajval.json'}; recipe: rollwise train {record['toml']}")


@app.command()
def report(run_dir: Path = typer.Argument(..., help="run directory")) -> None:
    """Write RUN_DIR/report.html with plots of the run's metrics."""
    from rollwise.metrics import ReportError, write_report

    try:
        path = write_report(run_dir)
    except ReportError as exc:
        _fail(str(exc))
    typer.echo(str(path))


@app.command()
def peak(
    dtype: Optional[list[str]] = typer.Option(None, "--dtype", help="float32 and/or bfloat16 (default both)"),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = the free cores, as a run chooses)"),
    fresh: bool = typer.Option(False, "--fresh", help="forget the cached figures first (e.g. measured while "
                               "the machine was busy); otherwise the better of the cached and new figure is kept"),
) -> None:
    """Measure the matmul peak that MFU figures divide by, and cache it (run it on an idle machine)."""
    from rollwise import perf
    from rollwise.hardware import configure_threads

    with guard(None):
        if fresh:
            perf._cache_file().unlink(missing_ok=True)
        used = configure_threads(threads)
        for name, entry in perf.remeasure_peaks(tuple(dtype or ("float32", "bfloat16")), used).items():
            typer.echo(f"{name}: {entry['gflops']:.0f} GFLOP/s on {used} threads ({entry.get('method', '')}, "
                       f"{entry.get('date', '')}) -> {perf._cache_file()}")


@app.command("config")
def config_cmd(
    target: Optional[str] = typer.Argument(None, help="SECTION, SECTION.KEY or SECTION.METHOD (a method's table, "
                                           "e.g. rollout.duet); none = every section"),
    markdown: bool = typer.Option(False, "--markdown", help="the whole reference as Markdown (docs/config.md)"),
) -> None:
    """Print config keys with their types, defaults and descriptions, from the config models."""
    from rollwise import config_reference

    try:
        typer.echo(config_reference.markdown() if markdown else config_reference.text(target), nl=not markdown)
    except ConfigError as exc:
        _fail(str(exc))


if __name__ == "__main__":
    app()
