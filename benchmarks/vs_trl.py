"""Step time of TRL's GRPOTrainer against rollwise on the same GRPO work, on CPU.

Both sides: the embedded SmolLM2-135M-Instruct (the HF-format directory from
`rollwise.models.resolve_model_dir`), the same prompts in the same order (4 prompts x 8 samples per
step), max 64 new tokens, temperature 1.0, top_p 1.0, a reference model with KL coefficient 0.04,
lr 1e-6, one optimizer step per RL step, every group trained (no zero-variance filtering), and the
same torch thread count.

Each precision runs in its own subprocess (accelerate keeps process-wide mixed-precision state).
Inside it both trainers are built up front, then the steps alternate: TRL step k, rollwise step k,
TRL step k+1, ... . TRL's loop is driven by `trainer.train()`; a `TrainerCallback` times each TRL
step from `on_step_begin` to `on_step_end` (generation, scoring, reference log-probs, forward,
backward and the optimizer step all happen in between) and then runs the matching rollwise step,
outside TRL's timed region. The first `--warmup-steps` steps of each side are not measured.

    python benchmarks/vs_trl.py                              # fp32 and bf16, 1 warm-up + 3 measured steps
    python benchmarks/vs_trl.py --measured-steps 1 --precisions fp32 --max-new-tokens 16   # smoke test
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO / "benchmarks" / "prompts.jsonl"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "vs_trl.json"
MODEL = "smollm2-135m-instruct"
PROMPTS_PER_STEP = 4
SAMPLES_PER_PROMPT = 8
KL_COEF = 0.04
LR = 1e-6
TEMPERATURE = 1.0
TOP_P = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured-steps", "--steps", dest="measured_steps", type=int, default=3,
                   help="measured steps per side and precision (default 3)")
    p.add_argument("--warmup-steps", type=int, default=1, help="unmeasured steps first (default 1)")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16 (default both)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generation limit (default 64)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides (default 2)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL with 'prompt' and 'answer'")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results path")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="keep TRL's default gradient checkpointing (off here by default: rollwise does none, "
                        "and it only adds recomputation)")
    p.add_argument("--worker", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measured_steps < 1 or args.warmup_steps < 0:
        p.error("--measured-steps must be >= 1 and --warmup-steps >= 0")
    args.precision_list = [x.strip() for x in args.precisions.split(",") if x.strip()]
    bad = [x for x in args.precision_list if x not in ("fp32", "bf16")]
    if bad or not args.precision_list:
        p.error(f"--precisions: unknown {bad or 'empty list'}; use fp32 and/or bf16")
    return args


# --------------------------------------------------------------------------------------------------
# Worker: one precision, both sides, alternating steps
# --------------------------------------------------------------------------------------------------


class WarningLog:
    """Collects Python warnings and transformers/trl/accelerate log warnings (and still prints them)."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def add(self, text: str) -> None:
        text = " ".join(str(text).split())[:400]
        if text not in self.messages:
            self.messages.append(text)

    def install(self) -> None:
        original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            self.add(f"{category.__name__}: {message}")
            original(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        warnings.simplefilter("default")
        log = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                log.add(f"{record.name}: {record.getMessage()}")

        for name in ("transformers", "trl", "accelerate"):
            logging.getLogger(name).addHandler(Handler(level=logging.WARNING))


def rollwise_config(args: argparse.Namespace, precision: str, model_dir: Path, total_steps: int):
    from rollwise.validate import load

    dtype, train_precision = ("bfloat16", "bf16") if precision == "bf16" else ("float32", "fp32")
    return load(None, [
        f"model.name={json.dumps(str(model_dir))}",
        f"model.dtype={dtype}",
        f"model.threads={args.threads}",
        f"data.path={json.dumps(str(Path(args.prompts).resolve()))}",
        "reward.fn=arith",  # last integer of the response == the answer
        f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
        f"rollout.samples_per_prompt={SAMPLES_PER_PROMPT}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.temperature={TEMPERATURE}",
        f"rollout.top_p={TOP_P}",
        f"algo.kl_coef={KL_COEF}",
        "algo.filter_zero_variance=false",  # train every group, as TRL does
        f"train.lr={LR}",
        f"train.precision={train_precision}",
        f"train.steps={total_steps}",
        "eval.n=0",
        "run.console=false",
        "run.report=false",
        "run.save_every_steps=0",
    ])


def trl_reward_fn(record: dict):
    """TRL reward: 1.0 when the completion's last integer equals `answer`; also counts completion tokens."""
    from rollwise.rewards import final_integer

    def last_integer_matches(prompts, completions, completion_ids, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [1.0 if final_integer(t) == int(a) else 0.0 for t, a in zip(texts, answer)]
        record["calls"] += 1
        record["completions"] += len(completion_ids)
        record["tokens"] += sum(len(ids) for ids in completion_ids)
        record["prompts"] += [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        record["rewards"] += rewards
        return rewards

    return last_integer_matches


def run_worker(args: argparse.Namespace) -> dict:
    precision = args.worker
    wlog = WarningLog()
    wlog.install()

    import torch

    torch.set_num_threads(args.threads)

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollwise.loop import rl_step
    from rollwise.models import resolve_model_dir
    from rollwise.build import open_run

    total_steps = args.warmup_steps + args.measured_steps
    model_dir = resolve_model_dir(MODEL)
    tmp = Path(tempfile.mkdtemp(prefix=f"vs_trl_{precision}_"))

    # ---- rollwise: the real run, stepped by hand with rl_step -----------------------------------------
    t0 = time.perf_counter()
    cfg = rollwise_config(args, precision, model_dir, total_steps)
    run = open_run(cfg, tmp / "rollwise")
    rollwise_build_s = time.perf_counter() - t0

    # The exact prompt sequence rollwise will train on; TRL gets the same rows in the same order.
    order = [run.source.train_prompt(i) for i in range(PROMPTS_PER_STEP * total_steps)]
    rows = [{"prompt": list(p.messages), "answer": p.answer} for p in order]

    # ---- TRL ---------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    trl_record = {"calls": 0, "completions": 0, "tokens": 0, "prompts": [], "rewards": []}
    trl_args = GRPOConfig(
        output_dir=str(tmp / "trl"),
        use_cpu=True,
        bf16=precision == "bf16",
        fp16=False,
        per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES_PER_PROMPT,
        num_generations=SAMPLES_PER_PROMPT,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        top_k=0,
        beta=KL_COEF,
        learning_rate=LR,
        max_steps=total_steps,
        shuffle_dataset=False,  # keep rollwise's order
        use_vllm=False,
        use_transformers_continuous_batching=False,
        torch_compile=False,
        gradient_checkpointing=args.trl_gradient_checkpointing,
        model_init_kwargs={"dtype": "float32"},
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )

    state: dict = {"trl": [], "rollwise": [], "logs": []}

    class Alternate(TrainerCallback):
        """Times TRL's step k, then runs (and times) rollwise's step k outside TRL's timed region."""

        def on_step_begin(self, targs, tstate, control, **kw):
            state["threads_seen_trl"] = torch.get_num_threads()
            torch.set_num_threads(args.threads)
            state["trl_gen_s"] = 0.0
            for key in ("calls", "completions", "tokens"):
                trl_record[key] = 0
            trl_record["prompts"], trl_record["rewards"] = [], []
            state["t_begin"] = time.perf_counter()

        def on_step_end(self, targs, tstate, control, **kw):
            step_s = time.perf_counter() - state["t_begin"]
            state["trl"].append({
                "step_s": step_s,
                "gen_s": state["trl_gen_s"],
                "gen_tokens": trl_record["tokens"],
                "completions": trl_record["completions"],
                "reward_calls": trl_record["calls"],
                "reward_mean": statistics.fmean(trl_record["rewards"]) if trl_record["rewards"] else None,
                "prompts": sorted(set(trl_record["prompts"])),
                "global_step": tstate.global_step,
                "threads": torch.get_num_threads(),
                "threads_at_begin": state["threads_seen_trl"],
            })
            rollwise_step()

        def on_log(self, targs, tstate, control, logs=None, **kw):
            if logs:
                state["logs"].append({"global_step": tstate.global_step, **logs})

    def rollwise_step():
        state["threads_seen_rw"] = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        start = time.perf_counter()
        row, batch = rl_step(run)
        step_s = time.perf_counter() - start
        run.writer.write(row)  # outside the timed region, as in rollwise's own loop
        state["rollwise"].append({
            "step_s": step_s,
            "gen_s": row.get("perf/rollout_s"),
            "train_s": row.get("perf/train_s"),
            "gen_tokens": int(row["rollout/tokens"]),
            "completions": sum(len(g.samples) for g in batch.generated),
            "groups_trained": row.get("filter/groups_kept"),
            "optimizer_steps": row.get("train/optimizer_steps"),
            "trained_tokens": row.get("train/tokens"),
            "reward_mean": row.get("reward/mean"),
            "prompts": sorted({g.prompt.messages[-1]["content"] for g in batch.generated}),
            "threads": torch.get_num_threads(),
            "threads_at_begin": state["threads_seen_rw"],
        })

    dataset = Dataset.from_list(rows)
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[trl_reward_fn(trl_record)],
        args=trl_args,
        train_dataset=dataset,
        callbacks=[Alternate()],
    )
    generate = trainer._generate_single_turn

    def timed_generate(*a, **kw):  # generation share of TRL's step (reported, not used for the ratio)
        start = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            state["trl_gen_s"] += time.perf_counter() - start

    trainer._generate_single_turn = timed_generate
    trl_build_s = time.perf_counter() - t0

    # Same prompt tokens on both sides: rollwise's encoder vs TRL's own chat-template call.
    tok = trainer.processing_class
    trl_ids = tok.apply_chat_template(conversation=[rows[0]["prompt"]], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"][0]
    rw_ids = run.encoder.encode(order[0])
    prompt_ids_match = list(map(int, trl_ids)) == list(rw_ids)

    torch.set_num_threads(args.threads)
    trainer.train()
    run.writer.close()
    shutil.rmtree(tmp, ignore_errors=True)

    if len(state["trl"]) != total_steps or len(state["rollwise"]) != total_steps:
        raise RuntimeError(f"expected {total_steps} steps per side, got TRL {len(state['trl'])}, "
                           f"rollwise {len(state['rollwise'])}")

    checks = {
        "prompt_token_ids_match": prompt_ids_match,
        "prompt_tokens": len(rw_ids),
        "same_prompts_each_step": all(a["prompts"] == b["prompts"] for a, b in zip(state["trl"], state["rollwise"])),
        "trl_completions_per_step": [s["completions"] for s in state["trl"]],
        "rollwise_completions_per_step": [s["completions"] for s in state["rollwise"]],
        "trl_generation_calls_per_step": [s["reward_calls"] for s in state["trl"]],
        "trl_optimizer_steps": trainer.state.global_step,
        "rollwise_optimizer_steps_per_step": [s["optimizer_steps"] for s in state["rollwise"]],
        "rollwise_groups_trained_per_step": [s["groups_trained"] for s in state["rollwise"]],
        "trl_ref_model": trainer.ref_model is not None,
        "rollwise_ref_model": run.trainer.ref_model is not None,
        "trl_accelerate_mixed_precision": str(trainer.accelerator.mixed_precision),
        "trl_logged_completion_mean_length": [l.get("completions/mean_length") for l in state["logs"]
                                              if "completions/mean_length" in l],
    }
    return {
        "precision": precision,
        "warmup_steps": args.warmup_steps,
        "measured_steps": args.measured_steps,
        "build_s": {"rollwise": rollwise_build_s, "trl": trl_build_s},
        "trl_settings": {
            "loss_type": trainer.args.loss_type,
            "beta": trainer.args.beta,
            "scale_rewards": trainer.args.scale_rewards,
            "epsilon": trainer.args.epsilon,
            "epsilon_high": trainer.args.epsilon_high,
            "optim": str(trainer.args.optim),
            "bf16": trainer.args.bf16,
            "gradient_checkpointing": trainer.args.gradient_checkpointing,
            "steps_per_generation": trainer.args.steps_per_generation,
            "generation_batch_size": trainer.args.generation_batch_size,
            "use_vllm": trainer.args.use_vllm,
            "torch_compile": trainer.args.torch_compile,
            "model_dtype": str(next(trainer.model.parameters()).dtype),
        },
        "rollwise_settings": {
            "algo": cfg.algo.model_dump(),
            "engine_dtype": cfg.model.dtype,
            "train_precision": cfg.train.precision,
            "share_prompt": cfg.train.share_prompt,
        },
        "steps": {"trl": state["trl"], "rollwise": state["rollwise"]},
        "trl_logs": state["logs"],
        "checks": checks,
        "warnings": wlog.messages,
    }


# --------------------------------------------------------------------------------------------------
# Parent: one subprocess per precision, then the table and the JSON
# --------------------------------------------------------------------------------------------------


def summarize(side_steps: list[dict], warmup: int) -> dict:
    measured = side_steps[warmup:]
    times = [s["step_s"] for s in measured]
    gen = [s["gen_s"] for s in measured if s.get("gen_s") is not None]
    return {
        "median_step_s": statistics.median(times),
        "step_s": times,
        "warmup_step_s": [s["step_s"] for s in side_steps[:warmup]],
        "gen_tokens_per_step": statistics.fmean(s["gen_tokens"] for s in measured),
        "gen_tokens": [s["gen_tokens"] for s in measured],
        "median_gen_s": statistics.median(gen) if gen else None,
    }


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("trl", "transformers", "torch", "accelerate", "datasets", "rollwise"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "rollwise"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        out["rollwise_git"] = commit + ("+uncommitted rollwise/ changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        out["rollwise_git"] = None
    return out




def print_table(results: list[dict]) -> None:
    print()
    print(f"{'precision':<10} {'side':<9} {'median_step_s':>13} {'gen_tokens/step':>16} "
          f"{'gen_s(median)':>14} {'ratio(TRL/rollwise)':>20}")
    for r in results:
        trl, rw = r["trl"], r["rollwise"]
        print(f"{r['precision']:<10} {'trl':<9} {trl['median_step_s']:>13.1f} {trl['gen_tokens_per_step']:>16.0f} "
              f"{trl['median_gen_s']:>14.1f}")
        print(f"{r['precision']:<10} {'rollwise':<9} {rw['median_step_s']:>13.1f} {rw['gen_tokens_per_step']:>16.0f} "
              f"{rw['median_gen_s']:>14.1f} {r['ratio_trl_over_rollwise']:>19.1f}x")
    print()


def run_parent(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    started = time.time()
    for precision in args.precision_list:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            worker_out = fh.name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", precision, "--worker-out", worker_out,
               "--measured-steps", str(args.measured_steps), "--warmup-steps", str(args.warmup_steps),
               "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
               "--prompts", args.prompts, "--precisions", precision]
        if args.trl_gradient_checkpointing:
            cmd.append("--trl-gradient-checkpointing")
        print(f"vs_trl: {precision}: building both trainers, then alternating TRL / rollwise steps "
              f"({args.warmup_steps} warm-up + {args.measured_steps} measured each)", flush=True)
        load_before = os.getloadavg()
        git_before = versions()["rollwise_git"]  # the code this worker imports
        try:
            subprocess.run(cmd, check=True)
            worker = json.loads(Path(worker_out).read_text())
        finally:
            os.unlink(worker_out)
        worker["loadavg_1_5_15"] = {"before": load_before, "after": os.getloadavg()}
        worker["rollwise_git_at_start"] = git_before
        trl = summarize(worker["steps"]["trl"], args.warmup_steps)
        rw = summarize(worker["steps"]["rollwise"], args.warmup_steps)
        result = {"precision": precision, "trl": trl, "rollwise": rw,
                  "ratio_trl_over_rollwise": trl["median_step_s"] / rw["median_step_s"], "worker": worker}
        results.append(result)
        c = worker["checks"]
        print(f"vs_trl: {precision}: TRL {trl['median_step_s']:.1f} s/step, rollwise {rw['median_step_s']:.1f} "
              f"s/step; same prompts each step: {c['same_prompts_each_step']}, prompt ids match: "
              f"{c['prompt_token_ids_match']}, TRL loss_type: {worker['trl_settings']['loss_type']}", flush=True)
        write_report(out, args, results, started)
    print_table(results)
    print(f"TRL loss_type (its default): {results[0]['worker']['trl_settings']['loss_type']}; "
          f"gen_s = generation time inside the step; wrote {out}")


def write_report(out: Path, args: argparse.Namespace, results: list[dict], started: float) -> None:
    from rollwise.perf import cpu_model_name

    report = {
        "benchmark": "vs_trl",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": time.time() - started,
        "machine": {"cpu": cpu_model_name(), "threads": args.threads},
        "versions": versions(),
        "setup": {
            "model": MODEL,
            "prompts": str(args.prompts),
            "prompts_per_step": PROMPTS_PER_STEP,
            "samples_per_prompt": SAMPLES_PER_PROMPT,
            "max_new_tokens": args.max_new_tokens,
            "temperature": TEMPERATURE,
            "top_p": TOP_P,
            "kl_coef": KL_COEF,
            "lr": LR,
            "warmup_steps": args.warmup_steps,
            "measured_steps": args.measured_steps,
            "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
            "timing": "TRL: on_step_begin -> on_step_end (generation included); rollwise: rollwise.loop.rl_step; "
                      "steps alternate TRL, rollwise within one process per precision",
        },
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        result = run_worker(args)
        Path(args.worker_out).write_text(json.dumps(result, indent=2, default=str))
    else:
        run_parent(args)


if __name__ == "__main__":
    main()
