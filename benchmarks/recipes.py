"""Every recipe on the embedded model and the `arith` task, at the same budget of RL steps, for several seeds.

Each (recipe, seed) runs in its own `rollwise train` process, one after another, with the same overrides:
`--steps` RL steps (64 samples each), `train.seed`, held-out evaluation on `--eval-n` prompts at the start and
the end only (sampled at T = 0.7 and greedy), no checkpoints. Prints one JSON row per run as it ends, then a
Markdown table per recipe (held-out accuracy before and after, mean over the seeds and each seed;
`train/clip_frac`, the share of trained tokens (GSPO: sequences) its loss clipped or truncated, averaged over
the steps; optimizer steps per RL step; wall time) and writes the rows and the table's numbers as JSON.

    python benchmarks/recipes.py [--steps 10] [--eval-n 100] [--seeds 0,1] [--recipes grpo,dapo,...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["grpo", "dr_grpo", "dapo", "cispo", "gspo", "rloo", "reinforce_pp", "ppo", "sao"]


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


def _numbers(rows: list[dict], key: str) -> list[float]:
    """The finite values of `key` in `rows` (absent, null and "nan"/"inf" markers left out)."""
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_recipe(name: str, seed: int, steps: int, eval_n: int, runs_dir: Path) -> dict:
    """One `rollwise train` of recipe `name` with `train.seed = seed`; its numbers as one row."""
    wall_s, trains, evals = run_train(str(REPO / "recipes" / f"{name}.toml"), runs_dir / f"{name}-seed{seed}",
                                      [f"train.steps={steps}", f"train.seed={seed}", f"eval.n={eval_n}",
                                       "eval.every_steps=0"])
    clip = _numbers(trains, "train/clip_frac")
    return {
        "recipe": name, "seed": seed, "steps": steps, "wall_s": round(wall_s, 1),
        "sampled_before": evals[0]["eval/sampled_accuracy"], "sampled_after": evals[-1]["eval/sampled_accuracy"],
        "greedy_before": evals[0].get("eval/greedy_accuracy"), "greedy_after": evals[-1].get("eval/greedy_accuracy"),
        "len_after": evals[-1]["eval/response_len_mean"],
        "clip_frac_mean": _mean(clip), "clip_frac_max": max(clip) if clip else None,
        "optimizer_steps_per_step": _mean(_numbers(trains, "train/optimizer_steps")),
        "peak_rss_gb": round(max(_numbers(trains, "perf/peak_rss_gb")), 2),
        "train_s_total": round(sum(_numbers(trains, "perf/train_s")), 1),
    }


def summarise(rows: list[dict]) -> list[dict]:
    """Per recipe (in run order): the mean over its seeds of every number, plus each seed's accuracies."""
    out = []
    for name in dict.fromkeys(r["recipe"] for r in rows):
        runs = [r for r in rows if r["recipe"] == name]
        summary = {"recipe": name, "seeds": [r["seed"] for r in runs]}
        for key in ("sampled_before", "sampled_after", "greedy_before", "greedy_after", "len_after",
                    "clip_frac_mean", "optimizer_steps_per_step", "wall_s", "peak_rss_gb"):
            summary[key] = _mean([r[key] for r in runs if r[key] is not None])
        for key in ("sampled_after", "greedy_after"):
            summary[f"{key}_per_seed"] = [r[key] for r in runs]
        out.append(summary)
    return out


def _acc(before: float | None, after: float | None, per_seed: list) -> str:
    if before is None or after is None:
        return "n/a"
    seeds = ", ".join("n/a" if a is None else f"{a:.2f}" for a in per_seed)
    return f"{before:.2f} -> {after:.2f} ({seeds})"


def print_table(summary: list[dict]) -> None:
    print("\n| recipe | optimizer steps per RL step | sampled acc before -> after (each seed) | greedy acc before -> "
          "after (each seed) | train/clip_frac | mean length after | wall time per run |")
    print("|---|---|---|---|---|---|---|")
    for s in summary:
        clip = "n/a" if s["clip_frac_mean"] is None else f"{s['clip_frac_mean']:.4f}"
        steps = "n/a" if s["optimizer_steps_per_step"] is None else f"{s['optimizer_steps_per_step']:.0f}"
        print(f"| {s['recipe']} | {steps} | {_acc(s['sampled_before'], s['sampled_after'], s['sampled_after_per_seed'])} | "
              f"{_acc(s['greedy_before'], s['greedy_after'], s['greedy_after_per_seed'])} | {clip} | "
              f"{s['len_after']:.1f} | {s['wall_s']:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-n", type=int, default=100)
    parser.add_argument("--seeds", default="0,1", help="comma-separated train.seed values, each a run per recipe")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--runs-dir", default=time.strftime("runs/bench-recipes-%Y%m%d-%H%M%S"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "recipes.json"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for seed in seeds:  # every recipe once before the next seed: a run stopped early still compares all recipes
        for name in args.recipes.split(","):
            rows.append(run_recipe(name, seed, args.steps, args.eval_n, Path(args.runs_dir)))
            print(json.dumps(rows[-1]), flush=True)
    summary = summarise(rows)
    print_table(summary)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
