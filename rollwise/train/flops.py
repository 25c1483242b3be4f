"""FLOPs and MFU of one RL step, counted the way the trainer micro-batches its passes.

    row.update(step_perf(run, batch, samples, trained, timer.seconds, train_metrics))   # perf/* figures

The model arithmetic and the measured peaks are `rollwise.perf`'s; what is here needs the trainer's batching
(`split_by_tokens`): a forward-only pass over samples computes each prompt once per micro-batch when prompts
are shared, so its FLOPs depend on how the samples split.
"""

from __future__ import annotations

from rollwise.perf import FlopCounter, PeakSpec, checked_mfu, rollout_flops, run_peak_spec, train_flops
from rollwise.perf_datasheet import datasheet_gflops
from rollwise.train.batching import split_by_tokens


def reference_flops(counter: FlopCounter, samples, micro_batch_tokens: int, share_prompt: bool) -> float:
    """FLOPs of the reference pass `Trainer.kl_penalties` runs in the filter stage (`algo.kl_in_reward`): one
    forward over the micro-batches it builds (a prompt counts once per micro-batch with `share_prompt`)."""
    if not samples:
        return 0.0
    tokens = 0
    for batch in split_by_tokens(samples, micro_batch_tokens, share_prompt=share_prompt):
        prompts = {tuple(s.prompt_ids) for s in batch} if share_prompt else [s.prompt_ids for s in batch]
        tokens += sum(len(p) for p in prompts) + sum(len(s.response_ids) for s in batch)
    responses = sum(len(s.response_ids) for s in samples)
    context = sum(s.num_tokens for s in samples) / len(samples)
    return counter.forward(tokens, context / 2, responses)


def step_perf(run, batch, samples, trained, seconds: dict[str, float],
              train_metrics: dict[str, float]) -> dict[str, float | None]:
    """`perf/*` FLOP and MFU figures of one RL step of `run` (see `mfu_figures` for the definitions).

    batch: the step's `StepBatch` (`scored` samples give the rollout contexts, `generate_s` the engine's own
    time); samples: the fresh samples the filter stage kept (the `kl_in_reward` reference pass runs on them);
    trained: what the update used; train_metrics: `Trainer.step`'s metrics (its `train/passes/*`)."""
    cfg, stats = run.cfg, run.rollouts.stats
    flops = {"rollout": rollout_flops(run.flops, stats, batch.scored),
             "train": train_flops(run.flops, trained, train_metrics)}
    if cfg.algo.kl_coef > 0 and cfg.algo.kl_in_reward:
        flops["filter"] = reference_flops(run.flops, samples, cfg.train.micro_batch_tokens, cfg.train.share_prompt)
    teacher = run.plan.setup.teacher
    scored = getattr(teacher, "last_scored", None)  # the teacher's pass over its prompts and the responses
    if scored:
        flops["method"] = reference_flops(teacher.flops, scored, cfg.train.micro_batch_tokens,
                                          cfg.train.share_prompt)
        teacher.last_scored = []
    spec = run_peak_spec(run)
    out = checked_mfu(flops, seconds, batch.generate_s, spec, step=run.step)
    out.update(datasheet_mfu(flops, seconds, spec))
    out["perf/step_tflop"] = sum(flops.values()) / 1e12
    out["perf/rollout_padding_eff"] = stats.padding_eff
    return out


def datasheet_mfu(flops: dict[str, float], seconds: dict[str, float], spec: PeakSpec) -> dict[str, float | None]:
    """`perf/train_mfu_datasheet`: train FLOPs / train seconds / the datasheet peak of the trainer's device and
    precision (`rollwise.perf_datasheet`), beside `perf/train_mfu` (the measured peak); None where the device's
    datasheet figure is not known. `perf/peak_gflops_train_datasheet` names the denominator."""
    peak = datasheet_gflops(spec.train_dtype, spec.train_on_cpu, spec.threads)
    train_s = seconds.get("train", 0.0)
    mfu = flops.get("train", 0.0) / train_s / (peak * 1e9) if peak and train_s > 0 else None
    return {"perf/train_mfu_datasheet": mfu, "perf/peak_gflops_train_datasheet": peak}
