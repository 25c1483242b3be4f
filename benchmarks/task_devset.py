"""A new task learns, or rollwise says why: the reasoning-gym development set, trained the default way (issue 31).

Six reasoning-gym tasks the embedded SmolLM2-135M-Instruct can start on (greedy accuracy between about 0.1 and
0.7 on held-out problems, with a short-answer prompt it follows; `--scan` measures that), each trained the way a
new user would: the default recipe (recipes/quickstart.toml) with the task named on the command line, so the
task-aware defaults apply (rollwise.config_tasks: the recipe's arithmetic prompt stays behind, a new task
starts from lr 1e-5 and KL 0.02), for `--steps` steps and `--seeds` seeds. The task's own settings (its options,
prompt, stop strings, reply length) are the only keys given, as a user would give them.

Held-out problems come from reasoning-gym's generator under the held-out seed and never meet training
(docs/tasks.md); they are graded by the dataset's own `score_answer` (greedy decoding; `eval.n` problems) at
step 0 (the starting model), every `--eval-every` steps and at the end. The table gives, per task and seed,
accuracy before, the best evaluation (the checkpoint `checkpoints/best` points the user to) and the final one,
the share of the last step's responses that gave the step's most common answer (`rollout/answer_mode_frac`), and
the RL wall time. `--baseline` trains with the demo's own settings instead (lr 2e-5, no KL: what a new task got
before the task-aware defaults) for the side-by-side.

    python benchmarks/task_devset.py --scan                      # starting accuracy of each candidate
    python benchmarks/task_devset.py --seeds 0,1                 # the table in BENCHMARKS.md
    python benchmarks/task_devset.py --seeds 0 --baseline        # the same with the demo's settings

Writes benchmarks/results/task_devset[_baseline].json; a run directory with a summary.json is read, not trained
again (`--fresh` retrains).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHORT = "Reply with the final answer only."

# name, data.options, system prompt, stop strings, max_new_tokens, data.eval_size
DEVSET = [
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, SHORT, ["\n"], 16, 100),
    ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, SHORT, ["\n"], 16, 100),
    ("needle_haystack", {"min_num_statements": 3, "max_num_statements": 5}, "Reply with the name only.",
     [",", ".", "\n", " is", " likes"], 6, 100),
    ("letter_counting", {"min_words": 3, "max_words": 5}, "Count how many times the letter appears in the text. "
     "Reply with the number only.", ["\n"], 16, 100),
    ("gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 20}, SHORT, ["\n"], 16, 100),
    ("course_schedule", {}, SHORT, ["\n"], 16, 100),
]


# settings measured against the default path (run dirs and results carry the name)
VARIANTS = {
    "baseline": ["train.lr=2e-5", "algo.kl_coef=0.0"],  # the demo's own, what a new task got before issue 31
    "kl": ["algo.kl_coef=0.1"],  # 5x the new-task KL: held nearer the start (ProRL-style KL anchoring)
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--tasks", default=",".join(t[0] for t in DEVSET), help="comma-separated subset")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-n", type=int, default=100)
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "devset")
    p.add_argument("--baseline", action="store_true", help="the demo's settings (lr 2e-5, KL 0) instead")
    p.add_argument("--variant", choices=sorted(VARIANTS), help="train with these settings on top of the default "
                   "path (collapse-resistance candidates); results in task_devset_<variant>.json")
    p.add_argument("--scan", action="store_true", help="only evaluate the starting model on each task")
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--analyse", action="store_true", help="after training (or on runs already there): greedy "
                   "answers of the start and each best checkpoint, split by the majority answer")
    return p.parse_args(argv)


def task_overrides(spec) -> list[str]:
    name, options, system, stop, max_new, eval_size = spec
    opts = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    return [f"data.task=reasoning_gym:{name}", f"data.options={{{opts}}}", f"data.system_prompt={system}",
            f"rollout.stop={json.dumps(stop)}", f"rollout.max_new_tokens={max_new}", f"data.eval_size={eval_size}"]


def scan(spec, args) -> dict:
    """The starting model's held-out greedy accuracy on the task (the same prompts the runs evaluate on)."""
    name, _, _, _, max_new, _ = spec
    eval_args = [a for a in task_overrides(spec) if not a.startswith(("data.task=", "rollout.max_new_tokens="))]
    command = [sys.executable, "-m", "rollwise.cli", "eval", "--model", "smollm2-135m-instruct", "--task",
               f"reasoning_gym:{name}", "--n", str(args.eval_n), "--max-new-tokens", str(max_new), *eval_args]
    done = subprocess.run(command, check=True, cwd=REPO, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def train(spec, seed: int, args) -> dict:
    run_dir = args.runs_dir / f"{spec[0]}-s{seed}{suffix(args)}"
    settings = VARIANTS[args.variant] if args.variant else []
    command = [sys.executable, "-m", "rollwise.cli", "train", *task_overrides(spec), *settings,
               f"train.seed={seed}", f"train.steps={args.steps}", f"eval.every_steps={args.eval_every}",
               f"eval.n={args.eval_n}", "run.save_every_steps=0", "run.console=false", "run.report=false",
               "--run-dir", str(run_dir)]
    if args.fresh or not (run_dir / "summary.json").exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        with open(args.runs_dir / f"{run_dir.name}.log", "w") as log:
            subprocess.run(command, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    prune(run_dir)
    return read_run(run_dir, command)


def suffix(args) -> str:
    """The run-dir and results-file suffix of the settings trained (`-baseline`, `-kl`, or "")."""
    return f"-{args.variant}" if args.variant else ""


def prune(run_dir: Path) -> None:
    """Every checkpoint but the one `checkpoints/best` points at (about 620 MB each: 12 runs fill a disk)."""
    from rollwise.train.checkpoint import best_checkpoint, list_checkpoints

    best = best_checkpoint(run_dir)
    for ckpt in list_checkpoints(run_dir):
        if best is None or ckpt.resolve() != best.resolve():
            subprocess.run(["rm", "-rf", str(ckpt)], check=True)


def best_pointer(evals: list[dict]) -> dict:
    """`checkpoints/best` as this tree's default rule picks it from the run's eval rows (rollwise.early_stop), so
    runs written by an older rule read alike: {"metric", "step", "passed_over_steps"}."""
    from rollwise.config import EarlyStopConfig
    from rollwise.early_stop import EarlyStop

    early = EarlyStop(EarlyStopConfig(metric="eval/greedy_balanced_accuracy", mode="max", patience=0), Path("."))
    for row in evals:
        if row.get(early.cfg.metric) is not None:
            early.count(row)
    return {"metric": early.cfg.metric, "step": early.best_step, "passed_over_steps": early.collapsed_steps}


def read_run(run_dir: Path, command: list[str]) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    steps = [r for r in rows if r.get("kind") == "train"]
    acc = [(int(r["step"]), r["eval/greedy_accuracy"]) for r in evals]
    best_step, best = max(acc, key=lambda sa: (sa[1], -sa[0]))
    summary = json.loads((run_dir / "summary.json").read_text())
    last = steps[-1] if steps else {}
    pointer = best_pointer(evals)
    by_step = {int(r["step"]): r for r in evals}
    at = by_step.get(pointer.get("step"), {})
    return {"run_dir": str(run_dir), "before": acc[0][1], "best": best, "best_step": best_step,
            "final": acc[-1][1], "evals": acc, "steps": len(steps),
            # what checkpoints/best is (rollwise.early_stop: by balanced accuracy, rollwise.metrics.prior)
            "pointer_metric": pointer.get("metric"), "pointer_step": pointer.get("step"),
            "passed_over_steps": pointer.get("passed_over_steps"),
            "pointer_accuracy": at.get("eval/greedy_accuracy"),
            "balanced": [(int(r["step"]), r.get("eval/greedy_balanced_accuracy")) for r in evals],
            "reply_mode_frac": [(int(r["step"]), r.get("eval/greedy_answer_mode_frac")) for r in evals],
            "reference_mode_frac": evals[0].get("eval/reference_mode_frac"),
            "answer_mode_frac_last": last.get("rollout/answer_mode_frac"),
            "answer_mode_frac_first": steps[0].get("rollout/answer_mode_frac") if steps else None,
            "train_accuracy_last": last.get("reward/accuracy"),
            "rl_wall_s": sum(r.get("perf/step_s", 0.0) for r in steps), "best_pointer": summary.get("best"),
            "warnings": summary.get("warnings", []), "command": " ".join(command[2:])}


def analyse(spec, run_dirs: list[Path], args) -> dict:
    """Greedy answers of the starting model and of each run's best checkpoint on the held-out problems, split by
    whether the reference is the held-out set's most common answer: a rise made of the majority answer alone is
    the prior, not the skill (BENCHMARKS.md, letter_counting)."""
    name = spec[0]
    out_dir = args.runs_dir / "answers"
    out_dir.mkdir(exist_ok=True)
    eval_args = [a for a in task_overrides(spec) if not a.startswith(("data.task=", "rollout.max_new_tokens="))]
    targets = {"start": ["--model", "smollm2-135m-instruct", "--task", f"reasoning_gym:{name}",  # as the runs: auto
                         "--max-new-tokens", str(spec[4]), "model.dtype=auto", *eval_args]}
    targets.update({d.name: ["--model", str(d), "--best"] for d in run_dirs})
    found = {}
    for label, target in targets.items():
        out = out_dir / f"{name}-{label}.jsonl"
        if args.fresh or not out.exists():
            subprocess.run([sys.executable, "-m", "rollwise.cli", "eval", *target, "--n", str(args.eval_n), "--out",
                            str(out)], check=True, cwd=REPO, capture_output=True, text=True)
        found[label] = split_by_majority(out)
    return found


def split_by_majority(answers_file: Path) -> dict:
    rows = [json.loads(line) for line in answers_file.read_text().splitlines() if line.strip()]
    greedy = [r for r in rows if r["mode"] == "greedy"]
    refs = [str(r["answer"]).strip().lower() for r in greedy]
    majority = max(set(refs), key=refs.count)
    others = [r for r, ref in zip(greedy, refs) if ref != majority]
    said = [_answer(r["final"], ref) == majority for r, ref in zip(greedy, refs)]
    return {"n": len(greedy), "accuracy": sum(r["correct"] for r in greedy) / len(greedy), "majority": majority,
            "majority_share_of_references": refs.count(majority) / len(refs),
            "accuracy_not_majority": sum(r["correct"] for r in others) / max(1, len(others)),
            "replies_majority_frac": sum(said) / len(said)}


def _answer(text: str, reference: str) -> str:
    """The answer the dataset's reward reads from a reply (its tag, else its lenient fallback), lowercased."""
    from rollwise.rewards.reasoning_gym import extract_answer

    answer, _ = extract_answer(str(text), reference)
    return str(answer).strip().lower() if answer is not None else ""


def table(results: dict) -> str:
    lines = ["| task | seed | greedy before | highest (step) | final | balanced before -> at checkpoints/best (step) "
             "-> final | greedy acc at checkpoints/best | held-out replies on one answer, before -> final "
             "(references) | answer_mode_frac first -> last | RL time |", "|" + "---|" * 10]
    for name, per_seed in results.items():
        for seed, r in per_seed.items():
            mode = (f"{r['answer_mode_frac_first']:.2f} -> {r['answer_mode_frac_last']:.2f}"
                    if r.get("answer_mode_frac_last") is not None else "-")
            bal, pointer, share = r.get("balanced") or [], r.get("pointer_step"), r.get("reply_mode_frac") or []
            at = dict(bal).get(pointer)
            balanced = (f"{bal[0][1]:.2f} -> {at:.2f} ({pointer}) -> {bal[-1][1]:.2f}"
                        if bal and at is not None else "-")
            replies = (f"{share[0][1]:.2f} -> {share[-1][1]:.2f} ({r['reference_mode_frac']:.2f})"
                       if share and share[0][1] is not None else "-")
            point_acc = f"{r['pointer_accuracy']:.2f}" if r.get("pointer_accuracy") is not None else "-"
            lines.append(f"| {name} | {seed} | {r['before']:.2f} | {r['best']:.2f} ({r['best_step']}) | "
                         f"{r['final']:.2f} | {balanced} | {point_acc} | {replies} | {mode} | {r['rl_wall_s']:.0f} s |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.baseline:
        args.variant = "baseline"
    by_name = {t[0]: t for t in DEVSET}
    unknown = [name for name in args.tasks.split(",") if name not in by_name]
    if unknown:
        raise SystemExit(f"--tasks: unknown {unknown}; the development set: {', '.join(by_name)}")
    chosen = [by_name[name] for name in args.tasks.split(",")]  # in the order given
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    if args.scan:
        for spec in chosen:
            r = scan(spec, args)
            print(f"{spec[0]}: greedy {r['greedy_accuracy']:.2f}, sampled {r['sampled_accuracy']:.2f}", flush=True)
        return 0
    start, results = time.time(), {}
    for spec in chosen:
        for seed in (int(s) for s in args.seeds.split(",")):
            results.setdefault(spec[0], {})[seed] = r = train(spec, seed, args)
            print(f"{spec[0]} seed {seed}: {r['before']:.2f} -> best {r['best']:.2f} (step {r['best_step']}), "
                  f"final {r['final']:.2f}", flush=True)
    from rollwise.perf import cpu_model_name

    if args.analyse:
        seeds = [int(x) for x in args.seeds.split(",")]
        analysis = {spec[0]: analyse(spec, [args.runs_dir / f"{spec[0]}-s{seed}{suffix(args)}" for seed in seeds],
                                     args)
                    for spec in chosen}
        for name, per in analysis.items():
            for label, a in per.items():
                print(f"{name} {label}: greedy {a['accuracy']:.2f}, on the {a['n'] - round(a['majority_share_of_references'] * a['n'])} "
                      f"items whose answer is not {a['majority']!r}: {a['accuracy_not_majority']:.2f}; replies "
                      f"{a['majority']!r}: {a['replies_majority_frac']:.2f}", flush=True)
    path = REPO / "benchmarks" / "results" / f"task_devset{suffix(args).replace('-', '_')}.json"
    before = json.loads(path.read_text()) if path.exists() else {}
    earlier = before.get("results", {})
    for name, per_seed in results.items():  # seeds run in separate invocations land in one file
        earlier.setdefault(name, {}).update({str(seed): r for seed, r in per_seed.items()})
    kept = {key: before[key] for key in ("analysis", "analysis_note") if key in before and not args.analyse}
    out = {"results": earlier, **({"analysis": analysis} if args.analyse else kept), "cpu": cpu_model_name(), "threads": os.environ.get("ROLLWISE_THREADS"),
           "variant": args.variant, "settings": VARIANTS.get(args.variant or "", []), "steps": args.steps, "wall_s_last_invocation": time.time() - start}
    path.write_text(json.dumps(out, indent=1))
    print(table(earlier))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
