"""Rollout lifecycle control on the embedded model: partial rollouts, dynamic sampling, replay, async mode.

Each variant runs in its own `rollwise train` process, one after another (never two at once: they would share
the two cores), from the same recipe with the same seed. Writes every variant's summary and per-step curves
to JSON and prints Markdown tables.

    python benchmarks/lifecycle.py partial [--steps 30]       # long-tail lengths: sync vs partial rollouts
    python benchmarks/lifecycle.py batch [--time-s 150]       # GRPO vs dynamic sampling vs replay, equal wall time
    python benchmarks/lifecycle.py partial_heldout [--time-s 150] [--eval-n 200] --seeds 0,1
                                  # sync vs partial rollouts at equal RL wall time, then held-out accuracy:
                                  # the long-tail setting (rollout-bound) and the quickstart (rollout a minority)
    python benchmarks/lifecycle.py async [--steps 12]         # sync vs async generation on this machine
    python benchmarks/lifecycle.py report A.json B.json [--out chart.svg]   # tables and reward chart, merged

`partial`: the quickstart's one-digit problems answered "step by step", `max_new_tokens = 256`: most answers
take 5-60 tokens, about one in ten runs to the limit; 4 prompts x 8 samples per step; both variants use `tis_token` so the only difference is the control.
`batch`: the quickstart recipe, stopped by `train.max_time_s`, then evaluated on 200 held-out prompts.
`async`: the quickstart recipe with `tis_token`, `control.mode` sync vs async (`max_staleness = 1`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark scripts
from recipes import run_train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "quickstart.toml")
QUIET = ["run.samples_logged_per_step=0"]
CORRECTED = ["algo.is_correction=\"tis_token\""]

LONG_TAIL = [
    "rollout.max_new_tokens=256", "rollout.prompts_per_step=4",
    'data.system_prompt="Solve the arithmetic problem step by step. End your reply with: The answer is N."',
    "eval.n=0", "eval.every_steps=0", *CORRECTED,
]
LONG_TAIL_EVAL = [o for o in LONG_TAIL if not o.startswith("eval.")]
SUITES = {
    "partial": {
        "sync": LONG_TAIL,
        "partial": [*LONG_TAIL, "control.partial_rollouts=true", "control.over_provision=1.5"],
        "partial_2x": [*LONG_TAIL, "control.partial_rollouts=true", "control.over_provision=2.0"],
    },
    # equal RL wall time (train.max_time_s), then held-out evaluation: where partial rollouts pay, where not
    "partial_heldout": {
        "longtail_sync": LONG_TAIL_EVAL,
        "longtail_partial": [*LONG_TAIL_EVAL, "control.partial_rollouts=true", "control.over_provision=1.5"],
        "quickstart_sync": [*CORRECTED],
        "quickstart_partial": [*CORRECTED, "control.partial_rollouts=true", "control.over_provision=1.5"],
    },
    "batch": {
        "grpo": [],
        "dynamic": ["control.dynamic_sampling=true", "control.max_sampling_rounds=3"],
        "hard_case": ["replay.kind=\"hard_case\"", "replay.mix_ratio=0.25", *CORRECTED],
        "ssr": ["replay.kind=\"ssr\"", "replay.mix_ratio=0.5", *CORRECTED],
    },
    "async": {
        "sync": [*CORRECTED],
        "async": [*CORRECTED, "control.mode=\"async\"", "control.max_staleness=1"],
    },
}


def run_variant(name: str, overrides: list[str], run_dir: Path) -> dict:
    wall_s, trains, evals = run_train(RECIPE, run_dir, [*QUIET, *overrides])
    tokens = sum(r["rollout/tokens"] for r in trains)
    out = {
        "variant": name, "overrides": overrides, "steps": len(trains), "wall_s": round(wall_s, 1),
        "step_s_mean": statistics.fmean(r["perf/step_s"] for r in trains),
        "rollout_s_mean": statistics.fmean(r["perf/rollout_s"] for r in trains),
        "train_s_mean": statistics.fmean(r["perf/train_s"] for r in trains),
        "rollout_tokens_per_s": tokens / max(1e-9, sum(r["perf/rollout_s"] for r in trains)),
        # the engine's own generation time (async: in the generation process, overlapping training)
        "generate_tokens_per_s": tokens / max(1e-9, sum(r["rollout/tokens"] / max(r["perf/rollout_tokens_per_s"], 1e-9)
                                                       for r in trains)),
        "reward_curve": [r.get("reward/mean") for r in trains],
        "response_len_curve": [r.get("rollout/response_len_mean") for r in trains],
        "off_policy_token_frac_mean": statistics.fmean(r.get("control/off_policy_token_frac", 0.0) for r in trains),
        "staleness_max": max((r.get("control/staleness_max", 0.0) for r in trains), default=0.0),
        "peak_rss_gb": max(r["perf/peak_rss_gb"] for r in trains),
    }
    if evals:
        out["sampled_before"] = evals[0]["eval/sampled_accuracy"]
        out["sampled_after"] = evals[-1]["eval/sampled_accuracy"]
        out["greedy_after"] = evals[-1].get("eval/greedy_accuracy")
    return out


def windows(curve: list[float | None], size: int = 5) -> list[str]:
    """Mean ± standard error of each window of `size` steps."""
    out = []
    for start in range(0, len(curve), size):
        part = [v for v in curve[start : start + size] if v is not None]
        if len(part) > 1:
            out.append(f"{statistics.fmean(part):.3f} ± {statistics.stdev(part) / len(part) ** 0.5:.3f}")
        elif part:
            out.append(f"{part[0]:.3f}")
    return out


def seed_of(row: dict) -> int:
    return next((int(o.split("=")[1]) for o in row["overrides"] if o.startswith("train.seed=")), 0)


def print_tables(suite: str, rows: list[dict]) -> None:
    """Per run: speed against the first run of the same seed; then per variant over seeds; reward windows."""
    bases: dict[int, dict] = {}
    for r in rows:
        bases.setdefault(seed_of(r), r)
    print(f"\n| {suite} variant | steps | mean step s | mean rollout wait s | rollout tok/s | engine tok/s | vs the "
          "seed's first variant (tok/s, step time) | off-policy tokens | max staleness | sampled acc after | "
          "peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = bases[seed_of(r)]
        speed = r["rollout_tokens_per_s"] / base["rollout_tokens_per_s"]
        step = 1 - r["step_s_mean"] / base["step_s_mean"]
        acc = f"{r['sampled_before']:.3f} -> {r['sampled_after']:.3f}" if "sampled_after" in r else "-"
        engine = r.get("generate_tokens_per_s")
        print(f"| {r['variant']} | {r['steps']} | {r['step_s_mean']:.1f} | {r['rollout_s_mean']:.1f} | "
              f"{r['rollout_tokens_per_s']:.0f} | {'-' if engine is None else f'{engine:.0f}'} | "
              f"{speed:.2f}x, {100 * abs(step):.0f}% {'shorter' if step >= 0 else 'longer'} | "
              f"{r['off_policy_token_frac_mean']:.2f} | "
              f"{r['staleness_max']:.0f} | {acc} | {r['peak_rss_gb']:.2f} |")
    by_variant: dict[str, list[dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"].split(" (seed")[0], []).append(r)
    if any(len(v) > 1 for v in by_variant.values()):
        print("\n| variant | seeds | steps (mean) | mean step s | sampled acc after (mean of seeds) |")
        print("|---|---|---|---|---|")
        for name, group in by_variant.items():
            accs = [r["sampled_after"] for r in group if "sampled_after" in r]
            acc = f"{statistics.fmean(accs):.3f} ({', '.join(f'{a:.3f}' for a in accs)})" if accs else "-"
            print(f"| {name} | {len(group)} | {statistics.fmean(r['steps'] for r in group):.1f} | "
                  f"{statistics.fmean(r['step_s_mean'] for r in group):.1f} | {acc} |")
    print("\nreward/mean per 5-step window (mean ± s.e.):")
    for r in rows:
        print(f"- {r['variant']}: {' | '.join(windows(r['reward_curve']))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=[*SUITES, "report"], help="report: tables and reward chart of saved JSON")
    parser.add_argument("files", nargs="*", help="report: result JSON files of earlier invocations")
    parser.add_argument("--steps", type=int, default=None, help="partial: 30, async: 12")
    parser.add_argument("--time-s", type=float, default=150.0, help="batch: train.max_time_s of each variant")
    parser.add_argument("--eval-n", type=int, default=200, help="batch, async: held-out prompts")
    parser.add_argument("--variants", default=None, help="comma-separated subset")
    parser.add_argument("--seeds", default="0", help="comma-separated train.seed values; each variant runs once per seed")
    parser.add_argument("--runs-dir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.suite == "report":
        rows = [row for f in args.files for row in json.loads(Path(f).read_text())]
        print_tables("report", rows)
        if args.out:
            Path(args.out).write_text(reward_svg(rows))
        return
    suite = SUITES[args.suite]
    runs_dir = Path(args.runs_dir or time.strftime(f"runs/bench-{args.suite}-%Y%m%d-%H%M%S"))
    common = []
    if args.suite == "partial":
        common = [f"train.steps={args.steps or 30}"]
    elif args.suite in ("batch", "partial_heldout"):
        common = ["train.steps=1000", f"train.max_time_s={args.time_s}", f"eval.n={args.eval_n}", "eval.every_steps=0"]
    else:
        common = [f"train.steps={args.steps or 12}", f"eval.n={args.eval_n}", "eval.every_steps=0"]
    rows = []
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        for name in (args.variants.split(",") if args.variants else list(suite)):
            label = name if len(seeds) == 1 else f"{name} (seed {seed})"
            rows.append(run_variant(label, [*suite[name], *common, f"train.seed={seed}"],
                                    runs_dir / f"{name}-seed{seed}"))
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("curve")}), flush=True)
    print_tables(args.suite, rows)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"lifecycle_{args.suite}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    out.with_suffix(".svg").write_text(reward_svg(rows))


def reward_svg(rows: list[dict]) -> str:
    """`reward/mean` per step of every variant, one chart (written next to the JSON)."""
    from rollwise.metrics import svg

    series = [svg.Series(r["variant"], list(range(1, len(r["reward_curve"]) + 1)), r["reward_curve"]) for r in rows]
    return svg.line_plot("Reward per step", "reward/mean of each step's rollouts", series, y_range=(0.0, 1.0))


if __name__ == "__main__":
    main()
