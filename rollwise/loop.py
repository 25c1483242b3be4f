"""The RL lifecycle loop: Generate -> Score -> Filter -> Control -> Method -> Replay -> Train -> Sync.

Read `rl_step` top to bottom to see one step; `train` wraps it with evaluation, checkpoints, metrics and the
console view. The step never asks which method, trainer backend, engine or placement it runs: they arrive
built (`rollwise.build`) behind their protocols.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rollwise.advantages import assign_advantages
from rollwise.early_stop import EarlyStop
from rollwise.control import StepBatch, staleness_metrics
from rollwise.envs.episode import episode_metrics
from rollwise.evaluate import evaluate
from rollwise.hardware import adapt_threads
from rollwise.interrupt import RunInterrupted, StopOnInterrupt
from rollwise.methods import StepInput
from rollwise.metrics import ConsoleView, print_summary, write_report
from rollwise.metrics.collapse import answer_metrics
from rollwise.train.flops import step_perf
from rollwise.record import TRAIN_KEYS, StageTimer, log_samples, perf_metrics, rollout_metrics
from rollwise.session import Run, save_run
from rollwise.build import open_run
from rollwise.train.checkpoint import latest_checkpoint
from rollwise.train.trainer import NonFiniteError
from rollwise.types import Status


def rl_step(run: Run) -> tuple[dict[str, float], StepBatch]:
    """One RL step. Returns its metrics row and its batch (groups generated, samples trained)."""
    cfg, timer = run.cfg, StageTimer()
    adapt_threads()  # fewer torch threads while other processes take cores (automatic threads only)
    step_start = time.perf_counter()
    version = run.step  # the policy version the trainer holds; the engines have it too (synced last step)
    run.rollouts.stats.reset()
    stage, method = run.plan.at(version)  # the [[stage]] of this step and its method (rollwise.methods)
    if run.plan.starts_now(version):
        print(f"rollwise: step {version + 1}: {stage.describe()}", flush=True)
    run.controller.keep_uniform_groups(method.keeps_uniform_groups)
    # Generate -> Score -> Filter -> Control: rounds of generation until the batch is full (control.py)
    batch = run.controller.collect(version, version, timer) if method.generates(stage) else StepBatch(groups=[])
    observe = getattr(run.source, "observe", None)  # a task's curriculum learns from the step's groups
    curriculum = observe(batch.generated) if observe is not None else {}
    with timer("filter"):  # training rewards (shaping, KL penalty) and outcome advantages
        samples, shaping_metrics = assign_advantages(batch.groups, cfg, run.trainer)
    with timer("method"):  # what the method adds: teacher scores, routes, demonstrations, loss terms
        prepared = method.prepare(StepInput(version, stage, batch.groups, samples))
    with timer("replay"):  # Replay: mix stored samples in, then store this batch's
        replayed = run.replay.draw(version, groups_dropped=batch.groups_short) if method.replays else []
        if method.replays:
            run.replay.add(batch.groups, version, trained=prepared.samples)
    batch.replayed, batch.trained = replayed, prepared.samples + replayed
    train_metrics: dict[str, float] = {}
    with timer("train"):  # Train
        run.sync.release_memory()  # an engine sharing the trainer's GPU frees it until the sync (vLLM sleep mode)
        if batch.trained:
            train_metrics = run.trainer.step(batch.trained, version=version, terms=prepared.terms)
            method.after_update(run.model)
        else:
            run.trainer.skip_step()  # nothing to learn from: the version and the schedule still advance
    with timer("sync"):  # Sync weights, then check the engine samples from them (sync/logprob_max_abs_diff)
        sync_metrics = run.sync.push(run.step)
    row = {"step": run.step, "kind": "train", **dict.fromkeys(TRAIN_KEYS), **batch.metrics, **shaping_metrics,
           **train_metrics, **sync_metrics, **run.replay.metrics(), **staleness_metrics(batch.trained, version),
           **curriculum, **prepared.metrics, **run.rollouts.pop_metrics(), **run.plan.metrics(version)}
    row["replay/replayed_frac"] = len(replayed) / max(1, len(batch.trained))
    row.update(rollout_metrics(batch.scored, run.rollouts.stats.generated_tokens, batch.generate_s))
    row.update(answer_metrics(batch.scored))  # one answer to every prompt? (rollwise.metrics.collapse)
    row.update(run.guards.observe(run.step, batch.scored, row, alarm=method.uses_teacher))
    row.update(episode_metrics([s for g in batch.generated for s in g.samples]))
    row.update(perf_metrics(row, timer, time.perf_counter() - step_start))
    row.update(step_perf(run, batch, samples, batch.trained, timer.seconds, train_metrics))
    row.update(run.encoder.metrics())
    row["perf/elapsed_s"] = time.time() - run.started_at
    run.totals["tokens_generated"] += row["rollout/tokens"]
    run.totals["tokens_trained"] += row.get("train/tokens", 0.0)
    run.totals["steps_s"] = run.totals.get("steps_s", 0.0) + row["perf/step_s"]
    batch.record = prepared.record
    if run.collapse is not None:  # the complete row: answer collapse, entropy ratio (prints a warning once)
        row.update(run.collapse.observe(row))
    return row, batch


def run_eval(run: Run, early: EarlyStop | None = None) -> dict[str, float]:
    """Evaluate the current policy and log the row; `early` (the best checkpoint, train.early_stop) observes
    it, and saves the step's checkpoint when it is the best so far."""
    cfg = run.cfg
    adapt_threads()
    start = time.perf_counter()
    if run.engine.version != run.step:  # async mode: the local engine only evaluates; bring it up to date
        run.engine.update_weights(run.trainer.policy_state(), version=run.step)
    metrics = evaluate(run.engine, run.eval_prompts, run.reward_fn, cfg.eval.temperature,
                       cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, cfg.eval.greedy,
                       reward_timeout_s=cfg.reward.timeout_s, episodes=run.episodes, k=cfg.eval.k,
                       stop=tuple(cfg.rollout.stop), top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
    row = {"step": run.step, "kind": "eval", **metrics, "perf/time/eval_s": time.perf_counter() - start}
    if run.collapse is not None:  # held-out accuracy below its best by more than noise (rollwise.metrics.collapse)
        row.update(run.collapse.observe(row))
    run.writer.write(row)
    if early is not None:
        early.observe(row, save=lambda: save_run(run))
    return row


def train(cfg, run_dir: Path, resume: bool = False) -> dict:
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
        run.close()  # trainer ranks, the Ray cluster, the teacher, the sinks


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


def _train(run: Run, cfg, run_dir: Path, stop: StopOnInterrupt) -> dict:
    print(f"rollwise: run {run_dir} | model {cfg.model.name} | task {cfg.data.path or cfg.data.task} | "
          f"step {run.step}/{cfg.train.steps}", flush=True)
    first_eval = None
    early = EarlyStop.for_run(cfg, run_dir)  # checkpoints/best, train.early_stop; resumed: from the eval rows
    # (a run resumed from its step-0 checkpoint, the best one so far, has its starting evaluation already)
    if run.step == 0 and cfg.eval.n > 0 and cfg.eval.at_start and not early.evaluated(0):
        print(f"rollwise: evaluating the starting model on {len(run.eval_prompts)} held-out prompts", flush=True)
        stop.phase = "evaluation at step 0"
        first_eval = run_eval(run, early)
    with ConsoleView(cfg.train.steps, enabled=cfg.run.console, start_step=run.step) as view:
        if first_eval:
            view.eval(first_eval)
        while run.step < cfg.train.steps and not early.stops(run.step):
            # a first Ctrl-C anywhere in this iteration (the step, its logs, an evaluation or checkpoint due now)
            # lets the iteration finish, then saves and stops
            stop.in_step, stop.phase = True, f"step {run.step + 1}"
            row, batch = rl_step(run)
            run.writer.write(row)
            # every response completed this step (failed ones too: their errors are logged), then the replayed
            log_samples(run.run_dir, run.step, [s for g in batch.generated for s in g.samples] + batch.replayed,
                        cfg.rollout.samples_per_prompt, cfg.run.samples_logged_per_step, batch.record)
            check_step_health(run, batch)
            if run.guards.alarmed(row):  # the collapse guard asks to stop: keep this step's checkpoint first
                stop.phase = f"checkpoint at step {run.step}"
                save_run(run)
                run.guards.check_stop(run.step, row)
            view.update(run.step, row)
            if cfg.eval.every_steps and run.step % cfg.eval.every_steps == 0 and run.step < cfg.train.steps:
                stop.phase = f"evaluation at step {run.step}"
                view.eval(run_eval(run, early))
            saved = cfg.run.save_every_steps and run.step % cfg.run.save_every_steps == 0
            if (saved or stop.requested) and early.saved_step != run.step:
                stop.phase = f"checkpoint at step {run.step}"
                save_run(run)
            stop.in_step = False
            if stop.requested:
                raise KeyboardInterrupt
            if cfg.train.max_time_s and run.totals["steps_s"] >= cfg.train.max_time_s:
                print(f"rollwise: train.max_time_s={cfg.train.max_time_s:g} reached after step {run.step}", flush=True)
                break
    stop.phase = f"final evaluation at step {run.step}"
    if early.stopped_at is not None:  # the evaluation that stopped the run is the last one
        last_eval = early.last_row
    else:
        last_eval = run_eval(run, early) if cfg.eval.n > 0 else None
    stop.phase = f"final checkpoint at step {run.step}"
    if early.saved_step != run.step:
        save_run(run)
    stop.phase = "report"
    return finish(run, first_eval, last_eval, early)


def finish(run: Run, first_eval: dict | None, last_eval: dict | None, early: EarlyStop | None = None) -> dict:
    from rollwise.metrics.report import summarize

    history = summarize(run.run_dir)
    best = early.best() if early is not None else None  # checkpoints/best and whether the run ended below it
    summary = {
        "eval_before": first_eval or history.get("eval_before") or {},
        "eval_after": last_eval or {},
        "wall_s": time.time() - run.started_at,
        "tokens_generated": run.totals["tokens_generated"],
        "tokens_trained": run.totals["tokens_trained"],
        "steps": run.step,
        "run_dir": str(run.run_dir),
        **({"early_stop": early.summary()} if early is not None and early.enabled else {}),
        **({"best": best} if best is not None else {}),
    }
    if run.collapse is not None and run.collapse.summary():  # the collapse warnings the run raised
        summary["warnings"] = run.collapse.summary()
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if run.cfg.run.report:  # after summary.json: the report shows its best checkpoint
        write_report(run.run_dir)
    print_summary(summary)
    for line in early.lines(run.step) if early is not None and early.keeps_best else []:
        print(line, flush=True)  # where the best is; a warning when the run ended below it by more than noise
    return summary
