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

from rollwise import sandbox
from rollwise.config import Config, to_toml
from rollwise.control import Controller
from rollwise.data import PromptEncoder, PromptSource, build_prompt_source
from rollwise.generate import TorchEngine
from rollwise.generate.factory import build_engine, engine_dtype
from rollwise.hardware import auto_threads, configure_allocator, configure_threads, slow_bf16_warning
from rollwise.metrics import MetricsWriter, build_sinks, truncate_after
from rollwise.models import load_model, model_info
from rollwise.perf import FlopCounter
from rollwise.replay import ReplayBuffer
from rollwise.rewards import RewardFailureGuard, build_reward_fn
from rollwise.envs import EnvError, build_env
from rollwise.envs.episode import EpisodeCodec
from rollwise.rollout import Episodes, LocalRollouts, ProcessRollouts
from rollwise.sync import WeightSync
from rollwise.train.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from rollwise.train.fsdp import build_trainer
from rollwise.train.trainer import Trainer
from rollwise.types import Prompt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Run:
    """A training run's components and counters."""

    cfg: Config
    run_dir: Path
    model: Any
    tokenizer: Any
    engine: TorchEngine  # or any engine of rollwise.generate.factory (vLLM, a server client, Ray actors)
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
    sync: WeightSync | None = None  # the Sync stage: transport + probe check
    episodes: Episodes | None = None  # multi-turn episodes (env.name or the task's environment); None = one turn
    stages: Any = None  # rollwise.distill.stages.StagePlan: the kind of every step
    teacher: Any = None  # rollwise.distill.teacher.Teacher (teacher.weights set); None = no teacher
    guards: Any = None  # rollwise.distill.step.Guards: repetition and the truncation-collapse alarm
    demo_sources: dict = field(default_factory=dict)  # SFT stages with a data file: stage index -> DemoSource

    def close(self) -> None:
        """Release what the run opened: rollouts (engines, servers, actors), reward workers, trainer ranks,
        the cluster and the sinks. Safe to call twice."""
        # the trainer first: its Ray rank actors need the cluster, which the engine owns and closes
        for owner in (self.trainer, self.reward_fn, self.rollouts, self.engine, self.teacher):
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


def open_run(cfg: Config, run_dir: Path, resume: bool = False) -> Run:
    """Build the run's components; with `resume`, restore the newest complete checkpoint."""
    configure_allocator()
    sandbox.allow_unconfined(cfg.sandbox.allow_unconfined)  # for reward workers too (they inherit it)
    warning = slow_bf16_warning(cfg.model.dtype, cfg.train.precision)
    if warning:
        print(warning, flush=True)
    generation_threads = 0
    if cfg.control.mode == "async":  # split the cores between the trainer and the generation process
        free_cores = auto_threads()  # the cores other processes leave free now (or ROLLWISE_THREADS)
        generation_threads = cfg.control.generation_threads or max(1, free_cores // 2)
        configure_threads(cfg.model.threads or max(1, free_cores - generation_threads))
    else:
        configure_threads(cfg.model.threads)
    seed_everything(cfg.train.seed)
    source = build_prompt_source(cfg.data, cfg.train.seed)  # data errors before the model loads
    env = build_env(cfg.env, getattr(source, "default_env", None))  # and environment errors
    if env is not None and cfg.control.mode == "async":
        raise EnvError(f"environment {env.name!r}: multi-turn episodes step their environment between engine "
                       "calls in this process; use control.mode = 'sync'")
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    lora = cfg.lora.rank > 0
    # with LoRA the base always comes from model.name (a LoRA checkpoint holds the adapter, not the model)
    model, tokenizer = load_model(str(ckpt) if ckpt and not lora else cfg.model.name, dtype=torch.float32)
    ref_model = None
    if cfg.algo.kl_coef > 0 and not lora:  # the frozen reference is always the starting model
        ref_model, _ = load_model(cfg.model.name, dtype=torch.float32)
        ref_model.eval().requires_grad_(False)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    state = load_trainer_state(ckpt) if ckpt is not None else None
    if state is not None:  # drop rows a killed run logged after its last checkpoint, before appending
        truncate_after(run_dir, state["step"])
    encoder = PromptEncoder(tokenizer, cfg.data.system_prompt, cfg.data.max_prompt_tokens)
    reward_fn = build_reward_fn(cfg.reward, source.default_reward)
    writer = build_sinks(cfg.run.trackers, run_dir, cfg.run.name or run_dir.name, cfg.model_dump(mode="json"),
                         resume_step=state["step"] if state is not None else None)  # JSONL + run.trackers
    run = Run(cfg, run_dir, model, tokenizer, None, None, source, encoder, reward_fn, writer)
    if env is not None:
        run.episodes = Episodes(env, EpisodeCodec(tokenizer, cfg.data.system_prompt), cfg.env.max_episode_tokens)
    try:  # nothing opened here outlives a failed start (engines, servers, ranks, tracker runs, workers)
        run.engine = build_engine(cfg, model, tokenizer, run_dir)  # plain weights: with LoRA, the base
        if lora:  # adapters wrap the model in place (after the engine copied it); the reference is the base
            run.model = model = attach_lora(cfg, model, ckpt)  # with the adapters disabled: no second copy
        run.trainer = build_run_trainer(cfg, model, pad_id, ref_model, str(ckpt) if ckpt else cfg.model.name,
                                        run.engine)
        _assemble(run, state, generation_threads)
    except BaseException:
        run.close()
        raise
    return run


def build_run_trainer(cfg: Config, model, pad_id: int, ref_model, model_path: str, engine):
    """The trainer (`rollwise.train.fsdp.build_trainer`); with `cluster.ray` and FSDP2, ranks 1..N-1 are Ray
    actors in the engine's cluster (rank 0 is this process), met at a store on the driver's address."""
    if not (cfg.cluster.ray and cfg.train.backend == "fsdp2" and cfg.train.world_size > 1):
        return build_trainer(cfg, model, pad_id, ref_model=ref_model, model_path=model_path)
    from rollwise.cluster import start_trainer_ranks
    from rollwise.train.distributed import Rendezvous, free_port

    cluster = engine.cluster
    rendezvous = Rendezvous(cluster.driver_address(), free_port(), cfg.train.world_size)
    ranks = start_trainer_ranks(cluster, cfg.train.world_size, rendezvous.addr, rendezvous.port,
                                cfg.model_dump_json(), model_path)
    try:
        trainer = build_trainer(cfg, model, pad_id, ref_model=ref_model, model_path=model_path,
                                rendezvous=rendezvous)
    except BaseException:
        ranks.close()
        raise
    trainer.workers.processes = ranks.processes()  # a rank actor that dies is noticed at once
    ranks.store = trainer.workers.store
    close_trainer = trainer.close

    def close() -> None:
        try:
            close_trainer()
        finally:
            ranks.close()  # frees the ranks' bundles

    trainer.close = close
    return trainer


def engine_rng_state(engine):
    """The engine's sampling-generator state for a checkpoint (None for engines that keep none here)."""
    if hasattr(engine, "rng_states"):  # Ray: one per engine worker
        return engine.rng_states()
    generator = getattr(engine, "generator", None)
    return None if generator is None else generator.get_state()


def set_engine_rng_state(engine, rng_state) -> None:
    if rng_state is None:
        return
    if hasattr(engine, "set_rng_states"):
        engine.set_rng_states(rng_state)
    elif getattr(engine, "generator", None) is not None:
        engine.generator.set_state(rng_state)


def attach_lora(cfg: Config, base, ckpt: Path | None):
    """The PEFT model that trains: fresh adapters (seeded by train.seed) or the checkpoint's, on `base`."""
    from rollwise.train.lora import apply_lora, load_lora_checkpoint, lora_info

    model = load_lora_checkpoint(ckpt, base, cfg.lora) if ckpt else apply_lora(base, cfg.lora, seed=cfg.train.seed)
    print(f"rollwise: {lora_info(model).line()}", flush=True)
    return model


def _assemble(run: Run, state: dict[str, Any] | None, generation_threads: int) -> None:
    """The parts of a run built after its sinks: eval prompts, counters, replay, rollouts, controller, state."""
    cfg = run.cfg
    build_distillation(run)
    run.eval_prompts = encode_eval_prompts(run.source, run.encoder, cfg.eval.n, to_stdout=True)
    run.flops = FlopCounter(model_info(run.model))
    run.replay = ReplayBuffer(cfg.replay, cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt,
                              seed=cfg.train.seed)
    if state is not None:
        restore_state(run, state)
    run.rollouts = LocalRollouts(run.engine, run.episodes)
    if cfg.rollout.source == "service":  # generation by a `rollwise serve` elsewhere (rollwise/serve/client.py)
        from rollwise.serve.client import service_rollouts

        run.rollouts = service_rollouts(run)
    elif cfg.control.mode == "async":
        plain = run.engine.model if cfg.lora.rank > 0 else run.model  # the process copies a plain model
        run.rollouts = ProcessRollouts(start_generation_process(cfg, plain, run.tokenizer, generation_threads,
                                                                run.step))
    if cfg.distill.trb_steps > 0 or cfg.distill.teacher_rollouts_per_group > 0:  # the teacher samples too
        from rollwise.distill.blend import BlendedRollouts

        run.rollouts = BlendedRollouts(run.rollouts, run.model, run.teacher, run.tokenizer, cfg.distill.trb_steps,
                                       cfg.distill.trb_budget, cfg.distill.teacher_rollouts_per_group, cfg.train.seed)
    run.sync = WeightSync(run.rollouts, run.trainer, run.tokenizer, cfg.sync.transport, cfg.sync.check_tokens,
                          cfg.sync.max_logprob_diff, sync_dir=run.run_dir / "sync", lora=cfg.lora.rank > 0)
    if cfg.lora.rank > 0 and state is not None:  # the engine started from the base: give it the trained adapters
        run.sync.push(run.engine.version)
    run.controller = Controller(cfg, run.rollouts, run.next_prompts, run.reward_fn)
    run.controller.substitution = build_substitution(run)
    run.reward_guard = RewardFailureGuard(cfg.reward.max_failed_steps)
    if state is not None and state.get("reward_guard") is not None:
        run.reward_guard.load_state_dict(state["reward_guard"])
    if state is not None and state.get("controller") is not None:
        run.controller.load_state_dict(state["controller"])


def build_distillation(run: Run) -> None:
    """Stages, the teacher (loaded and checked now, before any step) and the guards (rollwise.distill)."""
    from rollwise.distill.stages import StagePlan
    from rollwise.distill.step import Guards, load_demo_sources
    from rollwise.distill.teacher import build_teacher

    cfg = run.cfg
    run.stages = StagePlan(cfg.stage, cfg.train.steps, cfg.teacher)
    run.demo_sources = load_demo_sources(cfg, run.stages.stages)
    run.guards = Guards(cfg)
    if run.stages.uses_teacher:
        pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else run.tokenizer.eos_token_id
        run.teacher = build_teacher(cfg, run.model, run.tokenizer, run.encoder, run.trainer, pad_id, run.run_dir)
        if cfg.teacher.temperature != cfg.rollout.temperature:
            print(f"rollwise: warning: teacher.temperature {cfg.teacher.temperature:g} differs from rollout.temperature "
                  f"{cfg.rollout.temperature:g}: the teacher gap compares distributions at different temperatures",
                  flush=True)
        print(f"rollwise: teacher {cfg.teacher.weights} (context {cfg.teacher.context!r}, temperature "
              f"{cfg.teacher.temperature:g}, {cfg.distill.objective}); stages: "
              + ", ".join(s.describe() for s in run.stages.stages), flush=True)


def build_substitution(run: Run):
    """ToolExpander's hard-sample substitution when the task offers guided prompts (rollwise.envs.substitution)."""
    if run.episodes is None or not hasattr(run.source, "guided_prompt"):
        return None
    if not hasattr(run.rollouts, "engine"):
        print(f"rollwise: task {run.source.name!r}: hard-sample substitution needs the run's own engine; it is off "
              f"with rollout.source = {run.cfg.rollout.source!r}", flush=True)
        return None
    rollout = run.cfg.rollout
    if rollout.temperature != 1.0 or rollout.top_p < 1.0 or rollout.top_k > 0:
        raise EnvError(f"task {run.source.name!r} substitutes hard samples, whose log-probs are recomputed at "
                       "temperature 1 without top-k / top-p: set rollout.temperature = 1, top_p = 1, top_k = 0")
    from rollwise.envs.substitution import HardSampleSubstitution

    return HardSampleSubstitution(run.source, run.episodes, run.rollouts.engine, run.encoder, run.reward_fn,
                                  run.cfg.reward.timeout_s, **getattr(run.source, "substitution_options", {}))


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
    """Everything besides the weights that a resumed run needs to continue identically.

    FSDP2 (`train.backend = "fsdp2"`): the optimizer state is sharded over the ranks and saved beside it
    (`save_run`); "fsdp" records the world size it needs."""
    sharded = hasattr(run.trainer, "save_shards")
    return {
        "step": run.step,
        "data_position": run.data_position,
        "optimizer": None if sharded else run.trainer.optimizer.state_dict(),
        "fsdp": {"world_size": run.trainer.world_size} if sharded else None,
        "scheduler": run.trainer.scheduler.state_dict(),
        "updates": run.trainer.updates,
        "value_head": None if run.trainer.value_head is None else run.trainer.value_head.state_dict(),
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "engine": engine_rng_state(run.engine),
        },
        "engine_version": run.engine.version,
        "controller": run.controller.state_dict(),
        "replay": run.replay.state_dict(),
        "reward_guard": run.reward_guard.state_dict(),
        "nonfinite_streak": run.trainer.nonfinite_streak,
        "totals": dict(run.totals),
        "prompts_dropped": run.encoder.dropped,
        "source": run.source.state_dict() if hasattr(run.source, "state_dict") else None,  # a task's curriculum
        "guards": run.guards.state_dict() if run.guards is not None else None,
        "teacher": run.teacher.state_dict() if hasattr(run.teacher, "state_dict") else None,  # an EMA teacher
        "elapsed_s": time.time() - run.started_at,
    }


def restore_state(run: Run, state: dict[str, Any]) -> None:
    run.step = state["step"]
    run.data_position = state["data_position"]
    from rollwise.train.fsdp import SHARDS_DIR, check_resume_backend

    check_resume_backend(state, run.trainer)  # one clear error for another backend or world size
    if hasattr(run.trainer, "load_shards"):  # FSDP2: every rank loads its optimizer shard, and the rest
        ckpt = run.run_dir / "checkpoints" / f"step-{state['step']}"
        run.trainer.load_shards(ckpt / SHARDS_DIR, {key: state.get(key) for key in (
            "scheduler", "updates", "nonfinite_streak", "value_head")})
    else:
        run.trainer.optimizer.load_state_dict(state["optimizer"])
        run.trainer.scheduler.load_state_dict(state["scheduler"])
        run.trainer.updates = state.get("updates", 0)
        run.trainer.nonfinite_streak = state.get("nonfinite_streak", 0)
        if run.trainer.value_head is not None and state.get("value_head") is not None:
            run.trainer.value_head.load_state_dict(state["value_head"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    set_engine_rng_state(run.engine, state["rng"]["engine"])
    run.engine.version = state["engine_version"]
    if state.get("replay") is not None:
        run.replay.load_state_dict(state["replay"])
    run.totals = dict(state["totals"])
    run.encoder.dropped = state.get("prompts_dropped", 0)
    if state.get("source") is not None and hasattr(run.source, "load_state_dict"):
        run.source.load_state_dict(state["source"])
    if state.get("guards") is not None:
        run.guards.load_state_dict(state["guards"])
    if state.get("teacher") is not None and hasattr(run.teacher, "load_state_dict"):
        run.teacher.load_state_dict(state["teacher"])
    run.started_at = time.time() - state.get("elapsed_s", 0.0)


def save_run(run: Run) -> Path:
    """Write `checkpoints/step-N` (HF model + trainer state), atomically. FSDP2: the HF model from the gathered
    full weights (rank 0) and the optimizer shards of every rank (`torch.distributed.checkpoint`) beside it."""
    trainer = run.trainer
    if hasattr(trainer, "save_shards"):
        from rollwise.train.fsdp import SHARDS_DIR

        return save_checkpoint(run.run_dir, run.step, run.model, run.tokenizer, trainer_state(run),
                               keep=run.cfg.run.keep_checkpoints, state_dict=trainer.policy_state_dict(),
                               write_extra=lambda tmp: trainer.save_shards(tmp / SHARDS_DIR))
    if run.cfg.lora.rank > 0:  # the adapter under adapter/ (and, on request, the merged model under merged/)
        from rollwise.train.lora import write_lora_checkpoint

        return save_checkpoint(run.run_dir, run.step, run.model, run.tokenizer, trainer_state(run),
                               keep=run.cfg.run.keep_checkpoints,
                               write_extra=lambda tmp: write_lora_checkpoint(tmp, run.model, run.tokenizer,
                                                                             run.cfg.lora.save_merged))
    return save_checkpoint(
        run.run_dir, run.step, run.model, run.tokenizer, trainer_state(run), keep=run.cfg.run.keep_checkpoints
    )

