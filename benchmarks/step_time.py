"""The default recipe's RL step time, side by side between two source trees (say main before and after a change).

    python benchmarks/step_time.py --a /path/to/tree-before --b . --steps 4 --repeats 3

Each run is `rollwise train recipes/quickstart.toml` for `--steps` RL steps (no evaluation, no checkpoint) in a
fresh process with the tree's code (`PYTHONPATH`), on a fixed number of torch threads; the runs alternate
A B A B ... The first step of each run is a warm-up and is left out. Reported: the median step time of each side,
the ratio B / A of the medians, and the tokens generated per step on each side (the same seed gives the same
samples, so the same work, when the two trees compute the same thing; a difference is reported, not hidden).
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


def one_run(tree: Path, steps: int, threads: int, out: Path) -> list[dict]:
    """The training rows of one run of the default recipe with `tree`'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "rollwise.cli", "train", str(ROOT / "recipes" / "quickstart.toml"),
           f"train.steps={steps}", "eval.n=0", f"model.threads={threads}", "run.save_every_steps=0",
           "run.console=false", "run.report=false", "run.samples_logged_per_step=0", "--run-dir", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=tree)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="the first tree (e.g. before a change)")
    parser.add_argument("--b", type=Path, default=ROOT, help="the second tree (default: this one)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {"a": [], "b": []}
    tokens: dict[str, list[float]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory(prefix="rollwise-step-time-") as tmp:
        for repeat in range(args.repeats):
            for side in ("a", "b"):
                rows = one_run(getattr(args, side).resolve(), args.steps, args.threads,
                               Path(tmp) / f"{side}-{repeat}")
                times[side] += [r["perf/step_s"] for r in rows[1:]]  # the first step warms up
                tokens[side] += [r["rollout/tokens"] for r in rows[1:]]
                print(f"{side} run {repeat + 1}: step_s {[round(r['perf/step_s'], 2) for r in rows]}", flush=True)
    med = {side: statistics.median(values) for side, values in times.items()}
    result = {"steps_per_run": args.steps, "repeats": args.repeats, "threads": args.threads,
              "median_step_s": med, "ratio_b_over_a": med["b"] / med["a"],
              "tokens_per_step": {side: statistics.mean(v) for side, v in tokens.items()},
              "trees": {"a": str(args.a), "b": str(args.b)}}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
