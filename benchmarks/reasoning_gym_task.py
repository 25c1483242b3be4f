"""A reasoning-gym task learned by the embedded model: needle_haystack, before and after GRPO, two seeds (issue 22).

Trains `recipes/reasoning_gym.toml` (SmolLM2-135M-Instruct, 3-5 statements "Ranolph likes origami." and the
question "Who likes origami?") once per seed, then evaluates the starting model and every trained run on the
same `--eval-n` held-out prompts with `rollwise eval --out` (greedy and one sample at 0.7, the recipe's stops).
The score is reasoning-gym's own `score_answer`.

An accuracy alone cannot tell retrieval from a prior: a policy that always names the first statement's subject
is right whenever the answer is that name (about a quarter of the items). So each evaluation is also split by
where the answer stands: accuracy on the items whose answer is the first name and on all the others, how often
the reply is the first name, and how often it is any name of the text.

    python benchmarks/reasoning_gym_task.py [--seeds 0,1] [--eval-n 200] [--runs-dir runs/rg-bench] [--fresh]

Writes benchmarks/results/reasoning_gym_task.json and prints the Markdown table BENCHMARKS.md quotes. A run
directory that already holds `summary.json` is read, not trained again (`--fresh` retrains).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "reasoning_gym.toml"
BASE_MODEL = "smollm2-135m-instruct"


def eval_overrides() -> list[str]:
    """The recipe's task settings as `rollwise eval` arguments (so the base model is asked exactly as the runs)."""
    cfg = tomllib.loads(RECIPE.read_text())
    options = ", ".join(f"{k} = {json.dumps(v)}" for k, v in cfg["data"]["options"].items())
    return ["--task", cfg["data"]["task"], "--max-new-tokens", str(cfg["rollout"]["max_new_tokens"]),
            "--temperature", str(cfg["eval"]["temperature"]), f"data.options={{{options}}}",
            f"data.system_prompt={cfg['data']['system_prompt']}", f"rollout.stop={json.dumps(cfg['rollout']['stop'])}"]


def train(seed: int, run_dir: Path, fresh: bool) -> list[str]:
    command = [sys.executable, "-m", "rollwise.cli", "train", str(RECIPE), "--run-dir", str(run_dir),
               f"train.seed={seed}", "run.save_every_steps=0", "run.console=false", "run.report=false"]
    if fresh or not (run_dir / "summary.json").exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return command


def evaluate(model: str, out: Path, eval_n: int) -> dict:
    command = [sys.executable, "-m", "rollwise.cli", "eval", "--model", model, "--n", str(eval_n), "--out", str(out),
               *eval_overrides()]
    done = subprocess.run(command, check=True, cwd=REPO, capture_output=True, text=True)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), **by_position(out)}


def subjects(question: str) -> list[str]:
    """The subject (first word) of each statement of a needle_haystack question, in order."""
    text = question.split("\n")[0]
    return [s.split()[0] for s in re.split(r"(?<=\.) ", text) if s.strip()]


def by_position(out: Path) -> dict:
    """Greedy accuracy split by where the answer stands, and what the replies name (see the module docstring)."""
    greedy = [r for r in map(json.loads, out.read_text().splitlines()) if r["mode"] == "greedy"]
    names = [subjects(r["prompt"]) for r in greedy]
    first = [r for r, n in zip(greedy, names) if n[0] == r["answer"]]
    other = [r for r, n in zip(greedy, names) if n[0] != r["answer"]]

    def acc(rows):
        return round(sum(bool(r["correct"]) for r in rows) / max(1, len(rows)), 3)

    return {"items_first": len(first), "acc_first": acc(first), "items_other": len(other), "acc_other": acc(other),
            "says_first": round(sum(r["final"].strip() == n[0] for r, n in zip(greedy, names)) / len(greedy), 3),
            "says_a_name": round(sum(r["final"].strip() in n for r, n in zip(greedy, names)) / len(greedy), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--eval-n", type=int, default=200)
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "rg-bench")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "reasoning_gym_task.json")
    args = parser.parse_args()
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    rows = [{**evaluate(BASE_MODEL, args.runs_dir / "start.jsonl", args.eval_n), "model": "start"}]
    for seed in map(int, args.seeds.split(",")):
        run_dir = args.runs_dir / f"seed{seed}"
        command = train(seed, run_dir, args.fresh)
        summary = json.loads((run_dir / "summary.json").read_text())
        row = evaluate(str(run_dir), args.runs_dir / f"seed{seed}.jsonl", args.eval_n)
        rows.append({**row, "model": f"seed {seed}", "train_command": "python " + " ".join(command[1:]),
                     "wall_s": round(summary["wall_s"], 1)})
        print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print("| model | greedy acc | sampled acc | answer = 1st name: acc | other items: acc | replies the 1st name "
          "| replies a name of the text |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['greedy_accuracy']:.3f} | {r['sampled_accuracy']:.3f} | {r['acc_first']:.3f} "
              f"({r['items_first']}) | {r['acc_other']:.3f} ({r['items_other']}) | {r['says_first']:.2f} "
              f"| {r['says_a_name']:.2f} |")


if __name__ == "__main__":
    main()
