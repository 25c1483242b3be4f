"""The Sync stage's `sync/time_s` on a vLLM engine: safetensors folder (engine core in a child process) against
tensors (engine core in this process), on the embedded SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/vllm_sync.py                     # fp32, 5 timed syncs per side, alternating
    .venv/bin/python benchmarks/vllm_sync.py --reps 3 --dtype bfloat16

Both engines run at once, each started as rollwise starts it: `old` is `VLLMEngine` as it was before (engine core
in a child process, `sync.transport = "auto"` picks `safetensors`: the state dict written as a folder, then
reloaded by the worker), `new` the training engine now (`in_process`, `auto` picks `tensors`: the trainer's
tensors handed to the model's `load_weights`). Each sync goes through `rollwise.sync.WeightSync.push`, so the
figure is the metric the Sync stage writes (`trainer.policy_state()` plus the transport), and the probe check
after it must pass (`sync/logprob_max_abs_diff`). The trainer's weights change before every sync (a small
perturbation, the same on both sides); one untimed sync per side warms up, then syncs alternate old new old new.
Reported: the median of each side and new / old; then, for context, the quickstart recipe's rollout (64
sequences of at most 48 sampled tokens, 8 prompts x 8 samples at temperature 1) per side, alternating, 3 times:
where the engine core runs also changes where generation runs (`--no-generate` skips it).

Threads are chosen as a run chooses them (`rollwise.hardware.configure_threads`, re-checked by `adapt_threads`
before every timed call): an engine core in this process computes with this process's torch threads, so it
follows that choice, while a child's engine core keeps the OpenMP threads it was started with (bound to cores).
Why it matters: on a CPU that another process keeps busy, a fixed 2 threads here spin against it. On a 2-core
Xeon beside another 2-core benchmark, the in-process engine decoded 4-6 tok/s with 2 threads fixed, 40 with 1
thread and 44-51 with 2 under `OMP_WAIT_POLICY=passive`; the child, its 2 threads bound, 40-60.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "smollm2-135m-instruct"
KV_CACHE_BYTES = 128 * 2**20
QUESTIONS = ["What is 7 + 3?", "Name a colour.", "Count to five.", "What is the capital of France?",
             "Write a haiku about rain.", "Is 17 prime?", "Spell 'banana'.", "What is 12 * 12?"]


def probe_fn(model):
    """The trainer's side of the probe: fp32 log-probs of ids[1:] from the HF model as it is now."""

    def probe(ids: list[int]) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()

    return probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed syncs per side")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="engine dtype")
    parser.add_argument("--no-generate", action="store_true", help="time the syncs only")
    args = parser.parse_args()

    from rollwise.generate.vllm_engine import VLLMEngine
    from rollwise.hardware import adapt_threads, configure_threads
    from rollwise.models.resolve import load_model, resolve_model_dir
    from rollwise.perf import cpu_model_name
    from rollwise.sync import WeightSync
    from rollwise.types import GenerationRequest, SamplingParams

    dtype = getattr(torch, args.dtype)
    configure_threads(0)  # automatic, as `rollwise train` without model.threads
    model, tokenizer = load_model(MODEL)  # the trainer's policy, fp32
    folder = resolve_model_dir(MODEL)
    trainer = SimpleNamespace(has_adapter=False, policy_state=model.state_dict, probe_logprobs=probe_fn(model))
    work = Path(tempfile.mkdtemp(prefix="rollwise-vllm-sync-bench-"))
    base = {"enforce_eager": True, "kv_cache_memory_bytes": KV_CACHE_BYTES}
    engines, syncs = {}, {}
    try:
        for side, in_process in (("old", False), ("new", True)):
            start = time.perf_counter()
            engine = VLLMEngine(folder, tokenizer, dtype=dtype, max_batch_size=64, max_model_len=512,
                                options={**base, "in_process": in_process}, sync_dir=work / side)
            engines[side] = engine
            syncs[side] = WeightSync(SimpleNamespace(engine=engine), trainer, tokenizer, "auto",
                                     sync_dir=work / side)
            print(f"{side}: engine core {'here' if engine.in_process else 'in a child process'}, transport "
                  f"{syncs[side].transport.name}, started in {time.perf_counter() - start:.1f} s", flush=True)
        times: dict[str, list[float]] = {"old": [], "new": []}
        threads: list[int] = []
        gaps: dict[str, list[float]] = {"old": [], "new": []}
        generator = torch.Generator().manual_seed(0)
        for version in range(1, args.reps + 2):  # version 1: warm-up, untimed
            with torch.no_grad():  # new trainer weights, the same for both sides
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator) * 1e-3)
            for side in ("old", "new"):
                adapt_threads()
                threads.append(torch.get_num_threads())
                metrics = syncs[side].push(version)
                if version > 1:
                    times[side].append(metrics["sync/time_s"])
                    gaps[side].append(metrics["sync/logprob_max_abs_diff"])
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True) for q in QUESTIONS]
        prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
        params = SamplingParams(max_new_tokens=48, temperature=1.0, seed=0)
        requests = [GenerationRequest(i, prompts[i // 8], params) for i in range(64)]
        tok_s: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(0 if args.no_generate else 3):
            for side in ("old", "new"):
                adapt_threads()
                threads.append(torch.get_num_threads())
                start = time.perf_counter()
                results = engines[side].generate(requests)
                tok_s[side].append(sum(len(r.response_ids) for r in results) / (time.perf_counter() - start))
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    summary = {
        "cpu": cpu_model_name(), "threads": sorted(set(threads)), "dtype": args.dtype, "model": MODEL,
        "reps": args.reps, "old_sync_s": times["old"], "new_sync_s": times["new"],
        "old_median_s": old, "new_median_s": new, "new_over_old": new / old,
        "probe_max_gap": {side: max(g) for side, g in gaps.items()},
        "generate_tok_s": tok_s,
    }
    print(f"CPU: {summary['cpu']}, torch threads here {summary['threads']}, {MODEL}, engine {args.dtype}")
    print(f"sync/time_s median over {args.reps}: old (safetensors folder, child process) {old:.3f} s | "
          f"new (tensors, in process) {new:.3f} s | new / old {new / old:.3f}")
    print(f"probe gap after each sync, max: old {summary['probe_max_gap']['old']:.2e}, "
          f"new {summary['probe_max_gap']['new']:.2e}")
    if tok_s["old"]:
        print(f"rollout 64 x 48 tokens, median tok/s: old {statistics.median(tok_s['old']):.1f}, "
              f"new {statistics.median(tok_s['new']):.1f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
