"""Scale-out paths on this machine, side by side: rollout engines, trainer backends, LoRA (docs/scale.md).

Each variant is one `rollwise train` of the quickstart recipe in its own process, one after another (never two
at once), same seed. Needs the extras: `make scale`.

    python benchmarks/scale.py engines [--steps 20] [--eval-n 200]   # torch vs vllm engine, fp32 and bf16
    python benchmarks/scale.py raw_vllm                              # rollwise's vLLM engine vs raw vllm.LLM
    python benchmarks/scale.py fsdp [--steps 5]                      # local trainer vs FSDP2 on 2 gloo ranks
    python benchmarks/scale.py lora [--steps 20] [--eval-n 200]      # LoRA rank 16 (full = engines' torch_bf16)
    python benchmarks/scale.py lora_pair                             # LoRA rank 16 and full fine-tuning

Figures: rollout tok/s = sampled tokens / generation wall time (`perf/rollout_tokens_per_s`, mean over steps);
step time = mean `perf/step_s`; held-out accuracy = `eval/*_accuracy` on `eval.n` held-out prompts at the end;
memory = peak RSS of each process of the run (sampled every 0.2 s: trainer ranks and engine processes apart).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "quickstart.toml")
RESULTS = REPO / "benchmarks" / "results"

SUITES = {
    "engines": {
        "torch_fp32": ["rollout.engine=torch", "model.dtype=float32"],
        "vllm_fp32": ["rollout.engine=vllm", "model.dtype=float32"],
        "torch_bf16": ["rollout.engine=torch", "model.dtype=bfloat16"],
        "vllm_bf16": ["rollout.engine=vllm", "model.dtype=bfloat16"],
    },
    "fsdp": {
        "local": ["train.backend=local"],
        "fsdp2_2ranks": ["train.backend=fsdp2", "train.world_size=2"],
    },
    "lora": {  # full fine-tuning at the same settings is the engines suite's torch_bf16 (quickstart defaults here)
        "lora_r16": ["lora.rank=16", "lora.alpha=32", "train.lr=2e-4"],
    },
    "lora_pair": {  # both side by side, when the time is there
        "full": [],
        "lora_r16": ["lora.rank=16", "lora.alpha=32", "train.lr=2e-4"],
    },
}


class PeakMemory:
    """Peak RSS (GiB) of a process and each of its descendants, polled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.root = psutil.Process(pid)
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(every_s,), daemon=True)
        self._thread.start()

    def _poll(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            for proc in procs:
                try:
                    name = " ".join(proc.cmdline()[1:4])[:60] or proc.name()
                    rss = proc.memory_info().rss / 2**30
                except psutil.Error:
                    continue
                key = f"{proc.pid}:{name}"
                self.peaks[key] = max(self.peaks.get(key, 0.0), rss)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {k: round(v, 2) for k, v in sorted(self.peaks.items(), key=lambda kv: -kv[1])[:6]}


def train(run_dir: Path, overrides: list[str]) -> dict:
    """One quiet `rollwise train` of the quickstart; its rows, wall time and per-process peak memory."""
    cmd = [sys.executable, "-m", "rollwise.cli", "train", RECIPE, "--run-dir", str(run_dir), "run.console=false",
           "run.report=false", "run.samples_logged_per_step=0", "run.save_every_steps=0", *overrides]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(run_dir.with_suffix(".log"), "w"))
    memory = PeakMemory(proc.pid)
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: see {run_dir.with_suffix('.log')}")
    peaks = memory.stop()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"wall_s": time.perf_counter() - start, "rows": rows, "peak_rss_gb": peaks}


def _mean(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(values) / len(values) if values else None


def summarise(name: str, result: dict, run_dir: Path) -> dict:
    trains = [r for r in result["rows"] if r["kind"] == "train"]
    evals = [r for r in result["rows"] if r["kind"] == "eval"]
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))
    out = {
        "variant": name, "steps": len(trains), "wall_s": round(result["wall_s"], 1),
        "rollout_tok_s": _mean(trains, "perf/rollout_tokens_per_s"), "step_s": _mean(trains, "perf/step_s"),
        "rollout_s": _mean(trains, "perf/rollout_s"), "train_s": _mean(trains, "perf/train_s"),
        "sync_s": _mean(trains, "perf/time/sync_s"), "sync_logprob_max_abs_diff":
            max((r.get("sync/logprob_max_abs_diff") or 0.0) for r in trains) if trains else None,
        "mismatch_abs_diff_mean": _mean(trains, "mismatch/logprob_abs_diff_mean"),
        "peak_rss_gb": result["peak_rss_gb"],
        "checkpoint_mb": round(sum(f.stat().st_size for f in ckpt[-1].rglob("*") if f.is_file()) / 2**20, 1)
        if ckpt else None,
    }
    for key in ("eval/greedy_accuracy", "eval/sampled_accuracy"):
        if evals:
            out[key.split("/")[1] + "_before"] = evals[0].get(key)
            out[key.split("/")[1] + "_after"] = evals[-1].get(key)
    return out


def run_suite(suite: str, steps: int, eval_n: int, out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    table = []
    for name, overrides in SUITES[suite].items():
        run_dir = out_dir / name
        extra = [f"train.steps={steps}", f"eval.n={eval_n}", "eval.every_steps=0"]
        row = summarise(name, train(run_dir, [*overrides, *extra]), run_dir)
        print(json.dumps(row), flush=True)
        table.append(row)
    return table


def raw_vllm(dtype: str, out_dir: Path) -> dict:
    """The quickstart's first-step requests (8 prompts x 8 samples, 48 tokens, temperature 1) through raw
    `vllm.LLM.generate` and through rollwise's `VLLMEngine`, same engine settings: tokens/s of each."""
    import torch

    
    from rollwise.data import PromptEncoder, build_prompt_source
    from rollwise.generate.factory import engine_dtype
    from rollwise.models.weights_folder import write_initial_weights
    from rollwise.generate.vllm_engine import VLLMEngine
    from rollwise.models import load_model
    from rollwise.generate.groups import sampling_params
    from rollwise.types import GenerationRequest

    cfg = load(RECIPE, [f"model.dtype={dtype}"])
    model, tok = load_model(cfg.model.name, dtype=torch.float32)
    folder = write_initial_weights(model, tok, out_dir / "raw_vllm")
    source = build_prompt_source(cfg.data, cfg.train.seed)
    encoder = PromptEncoder(tok, cfg.data.system_prompt, cfg.data.max_prompt_tokens)
    prompts = [encoder.encode(source.train_prompt(i)) for i in range(cfg.rollout.prompts_per_step)]
    params = sampling_params(cfg.rollout)
    engine = VLLMEngine(folder, tok, dtype=engine_dtype(dtype), max_batch_size=cfg.rollout.max_batch_size,
                        seed=0, max_model_len=512)
    requests = [GenerationRequest(i * 8 + j, ids, params) for i, ids in enumerate(prompts) for j in range(8)]
    engine.generate(requests[:8])  # warm-up
    start = time.perf_counter()
    results = engine.generate(requests)
    ours_s = time.perf_counter() - start
    ours_tokens = sum(len(r.response_ids) for r in results)
    from vllm import SamplingParams, TokensPrompt

    raw = engine.llm  # the same vllm.LLM, called directly
    raw_params = SamplingParams(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, logprobs=0,
                                seed=None)
    start = time.perf_counter()
    outs = raw.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts for _ in range(8)], raw_params,
                        use_tqdm=False)
    raw_s = time.perf_counter() - start
    raw_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    engine.close()
    return {"dtype": dtype, "rollwise_tok_s": ours_tokens / ours_s, "raw_vllm_tok_s": raw_tokens / raw_s,
            "ratio": (ours_tokens / ours_s) / (raw_tokens / raw_s), "rollwise_tokens": ours_tokens,
            "raw_tokens": raw_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=[*SUITES, "raw_vllm"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-n", type=int, default=200)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-scale")
    args = parser.parse_args()
    if args.suite == "raw_vllm":
        table = [raw_vllm(d, args.out) for d in ("float32", "bfloat16")]
        for row in table:
            print(json.dumps(row), flush=True)
    else:
        table = run_suite(args.suite, args.steps, args.eval_n, args.out / args.suite)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"scale_{args.suite}.json").write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
