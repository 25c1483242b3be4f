"""The RL lifecycle loop: Generate -> Score -> Filter -> Control -> Replay -> Train -> Sync.

Read `rl_step` top to bottom to see one step; `train` wraps it with evaluation, checkpoints,
metrics and the console view.
"""

from __future__ import annotations

import json
import resource
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from rollwise import algo
from rollwise.config import Config
from rollwise.envs.episode import episode_metrics, transcript
from rollwise.evaluate import evaluate
from rollwise.hardware import adapt_threads
from rollwise.control import StepBatch, staleness_metrics
from rollwise.distill import step as distill_step
from rollwise.metrics import ConsoleView, print_summary, write_report
from rollwise.perf import step_perf
from rollwise.session import Run, open_run, save_run
from rollwise.sync import policy_state
from rollwise.train.checkpoint import latest_checkpoint
from rollwise.train.trainer import NonFiniteError
from rollwise.types import Group, Sample, Status


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


def assign_advantages(groups: list[Group], cfg: Config, trainer=None) -> tuple[list[Sample], dict[str, float]]:
    """Set each sample's training reward (shaped, KL-penalised) and, for outcome estimators, its advantage.

    Returns the samples to train on and `reward/*` metrics of the shaping. Token-level estimators (`gae`)
    get their advantages in the trainer, from the value head.
    """
    samples = [s for g in groups for s in g.usable()]
    if not samples:
        return [], {}
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # [N]
    group_ids = torch.tensor([s.group_id for s in samples])  # [N]
    metrics: dict[str, float] = {}
    if cfg.algo.shaping:
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
        correct = torch.tensor([bool(s.correct) for s in samples])
        names = sorted({k for s in samples for k in s.reward_parts})
        parts = {k: torch.tensor([s.reward_parts.get(k, 0.0) for s in samples], dtype=torch.float32) for k in names}
        for name, options in cfg.algo.shaping.items():
            options = {"max_len": cfg.rollout.max_new_tokens, **options}
            rewards = algo.shape_rewards(name, rewards, lengths, group_ids, correct, parts=parts, **options)
        metrics["reward/shaped_mean"] = float(rewards.mean())
    if cfg.algo.kl_coef > 0 and cfg.algo.kl_in_reward and trainer is not None:
        penalty = torch.tensor(trainer.kl_penalties(samples), dtype=torch.float32)  # [N], <= 0
        rewards = rewards + penalty
        metrics["reward/kl_penalty_mean"] = float(penalty.mean())
    for s, r in zip(samples, rewards.tolist()):
        s.train_reward = r
    if algo.is_token_advantage(cfg.algo.advantage):
        return samples, metrics
    options = {"scale": cfg.algo.scale_rewards == "group"} if cfg.algo.advantage == "grpo" else {}
    advantages = algo.advantage(cfg.algo.advantage, rewards, group_ids, **options)  # [N]
    for s, a in zip(samples, advantages.tolist()):
        s.advantage = a
    return samples, metrics


def rl_step(run: Run) -> tuple[dict[str, float], StepBatch]:
    """One RL step. Returns its metrics row and its batch (groups generated, samples trained)."""
    cfg, timer = run.cfg, StageTimer()
    adapt_threads()  # fewer torch threads while other processes take cores (automatic threads only)
    step_start = time.perf_counter()
    version = run.step  # the policy version the trainer holds; the engines have it too (synced last step)
    run.rollouts.stats.reset()
    stage = run.stages.at(run.step)  # [[stage]]: rl, opd, opsd or sft (rollwise.distill.stages)
    if run.stages.starts_now(run.step):
        print(f"rollwise: step {run.step + 1}: {stage.describe()}", flush=True)
    demos = stage.kind == "sft" and stage.cfg is not None and stage.cfg.data is not None
    # groups whose rewards are all equal still carry the teacher's signal, and an SFT stage keeps every correct one
    run.controller.keep_uniform_groups(stage.uses_teacher or stage.kind == "sft")
    # Generate -> Score -> Filter -> Control: rounds of generation until the batch is full (control.py)
    batch = StepBatch(groups=[]) if demos else run.controller.collect(run.step, version, timer)
    observe = getattr(run.source, "observe", None)  # a task's curriculum learns from the step's groups
    curriculum = observe(batch.generated) if observe is not None else {}
    if run.controller.substitution is not None:
        curriculum.update(run.controller.substitution.metrics())
    with timer("filter"):
        samples, shaping_metrics = assign_advantages(batch.groups, cfg, run.trainer)
    if stage.kind == "sft":  # demonstrations: from the stage's file, or the correct responses just sampled
        samples, sft_metrics = (distill_step.demo_batch(run, stage), {}) if demos else \
            distill_step.rejection_sampled(batch.groups)
        shaping_metrics.update(sft_metrics)
    with timer("teacher"):  # the teacher scores every response token; Self-Routing; SFT marks
        samples, distill_metrics = distill_step.prepare(run, stage, samples)
    if hasattr(run.rollouts, "pop_metrics"):  # the TRB warm-up's budget and mixture weight
        distill_metrics.update(run.rollouts.pop_metrics())
    run.trainer.terms = distill_step.step_terms(run, stage, samples)
    with timer("replay"):  # Replay: mix stored samples in, then store this batch's
        replayed = [] if stage.kind == "sft" else run.replay.draw(version, groups_dropped=batch.groups_short)
        if stage.kind != "sft":
            run.replay.add(batch.groups, version)
    batch.replayed = replayed
    trained = batch.trained = samples + replayed
    train_metrics: dict[str, float] = {}
    with timer("train"):  # Train
        if trained:
            train_metrics = run.trainer.step(trained, version=version)
        else:
            run.trainer.skip_step()  # nothing to learn from: the schedule still advances
        if run.teacher is not None and trained:
            run.teacher.after_update(run.model)  # an EMA teacher follows the policy
    with timer("sync"):  # Sync weights, then check the engine samples from them (sync/logprob_max_abs_diff)
        sync_metrics = run.sync.push(version + 1)
    run.step += 1
    row = {"step": run.step, "kind": "train", **dict.fromkeys(TRAIN_KEYS), **batch.metrics, **shaping_metrics,
           **train_metrics, **sync_metrics, **run.replay.metrics(), **staleness_metrics(trained, version), **curriculum,
           **distill_metrics, **run.stages.metrics(version)}
    row["replay/replayed_frac"] = len(replayed) / max(1, len(trained))
    row.update(rollout_metrics(batch.scored, run.rollouts.stats.generated_tokens, batch.generate_s))
    row.update(run.guards.observe(run.step, batch.scored, row, alarm=stage.uses_teacher))
    row.update(episode_metrics([s for g in batch.generated for s in g.samples]))
    row.update(perf_metrics(row, timer, time.perf_counter() - step_start))
    row.update(step_perf(run, batch, samples, trained, timer.seconds, train_metrics))
    row.update(run.encoder.metrics())
    row["perf/elapsed_s"] = time.time() - run.started_at
    run.totals["tokens_generated"] += row["rollout/tokens"]
    run.totals["tokens_trained"] += row.get("train/tokens", 0.0)
    run.totals["steps_s"] = run.totals.get("steps_s", 0.0) + row["perf/step_s"]
    return row, batch


def episode_record(s: Sample) -> dict:
    """The JSON-ready record of an episode: transcript, tool calls, turns, how it ended, env reward parts."""
    ep = s.episode
    return {"transcript": transcript(s), "ended_by": ep.ended_by, "turns": [list(t) for t in s.turns],
            "tool_calls": [{"name": c.name, "args": c.args, "result": c.result, "error": c.error,
                            "wall_s": c.wall_s} for c in s.tool_calls],
            "env_parts": ep.parts, "turn_parts": ep.turn_parts, "env_error": ep.error}


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
    train_s = timer.seconds.get("train", 0.0)
    return {
        **timer.metrics(),
        "perf/step_s": step_s,
        "perf/rollout_s": timer.seconds.get("rollout", 0.0),
        "perf/train_s": train_s,
        "perf/train_tokens_per_s": row.get("train/tokens", 0.0) / max(train_s, 1e-9),
        "perf/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def run_eval(run: Run) -> dict[str, float]:
    cfg = run.cfg
    adapt_threads()
    start = time.perf_counter()
    if run.engine.version != run.step:  # async mode: the local engine only evaluates; bring it up to date
        run.engine.update_weights(policy_state(run.trainer), version=run.step)
    metrics = evaluate(run.engine, run.eval_prompts, run.reward_fn, cfg.eval.temperature,
                       cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, cfg.eval.greedy,
                       reward_timeout_s=cfg.reward.timeout_s, episodes=run.episodes)
    row = {"step": run.step, "kind": "eval", **metrics, "perf/time/eval_s": time.perf_counter() - start}
    run.writer.write(row)
    return row


def log_samples(run: Run, samples: list[Sample]) -> None:
    """Write a subset of this step's prompts, responses and rewards to `samples/step-N.jsonl`."""
    n = run.cfg.run.samples_logged_per_step
    if n <= 0:
        return
    out = run.run_dir / "samples" / f"step-{run.step}.jsonl"
    out.parent.mkdir(exist_ok=True)
    picked = samples[:: max(1, run.cfg.rollout.samples_per_prompt // 2)][:n]
    with out.open("w") as f:
        for s in picked:
            row = {"prompt": s.prompt.messages[-1]["content"], "answer": s.prompt.answer,
                   "response": s.response_text, "reward": s.reward, "status": s.status.value,
                   "error": s.reward_error, "advantage": s.advantage,
                   "policy_versions": sorted({v for _, _, v in s.version_spans}), "replayed": s.replayed}
            if getattr(s, "teacher_logprobs", None):  # distillation: the mean gap logp_sampling - logp_teacher, and the route
                row.update(distill_step.sample_record(s))
            if getattr(s, "episode", None) is not None:  # the whole transcript, tool calls and how the episode ended
                row.update(episode_record(s))
            f.write(json.dumps(row) + "\n")


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C: the run stopped; `checkpoint` is the newest complete checkpoint (None: none yet)."""

    def __init__(self, step: int, checkpoint: Path | None):
        super().__init__(f"interrupted during step {step + 1}")
        self.step, self.checkpoint = step, checkpoint


def train(cfg: Config, run_dir: Path, resume: bool = False) -> dict:
    """Run (or resume) training to `train.steps`; returns the summary printed at the end.

    Errors carry where they happened as `exc.rollwise_where` ("step 3", ...) for the CLI's one-line message.
    """
    run = open_run(cfg, run_dir, resume)
    stop = StopOnInterrupt()
    try:
        with stop:
            return _train(run, cfg, run_dir, stop)
    except KeyboardInterrupt as exc:
        raise RunInterrupted(run.step, latest_checkpoint(run_dir)) from exc
    except BaseException as exc:
        exc.rollwise_where = stop.phase  # type: ignore[attr-defined]
        raise
    finally:  # also on errors and Ctrl-C: engines and servers, the generation process, reward workers,
        run.close()  # trainer ranks, the Ray cluster, the sinks


class StopOnInterrupt:
    """Ctrl-C during an RL step finishes that step, saves a checkpoint and then stops (`requested`); Ctrl-C
    outside a step, or a second one, stops at once. Only installed in the main thread. `phase` names what the
    loop is doing, for the one-line error of anything that fails."""

    def __init__(self) -> None:
        self.in_step = False
        self.requested = False
        self.phase = "start"  # what the loop is doing, for error messages ("step 3", "evaluation at step 10")
        self._previous = None

    def __enter__(self) -> "StopOnInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum, frame) -> None:
        if not self.in_step or self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nrollwise: Ctrl-C: finishing this step and saving a checkpoint, then stopping "
              "(Ctrl-C again stops at once)", flush=True)


def check_step_health(run: Run, batch: StepBatch) -> None:
    """Stop the run when every reward failed for `reward.max_failed_steps` steps in a row, or training was
    non-finite for `train.max_nonfinite_steps` RL steps in a row."""
    failed = [s for g in batch.generated for s in g.samples if s.status == Status.FAILED]
    run.reward_guard.observe(run.step, len(batch.scored), len(failed), failed[0] if failed else None)
    limit = run.cfg.train.max_nonfinite_steps
    if run.trainer.nonfinite_streak >= limit:
        raise NonFiniteError(
            f"step {run.step}: the loss or gradient was NaN/Inf in {run.trainer.nonfinite_streak} steps in a row "
            f"(train.max_nonfinite_steps={limit}); those updates were skipped and no checkpoint holds them. "
            "Lower train.lr, check a custom loss or reward, or try train.precision=fp32")


def _train(run: Run, cfg: Config, run_dir: Path, stop: StopOnInterrupt) -> dict:
    print(f"rollwise: run {run_dir} | model {cfg.model.name} | task {cfg.data.path or cfg.data.task} | "
          f"step {run.step}/{cfg.train.steps}", flush=True)
    first_eval = None
    if run.step == 0 and cfg.eval.n > 0:
        print(f"rollwise: evaluating the starting model on {len(run.eval_prompts)} held-out prompts", flush=True)
        stop.phase = "evaluation at step 0"
        first_eval = run_eval(run)
    with ConsoleView(cfg.train.steps, enabled=cfg.run.console, start_step=run.step) as view:
        if first_eval:
            view.eval(first_eval)
        while run.step < cfg.train.steps:
            stop.in_step, stop.phase = True, f"step {run.step + 1}"
            row, batch = rl_step(run)
            stop.in_step = False
            run.writer.write(row)
            # every response completed this step (failed ones too: their errors are logged), then the replayed
            log_samples(run, [s for g in batch.generated for s in g.samples] + batch.replayed)
            check_step_health(run, batch)
            if cfg.distill.guard_stop and row.get("distill/collapse_alarm") == 1.0:
                stop.phase = f"checkpoint at step {run.step}"
                save_run(run)
                run.guards.check_stop(run.step, row)
            if stop.requested:
                save_run(run)
                raise KeyboardInterrupt
            view.update(run.step, row)
            if cfg.eval.every_steps and run.step % cfg.eval.every_steps == 0 and run.step < cfg.train.steps:
                stop.phase = f"evaluation at step {run.step}"
                view.eval(run_eval(run))
            if cfg.run.save_every_steps and run.step % cfg.run.save_every_steps == 0:
                stop.phase = f"checkpoint at step {run.step}"
                save_run(run)
            if cfg.train.max_time_s and run.totals["steps_s"] >= cfg.train.max_time_s:
                print(f"rollwise: train.max_time_s={cfg.train.max_time_s:g} reached after step {run.step}", flush=True)
                break
    stop.phase = f"final evaluation at step {run.step}"
    last_eval = run_eval(run) if cfg.eval.n > 0 else None
    stop.phase = f"final checkpoint at step {run.step}"
    save_run(run)
    stop.phase = "report"
    return finish(run, first_eval, last_eval)


def finish(run: Run, first_eval: dict | None, last_eval: dict | None) -> dict:
    from rollwise.metrics.report import summarize

    if run.cfg.run.report:
        write_report(run.run_dir)
    history = summarize(run.run_dir)
    summary = {
        "eval_before": first_eval or history.get("eval_before") or {},
        "eval_after": last_eval or {},
        "wall_s": time.time() - run.started_at,
        "tokens_generated": run.totals["tokens_generated"],
        "tokens_trained": run.totals["tokens_trained"],
        "steps": run.step,
        "run_dir": str(run.run_dir),
    }
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    return summary
