"""Build everything a run needs from its config, and save or restore its state.

`open_run` returns a `Run`: the components of the loop (engine, trainer, data, rewards, sinks)
and its counters. `save_run` writes a checkpoint; a run opened with `resume=True` continues from
the newest complete one with the same data order, RNG streams and optimizer state.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwise.config import Config, to_toml
from rollwise.control import Controller
from rollwise.data import PromptEncoder, PromptSource, build_prompt_source
from rollwise.generate import TorchEngine
from rollwise.hardware import auto_threads, bf16_is_native, configure_allocator, configure_threads
from rollwise.metrics import MetricsWriter, build_sinks, truncate_after
from rollwise.models import load_model, model_info
from rollwise.perf import FlopCounter
from rollwise.replay import ReplayBuffer
from rollwise.rewards import RewardFailureGuard, build_reward_fn
from rollwise.rollout import LocalRollouts, ProcessRollouts
from rollwise.train.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def engine_dtype(name: str) -> torch.dtype:
    """`model.dtype`: `auto` is bf16 on CUDA or on a CPU with native bf16 instructions, else fp32."""
    if name == "auto":
        return torch.bfloat16 if bf16_is_native("cuda" if torch.cuda.is_available() else "cpu") else torch.float32
    return DTYPES[name]


@dataclass
class Run:
    """A training run's components and counters."""

    cfg: Config
    run_dir: Path
    model: Any
    tokenizer: Any
    engine: TorchEngine
    trainer: Trainer
    source: PromptSource
    encoder: PromptEncoder
    reward_fn: Any
    writer: MetricsWriter
    step: int = 0
    data_position: int = 0
    totals: dict[str, float] = field(default_factory=lambda: {"tokens_generated": 0.0, "tokens_trained": 0.0})
    started_at: float = field(default_factory=time.time)
    eval_prompts: list[tuple[Prompt, list[int]]] = field(default_factory=list)
    flops: FlopCounter | None = None
    rollouts: Any = None  # LocalRollouts (the engine above) or ProcessRollouts (control.mode = "async")
    controller: Controller | None = None
    reward_guard: RewardFailureGuard | None = None
    replay: ReplayBuffer | None = None

    def next_prompts(self, n: int) -> list[tuple[Prompt, list[int]]]:
        """The next `n` training prompts that fit `max_prompt_tokens` (longer ones are skipped and counted)."""
        out = []
        skipped = 0
        while len(out) < n:
            prompt = self.source.train_prompt(self.data_position)
            self.data_position += 1
            ids = self.encoder.encode(prompt)
            if ids is None:
                skipped += 1
                if skipped > 100 * n:
                    raise RuntimeError(
                        f"over {100 * n} prompts in a row exceed data.max_prompt_tokens="
                        f"{self.cfg.data.max_prompt_tokens}; raise it"
                    )
                continue
            out.append((prompt, ids))
        return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def open_run(cfg: Config, run_dir: Path, resume: bool = False) -> Run:
    """Build the run's components; with `resume`, restore the newest complete checkpoint."""
    configure_allocator()
    generation_threads = 0
    if cfg.control.mode == "async":  # split the cores between the trainer and the generation process
        free_cores = auto_threads()  # the cores other processes leave free now (or ROLLWISE_THREADS)
        generation_threads = cfg.control.generation_threads or max(1, free_cores // 2)
        configure_threads(cfg.model.threads or max(1, free_cores - generation_threads))
    else:
        configure_threads(cfg.model.threads)
    seed_everything(cfg.train.seed)
    source = build_prompt_source(cfg.data, cfg.train.seed)  # data errors before the model loads
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    model, tokenizer = load_model(str(ckpt) if ckpt else cfg.model.name, dtype=torch.float32)
    ref_model = None
    if cfg.algo.kl_coef > 0:  # the frozen reference is always the starting model
        ref_model, _ = load_model(cfg.model.name, dtype=torch.float32)
        ref_model.eval().requires_grad_(False)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = TorchEngine(model, tokenizer, dtype=engine_dtype(cfg.model.dtype),
                         max_batch_size=cfg.rollout.max_batch_size, seed=cfg.train.seed)
    trainer = Trainer(model, cfg.train, cfg.algo, pad_id, ref_model=ref_model, temperature=cfg.rollout.temperature,
                      max_new_tokens=cfg.rollout.max_new_tokens)
    encoder = PromptEncoder(tokenizer, cfg.data.system_prompt, cfg.data.max_prompt_tokens)
    reward_fn = build_reward_fn(cfg.reward, source.default_reward)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    state = load_trainer_state(ckpt) if ckpt is not None else None
    if state is not None:  # drop rows a killed run logged after its last checkpoint, before appending
        truncate_after(run_dir, state["step"])
    writer = build_sinks(cfg.run.trackers, run_dir, cfg.run.name or run_dir.name, cfg.model_dump(mode="json"),
                         resume_step=state["step"] if state is not None else None)  # JSONL + run.trackers
    run = Run(cfg, run_dir, model, tokenizer, engine, trainer, source, encoder, reward_fn, writer)
    try:
        _assemble(run, state, generation_threads)
    except BaseException:  # nothing opened here outlives a failed start (tracker runs, worker processes)
        for close in (getattr(run.rollouts, "close", None), getattr(reward_fn, "close", None), writer.close):
            if close is not None:
                close()
        raise
    return run


def _assemble(run: Run, state: dict[str, Any] | None, generation_threads: int) -> None:
    """The parts of a run built after its sinks: eval prompts, counters, replay, rollouts, controller, state."""
    cfg = run.cfg
    run.eval_prompts = encode_eval_prompts(run.source, run.encoder, cfg.eval.n, to_stdout=True)
    run.flops = FlopCounter(model_info(run.model))
    run.replay = ReplayBuffer(cfg.replay, cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt,
                              seed=cfg.train.seed)
    if state is not None:
        restore_state(run, state)
    run.rollouts = LocalRollouts(run.engine)
    if cfg.control.mode == "async":
        run.rollouts = ProcessRollouts(start_generation_process(cfg, run.model, run.tokenizer, generation_threads,
                                                                run.step))
    run.controller = Controller(cfg, run.rollouts, run.next_prompts, run.reward_fn)
    run.reward_guard = RewardFailureGuard(cfg.reward.max_failed_steps)
    if state is not None and state.get("reward_guard") is not None:
        run.reward_guard.load_state_dict(state["reward_guard"])
    if state is not None and state.get("controller") is not None:
        run.controller.load_state_dict(state["controller"])


def start_generation_process(cfg: Config, model, tokenizer, threads: int, version: int):
    """The async mode's generation process: its own engine, weights (`model`'s, as `version`) and threads."""
    from rollwise.generate.process import GenerationProcess

    return GenerationProcess(model, tokenizer, dtype=engine_dtype(cfg.model.dtype),
                             max_batch_size=cfg.rollout.max_batch_size, seed=cfg.train.seed + 1, threads=threads,
                             device=cfg.control.generation_device, version=version)


def encode_eval_prompts(source: PromptSource, encoder: PromptEncoder, n: int,
                        to_stdout: bool = False) -> list[tuple[Prompt, list[int]]]:
    """The first min(n, held-out split size) held-out prompts that fit the prompt limit, encoded.

    Prints ONE line: the split the source chose (`split_summary()`) and how many prompts eval uses, e.g.
    `rollwise: data: 64 rows in my.jsonl -> 48 train, 16 held-out (...); eval.n=200 -> 16`. It goes to stderr
    unless `to_stdout` (`rollwise eval` keeps stdout for its one JSON object). `n` is capped at the source's
    `num_eval` when it has one; a source without it raises its own error for too large an `n`.
    ValueError when n > 0 and no prompt is left to evaluate (empty split, or all over data.max_prompt_tokens).
    """
    import sys

    available = getattr(source, "num_eval", None)
    used = n if available is None else min(n, available)
    dropped_before = encoder.dropped
    out = [(p, ids) for p in source.eval_prompts(used) if (ids := encoder.encode(p)) is not None]
    too_long = encoder.dropped - dropped_before
    encoder.dropped = dropped_before  # count only training drops in data/ metrics
    summary = source.split_summary() if hasattr(source, "split_summary") else f"task {source.name}"
    if n > 0 and used == 0:
        raise ValueError(f"data: {summary}; eval.n={n} needs held-out prompts: give data.eval_path, or set "
                         f"eval.n = 0 to train on every row without evaluation")
    if n > 0 and not out:
        raise ValueError(f"data: all {used} held-out prompts are longer than data.max_prompt_tokens="
                         f"{encoder.max_prompt_tokens}; raise it")
    tail = "eval.n=0: evaluation off" if n == 0 else f"eval.n={n}" + (f" -> {used}" if used < n else "")
    if too_long:
        tail += f" ({too_long} over data.max_prompt_tokens={encoder.max_prompt_tokens} left out: {len(out)} used)"
    print(f"rollwise: data: {summary}; {tail}", file=sys.stdout if to_stdout else sys.stderr, flush=True)
    return out


def trainer_state(run: Run) -> dict[str, Any]:
    """Everything besides the weights that a resumed run needs to continue identically."""
    return {
        "step": run.step,
        "data_position": run.data_position,
        "optimizer": run.trainer.optimizer.state_dict(),
        "scheduler": run.trainer.scheduler.state_dict(),
        "updates": run.trainer.updates,
        "value_head": None if run.trainer.value_head is None else run.trainer.value_head.state_dict(),
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "engine": run.engine.generator.get_state(),
        },
        "engine_version": run.engine.version,
        "controller": run.controller.state_dict(),
        "replay": run.replay.state_dict(),
        "reward_guard": run.reward_guard.state_dict(),
        "nonfinite_streak": run.trainer.nonfinite_streak,
        "totals": dict(run.totals),
        "prompts_dropped": run.encoder.dropped,
        "elapsed_s": time.time() - run.started_at,
    }


def restore_state(run: Run, state: dict[str, Any]) -> None:
    run.step = state["step"]
    run.data_position = state["data_position"]
    run.trainer.optimizer.load_state_dict(state["optimizer"])
    run.trainer.scheduler.load_state_dict(state["scheduler"])
    run.trainer.updates = state.get("updates", 0)
    run.trainer.nonfinite_streak = state.get("nonfinite_streak", 0)
    if run.trainer.value_head is not None and state.get("value_head") is not None:
        run.trainer.value_head.load_state_dict(state["value_head"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    run.engine.generator.set_state(state["rng"]["engine"])
    run.engine.version = state["engine_version"]
    if state.get("replay") is not None:
        run.replay.load_state_dict(state["replay"])
    run.totals = dict(state["totals"])
    run.encoder.dropped = state.get("prompts_dropped", 0)
    run.started_at = time.time() - state.get("elapsed_s", 0.0)


def save_run(run: Run) -> Path:
    """Write `checkpoints/step-N` (HF model + trainer state), atomically."""
    return save_checkpoint(
        run.run_dir, run.step, run.model, run.tokenizer, trainer_state(run), keep=run.cfg.run.keep_checkpoints
    )

