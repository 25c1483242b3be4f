"""Held-out evaluation: sampled and greedy accuracy on a task's fixed evaluation split."""

from __future__ import annotations

from itertools import count

from rollwise.generate.base import Engine
from rollwise.generate.groups import make_groups, new_groups
from rollwise.rewards import DEFAULT_TIMEOUT_S, score_samples
from rollwise.types import GenerationRequest, Prompt, SamplingParams, Status

EVAL_SEED = 1234  # evaluation samples from its own stream, so it never shifts training's RNG


def evaluate(
    engine: Engine,
    prompts: list[tuple[Prompt, list[int]]],
    reward_fn,
    temperature: float,
    max_new_tokens: int,
    greedy: bool = True,
    reward_timeout_s: float | None = DEFAULT_TIMEOUT_S,
    episodes=None,
    keep_samples: list | None = None,
) -> dict[str, float]:
    """One response per prompt at `temperature` (and one greedy), each reward call limited to `reward_timeout_s`
    (`reward.timeout_s`). With `episodes` (rollwise.rollout.Episodes) each response is a multi-turn episode in
    its environment, and `max_new_tokens` bounds one turn. Returns `eval/*` metrics:
    `eval/sampled_accuracy`, `eval/greedy_accuracy`, `eval/response_len_mean`,
    `eval/greedy_response_len_mean`, `eval/n`, `eval/reward_errors` (+ `eval/<mode>_episode/*` for episodes).
    An accuracy is None when every reward of that mode failed (the errors are counted, never scored 0).
    `keep_samples`, when given, receives `(mode, samples)` for each mode (`rollwise eval --out`).
    """
    out: dict[str, float] = {"eval/n": float(len(prompts))}
    modes = [("sampled", temperature)] + ([("greedy", 0.0)] if greedy else [])
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=t, seed=EVAL_SEED) for _, t in modes]
    per_mode = _episode_samples(engine, prompts, params, episodes) if episodes is not None else \
        _one_turn_samples(engine, prompts, params)
    for (label, _), samples in zip(modes, per_mode):
        metrics = score_samples(samples, reward_fn, reward_timeout_s)
        scored = [s for s in samples if s.status != Status.FAILED]  # failed rewards are errors, not wrong answers
        n = max(1, len(samples))
        prefix = "eval/" if label == "sampled" else "eval/greedy_"
        # None (null) when no reward could be scored: every answer an error is not an accuracy of 0
        out[f"eval/{label}_accuracy"] = sum(bool(s.correct) for s in scored) / len(scored) if scored else None
        out[f"{prefix}response_len_mean"] = sum(len(s.response_ids) for s in samples) / n
        out[f"{prefix}truncated_frac"] = sum(s.status.value == "truncated" for s in samples) / n
        out[f"{prefix}reward_errors"] = metrics.get("reward/errors", 0.0)
        if episodes is not None:
            from rollwise.envs.episode import episode_metrics

            out.update({f"eval/{label}_{k}": v for k, v in episode_metrics(samples).items()})
        if keep_samples is not None:
            keep_samples.append((label, samples))
    return out


def _one_turn_samples(engine: Engine, prompts, params: list[SamplingParams]) -> list[list]:
    # one engine call, the modes of each prompt next to each other: they share that prompt's prefill
    requests = [GenerationRequest(i * len(params) + k, ids, p)
                for i, (_, ids) in enumerate(prompts) for k, p in enumerate(params)]
    results = engine.generate(requests)
    return [[g.samples[0] for g in make_groups(prompts, 1, results[k :: len(params)])] for k in range(len(params))]


def _episode_samples(engine: Engine, prompts, params: list[SamplingParams], episodes) -> list[list]:
    out = []
    ids = count()
    for p in params:
        groups = new_groups(prompts, 1, 0)
        episodes.run(engine, groups, p, ids)
        out.append([g.samples[0] for g in groups])
    return out
