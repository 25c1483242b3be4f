"""What a step writes: its metrics row (besides the stages' own metrics) and its samples log.

- `StageTimer`: wall time per stage, `perf/time/<stage>_s`.
- `rollout_metrics`, `perf_metrics`: lengths, tokens and rates of the step, and its time split.
- `log_samples`: a subset of the step's prompts, responses and rewards to `samples/step-N.jsonl`, with the
  method's per-sample record (teacher gap, route) and, for episodes, the whole transcript.
"""

from __future__ import annotations

import json
import resource
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from rollwise.envs.episode import transcript
from rollwise.types import Sample

# always present in a training row (null when not measured: no update this step, or no reference model)
TRAIN_KEYS = ("train/loss", "train/kl", "train/entropy", "train/clip_frac", "train/grad_norm",
              "train/nonfinite_steps", "mismatch/logprob_abs_diff_mean", "mismatch/k3")


class StageTimer:
    """Wall time per stage, reported as `perf/time/<stage>_s`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"perf/time/{k}_s": v for k, v in self.seconds.items()}


def rollout_metrics(samples: list[Sample], generated_tokens: int, generate_s: float) -> dict[str, float]:
    """Lengths of the responses completed this step; tokens sampled this step (partial responses included)
    and their rate over the engine's generation time."""
    lengths = [len(s.response_ids) for s in samples]
    n = max(1, len(samples))
    return {
        "rollout/response_len_mean": sum(lengths) / n,
        "rollout/response_len_max": float(max(lengths, default=0)),
        "rollout/truncated_frac": sum(s.status.value == "truncated" for s in samples) / n,
        "rollout/tokens": float(generated_tokens),
        "perf/rollout_tokens_per_s": generated_tokens / max(generate_s, 1e-9),
    }


def perf_metrics(row: dict[str, float], timer: StageTimer, step_s: float) -> dict[str, float]:
    """The step's time split, the trainer's token rate, this process's peak memory (and, when it uses CUDA, the
    GPU memory it allocated and reserved at most during the step)."""
    train_s = timer.seconds.get("train", 0.0)
    return {
        **timer.metrics(),
        "perf/step_s": step_s,
        "perf/rollout_s": timer.seconds.get("rollout", 0.0),
        "perf/train_s": train_s,
        "perf/train_tokens_per_s": row.get("train/tokens", 0.0) / max(train_s, 1e-9),
        "perf/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        **cuda_memory_metrics(),
    }


def cuda_memory_metrics() -> dict[str, float]:
    """`perf/cuda_peak_allocated_gb` and `perf/cuda_peak_reserved_gb` of this process since the last call (the
    peak counters are reset after reading), on the current CUDA device; {} when CUDA was never used here."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    out = {"perf/cuda_peak_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
           "perf/cuda_peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}
    torch.cuda.reset_peak_memory_stats()
    return out


def episode_record(s: Sample) -> dict:
    """The JSON-ready record of an episode: transcript, tool calls, turns, how it ended, env reward parts."""
    ep = s.episode
    return {"transcript": transcript(s), "ended_by": ep.ended_by, "turns": [list(t) for t in s.turns],
            "tool_calls": [{"name": c.name, "args": c.args, "result": c.result, "error": c.error,
                            "wall_s": c.wall_s} for c in s.tool_calls],
            "env_parts": ep.parts, "turn_parts": ep.turn_parts, "env_error": ep.error}


def log_samples(run_dir: Path, step: int, samples: list[Sample], per_prompt: int, n: int,
                method_record: Callable[[Sample], dict]) -> None:
    """Write `n` of the step's samples (every `per_prompt // 2`-th) to `run_dir/samples/step-<step>.jsonl`."""
    if n <= 0:
        return
    out = run_dir / "samples" / f"step-{step}.jsonl"
    out.parent.mkdir(exist_ok=True)
    picked = samples[:: max(1, per_prompt // 2)][:n]
    with out.open("w") as f:
        for s in picked:
            row = {"prompt": s.prompt.messages[-1]["content"], "answer": s.prompt.answer,
                   "response": s.response_text, "reward": s.reward, "status": s.status.value,
                   "error": s.reward_error, "advantage": s.advantage,
                   "policy_versions": sorted({v for _, _, v in s.version_spans}), "replayed": s.replayed}
            row.update(method_record(s))  # a method's view of the sample (teacher gap, route)
            if s.episode is not None:  # the whole transcript, tool calls and how the episode ended
                row.update(episode_record(s))
            f.write(json.dumps(row) + "\n")
