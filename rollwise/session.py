"""A run's components (`Run`), and its state: what a checkpoint saves and a resumed run restores.

`rollwise.build.open_run` assembles a `Run` from a config; `save_run` writes a checkpoint; a run opened with
`resume=True` continues from the newest complete one with the same data order, RNG streams, optimizer state
and policy version. The trainer backend saves and restores its own part (`state_dict`, `write_checkpoint`,
`load_state_dict`), the engine its RNG (`caps.rng_state`): nothing here asks which backend or engine it holds.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollwise.config import Config
from rollwise.control import Controller
from rollwise.data import PromptEncoder, PromptSource
from rollwise.data.errors import DatasetError
from rollwise.distill.guards import Guards
from rollwise.generate.base import Engine
from rollwise.metrics import MetricsWriter
from rollwise.metrics.collapse import CollapseWatch
from rollwise.methods.plan import MethodPlan
from rollwise.perf import FlopCounter
from rollwise.replay import ReplayBuffer
from rollwise.rewards import RewardFailureGuard
from rollwise.rollout import Episodes, Rollouts
from rollwise.sync import WeightSync
from rollwise.train.checkpoint import save_checkpoint
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt


@dataclass
class Run:
    """A training run's components and counters. `step` is the policy version: the RL steps the trainer has
    applied (the one counter the Sync stage pushes to the engines and the engines stamp on samples)."""

    cfg: Config
    run_dir: Path
    model: Any  # the policy module the trainer updates (a PEFT model with LoRA)
    tokenizer: Any
    engine: Engine | None
    trainer: Trainer | None  # the backend: Trainer, LoraTrainer or FSDPTrainer (rollwise.train)
    source: PromptSource
    encoder: PromptEncoder
    reward_fn: Any
    writer: MetricsWriter
    data_position: int = 0
    totals: dict[str, float] = field(default_factory=lambda: {"tokens_generated": 0.0, "tokens_trained": 0.0})
    started_at: float = field(default_factory=time.time)
    eval_prompts: list[tuple[Prompt, list[int]]] = field(default_factory=list)
    flops: FlopCounter | None = None
    rollouts: Rollouts | None = None
    controller: Controller | None = None
    reward_guard: RewardFailureGuard | None = None
    replay: ReplayBuffer | None = None
    sync: WeightSync | None = None  # the Sync stage: transport + probe check
    episodes: Episodes | None = None  # multi-turn episodes (env.name or the task's environment); None = one turn
    plan: MethodPlan | None = None  # the stage and method of every step
    guards: Guards | None = None  # repetition and the truncation-collapse alarm
    collapse: CollapseWatch | None = None  # answer-collapse and held-out-drop warnings (rollwise.metrics.collapse)
    strategy: Any = None  # the rollout strategy in this process (rollout.strategy); None for episodes

    @property
    def step(self) -> int:
        return self.trainer.version

    def close(self) -> None:
        """Release what the run opened: rollouts (engines, servers, actors), reward workers, trainer ranks, the
        teacher, the cluster and the sinks. Safe to call twice."""
        # the trainer first: its Ray rank actors need the cluster, which the engine owns and closes
        for owner in (self.trainer, self.reward_fn, self.rollouts, self.engine, self.plan):
            close = getattr(owner, "close", None)
            if close is not None:
                close()
        self.writer.close()

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


def encode_eval_prompts(source: PromptSource, encoder: PromptEncoder, n: int,
                        to_stdout: bool = False) -> list[tuple[Prompt, list[int]]]:
    """The first min(n, held-out split size) held-out prompts that fit the prompt limit, encoded.

    Prints ONE line: the split the source chose (`split_summary()`) and how many prompts eval uses, e.g.
    `rollwise: data: 64 rows in my.jsonl -> 48 train, 16 held-out (...); eval.n=200 -> 16`. It goes to stderr
    unless `to_stdout` (`rollwise eval` keeps stdout for its one JSON object). `n` is capped at the source's
    `num_eval` when it has one; a source without it raises its own error for too large an `n`.
    DatasetError (a ValueError) when n > 0 and no prompt is left to evaluate (empty split, or all over
    data.max_prompt_tokens).
    """
    available = getattr(source, "num_eval", None)
    used = n if available is None else min(n, available)
    dropped_before = encoder.dropped
    out = [(p, ids) for p in source.eval_prompts(used) if (ids := encoder.encode(p)) is not None]
    too_long = encoder.dropped - dropped_before
    encoder.dropped = dropped_before  # count only training drops in data/ metrics
    summary = source.split_summary() if hasattr(source, "split_summary") else f"task {source.name}"
    if n > 0 and used == 0:
        raise DatasetError(f"data: {summary}; eval.n={n} needs held-out prompts: give data.eval_path, or set "
                         f"eval.n = 0 to train on every row without evaluation")
    if n > 0 and not out:
        raise DatasetError(f"data: all {used} held-out prompts are longer than data.max_prompt_tokens="
                           f"{encoder.max_prompt_tokens}; raise it")
    tail = "eval.n=0: evaluation off" if n == 0 else f"eval.n={n}" + (f" -> {used}" if used < n else "")
    if too_long:
        tail += f" ({too_long} over data.max_prompt_tokens={encoder.max_prompt_tokens} left out: {len(out)} used)"
    print(f"rollwise: data: {summary}; {tail}", file=sys.stdout if to_stdout else sys.stderr, flush=True)
    return out


def trainer_state(run: Run) -> dict[str, Any]:
    """Everything besides the weights that a resumed run needs to continue identically (the trainer backend's
    own part from `Trainer.state_dict`)."""
    engine = run.engine
    plan = run.plan.state_dict()
    return {
        "step": run.step,
        "data_position": run.data_position,
        **run.trainer.state_dict(),
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "engine": engine.rng_state() if engine.caps.rng_state else None,
        },
        "engine_version": engine.version,
        "controller": run.controller.state_dict(),
        "replay": run.replay.state_dict(),
        "reward_guard": run.reward_guard.state_dict(),
        "totals": dict(run.totals),
        "prompts_dropped": run.encoder.dropped,
        "source": run.source.state_dict() if hasattr(run.source, "state_dict") else None,  # a task's curriculum
        "guards": run.guards.state_dict(),
        "teacher": plan["teacher"],  # an EMA teacher's weights
        "methods": plan["methods"],
        "strategy": run.strategy.state_dict() if hasattr(run.strategy, "state_dict") else None,
        "elapsed_s": time.time() - run.started_at,
    }


def restore_state(run: Run, state: dict[str, Any], checkpoint: Path) -> None:
    """Restore what `trainer_state` saved (before the rollouts and controller are built, which read the version
    and the replay buffer); `checkpoint` is where the backend's own files are."""
    run.trainer.load_state_dict(state, checkpoint)  # one clear error for another backend or world size
    run.data_position = state["data_position"]
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"].get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    if state["rng"]["engine"] is not None and run.engine.caps.rng_state:
        run.engine.set_rng_state(state["rng"]["engine"])
    run.engine.version = state["engine_version"]
    if state.get("replay") is not None:
        run.replay.load_state_dict(state["replay"])
    run.totals = dict(state["totals"])
    run.encoder.dropped = state.get("prompts_dropped", 0)
    if state.get("source") is not None and hasattr(run.source, "load_state_dict"):
        run.source.load_state_dict(state["source"])
    if state.get("guards") is not None:
        run.guards.load_state_dict(state["guards"])
    run.plan.load_state_dict({"teacher": state.get("teacher"), "methods": state.get("methods")})
    run.started_at = time.time() - state.get("elapsed_s", 0.0)


def restore_loop_state(run: Run, state: dict[str, Any]) -> None:
    """The reward guard's, the controller's and the rollout strategy's state (restored once they are built)."""
    if state.get("strategy") is not None and hasattr(run.strategy, "load_state_dict"):
        run.strategy.load_state_dict(state["strategy"])
    if state.get("reward_guard") is not None:
        run.reward_guard.load_state_dict(state["reward_guard"])
    if state.get("controller") is not None:
        run.controller.load_state_dict(state["controller"])


def save_run(run: Run) -> Path:
    """Write `checkpoints/step-N` (HF model + trainer state + the backend's own files), atomically."""
    return save_checkpoint(run.run_dir, run.step, run.model, run.tokenizer, trainer_state(run),
                           keep=run.cfg.run.keep_checkpoints, state_dict=run.trainer.checkpoint_weights(),
                           write_extra=run.trainer.write_checkpoint)
