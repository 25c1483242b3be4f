"""The default recipe's RL step time, side by side between source trees and settings (main before and after a
change; the torch engine against vLLM).

    python benchmarks/step_time.py --a /path/to/tree-before --b . --steps 4 --repeats 3
    python benchmarks/step_time.py --side before /path/to/tree-before rollout.engine=vllm \
        --side after . rollout.engine=vllm --side torch . rollout.engine=torch --steps 6 --repeats 2

Each run is `rollwise train recipes/quickstart.toml` for `--steps` RL steps (no evaluation, no checkpoint) in a
fresh process with the tree's code (`PYTHONPATH`) and the side's `KEY=VALUE` overrides, on a fixed number of torch
threads; the runs alternate A B A B ... (`--side` in the order given). The first step of each run is a warm-up and
is left out. Reported per side: the median step time and the median of each stage (`perf/time/*_s`) and of the
Sync stage's parts (`sync/time_s` the transfer, `sync/check_s` the probe check, where the tree writes it); each
side's median step over the first side's; and the tokens generated per step (the same seed gives the same
samples, so the same work, when the sides compute the same thing; a difference is reported, not hidden).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


STAGE_KEYS = ("perf/time/rollout_s", "perf/time/train_s", "perf/time/sync_s", "sync/time_s", "sync/check_s")


def one_run(tree: Path, steps: int, threads: int, out: Path, overrides: list[str] = ()) -> list[dict]:
    """The training rows of one run of the default recipe with `tree`'s code and `overrides`."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "rollwise.cli", "train", str(ROOT / "recipes" / "quickstart.toml"),
           f"train.steps={steps}", "eval.n=0", f"model.threads={threads}", "run.save_every_steps=0",
           "run.console=false", "run.report=false", "run.samples_logged_per_step=0", *overrides,
           "--run-dir", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=tree)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, help="the first tree (e.g. before a change)")
    parser.add_argument("--b", type=Path, default=ROOT, help="the second tree (default: this one)")
    parser.add_argument("--side", nargs="+", action="append", metavar="LABEL TREE [KEY=VALUE ...]",
                        help="a side: its label, its tree and its overrides (repeat; replaces --a / --b)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.side:
        sides = {s[0]: (Path(s[1]).resolve(), s[2:]) for s in args.side}
    elif args.a is not None:
        sides = {"a": (args.a.resolve(), []), "b": (args.b.resolve(), [])}
    else:
        parser.error("give --a TREE (and --b), or --side LABEL TREE [KEY=VALUE ...] at least twice")
    rows_of: dict[str, list[dict]] = {label: [] for label in sides}
    with tempfile.TemporaryDirectory(prefix="rollwise-step-time-") as tmp:
        for repeat in range(args.repeats):
            for label, (tree, overrides) in sides.items():
                rows = one_run(tree, args.steps, args.threads, Path(tmp) / f"{label}-{repeat}", overrides)
                rows_of[label] += rows[1:]  # the first step warms up
                print(f"{label} run {repeat + 1}: step_s {[round(r['perf/step_s'], 2) for r in rows]}", flush=True)
    first = next(iter(sides))
    med = {label: statistics.median(r["perf/step_s"] for r in rows) for label, rows in rows_of.items()}
    stages = {label: {k: round(statistics.median(r[k] for r in rows), 4) for k in STAGE_KEYS
                      if all(k in r for r in rows)} for label, rows in rows_of.items()}
    from rollwise.perf import cpu_model_name

    result = {"cpu": cpu_model_name(), "steps_per_run": args.steps, "repeats": args.repeats,
              "threads": args.threads, "median_step_s": med,
              "ratio_over_" + first: {label: med[label] / med[first] for label in sides},
              "median_stage_s": stages,
              "tokens_per_step": {label: statistics.mean(r["rollout/tokens"] for r in rows)
                                  for label, rows in rows_of.items()},
              "sides": {label: {"tree": str(tree), "overrides": overrides}
                        for label, (tree, overrides) in sides.items()}}
    if set(sides) == {"a", "b"}:
        result["ratio_b_over_a"] = med["b"] / med["a"]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
