"""The Train stage alone at the default recipe's shape: time, tokens/s, MFU, and where the time goes.

    python benchmarks/train_step.py                          # this tree: median trainer step, tokens/s, MFU
    python benchmarks/train_step.py --profile                # + torch.profiler's top operators by self time
    python benchmarks/train_step.py --a /tree/before --b .   # two trees side by side (A B A B ...), ratio
    python benchmarks/train_step.py --a . --b . --b-set compile=true   # one tree against itself with a setting

The batch is synthetic but shaped like the default recipe's (recipes/quickstart.toml): 8 prompts x 8 responses,
prompts of `--prompt-tokens` tokens, response lengths drawn uniformly from [`--min-response`, `--max-response`]
(seeded: both trees get the same batch), advantages of both signs, the embedded SmolLM2-135M-Instruct, PPO-clip
GRPO, KL off, `train.precision` as given. Only `Trainer.step` is timed (micro-batching, forward, backward,
optimizer step); the first `--warmup` steps are left out. MFU is model FLOPs (6 x matmul parameters x real
tokens + attention + LM head on response tokens, `rollwise.perf.FlopCounter`) over the measured matmul peak of
the precision used on this machine's threads (`rollwise.perf.matmul_peak_gflops`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, help="first tree (side-by-side mode)")
    p.add_argument("--b", type=Path, default=ROOT, help="second tree (default: this one)")
    p.add_argument("--repeats", type=int, default=3, help="side-by-side: runs per tree, alternating")
    p.add_argument("--steps", type=int, default=4, help="measured trainer steps per run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=60)
    p.add_argument("--min-response", type=int, default=12)
    p.add_argument("--max-response", type=int, default=48)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--set", action="append", default=[], help="extra train.KEY=VALUE (both trees)")
    p.add_argument("--b-set", action="append", default=[], help="side by side: extra train.KEY=VALUE for tree b "
                   "only (one tree against itself with a setting: --a . --b . --b-set compile=true)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top operators")
    p.add_argument("--json", action="store_true", help="one JSON line (used by the side-by-side mode)")
    return p.parse_args(argv)


def synthetic_samples(args, vocab: int) -> list:
    import random

    from rollwise.types import Prompt, Sample, Status

    rng = random.Random(0)
    samples = []
    for g in range(args.prompts):
        prompt_ids = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
        for _ in range(args.samples):
            n = rng.randint(args.min_response, args.max_response)
            s = Sample(prompt=Prompt(uid=str(g), messages=[]), prompt_ids=prompt_ids,
                       response_ids=[rng.randrange(100, vocab) for _ in range(n)],
                       behaviour_logprobs=[-rng.uniform(0.0, 3.0) for _ in range(n)], loss_mask=[1] * n,
                       status=Status.COMPLETED, group_id=g)
            s.advantage = rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5)
            samples.append(s)
    return samples


def run_here(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from rollwise.config import AlgoConfig, TrainConfig
    from rollwise.models.resolve import load_model
    from rollwise.perf import FlopCounter, matmul_peak_gflops
    from rollwise.train.trainer import Trainer, use_bf16

    model, tokenizer = load_model("smollm2-135m-instruct")
    extra = dict(kv.split("=", 1) for kv in args.set)
    train_cfg = TrainConfig(steps=100, lr=2e-5, precision=args.precision,
                            micro_batch_tokens=args.micro_batch_tokens, **{k: json.loads(v) for k, v in extra.items()})
    algo_cfg = AlgoConfig(advantage="grpo", loss="ppo_clip", clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    trainer = Trainer(model, train_cfg, algo_cfg, pad_id=tokenizer.pad_token_id, max_new_tokens=args.max_response)
    samples = synthetic_samples(args, model.config.vocab_size)
    times, warmup_s, metrics = [], [], {}
    for k in range(args.warmup + args.steps):
        start = time.perf_counter()
        metrics = trainer.step(samples)
        (times if k >= args.warmup else warmup_s).append(time.perf_counter() - start)
    if args.profile:
        profile(trainer, samples)
    cfg = model.config
    head = cfg.vocab_size * cfg.hidden_size
    params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n) + head
    counter = FlopCounter({"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "params_matmul": params,
                           "layers": cfg.num_hidden_layers})
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)  # one row per sample (plain layout)
    real = metrics["train/tokens"]
    responses = sum(len(s.response_ids) for s in samples)
    context = tokens / len(samples)
    flops = counter.train(real, responses, context)
    dtype = torch.bfloat16 if use_bf16(args.precision, "cpu") else torch.float32
    median = statistics.median(times)
    peak = matmul_peak_gflops(dtype, args.threads)
    return {"median_step_s": median, "times_s": times, "warmup_s": warmup_s, "real_tokens": real, "response_tokens": responses,
            "tokens_per_s": real / median, "model_gflop": flops / 1e9, "gflops": flops / median / 1e9,
            "peak_gflops": peak, "mfu_measured": flops / median / 1e9 / peak if peak else None,
            "dtype": str(dtype).replace("torch.", ""), "padding_eff": metrics.get("perf/train_padding_eff"),
            "cpu": _cpu(), "torch": torch.__version__}


def profile(trainer, samples) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(samples)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)




def _cpu() -> str:
    """The CPU's model name (rollwise.perf's, or the older tree's /proc/cpuinfo line when it has none)."""
    try:
        from rollwise.perf import cpu_model_name
    except ImportError:  # a tree from before the function (side-by-side runs import the other tree)
        return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "unknown CPU")
    return cpu_model_name()


def side_by_side(args) -> dict:
    forwarded = [a for a in sys.argv[1:] if a not in ("--profile",)]
    skip = {"--a", "--b", "--repeats", "--b-set"}
    inner, it = [], iter(forwarded)
    for a in it:
        if a in skip:
            next(it, None)
        elif not any(a.startswith(s + "=") for s in skip):
            inner.append(a)
    results: dict[str, list[dict]] = {"a": [], "b": []}
    for repeat in range(args.repeats):
        for side in ("a", "b"):
            tree = getattr(args, side).resolve()
            env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
            extra = [x for kv in args.b_set for x in ("--set", kv)] if side == "b" else []
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *inner, *extra, "--json"], env=env,
                                 cwd=tree, check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            results[side].append(row)
            print(f"{side} run {repeat + 1}: median {row['median_step_s']:.3f} s, {row['tokens_per_s']:.0f} tok/s",
                  flush=True)
    med = {s: statistics.median(t for r in rows for t in r["times_s"]) for s, rows in results.items()}
    last = {s: rows[-1] for s, rows in results.items()}
    return {"median_step_s": med, "ratio_a_over_b": med["a"] / med["b"],
            "first_step_s": {s: statistics.median(r["warmup_s"][0] for r in rows if r.get("warmup_s"))
                             if any(r.get("warmup_s") for r in rows) else None for s, rows in results.items()},
            "tokens_per_s": {s: last[s]["real_tokens"] / med[s] for s in med},
            "mfu_measured": {s: last[s]["model_gflop"] / med[s] / last[s]["peak_gflops"] for s in med},
            "peak_gflops": last["b"]["peak_gflops"], "dtype": last["b"]["dtype"], "cpu": last["b"]["cpu"],
            "trees": {"a": str(args.a), "b": str(args.b)}, "b_set": args.b_set}


def main(argv=None) -> int:
    args = parse_args(argv)
    result = side_by_side(args) if args.a is not None else run_here(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
