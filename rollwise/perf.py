"""FLOP accounting and the machine's measured matrix-multiply peak per precision, for MFU figures.

FLOPs per token of a decoder (see MEASURING.md): forward 2 * body params + attention 4 * layers * hidden *
context; the LM head (2 * vocab * hidden) only where logits are computed. Backward costs twice the forward.
These are model FLOPs (MFU in the sense of PaLM, Chowdhery et al. 2022): recomputation (the LM head's chunked
backward) and padding are not counted as work.

The peak is measured per (CPU, torch threads, torch version, dtype) and cached in
`$ROLLWISE_CACHE/matmul_peak.json` (default `~/.cache/rollwise`); each entry records its value, the date, the
method and the thread count. `python -m rollwise.perf` re-measures it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PEAK_FILE = "matmul_peak.json"
MEASURE_SIZE = 2048  # matmul side: large enough for the kernels' full rate, ~0.1-0.5 s per run on 2 cores
BEST_OF = 5  # timed runs per kernel; the fastest counts (noise from other processes only ever slows a run)
FAR_BELOW_NOMINAL = 0.7  # a cached peak under this fraction of the conservative nominal rate is re-measured once
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_REMEASURED: set[str] = set()  # cache keys re-measured in this process because an MFU came out above 1
_MEASURED_HERE: set[str] = set()  # cache keys this process measured (not re-checked against nominal here)


# -- the measured peak -------------------------------------------------------------------------------------
def _cache_file() -> Path:
    return Path(os.environ.get("ROLLWISE_CACHE", Path.home() / ".cache" / "rollwise")) / PEAK_FILE


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_name(cpuinfo: str) -> str:
    match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return match.group(1).strip() if match else platform.processor() or platform.machine()


def cpu_model_name() -> str:
    """This machine's CPU model (/proc/cpuinfo's `model name`), for naming the CPU next to a figure."""
    return _cpu_name(_cpuinfo())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def method(size: int = MEASURE_SIZE) -> str:
    """How a cached peak was measured (entries measured another way are measured again)."""
    return f"best of {BEST_OF}, {size}^3 matmul and prepacked oneDNN linear"


def _key(dtype: torch.dtype, threads: int) -> str:
    return f"{_cpu_name(_cpuinfo())}|threads={threads}|torch={torch.__version__}|{_dtype_name(dtype)}"


@contextmanager
def _threads(n: int):
    """Run the body on `n` torch intra-op threads, then restore the previous count."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def measure_matmul_gflops(dtype: torch.dtype = torch.float32, size: int = MEASURE_SIZE,
                          repeats: int = BEST_OF) -> float:
    """GFLOP/s of a `size` x `size` x `size` matmul in `dtype` on the CPU, on the current torch threads: the
    fastest of `repeats` timed runs after a warm-up, for both `a @ b` and a oneDNN prepacked linear (what the
    engine uses); the faster kernel counts."""
    from rollwise.models.packed_linear import PackedLinear

    gen = torch.Generator().manual_seed(0)  # never touch the global RNG (runs must resume identically)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    packed = PackedLinear(b, rows_hint=size)
    fastest_s = math.inf
    for matmul in (lambda: a @ b, lambda: packed(a)):
        matmul()
        for _ in range(repeats):
            start = time.perf_counter()
            matmul()
            fastest_s = min(fastest_s, time.perf_counter() - start)
    return 2 * size**3 / fastest_s / 1e9


def nominal_gflops(dtype: torch.dtype, threads: int, cpuinfo: str | None = None) -> float | None:
    """A conservative nominal matmul rate of `threads` cores (GFLOP/s), or None when the ISA is not known.

    cores x clock x FLOP/cycle/core. The clock is the lowest one /proc/cpuinfo states (the `@ x GHz` of the
    model name, the current `cpu MHz`): turbo clocks are higher. FLOP/cycle takes the weakest implementation
    of the widest vector ISA the flags name: fp32 AVX-512 32 (16 lanes x FMA, one FMA unit or AMD Zen 4's
    2 x 256-bit; Intel parts with 2 units reach 64), AVX2 + FMA 16; bf16 AMX 512 (half the TMUL's
    theoretical 1024, which oneDNN does not reach), AVX512-BF16 64. Emulated bf16 and other ISAs: None.
    Cores count once per physical core (SMT siblings add no FMA units).
    """
    from rollwise.hardware import physical_cores

    text = _cpuinfo() if cpuinfo is None else cpuinfo
    flags_line = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    flags = set(flags_line.group(1).split()) if flags_line else set()
    if dtype == torch.float32:
        per_cycle = 32 if "avx512f" in flags else 16 if {"avx2", "fma"} <= flags else None
    elif dtype == torch.bfloat16:
        per_cycle = 512 if "amx_bf16" in flags else 64 if "avx512_bf16" in flags else None
    else:
        per_cycle = None
    clocks = [float(m) / 1000 for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)[:1]]
    clocks += [float(g) for g in re.findall(r"@\s*([\d.]+)\s*GHz", _cpu_name(text))]
    if per_cycle is None or not clocks:
        return None
    cores = min(threads, physical_cores()) if cpuinfo is None else threads
    return cores * min(clocks) * per_cycle


def _read_cache() -> dict:
    try:
        cached = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _write_entry(key: str, entry: dict) -> None:
    """Merge one entry into the cache file (read again just before: a generation process may write too)."""
    path = _cache_file()
    cached = _read_cache()
    cached[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _valid(entry, size: int) -> bool:
    return isinstance(entry, dict) and entry.get("method") == method(size) and float(entry.get("gflops", 0)) > 0


def _measure_entry(dtype: torch.dtype, threads: int, size: int, previous: dict | None) -> dict:
    """Measure on `threads` threads; keep the better of this and `previous` (same method): a peak is the best
    the machine has shown, and contention only ever lowers a measurement."""
    with _threads(threads):
        gflops = measure_matmul_gflops(dtype, size)
    if _valid(previous, size) and previous["gflops"] > gflops:
        return {**previous, "last_measured_gflops": gflops, "last_measured": _now()}
    return {"gflops": gflops, "dtype": _dtype_name(dtype), "threads": threads, "date": _now(),
            "method": method(size), "cpu": _cpu_name(_cpuinfo()), "torch": torch.__version__,
            "nominal_gflops": nominal_gflops(dtype, threads)}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def peak_entry(dtype: torch.dtype = torch.float32, threads: int | None = None, size: int = MEASURE_SIZE,
               remeasure: bool = False) -> dict:
    """The cache entry of this machine's matmul peak in `dtype` on `threads` threads (default: the current
    torch threads): measured when missing or measured another way, or with `remeasure`. A cached peak below
    `FAR_BELOW_NOMINAL` of the nominal rate (`nominal_gflops`) is re-measured once per entry, by the next
    process that reads it (then `nominal_checked` is set): a busy moment rarely ends within seconds."""
    threads = threads or torch.get_num_threads()
    key = _key(dtype, threads)
    cached = entry = _read_cache().get(key)
    if remeasure or not _valid(entry, size):
        entry = _measure_entry(dtype, threads, size, entry)
        _MEASURED_HERE.add(key)
    nominal = nominal_gflops(dtype, threads)
    if (key not in _MEASURED_HERE and nominal is not None and entry["gflops"] < FAR_BELOW_NOMINAL * nominal
            and not entry.get("nominal_checked")):
        low = entry["gflops"]
        entry = {**_measure_entry(dtype, threads, size, entry), "nominal_checked": True}
        _MEASURED_HERE.add(key)
        logger.warning("matmul peak %s on %d threads: %.0f GFLOP/s is below %.0f%% of the nominal %.0f; "
                       "re-measured: %.0f GFLOP/s (re-measure on an idle machine: python -m rollwise.perf)",
                       _dtype_name(dtype), threads, low, 100 * FAR_BELOW_NOMINAL, nominal, entry["gflops"])
    if entry is not cached:
        _write_entry(key, entry)
    return entry


def matmul_peak_gflops(dtype: torch.dtype = torch.float32, threads: int | None = None,
                       size: int = MEASURE_SIZE, remeasure: bool = False) -> float:
    """The measured matmul peak (GFLOP/s) for this machine, `threads` (default: current) and `dtype`;
    measured once, then cached (see `peak_entry`)."""
    return float(peak_entry(dtype, threads, size, remeasure)["gflops"])


CUDA_MEASURE_SIZE = 8192  # a GPU reaches its matmul rate only on large operands


def measure_cuda_matmul_gflops(dtype: torch.dtype, size: int = CUDA_MEASURE_SIZE, repeats: int = BEST_OF,
                               device: str = "cuda") -> float:
    """GFLOP/s of a `size`^3 matmul in `dtype` on the CUDA device: the fastest of `repeats` timed runs of 10
    matmuls each, after a warm-up, timed between `torch.cuda.synchronize` calls (what the GPU sustains, as the
    CPU peak is: no nominal datasheet figure)."""
    gen = torch.Generator(device=device).manual_seed(0)  # never the global RNG
    a = torch.randn(size, size, generator=gen, device=device).to(dtype)
    b = torch.randn(size, size, generator=gen, device=device).to(dtype)
    inner = 10
    a @ b
    torch.cuda.synchronize(device)
    fastest_s = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            a @ b
        torch.cuda.synchronize(device)
        fastest_s = min(fastest_s, (time.perf_counter() - start) / inner)
    return 2 * size**3 / fastest_s / 1e9


def cuda_peak_gflops(dtype: torch.dtype, remeasure: bool = False, size: int = CUDA_MEASURE_SIZE) -> float | None:
    """The current CUDA device's measured matmul peak in `dtype` (GFLOP/s), cached like the CPU's under the GPU's
    name; None without a CUDA device."""
    if not torch.cuda.is_available():
        return None
    key = f"cuda:{torch.cuda.get_device_name()}|torch={torch.__version__}|{_dtype_name(dtype)}|{size}"
    entry = _read_cache().get(key)
    if remeasure or not (isinstance(entry, dict) and float(entry.get("gflops", 0)) > 0):
        gflops = measure_cuda_matmul_gflops(dtype, size)
        if isinstance(entry, dict) and entry.get("gflops", 0) > gflops:  # the better of the two stays
            gflops = entry["gflops"]
        entry = {"gflops": gflops, "dtype": _dtype_name(dtype), "date": _now(), "gpu": torch.cuda.get_device_name(),
                 "method": f"best of {BEST_OF} x 10 {size}^3 matmuls", "torch": torch.__version__}
        _write_entry(key, entry)
    return float(entry["gflops"])


def remeasure_peaks(dtypes=("float32", "bfloat16"), threads: int | None = None,
                    size: int = MEASURE_SIZE) -> dict[str, dict]:
    """Measure the peak of each dtype (names or torch dtypes) again on `threads` (default: current) and cache
    it (the better of the new and the cached figure of the same method is kept). Returns {dtype name: entry}."""
    out = {}
    for dtype in dtypes:
        dtype = DTYPE_NAMES[dtype] if isinstance(dtype, str) else dtype
        out[_dtype_name(dtype)] = peak_entry(dtype, threads, size, remeasure=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m rollwise.perf`: re-measure the matmul peaks on the threads a run uses; print the cache."""
    from rollwise.hardware import configure_threads

    parser = argparse.ArgumentParser(prog="python -m rollwise.perf", description=main.__doc__)
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPE_NAMES),
                        help="dtype to measure (repeatable; default both)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = physical cores, as a run)")
    parser.add_argument("--size", type=int, default=MEASURE_SIZE, help="matmul side")
    args = parser.parse_args(argv)
    threads = configure_threads(args.threads)
    measured = remeasure_peaks(args.dtype or ("float32", "bfloat16"), threads, args.size)
    print(f"{_cache_file()}:")
    print(json.dumps(_read_cache(), indent=1, sort_keys=True))
    for name, entry in measured.items():
        nominal = entry.get("nominal_gflops")
        print(f"{name}: {entry['gflops']:.0f} GFLOP/s on {threads} threads"
              + (f" (conservative nominal {nominal:.0f})" if nominal else ""))
    return 0


# -- FLOPs -------------------------------------------------------------------------------------------------
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

    def rollout(self, prefill_tokens: float, decode_tokens: float, logit_rows: float, prompt_len: float,
                response_len: float) -> float:
        """Prefill of `prefill_tokens` context tokens (mean context prompt_len / 2), decode of `decode_tokens`
        fed tokens (mean context prompt_len + response_len / 2), LM head on `logit_rows` rows."""
        prefill = self.forward(prefill_tokens, prompt_len / 2, 0)
        return prefill + self.forward(decode_tokens, prompt_len + response_len / 2, logit_rows)

    def train(self, tokens: float, response_tokens: float, mean_context: float, passes: float = 1.0) -> float:
        """Forward + backward (3x forward) over `tokens`, logits on `response_tokens`, `passes` times."""
        return 3 * passes * self.forward(tokens, mean_context / 2, response_tokens)


def rollout_flops(counter: FlopCounter, stats, samples) -> float:
    """Model FLOPs the engine computed, from its counters (`EngineStats`): real prefill tokens, tokens fed to
    decode steps (one per active slot and step), LM-head rows (prefilled contexts + decode rows); attention
    context from the completed `samples`' mean prompt and response lengths."""
    n = max(1, len(samples))
    prompt_len = sum(len(s.prompt_ids) for s in samples) / n
    response_len = sum(len(s.response_ids) for s in samples) / n
    logit_rows = stats.prefill_sequences + stats.active_slot_steps
    return counter.rollout(stats.prefill_tokens, stats.active_slot_steps, logit_rows, prompt_len, response_len)


def train_flops(counter: FlopCounter, trained, train_metrics: dict) -> float:
    """Model FLOPs of the passes `Trainer.step` reports (`train/passes/*`), each over the real (unpadded)
    tokens it computed (`train/tokens` / update passes): `update` forward + backward passes (PPO epochs),
    forward-only passes for `old_logprobs` and `reference` (LM head on response tokens) and `critic` (the
    value head's hidden states, no LM head)."""
    updates = train_metrics.get("train/passes/update", 0.0)
    if not trained or not updates:
        return 0.0
    tokens = train_metrics["train/tokens"] / updates  # real tokens of one pass over the batch
    responses = sum(len(s.response_ids) for s in trained)
    context = sum(s.num_tokens for s in trained) / len(trained)
    frozen = train_metrics.get("train/passes/old_logprobs", 0.0) + train_metrics.get("train/passes/reference", 0.0)
    return (counter.train(tokens, responses, context, passes=updates)
            + frozen * counter.forward(tokens, context / 2, responses)
            + train_metrics.get("train/passes/critic", 0.0) * counter.forward(tokens, context / 2, 0))


# -- MFU of a step -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeakSpec:
    """Where and in which precision each part of a step runs, and so which measured peak it is held to.

    threads: the trainer's torch threads (in sync mode the engine's too).
    rollout_threads: async mode: the generation process's threads (None = not known yet).
    concurrent: async mode: generation runs in its own process, on its own cores, while this one trains.
    rollout_on_cpu / train_on_cpu: False where that part runs on a GPU: it is held to the GPU's own measured peak
    (`cuda_peak_gflops`; None, and MFU null, where no CUDA device is visible).
    """

    rollout_dtype: torch.dtype
    train_dtype: torch.dtype
    threads: int
    rollout_threads: int | None = None
    concurrent: bool = False
    rollout_on_cpu: bool = True
    train_on_cpu: bool = True

    def peaks(self, size: int = MEASURE_SIZE, remeasure: bool = False) -> tuple[float | None, float | None]:
        """(rollout, train) peaks in GFLOP/s; `remeasure` measures again those not re-measured in this
        process yet."""
        threads = self.rollout_threads if self.concurrent else self.threads
        rollout = self._peak(self.rollout_dtype, threads, size, remeasure) if self.rollout_on_cpu else \
            cuda_peak_gflops(self.rollout_dtype, remeasure)
        train = self._peak(self.train_dtype, self.threads, size, remeasure) if self.train_on_cpu else \
            cuda_peak_gflops(self.train_dtype, remeasure)
        return rollout, train

    @staticmethod
    def _peak(dtype: torch.dtype, threads: int | None, size: int, remeasure: bool) -> float | None:
        if not threads:
            return None
        key = f"{_key(dtype, threads)}|{size}"
        again = remeasure and key not in _REMEASURED
        if again:
            _REMEASURED.add(key)
        return matmul_peak_gflops(dtype, threads, size, remeasure=again)


MFU_KEYS = ("perf/rollout_mfu", "perf/train_mfu", "perf/mfu")


def mfu_figures(flops: dict[str, float], seconds: dict[str, float], generate_s: float,
                peaks: tuple[float | None, float | None], concurrent: bool = False) -> dict[str, float | None]:
    """MFU of one step from model FLOPs per stage (`rollout`, `train`, `filter`: the `kl_in_reward` reference
    pass, `method`: the method's own model passes, e.g. a distillation teacher's scoring) and the peaks (GFLOP/s) of the precision each runs in.

    - `perf/rollout_mfu` = rollout FLOPs / the engine's own generation seconds (`generate_s`: in async mode
      measured in the generation process) / the rollout peak (engine dtype, the engine's threads).
    - `perf/train_mfu` = train FLOPs / train-stage seconds / the train peak (trainer precision).
    - `perf/mfu` = all FLOPs / the FLOPs the machine could have done over the step: TIME-WEIGHTED peaks,
      sum over stages of seconds x that stage's peak (rollout: rollout peak; train, and filter when it ran
      the reference pass: train peak; stages without model FLOPs such as reward, replay and sync: the higher
      of the two, so idle time is never costed at the cheaper rate). Time-weighting rather than
      FLOP-weighting keeps the figure a fraction of what the step's wall time could have delivered.
      In async mode the generation process's cores add step time x rollout peak, and the trainer's own
      stages (its wait for rollouts included) count at the train peak.
    A figure whose peak is unknown (a part on a GPU) is None.
    """
    rollout_peak, train_peak = peaks
    rollout, train, filter_ = flops.get("rollout", 0.0), flops.get("train", 0.0), flops.get("filter", 0.0)
    teacher = flops.get("method", 0.0)  # the method's own model passes (a teacher's scoring), trainer precision
    out: dict[str, float | None] = dict.fromkeys(MFU_KEYS)
    if rollout_peak:
        out["perf/rollout_mfu"] = rollout / max(generate_s, 1e-9) / (rollout_peak * 1e9)
    if train_peak:
        out["perf/train_mfu"] = train / max(seconds.get("train", 0.0), 1e-9) / (train_peak * 1e9) if train else 0.0
    if rollout_peak and train_peak:
        step_s = sum(seconds.values())
        if concurrent:
            capacity = step_s * (train_peak + rollout_peak)
        else:
            idle_peak = max(rollout_peak, train_peak)
            stage_peak = {"rollout": rollout_peak, "train": train_peak, "filter": train_peak if filter_ else idle_peak,
                          "method": train_peak if teacher else idle_peak}
            capacity = sum(s * stage_peak.get(stage, idle_peak) for stage, s in seconds.items())
        out["perf/mfu"] = (rollout + train + filter_ + teacher) / max(capacity * 1e9, 1e-9)
    return out


def checked_mfu(flops: dict[str, float], seconds: dict[str, float], generate_s: float, spec: PeakSpec,
                size: int = MEASURE_SIZE, step: int | None = None) -> dict[str, float | None]:
    """`mfu_figures` with the peaks of `spec`, plus `perf/peak_gflops_{rollout,train}` and `perf/mfu_suspect`.

    An MFU above 1 means the peak is wrong (measured while the machine was busy) or the FLOPs are: the peaks
    are measured again (once per process) and the figures recomputed; if one is still above 1 it is not
    reported (None), `perf/mfu_suspect` is 1 and a warning line "MFU > 1 is a bug: ..." is logged."""
    peaks = spec.peaks(size)
    out = mfu_figures(flops, seconds, generate_s, peaks, spec.concurrent)
    if _over_one(out):
        peaks = spec.peaks(size, remeasure=True)
        out = mfu_figures(flops, seconds, generate_s, peaks, spec.concurrent)
    suspect = _over_one(out)
    if suspect:
        logger.warning("MFU > 1 is a bug: step %s %s against peaks rollout %s / train %s GFLOP/s (re-measured); "
                       "please report it with this line", step,
                       ", ".join(f"{k.removeprefix('perf/')}={v:.3g}" for k, v in out.items() if v is not None),
                       _fmt(peaks[0]), _fmt(peaks[1]))
        out = {k: None if v is not None and v > 1 else v for k, v in out.items()}
    out["perf/peak_gflops_rollout"], out["perf/peak_gflops_train"] = peaks
    out["perf/mfu_suspect"] = float(suspect)
    return out


def _over_one(figures: dict) -> bool:
    return any(figures.get(k) is not None and figures[k] > 1 for k in MFU_KEYS)


def _fmt(value: float | None) -> str:
    return "none" if value is None else f"{value:.0f}"


def run_peak_spec(run) -> PeakSpec:
    """The `PeakSpec` of a run: engine dtype (`model.dtype`), trainer precision (`train.precision`), threads
    of this process and, in async mode, of the generation process (reported with its results)."""
    concurrent = run.cfg.control.mode == "async"
    return PeakSpec(
        rollout_dtype=run.engine.dtype,
        train_dtype=torch.bfloat16 if run.trainer.bf16 else torch.float32,
        threads=torch.get_num_threads(),
        rollout_threads=getattr(run.rollouts, "threads", None) if concurrent else None,
        concurrent=concurrent,
        rollout_on_cpu=(run.cfg.control.generation_device if concurrent else run.engine.device.type) == "cpu",
        train_on_cpu=run.trainer.device_type == "cpu",
    )


if __name__ == "__main__":
    raise SystemExit(main())
