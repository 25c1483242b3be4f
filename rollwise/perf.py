"""FLOP accounting and the machine's measured matrix-multiply peak, for MFU figures.

FLOPs per token of a decoder (see MEASURING.md): forward 2 * body params + attention 4 * layers * hidden *
context; the LM head (2 * vocab * hidden) only where logits are needed. Backward costs twice the forward.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

PEAK_FILE = "matmul_peak.json"


def _cache_file() -> Path:
    return Path(os.environ.get("ROLLWISE_CACHE", Path.home() / ".cache" / "rollwise")) / PEAK_FILE


def _machine_key(dtype: torch.dtype) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}|mm+packed"


def measure_matmul_gflops(dtype: torch.dtype = torch.float32, size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a `size` x `size` matmul in `dtype` on the CPU: the median of `repeats` timed runs after a
    warm-up, for both `a @ b` and a oneDNN prepacked linear (what the engine uses); the faster one counts."""
    from rollwise.generate.packed_linear import PackedLinear

    gen = torch.Generator().manual_seed(0)  # never touch the global RNG (runs must resume identically)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    packed = PackedLinear(b, rows_hint=size)
    best = 0.0
    for matmul in (lambda: a @ b, lambda: packed(a)):
        matmul()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            matmul()
            times.append(time.perf_counter() - start)
        best = max(best, 2 * size**3 / statistics.median(times) / 1e9)
    return best


def matmul_peak_gflops(dtype: torch.dtype = torch.float32) -> float:
    """The measured matmul peak for this machine, thread count and dtype; measured once, then cached."""
    path = _cache_file()
    key = _machine_key(dtype)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = measure_matmul_gflops(dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    return float(cached[key])


class FlopCounter:
    """Model FLOPs of rollout and training work for one model.

    `body` = matmul parameters without the LM head; `head` = vocab * hidden.
    """

    def __init__(self, info: dict):
        self.head = info["vocab_size"] * info["hidden_size"]
        self.body = info["params_matmul"] - self.head
        self.attn_per_ctx = 4 * info["layers"] * info["hidden_size"]  # per token per context position

    def forward(self, tokens: float, context: float, head_tokens: float) -> float:
        """Forward FLOPs of `tokens` tokens at mean attention context `context`, logits for `head_tokens`."""
        return 2 * self.body * tokens + self.attn_per_ctx * context * tokens + 2 * self.head * head_tokens

    def rollout(self, prefill_tokens: float, generated_tokens: float, mean_context: float) -> float:
        prefill = self.forward(prefill_tokens, mean_context / 2, 0)
        return prefill + self.forward(generated_tokens, mean_context, generated_tokens)

    def train(self, tokens: float, response_tokens: float, mean_context: float, passes: float = 1.0) -> float:
        """Forward + backward (3x forward) over `tokens`, logits on `response_tokens`, `passes` times."""
        return 3 * passes * self.forward(tokens, mean_context / 2, response_tokens)


def step_perf(counter: FlopCounter, peak_gflops: float, engine_stats, samples, trained, seconds: dict[str, float],
              train_passes: float, reference: bool) -> dict[str, float]:
    """MFU of one RL step against the measured fp32 matmul peak.

    samples: every sample generated this step; trained: those the update used.
    """
    n = max(1, len(samples))
    context = sum(s.num_tokens for s in samples) / n
    rollout = counter.rollout(engine_stats.prefill_tokens, engine_stats.generated_tokens, context)
    prompts = {tuple(s.prompt_ids): len(s.prompt_ids) for s in trained}
    tokens = sum(prompts.values()) + sum(len(s.response_ids) for s in trained)  # shared prompts count once
    responses = sum(len(s.response_ids) for s in trained)
    train = counter.train(tokens, responses, context, passes=train_passes)
    if reference:
        train += counter.forward(tokens, context / 2, responses)
    peak = peak_gflops * 1e9
    rollout_s, train_s = seconds.get("rollout", 0.0), seconds.get("train", 0.0)
    return {
        "perf/rollout_mfu": rollout / max(rollout_s, 1e-9) / peak,
        "perf/train_mfu": train / max(train_s, 1e-9) / peak if trained else 0.0,
        "perf/mfu": (rollout + train) / max(sum(seconds.values()), 1e-9) / peak,
        "perf/step_tflop": (rollout + train) / 1e12,
        "perf/rollout_padding_eff": engine_stats.padding_eff,
        "perf/peak_gflops_fp32": peak_gflops,
    }
