"""Distillation against GRPO on the embedded model and the `arith` task, two seeds each (issue 13).

Runs, one `rollwise train` process at a time (checkpoints only at the end, no console or report):
- `grpo`: recipes/quickstart.toml (the default GRPO recipe); seed 0's final checkpoint is the OPD teacher;
- `opd`: recipes/opd.toml with `teacher.weights` = that run (reward weight 0: pure OPD), student = the base model;
- `opsd`: recipes/opsd.toml (the frozen base model with the answer hint as teacher, reward weight 0);
- `sft_then_grpo`: recipes/sft_then_grpo.toml (4 rejection-sampled SFT steps, then 16 GRPO steps).
A run whose directory already holds a `summary.json` is read, not run again (`--fresh` reruns everything).

Prints one JSON row per run, then a Markdown table per method: held-out accuracy (greedy and sampled at
T = 0.7) at each evaluation, the first evaluated step reaching `--target` and the RL wall time to it (evaluation
excluded), and per-step means of the distillation guards (teacher KL, truncated fraction, mean length,
repetition rate) over the first and last five steps.

    python benchmarks/distill.py [--methods grpo,opd,opsd,sft_then_grpo] [--seeds 0,1] [--runs-dir runs/distill]

`--timing N` instead runs N steps of each method back to back with evaluation off (seed 0; opd distils
RUNS_DIR/grpo-seed0) and prints the median step time and the teacher's share of it, side by side: run it on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = {"grpo": "quickstart", "opd": "opd", "opsd": "opsd", "sft_then_grpo": "sft_then_grpo"}
GUARDS = ("distill/teacher_kl", "rollout/truncated_frac", "rollout/response_len_mean", "rollout/repetition_rate")


def train_command(method: str, seed: int, runs_dir: Path) -> list[str]:
    """The exact `rollwise train` command of one run."""
    cmd = [sys.executable, "-m", "rollwise.cli", "train", str(REPO / "recipes" / f"{RECIPE[method]}.toml"),
           "--run-dir", str(runs_dir / f"{method}-seed{seed}"), f"train.seed={seed}", "run.console=false",
           "run.save_every_steps=0", "run.report=false"]
    if method == "opd":
        cmd.append(f"teacher.weights={runs_dir / 'grpo-seed0'}")
    return cmd


def read_run(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(sum(values) / len(values), 4) if values else None


def run_row(method: str, seed: int, runs_dir: Path, target: float, fresh: bool) -> dict:
    run_dir = runs_dir / f"{method}-seed{seed}"
    if fresh or not (run_dir / "summary.json").exists():
        if run_dir.exists():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        subprocess.run(train_command(method, seed, runs_dir), check=True, stdout=subprocess.DEVNULL)
    trains, evals = read_run(run_dir)
    rl_time = {0: 0.0}
    total = 0.0
    for r in trains:
        total += r["perf/step_s"]
        rl_time[r["step"]] = total
    reached = next((e["step"] for e in evals if (e.get("eval/greedy_accuracy") or 0) >= target), None)
    return {
        "method": method, "seed": seed,
        "greedy": {e["step"]: e.get("eval/greedy_accuracy") for e in evals},
        "sampled": {e["step"]: e["eval/sampled_accuracy"] for e in evals},
        "eval_len": {e["step"]: e["eval/response_len_mean"] for e in evals},
        "first_step_at_target": reached, "rl_s_to_target": None if reached is None else round(rl_time[reached], 1),
        "rl_s_total": round(total, 1), "step_s_median": sorted(r["perf/step_s"] for r in trains)[len(trains) // 2],
        "first5": {k: _mean(trains[:5], k) for k in GUARDS}, "last5": {k: _mean(trains[-5:], k) for k in GUARDS},
        "command": " ".join(train_command(method, seed, runs_dir)).replace(sys.executable, "python"),
    }


def print_tables(rows: list[dict], target: float) -> None:
    for method in dict.fromkeys(r["method"] for r in rows):
        runs = [r for r in rows if r["method"] == method]
        steps = sorted({int(s) for r in runs for s in r["greedy"]})
        print(f"\n#### {method}\n")
        print("| seed | " + " | ".join(f"step {s}" for s in steps) + f" | first step >= {target} | RL time to it | "
              "RL time total |")
        print("|---|" + "---|" * (len(steps) + 3))
        for r in runs:
            cells = [f"{r['greedy'].get(s, r['greedy'].get(str(s)))} / {r['sampled'].get(s, r['sampled'].get(str(s)))}"
                     for s in steps]
            print(f"| {r['seed']} | " + " | ".join(cells) + f" | {r['first_step_at_target']} | "
                  f"{r['rl_s_to_target']} s | {r['rl_s_total']} s |")
        print("\n| seed | " + " | ".join(f"{k} first 5 -> last 5" for k in GUARDS) + " |")
        print("|---|" + "---|" * len(GUARDS))
        for r in runs:
            print(f"| {r['seed']} | " + " | ".join(f"{r['first5'][k]} -> {r['last5'][k]}" for k in GUARDS) + " |")


def timing(methods: list[str], steps: int, runs_dir: Path) -> list[dict]:
    """Median `perf/step_s` and `perf/time/teacher_s` of `steps` steps per method, one run after another."""
    out = []
    for method in methods:
        if method == "sft_then_grpo":
            continue  # its stages need their own step counts
        run_dir = runs_dir / f"timing-{method}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        cmd = [a.replace(str(runs_dir / f"{method}-seed0"), str(run_dir)) for a in train_command(method, 0, runs_dir)]
        subprocess.run(cmd + [f"train.steps={steps}", "eval.n=0"], check=True, stdout=subprocess.DEVNULL)
        trains, _ = read_run(run_dir)
        median = lambda key: sorted(r.get(key) or 0.0 for r in trains)[len(trains) // 2]  # noqa: E731
        row = {"method": method, "steps": steps, "step_s_median": round(median("perf/step_s"), 2),
               "teacher_s_median": round(median("perf/time/teacher_s"), 2),
               "peak_rss_gb": round(max(r["perf/peak_rss_gb"] for r in trains), 2)}
        print(json.dumps(row), flush=True)
        out.append(row)
    base = next(r["step_s_median"] for r in out if r["method"] == "grpo")
    for r in out:
        print(f"| {r['method']} | {r['step_s_median']} s | {r['teacher_s_median']} s | "
              f"{r['step_s_median'] / base:.2f} | {r['peak_rss_gb']} GB |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="grpo,opd,opsd,sft_then_grpo")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--runs-dir", default="runs/distill")
    parser.add_argument("--target", type=float, default=0.65, help="greedy held-out accuracy to reach")
    parser.add_argument("--fresh", action="store_true", help="rerun runs that already finished")
    parser.add_argument("--timing", type=int, default=0, help="N steps per method, side by side (see above)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "distill.json"))
    args = parser.parse_args()
    runs_dir, rows = Path(args.runs_dir), []
    methods = args.methods.split(",")
    if args.timing:
        timing(methods, args.timing, runs_dir)
        return
    if "opd" in methods and "grpo" not in methods and not (runs_dir / "grpo-seed0" / "summary.json").exists():
        parser.error(f"opd distils {runs_dir}/grpo-seed0: run the grpo method first")
    for method in methods:
        for seed in (int(s) for s in args.seeds.split(",")):
            start = time.perf_counter()
            row = run_row(method, seed, runs_dir, args.target, args.fresh)
            row["bench_wall_s"] = round(time.perf_counter() - start, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print_tables(rows, args.target)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
