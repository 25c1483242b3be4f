"""Discrepancy control on the embedded model: the same fp8-engine run without control, with DCMDP and with ACRL.

Every run is `recipes/dcmdp.toml` (a bf16 engine whose linear weights are rounded to fp8, against an fp32
trainer, on `arith`), with `algo.method` set to `rl`, `dcmdp` or `acrl`; one `rollwise train` process at a time,
seeds 0 and 1. A run whose directory already holds a `summary.json` is read, not run again (`--fresh` reruns).

Prints one JSON row per run, then a Markdown table: held-out greedy accuracy at the last evaluation, and the
per-step means over the first and the last five steps of the discrepancy D (`mismatch/k3` on current tokens,
the same measure in every arm), the policy's entropy, and the controller (lambda, or ACRL's threshold with the
discrepancy of the tokens it trained on and the share it masked).

    python benchmarks/discrepancy.py [--methods rl,dcmdp,acrl] [--seeds 0,1] [--runs-dir runs/discrepancy]
                                     [--steps N] [--eval-n N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERIES = ("mismatch/k3", "train/entropy", "reward/mean", "mismatch/lambda", "mismatch/acrl_threshold",
          "mismatch/acrl_trained_discrepancy", "mismatch/acrl_masked_frac")


def train_command(method: str, seed: int, runs_dir: Path, budget: list[str]) -> list[str]:
    """The exact `rollwise train` command of one run; `budget`: extra overrides (steps, evaluation)."""
    return [sys.executable, "-m", "rollwise.cli", "train", str(REPO / "recipes" / "dcmdp.toml"),
            "--run-dir", str(runs_dir / f"{method}-seed{seed}"), f"algo.method={method}", f"train.seed={seed}",
            "run.console=false", "run.save_every_steps=0", "run.report=false", *budget]


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(sum(values) / len(values), 5) if values else None


def run_row(method: str, seed: int, runs_dir: Path, fresh: bool, budget: list[str]) -> dict:
    run_dir = runs_dir / f"{method}-seed{seed}"
    if fresh or not (run_dir / "summary.json").exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        subprocess.run(train_command(method, seed, runs_dir, budget), check=True, cwd=REPO)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    out = {"method": method, "seed": seed, "steps": len(train),
           "accuracy": [(r["step"], r.get("eval/greedy_accuracy")) for r in evals]}
    for key in SERIES:
        out[f"{key} first5"], out[f"{key} last5"] = _mean(train[:5], key), _mean(train[-5:], key)
    out["mismatch/k3 per step"] = [round(r.get("mismatch/k3") or 0.0, 5) for r in train]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| method | seed | greedy acc (last eval) | D first 5 / last 5 | entropy first 5 / last 5 | controller "
             "last 5 |", "|---|---|---|---|---|---|"]
    for r in rows:
        control = {"dcmdp": f"lambda {r['mismatch/lambda last5']}",
                   "acrl": f"tau {r['mismatch/acrl_threshold last5']}, trained D "
                           f"{r['mismatch/acrl_trained_discrepancy last5']}, masked "
                           f"{r['mismatch/acrl_masked_frac last5']}"}.get(r["method"], "-")
        acc = r["accuracy"][-1][1] if r["accuracy"] else None
        lines.append(f"| {r['method']} | {r['seed']} | {acc} | {r['mismatch/k3 first5']} / {r['mismatch/k3 last5']} "
                     f"| {r['train/entropy first5']} / {r['train/entropy last5']} | {control} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="rl,dcmdp,acrl")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "discrepancy")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--steps", type=int, help="train.steps (default: the recipe's)")
    parser.add_argument("--eval-n", type=int, help="eval.n, evaluated at the start and the end only")
    args = parser.parse_args()
    budget = [f"train.steps={args.steps}"] if args.steps else []
    budget += [f"eval.n={args.eval_n}", "eval.every_steps=0"] if args.eval_n else []
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for method in args.methods.split(","):
            rows.append(run_row(method, seed, args.runs_dir, args.fresh, budget))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
