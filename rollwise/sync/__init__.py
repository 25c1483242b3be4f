"""The Sync stage: push the trainer's weights to the engines, versioned, and check that they arrived.

`WeightSync.push(version)` takes the trainer's full policy weights (`trainer.policy_state()`: merged LoRA, gathered
FSDP shards), sends them through the configured transport (`rollwise.sync.transports`: tensors copied in this
process, into the torch engine or a vLLM engine core running here; a safetensors folder the engine reloads; or
vLLM's NCCL transfer) or, with LoRA on an engine that serves adapters, the adapter alone; then it compares the
log-probs the engine and the trainer give to a fixed probe sequence.
A gap above `sync.max_logprob_diff` stops the run (`SyncError`): weights that were half-loaded, a tied LM head
left stale, or a dtype mix-up would otherwise train on silently corrupted samples.

`WeightSync.release_memory()`, called before the Train stage, lets an engine that shares the trainer's GPU free
its memory (vLLM's sleep mode, `caps.sleep_mode`); the push that follows takes the weights' memory back, the
probe (or the next generation) the KV cache. A no-op for every other engine.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from rollwise.errors import UserError


PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. 12 + 7 = 19, and 9 * 8 = 72. "
              "Rollouts, rewards and gradients: every step moves the policy a little. ") * 8


class SyncError(UserError, RuntimeError):
    """The engine's weights are not the trainer's after a sync (or the sync itself failed)."""


def probe_tokens(tokenizer, n_tokens: int) -> list[int]:
    """`n_tokens + 1` fixed token ids (the first is context only): the same every step and every run."""
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens + 1:
        raise ValueError(f"sync.check_tokens = {n_tokens} is longer than the probe text ({len(ids) - 1} tokens)")
    return list(ids[: n_tokens + 1])


def default_max_diff(engine_dtype: torch.dtype, weight_quant: str | None = None) -> float:
    """Probe gap allowed by the engine's precision: float32 engines agree with the trainer to ~5e-5 (1e-2
    leaves room for kernels). A bfloat16 engine's rounding alone gave gaps up to 0.47 on SmolLM2-135M over
    20 steps (BENCHMARKS.md): 1.0. Int8 / fp8 weights (`weight_quant`) differ by design, up to 1.34 with fp8
    weights in a bfloat16 engine on SmolLM2-135M: 3.0. Both catch gross failures only (NaN, wrong or missing
    tensors), not a subtly stale tensor, whose gap is of the same size; check such engines in float32 without
    quantization first."""
    if weight_quant is not None:
        return 3.0
    return 1e-2 if engine_dtype == torch.float32 else 1.0


class WeightSync:
    """Pushes the trainer's weights to the run's rollouts after each update and checks the engine got them.

    Args:
        rollouts: the run's `Rollouts` (its `engine`, or None when the engine lives elsewhere: then the weights go
            through `rollouts.push_weights`, unchecked here).
        trainer: the run's trainer backend (`policy_state`, `probe_logprobs`; `adapter_folder` when
            `has_adapter`).
        transport: name from `sync.transport`; built on the engine by `rollwise.sync.transports`.
        check_tokens: probe length (0 = no check); max_logprob_diff: None = `default_max_diff(engine dtype)`.
        sync_dir: folder the safetensors transport and LoRA adapters are written to.
    """

    def __init__(self, rollouts, trainer, tokenizer, transport: str = "auto", check_tokens: int = 32,
                 max_logprob_diff: float | None = None, sync_dir: Path | None = None):
        self.rollouts = rollouts
        self.trainer = trainer
        self.engine = rollouts.engine  # None: the engine lives elsewhere (a generation process, a server)
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        # a LoRA trainer's adapter alone, to an engine that serves adapters
        self.lora_adapters = trainer.has_adapter and self.engine is not None and self.engine.caps.adapters
        self.transport = None
        if self.engine is not None:
            from rollwise.sync.transports import build_transport

            self.transport = build_transport(transport, self.engine, self.sync_dir)
        can_probe = self.engine is not None and self.engine.caps.probe_logprobs and check_tokens > 0
        self.probe_ids = probe_tokens(tokenizer, check_tokens) if can_probe else []
        dtype = self.engine.dtype if self.engine is not None else torch.float32
        quant = getattr(self.engine, "weight_quant", None)
        self.max_diff = max_logprob_diff if max_logprob_diff is not None else default_max_diff(dtype, quant)

    def push(self, version: int) -> dict[str, float]:
        """Send the weights as `version`; returns `sync/*` metrics: `sync/time_s` the transfer (state dict plus
        transport), `sync/check_s` the probe check after it (both sides' forward), the gaps it found. Raises
        SyncError when the check fails."""
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.engine is None:  # async: the generation process takes tensors through shared memory
            self.rollouts.push_weights(self.trainer.policy_state(), version)
        elif self.lora_adapters:
            metrics.update(self._push_adapter(version))
        else:
            metrics.update(self.transport.push(self.trainer.policy_state(), version) or {})
        metrics["sync/time_s"] = time.perf_counter() - start
        if self.probe_ids:
            start = time.perf_counter()
            metrics["sync/logprob_max_abs_diff"], metrics["sync/logprob_mean_abs_diff"] = self.check(version)
            metrics["sync/check_s"] = time.perf_counter() - start
        return metrics

    def release_memory(self) -> None:
        """Before the Train stage: the engine gives its accelerator memory to the trainer until the next push or
        generation needs it (only an engine with `caps.sleep_mode`, started with it; else nothing happens)."""
        if self.engine is not None and self.engine.caps.sleep_mode:
            self.engine.release_memory()

    def _push_adapter(self, version: int) -> dict[str, float]:
        folder = self.sync_dir / f"adapter-v{version}"
        self.trainer.adapter_folder(folder)
        self.engine.update_adapter(folder, version)
        for old in self.sync_dir.glob("adapter-v*"):
            if old != folder and old.name.removeprefix("adapter-v").isdigit() and \
                    int(old.name.removeprefix("adapter-v")) < version - 1:  # the previous one may still serve
                import shutil

                shutil.rmtree(old, ignore_errors=True)
        return {"sync/bytes": float(sum(f.stat().st_size for f in folder.iterdir()))}

    def check(self, version: int) -> tuple[float, float]:
        """(max, mean) |engine - trainer| log-prob over the probe tokens; SyncError when any gap is not finite
        (a NaN anywhere, not only first: Python's `max` skips a NaN that does not come first), when the engine
        answered for a different number of tokens, or when the max is above the limit."""
        engine_logp = self.engine.probe_logprobs(self.probe_ids)
        trainer_logp = self.trainer.probe_logprobs(self.probe_ids)
        if len(engine_logp) != len(trainer_logp) or not trainer_logp:
            raise SyncError(f"weight sync to version {version}: the engine returned {len(engine_logp)} probe "
                            f"log-probs for {len(trainer_logp)} probe tokens; the check cannot compare them")
        gaps = [abs(a - b) for a, b in zip(engine_logp, trainer_logp)]
        bad = [i for i, g in enumerate(gaps) if not math.isfinite(g)]
        if bad:
            first = bad[0]
            side, value = ("engine", engine_logp[first]) if not math.isfinite(engine_logp[first]) else \
                ("trainer", trainer_logp[first])
            raise SyncError(
                f"weight sync to version {version}: the {side}'s log-prob of probe token {first + 1} of {len(gaps)} "
                f"is {value} ({len(bad)} non-finite in all); the weights hold NaN/Inf or were corrupted in transfer")
        gap = max(gaps)
        if gap > self.max_diff:
            raise SyncError(
                f"weight sync to version {version}: the engine's log-probs of the {len(trainer_logp)} probe tokens "
                f"differ from the trainer's by up to {gap:.3g} (limit sync.max_logprob_diff = {self.max_diff:g}); "
                "the engine is not sampling from the trained weights (a partial load, a stale tied LM head, "
                "or a dtype mismatch); rerun with --debug and report it, or raise the limit if the engine's "
                "precision explains it")
        return gap, sum(gaps) / len(gaps)
