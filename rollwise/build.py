"""Assembly: a run's components from its config. The one place that reads the mode flags.

| part           | chosen by                                            | built                                          |
|----------------|------------------------------------------------------|------------------------------------------------|
| engine         | rollout.engine, rollout.server, cluster.ray          | torch, vLLM (in-process / server), SGLang and   |
|                |                                                      | OpenAI clients; Ray actors (`RemoteEngine`)     |
| trainer        | lora.rank, train.backend, world_size, cluster.ray     | `Trainer`, `LoraTrainer`, `FSDPTrainer` (ranks  |
|                |                                                      | spawned, from torchrun, or Ray actors)          |
| methods        | [[stage]], teacher.*                                 | `MethodPlan` (rl / opd / opsd / sft / plugins)  |
| rollouts       | rollout.source, control.mode, env, agent, distill.*  | local, generation process, `rollwise serve`,    |
|                |                                                      | episodes, agent programs (EPISODE_SOURCES),     |
|                |                                                      | teacher-blended                                 |
| sync, sinks... | sync.*, run.trackers, replay.*, reward.*             | `WeightSync`, metric sinks, replay, controller  |

The loop receives these as objects with typed protocols (`Engine`, `Trainer`, `Rollouts`, `Method`) and never
asks which kind it holds. `open_run` builds in a fixed order (the RNG streams a resumed run restores depend on
it) and closes whatever it opened when a later part fails.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollwise import sandbox
from rollwise.config import Config, ConfigError
from rollwise.config_toml import to_toml
from rollwise.control import Controller
from rollwise.data import PromptEncoder, build_prompt_source
from rollwise.distill.guards import Guards
from rollwise.envs import EnvError, build_env
from rollwise.generate.factory import build_engine as build_local_engine, engine_dtype
from rollwise.hardware import auto_threads, configure_allocator, configure_threads, resolve_device, slow_bf16_warning
from rollwise.methods import MethodSetup
from rollwise.methods.plan import MethodPlan, plan_stages
from rollwise.methods.sft import load_demo_sources
from rollwise.metrics import build_sinks, truncate_after
from rollwise.metrics.collapse import CollapseWatch
from rollwise.models import load_model, model_info
from rollwise.models.weights_folder import write_initial_weights
from rollwise.perf import FlopCounter
from rollwise.registry import Registry
from rollwise.replay import ReplayBuffer
from rollwise.rewards import RewardFailureGuard, build_reward_fn
from rollwise.rewards.noise import training_reward  # verifier noise (reward.noise_*): training rewards only
from rollwise.rewards.memreward import with_label_propagation  # MemReward ([reward.memreward])
from rollwise.rollout import LocalRollouts, ProcessRollouts, episodes_for
from rollwise.rollout_strategies import StrategyContext, build_strategy
from rollwise.session import Run, encode_eval_prompts, restore_loop_state, restore_state, seed_everything
from rollwise.sync import WeightSync
from rollwise.train.checkpoint import latest_checkpoint, load_trainer_state

# Episode sources that run beside the engine loop, by name: a factory `(cfg, prompt source) -> source | None`
# (None when the run does not use it), imported on first use; a source gives `reward(fn)` (the run's reward
# wrapped) and `episodes(tokenizer)` (run.episodes; with a `rollouts(engine)` of its own for the Generate stage).
EPISODE_SOURCES: Registry = Registry("episode source")
EPISODE_SOURCES.register_lazy("agent", "rollwise.agents:agent_source")  # agent programs, verifiers environments


def open_run(cfg: Config, run_dir: Path, resume: bool = False) -> Run:
    """Build the run's components; with `resume`, restore the newest complete checkpoint."""
    configure_allocator()
    sandbox.allow_unconfined(cfg.sandbox.allow_unconfined)  # for reward workers too (they inherit it)
    device = resolve_device(cfg.train.device)
    warning = slow_bf16_warning(cfg.model.dtype, cfg.train.precision, device.type)
    if warning:
        print(warning, flush=True)
    generation_threads = split_threads(cfg)
    seed_everything(cfg.train.seed)
    source = build_prompt_source(cfg.data, cfg.train.seed)  # data errors before the model loads
    external = episode_source(cfg, source)  # agent programs run the episodes themselves (rollwise.agents)
    env = None if external is not None else build_env(cfg.env, getattr(source, "default_env", None))
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    lora = cfg.lora.rank > 0
    # with LoRA the base always comes from model.name (a LoRA checkpoint holds the adapter, not the model)
    model, tokenizer = load_model(str(ckpt) if ckpt and not lora else cfg.model.name, dtype=torch.float32)
    model = model.to(device)  # the engine copies it where it is: colocated with the trainer
    ref_model = None
    if cfg.algo.kl_coef > 0 and not lora:  # the frozen reference is always the starting model
        ref_model, _ = load_model(cfg.model.name, dtype=torch.float32)
        ref_model = ref_model.eval().requires_grad_(False).to(device)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    state = load_trainer_state(ckpt) if ckpt is not None else None
    if state is not None:  # drop rows a killed run logged after its last checkpoint, before appending
        truncate_after(run_dir, state["step"])
    encoder = PromptEncoder(tokenizer, cfg.data.system_prompt, cfg.data.max_prompt_tokens)
    reward_fn = build_reward_fn(cfg.reward, source.default_reward)
    reward_fn = external.reward(reward_fn) if external is not None else reward_fn
    writer = build_sinks(cfg.run.trackers, run_dir, cfg.run.name or run_dir.name, cfg.model_dump(mode="json"),
                         resume_step=state["step"] if state is not None else None)  # JSONL + run.trackers
    run = Run(cfg, run_dir, model, tokenizer, None, None, source, encoder, reward_fn, writer)
    if env is not None:
        run.episodes = episodes_for(cfg, env, tokenizer, getattr(source, "default_env", None))
    elif external is not None:
        run.episodes = external.episodes(tokenizer)
    try:  # nothing opened here outlives a failed start (engines, servers, ranks, tracker runs, workers)
        run.engine = build_engine(cfg, model, tokenizer, run_dir)  # plain weights: with LoRA, the base
        if lora:  # adapters wrap the model in place (after the engine copied it); the reference is the base
            run.model = model = attach_lora(cfg, model, ckpt)  # with the adapters disabled: no second copy
        run.trainer = build_trainer_backend(cfg, model, tokenizer, ref_model, str(ckpt) if ckpt else cfg.model.name,
                                            run.engine)
        assemble(run, state, ckpt, generation_threads)
    except BaseException:
        run.close()
        raise
    return run


def episode_source(cfg: Config, source):
    """The first source of `EPISODE_SOURCES` the run uses, or None (episodes from the engine and `[env]`)."""
    for name in EPISODE_SOURCES.names():
        found = EPISODE_SOURCES.get(name)(cfg, source)
        if found is not None:
            return found
    return None


def split_threads(cfg: Config) -> int:
    """Set this process's torch threads; return the generation process's (async mode), else 0."""
    if cfg.control.mode != "async":
        configure_threads(cfg.model.threads)
        return 0
    free_cores = auto_threads()  # the cores other processes leave free now (or ROLLWISE_THREADS)
    generation_threads = cfg.control.generation_threads or max(1, free_cores // 2)
    configure_threads(cfg.model.threads or max(1, free_cores - generation_threads))
    return generation_threads


def assemble(run: Run, state: dict | None, ckpt: Path | None, generation_threads: int) -> None:
    """The parts of a run built after its trainer: methods, eval prompts, counters, replay, rollouts, sync,
    controller; then the checkpoint's state."""
    cfg = run.cfg
    run.plan = build_plan(run)
    run.guards = Guards(cfg)
    run.collapse = CollapseWatch.for_run(run.run_dir)  # resumed: folded from the rows metrics.jsonl kept
    run.eval_prompts = encode_eval_prompts(run.source, run.encoder, cfg.eval.n, to_stdout=True)
    run.flops = FlopCounter(model_info(run.model))
    run.replay = ReplayBuffer(cfg.replay, cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt,
                              seed=cfg.train.seed)
    if state is not None:
        restore_state(run, state, ckpt)
    run.rollouts = build_rollouts(run, generation_threads)
    run.sync = WeightSync(run.rollouts, run.trainer, run.tokenizer, cfg.sync.transport, cfg.sync.check_tokens,
                          cfg.sync.max_logprob_diff, sync_dir=run.run_dir / "sync")
    run.plan.setup.sync = run.sync  # a method may check an update on the engine before the step's sync (MIPU)
    if run.trainer.has_adapter and state is not None:  # the engine started from the base: give it the adapters
        run.sync.push(run.engine.version)
    run.controller = Controller(cfg, run.rollouts, run.next_prompts,
                                with_label_propagation(training_reward(run.reward_fn, cfg.reward), cfg.reward))
    run.controller.substitution = build_substitution(run)
    run.reward_guard = RewardFailureGuard(cfg.reward.max_failed_steps)
    if state is not None:
        restore_loop_state(run, state)


# -- the engine ---------------------------------------------------------------------------------------------
def build_engine(cfg: Config, model, tokenizer, run_dir: Path):
    """The engine `[rollout]` names, holding `model`'s weights as version 0: in this process
    (`rollwise.generate.factory`), or with `cluster.ray` as Ray actors that load the policy from an HF folder."""
    if cfg.cluster.ray:
        from rollwise.cluster import RemoteEngine

        return RemoteEngine.start(cfg, write_initial_weights(model, tokenizer, run_dir), tokenizer,
                                  engine_dtype(cfg.model.dtype))
    return build_local_engine(cfg, model, tokenizer, run_dir)


# -- the trainer backend ------------------------------------------------------------------------------------
def build_trainer_backend(cfg: Config, model, tokenizer, ref_model, model_path: str, engine):
    """`LoraTrainer` (lora.rank > 0), or `rollwise.train.launch.build_trainer`'s local or FSDP2 trainer; with
    `cluster.ray` and FSDP2, ranks 1..N-1 are Ray actors in the engine's cluster (rank 0 is this process), met
    at a store on the driver's address."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if cfg.lora.rank > 0:
        from rollwise.train.lora_trainer import LoraTrainer

        return LoraTrainer(model, cfg.train, cfg.algo, pad_id, tokenizer=tokenizer, save_merged=cfg.lora.save_merged,
                           temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens)
    from rollwise.train.launch import build_trainer

    if not (cfg.cluster.ray and cfg.train.backend == "fsdp2" and cfg.train.world_size > 1):
        return build_trainer(cfg, model, pad_id, ref_model=ref_model, model_path=model_path)
    from rollwise.cluster import start_trainer_ranks
    from rollwise.train.distributed import Rendezvous, free_port

    rendezvous = Rendezvous(engine.cluster.driver_address(), free_port(), cfg.train.world_size)
    ranks = start_trainer_ranks(engine.cluster, cfg.train.world_size, rendezvous.addr, rendezvous.port,
                                cfg.model_dump_json(), model_path)
    try:
        trainer = build_trainer(cfg, model, pad_id, ref_model=ref_model, model_path=model_path,
                                rendezvous=rendezvous)
    except BaseException:
        ranks.close()
        raise
    trainer.workers.processes = ranks.processes()  # a rank actor that dies is noticed at once
    ranks.store = trainer.workers.store
    trainer.closers.append(ranks.close)  # frees the ranks' bundles
    return trainer


def attach_lora(cfg: Config, base, ckpt: Path | None):
    """The PEFT model that trains: fresh adapters (seeded by train.seed) or the checkpoint's, on `base`."""
    from rollwise.train.lora import apply_lora, load_lora_checkpoint, lora_info

    model = load_lora_checkpoint(ckpt, base, cfg.lora) if ckpt else apply_lora(base, cfg.lora, seed=cfg.train.seed)
    print(f"rollwise: {lora_info(model).line()}", flush=True)
    return model


# -- methods ------------------------------------------------------------------------------------------------
def build_plan(run: Run) -> MethodPlan:
    """The stages and their methods; the teacher (loaded and checked now, before any step) when a stage uses one;
    the SFT stages' demonstration files (read now: a bad row stops the run before its first step)."""
    from rollwise.distill.teacher import build_teacher

    cfg = run.cfg
    stages = plan_stages(cfg.stage, cfg.train.steps, cfg.teacher, cfg.algo.method)
    setup = MethodSetup(cfg, policy=run.model, tokenizer=run.tokenizer, encoder=run.encoder,
                        demo_sources=load_demo_sources(cfg, stages), trainer=run.trainer)
    plan = MethodPlan(stages, setup)
    if plan.uses_teacher:
        pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else run.tokenizer.eos_token_id
        setup.teacher = build_teacher(cfg, run.model, run.tokenizer, run.encoder, run.trainer, pad_id, run.run_dir)
        if cfg.teacher.temperature != cfg.rollout.temperature:
            print(f"rollwise: warning: teacher.temperature {cfg.teacher.temperature:g} differs from rollout.temperature "
                  f"{cfg.rollout.temperature:g}: the teacher gap compares distributions at different temperatures",
                  flush=True)
        print(f"rollwise: teacher {cfg.teacher.weights} (context {cfg.teacher.context!r}, temperature "
              f"{cfg.teacher.temperature:g}, {cfg.distill.objective}); stages: "
              + ", ".join(s.describe() for s in stages), flush=True)
    return plan


# -- rollouts -----------------------------------------------------------------------------------------------
def build_rollouts(run: Run, generation_threads: int):
    """Where generation runs: this process (one turn or episodes), a `rollwise serve` elsewhere
    (`rollout.source = "service"`), a generation process (`control.mode = "async"`); with the TRB warm-up or
    the teacher rollout mixture, the teacher blended into sampling."""
    cfg = run.cfg
    own = getattr(run.episodes, "rollouts", None)  # an episode source with its own Generate stage (rollwise.agents)
    if run.episodes is not None and cfg.rollout.strategy != "plain":  # e.g. a tool task's own environment
        raise ConfigError(f"rollout.strategy = {cfg.rollout.strategy!r} generates single-turn responses; this run's "
                          "samples are multi-turn episodes: set rollout.strategy = 'plain' or a single-turn task")
    strategy = None if run.episodes is not None else build_strategy(  # rollout.strategy (rollwise.rollout_strategies)
        cfg, StrategyContext(run.tokenizer, run.model, cfg.train.seed, reward_fn=run.reward_fn))
    run.strategy = strategy  # its state (running rates, RNG) goes into checkpoints
    rollouts = own(run.engine) if own is not None else LocalRollouts(run.engine, run.episodes, strategy)
    if cfg.rollout.source == "service":  # generation by a `rollwise serve` elsewhere (rollwise/serve/client.py)
        from rollwise.serve.client import service_rollouts

        rollouts = service_rollouts(run)
    elif cfg.control.mode == "async":
        plain = run.engine.model if cfg.lora.rank > 0 else run.model  # the process copies a plain model
        recipe = getattr(run.episodes, "recipe", None)  # episodes run in the generation process too
        rollouts = ProcessRollouts(start_generation_process(cfg, plain, run.tokenizer, generation_threads,
                                                            run.step, recipe), run.episodes if recipe else None)
    if cfg.distill.trb_steps > 0 or cfg.distill.teacher_rollouts_per_group > 0:  # the teacher samples too
        from rollwise.distill.blend import BlendedRollouts

        d = cfg.distill
        rollouts = BlendedRollouts(rollouts, run.model, run.plan.setup.teacher, run.tokenizer, d.trb_steps,
                                   d.trb_budget, d.teacher_rollouts_per_group, cfg.train.seed)
    return rollouts


def start_generation_process(cfg: Config, model, tokenizer, threads: int, version: int, episodes=None):
    """The async mode's generation process: its own engine, weights (`model`'s, as `version`) and threads; with
    `episodes` (an `EpisodeRecipe`), the run's environment built there."""
    from rollwise.generate.process import GenerationProcess

    return GenerationProcess(model, tokenizer, dtype=engine_dtype(cfg.model.dtype, cfg.control.generation_device),
                             max_batch_size=cfg.rollout.max_batch_size, seed=cfg.train.seed + 1, threads=threads,
                             device=cfg.control.generation_device, version=version, episodes=episodes)


def build_substitution(run: Run):
    """ToolExpander's hard-sample substitution when the task offers guided prompts (rollwise.envs.substitution)."""
    if run.episodes is None or not hasattr(run.source, "guided_prompt"):
        return None
    if run.rollouts.engine is None:
        where = ("control.mode = 'async'" if run.cfg.rollout.source == "local"
                 else f"rollout.source = {run.cfg.rollout.source!r}")
        print(f"rollwise: task {run.source.name!r}: hard-sample substitution needs the run's own engine; it is off "
              f"with {where}", flush=True)
        return None
    rollout = run.cfg.rollout
    if rollout.temperature != 1.0 or rollout.top_p < 1.0 or rollout.top_k > 0:
        raise EnvError(f"task {run.source.name!r} substitutes hard samples, whose log-probs are recomputed at "
                       "temperature 1 without top-k / top-p: set rollout.temperature = 1, top_p = 1, top_k = 0")
    from rollwise.envs.substitution import HardSampleSubstitution

    return HardSampleSubstitution(run.source, run.episodes, run.rollouts.engine, run.encoder, run.reward_fn,
                                  run.cfg.reward.timeout_s, **getattr(run.source, "substitution_options", {}))
