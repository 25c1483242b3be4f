"""Every recipe on the embedded model and the `arith` task, at the same budget of RL steps.

Each recipe runs in its own `rollwise train` process, one after another, with the same overrides: `--steps`
RL steps (64 samples each), held-out evaluation on `--eval-n` prompts at the start and the end only (sampled
at T = 0.7 and greedy), no checkpoints. Prints a Markdown table (accuracy before and after, wall time of the
whole command) and writes the rows as JSON.

    python benchmarks/recipes.py [--steps 10] [--eval-n 100] [--recipes grpo,dapo,...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo", "sao"]


def run_train(recipe: str, run_dir: Path, overrides: list[str]) -> tuple[float, list[dict], list[dict]]:
    """`rollwise train RECIPE --run-dir RUN_DIR OVERRIDES...` in its own process (quiet: no console, report or
    checkpoints before the end). Returns (wall seconds, training rows, eval rows) of its metrics.jsonl."""
    cmd = [sys.executable, "-m", "rollwise.cli", "train", recipe, "--run-dir", str(run_dir), "run.save_every_steps=0",
           "run.console=false", "run.report=false", *overrides]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall_s = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return wall_s, [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


def run_recipe(name: str, steps: int, eval_n: int, runs_dir: Path) -> dict:
    wall_s, trains, evals = run_train(str(REPO / "recipes" / f"{name}.toml"), runs_dir / name,
                                      [f"train.steps={steps}", f"eval.n={eval_n}", "eval.every_steps=0"])
    return {
        "recipe": name, "steps": steps, "wall_s": round(wall_s, 1),
        "sampled_before": evals[0]["eval/sampled_accuracy"], "sampled_after": evals[-1]["eval/sampled_accuracy"],
        "greedy_before": evals[0].get("eval/greedy_accuracy"), "greedy_after": evals[-1].get("eval/greedy_accuracy"),
        "len_after": evals[-1]["eval/response_len_mean"],
        "peak_rss_gb": round(max(r["perf/peak_rss_gb"] for r in trains), 2),
        "train_s_total": round(sum(r["perf/train_s"] for r in trains), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-n", type=int, default=100)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--runs-dir", default=time.strftime("runs/bench-recipes-%Y%m%d-%H%M%S"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "recipes.json"))
    args = parser.parse_args()
    rows = []
    for name in args.recipes.split(","):
        rows.append(run_recipe(name, args.steps, args.eval_n, Path(args.runs_dir)))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| recipe | sampled acc before -> after | greedy acc before -> after | mean length after | wall time |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['sampled_before']:.2f} -> {r['sampled_after']:.2f} | "
              f"{r['greedy_before']:.2f} -> {r['greedy_after']:.2f} | {r['len_after']:.1f} | {r['wall_s']:.0f} s |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
