"""Rollout throughput: the rollwise engine against `model.generate` on the same requests.

64 sequences (8 arithmetic prompts x 8 samples, as in a GRPO step), temperature 1.0, `max_new_tokens` 64,
embedded SmolLM2-135M-Instruct. Sides alternate (A B A B ...) after a warm-up; medians and their ratio are
reported, with the ceiling implied by the measured matmul peak (model FLOPs per generated token).

    python benchmarks/rollout.py [--repeats 3] [--precisions fp32,bf16] [--out benchmarks/results/rollout.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rollwise.config import DataConfig
from rollwise.data import PromptEncoder, build_prompt_source
from rollwise.generate import TorchEngine
from rollwise.hardware import configure_allocator, configure_threads
from rollwise.models import load_model, model_info
from rollwise.perf import FlopCounter, matmul_peak_gflops
from rollwise.types import GenerationRequest, SamplingParams

SYSTEM = "Solve the arithmetic problem. End your reply with: The answer is N."
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def prompts(tokenizer, n_prompts: int) -> list[list[int]]:
    source = build_prompt_source(DataConfig(), seed=0)
    encoder = PromptEncoder(tokenizer, SYSTEM, 256)
    return [encoder.encode(source.train_prompt(i)) for i in range(n_prompts)]


def run_engine(engine: TorchEngine, ids: list[list[int]], samples: int, max_new_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    reqs = [GenerationRequest(i, ids[i // samples], params) for i in range(len(ids) * samples)]
    start = time.perf_counter()
    results = engine.generate(reqs)
    return time.perf_counter() - start, sum(len(r.response_ids) for r in results)


def run_hf(model, tokenizer, ids: list[list[int]], samples: int, max_new_tokens: int) -> tuple[float, int]:
    rows = [p for p in ids for _ in range(samples)]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad)
    seconds = time.perf_counter() - start
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    tokens = 0
    for row in out[:, width:].tolist():  # real tokens: up to and including the first EOS
        tokens += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return seconds, tokens


def ceiling_tokens_per_s(info: dict, peak_gflops: float, mean_context: float) -> float:
    flops = FlopCounter(info).forward(1, mean_context, 1)  # one generated token: body + attention + LM head
    return peak_gflops * 1e9 / flops


def measure(precision: str, repeats: int, samples: int, n_prompts: int, max_new_tokens: int) -> dict:
    policy, tokenizer = load_model("smollm2-135m-instruct", dtype=torch.float32)
    dtype = DTYPES[precision]
    engine = TorchEngine(policy, tokenizer, dtype=dtype, max_batch_size=n_prompts * samples)
    hf = policy.to(dtype).eval()
    ids = prompts(tokenizer, n_prompts)
    run_engine(engine, ids, samples, max_new_tokens)  # warm-up
    run_hf(hf, tokenizer, ids[:2], 2, 8)
    sides = {"rollwise": [], "generate": []}
    for _ in range(repeats):  # alternate A B A B
        sides["rollwise"].append(run_engine(engine, ids, samples, max_new_tokens))
        sides["generate"].append(run_hf(hf, tokenizer, ids, samples, max_new_tokens))
    peak = matmul_peak_gflops(dtype)
    mean_prompt = sum(len(p) for p in ids) / len(ids)
    out = {"precision": precision, "sequences": n_prompts * samples, "peak_gflops": peak}
    for side, runs in sides.items():
        rates = [tokens / seconds for seconds, tokens in runs]
        out[side] = {"tokens_per_s_median": statistics.median(rates), "tokens_per_run": [t for _, t in runs],
                     "seconds": [round(s, 2) for s, _ in runs]}
    mean_len = statistics.mean(t for _, t in sides["rollwise"]) / (n_prompts * samples)
    out["ceiling_tokens_per_s"] = ceiling_tokens_per_s(model_info(policy), peak, mean_prompt + mean_len / 2)
    out["speedup"] = out["rollwise"]["tokens_per_s_median"] / out["generate"]["tokens_per_s_median"]
    out["rollwise_pct_of_ceiling"] = 100 * out["rollwise"]["tokens_per_s_median"] / out["ceiling_tokens_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/rollout.json")
    args = parser.parse_args()
    configure_allocator()
    configure_threads(0)
    results = [measure(p, args.repeats, args.samples, args.prompts, args.max_new_tokens)
               for p in args.precisions.split(",")]
    print(f"{'precision':9} {'rollwise tok/s':>14} {'generate tok/s':>14} {'speedup':>8} {'ceiling tok/s':>13} {'% ceiling':>9}")
    for r in results:
        print(f"{r['precision']:9} {r['rollwise']['tokens_per_s_median']:14.0f} {r['generate']['tokens_per_s_median']:14.0f} "
              f"{r['speedup']:7.2f}x {r['ceiling_tokens_per_s']:13.0f} {r['rollwise_pct_of_ceiling']:8.1f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
