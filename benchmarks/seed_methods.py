"""The seed methods against GRPO at the same budget, on the embedded model and the `arith` task (issue 23).

Every arm is a recipe: `grpo` is recipes/quickstart.toml (the default GRPO recipe), every other arm is
recipes/seed/<name>.toml. All arms run with the same budget overrides (`--steps` RL steps, one held-out evaluation
of `--eval-n` prompts at the end, no checkpoints), seeds 0 and 1, one `rollwise train` process at a time. Only
the `grpo` arm evaluates the starting model (the same model and held-out prompts for every arm). A run
whose directory already holds a `summary.json` is read, not run again (`--fresh` reruns).

Per run: held-out greedy accuracy at the end (`eval/greedy_accuracy`), the RL wall time (sum of `perf/step_s`,
evaluation excluded), tokens generated, and the mean response length over the last five steps. Prints one JSON row
per run and then the Markdown table BENCHMARKS.md quotes, with the arm's mean over seeds next to GRPO's.

    python benchmarks/seed_methods.py [--arms grpo,cme,...] [--seeds 0,1] [--steps 10] [--eval-n 100]

Run it on an otherwise idle machine: the wall times are compared side by side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEED_RECIPES = REPO / "recipes" / "seed"


def recipe(arm: str) -> Path:
    return REPO / "recipes" / "quickstart.toml" if arm == "grpo" else SEED_RECIPES / f"{arm}.toml"


def train_command(arm: str, seed: int, runs_dir: Path, steps: int, eval_n: int) -> list[str]:
    """The exact `rollwise train` command of one run."""
    return [sys.executable, "-m", "rollwise.cli", "train", str(recipe(arm)), "--run-dir",
            str(runs_dir / f"{arm}-seed{seed}"), f"train.seed={seed}", f"train.steps={steps}",
            f"eval.n={eval_n}", f"eval.every_steps={steps}", f"eval.at_start={str(arm == 'grpo').lower()}",
            "run.console=false", "run.save_every_steps=0", "run.report=false"]


def _mean(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def run_row(arm: str, seed: int, runs_dir: Path, steps: int, eval_n: int, fresh: bool) -> dict:
    run_dir = runs_dir / f"{arm}-seed{seed}"
    command = train_command(arm, seed, runs_dir, steps, eval_n)
    if fresh or not (run_dir / "summary.json").exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"arm": arm, "seed": seed, "steps": len(train),
            "greedy_accuracy": evals[-1].get("eval/greedy_accuracy") if evals else None,
            "start_greedy_accuracy": next((r.get("eval/greedy_accuracy") for r in evals if r["step"] == 0), None),
            "rl_s": round(sum(r.get("perf/step_s") or 0.0 for r in train), 1),
            "tokens_generated": summary.get("tokens_generated"),
            "response_len_last5": _mean([r.get("rollout/response_len_mean") for r in train[-5:]]),
            "command": " ".join(command).replace(sys.executable, "python")}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    lines = ["| arm | held-out greedy acc (seeds) | mean | RL time (seeds) | tokens generated (mean) | "
             "response length, last 5 steps (mean) |", "|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        runs = [r for r in rows if r["arm"] == arm]
        accuracies = " / ".join(_fmt(r["greedy_accuracy"], ".3f") for r in runs)
        times = " / ".join(_fmt(r["rl_s"], ".0f") + " s" for r in runs)
        lines.append(f"| {arm} | {accuracies} | {_fmt(_mean([r['greedy_accuracy'] for r in runs]), '.3f')} | "
                     f"{times} | {_fmt(_mean([r['tokens_generated'] for r in runs]), '.0f')} | "
                     f"{_fmt(_mean([r['response_len_last5'] for r in runs]), '.1f')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arms = ["grpo"] + sorted(p.stem for p in SEED_RECIPES.glob("*.toml"))
    parser.add_argument("--arms", default=",".join(arms), help="grpo and recipes/seed/<name>.toml names")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-n", type=int, default=100)
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "seed_methods")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "seed_methods.json")
    args = parser.parse_args()
    rows = []
    for arm in args.arms.split(","):
        if not recipe(arm).exists():
            parser.error(f"--arms: no recipe {recipe(arm)}")
        for seed in [int(s) for s in args.seeds.split(",")]:
            rows.append(run_row(arm, seed, args.runs_dir, args.steps, args.eval_n, args.fresh))
            print(json.dumps(rows[-1]), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1) + "\n")  # after every run: a cut sweep keeps its rows
    print(table(rows))


if __name__ == "__main__":
    main()
