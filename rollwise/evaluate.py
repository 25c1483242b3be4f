"""Held-out evaluation: sampled accuracy, pass@k and avg@K over K samples, and greedy accuracy, on a task's
fixed evaluation split; per source when the prompts come from more than one (`Prompt.origin`).

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
eq. 1): with n samples of a prompt of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), the chance that
at least one of k samples drawn without replacement from the n is correct, averaged over prompts.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import count

from rollwise.generate.base import Engine
from rollwise.generate.groups import make_groups, new_groups
from rollwise.metrics.prior import prior_metrics, reference_mode_frac
from rollwise.rewards import DEFAULT_TIMEOUT_S, score_samples
from rollwise.types import GenerationRequest, Prompt, Sample, SamplingParams, Status

EVAL_SEED = 1234  # evaluation samples from its own stream, so it never shifts training's RNG
# the per-mode keys of an eval row (besides pass@k, avg@K and the episode keys)
SAMPLED_KEYS = ("eval/sampled_accuracy", "eval/response_len_mean", "eval/truncated_frac", "eval/reward_errors",
                "eval/n", "eval/sampled_balanced_accuracy", "eval/sampled_answer_mode_frac",
                "eval/reference_mode_frac")
GREEDY_KEYS = ("eval/greedy_accuracy", "eval/greedy_response_len_mean", "eval/greedy_truncated_frac",
               "eval/greedy_reward_errors", "eval/greedy_balanced_accuracy", "eval/greedy_answer_mode_frac")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `n` samples, `c` of them correct (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), computed as the product 1 - prod_{i=n-c+1..n} (1 - k/i), which never forms the
    (huge) binomials. 1.0 when n - c < k (every draw of k holds a correct one). ValueError when k < 1, n < k
    (k samples cannot be drawn from n) or c is not in 0..n."""
    if k < 1 or n < k:
        raise ValueError(f"pass@{k} needs at least {max(k, 1)} samples of the prompt, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: c={c} correct samples out of n={n}")
    if n - c < k:
        return 1.0
    missing = 1.0
    for i in range(n - c + 1, n + 1):
        missing *= 1.0 - k / i
    return 1.0 - missing


def pass_ks(k: int) -> list[int]:
    """The k's reported for K samples per prompt: the powers of two below K, then K itself
    (K = 10 -> [1, 2, 4, 8, 10]; K = 8 -> [1, 2, 4, 8]; K = 1 -> [1]): log-spaced, as pass@k curves are read,
    and a bounded number of metric keys for large K."""
    out = [1 << i for i in range(k.bit_length()) if (1 << i) < k]
    return out + [k]


def correctness_metrics(groups: list[list[Sample]], k: int, prefix: str = "eval/") -> dict[str, float | None]:
    """pass@j for j in `pass_ks(k)` and avg@k over prompts (`groups`: the k scored samples of each prompt).

    Failed rewards are errors, not wrong answers: a prompt's n and c count its scored samples only; a prompt
    with fewer than j scored samples is left out of pass@j, and a figure no prompt could give is None.
    avg@k is each prompt's accuracy over its scored samples, averaged over prompts."""
    scored = [[s for s in g if s.status != Status.FAILED] for g in groups]
    counts = [(len(g), sum(bool(s.correct) for s in g)) for g in scored]
    out: dict[str, float | None] = {}
    for j in pass_ks(k):
        values = [pass_at_k(n, c, j) for n, c in counts if n >= j]
        out[f"{prefix}pass@{j}"] = sum(values) / len(values) if values else None
    means = [c / n for n, c in counts if n > 0]
    out[f"{prefix}avg@{k}"] = sum(means) / len(means) if means else None
    return out


def accuracy(samples: list[Sample]) -> float | None:
    """Correct share of the scored samples; None when no reward could be scored (every answer an error is not
    an accuracy of 0)."""
    scored = [s for s in samples if s.status != Status.FAILED]
    return sum(bool(s.correct) for s in scored) / len(scored) if scored else None


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
    k: int = 1,
    stop: tuple[str, ...] = (),
    top_p: float = 1.0,
    top_k: int = 0,
) -> dict[str, float]:
    """`k` responses per prompt at `temperature` (and one greedy), each reward call limited to `reward_timeout_s`
    (`reward.timeout_s`). With `episodes` (rollwise.rollout.Episodes) each response is a multi-turn episode in
    its environment, and `max_new_tokens` bounds one turn. Returns `eval/*` metrics:
    `eval/sampled_accuracy` (over all k x n sampled responses), `eval/greedy_accuracy`, `eval/response_len_mean`,
    `eval/greedy_response_len_mean`, `eval/n`, `eval/reward_errors` (+ `eval/<mode>_episode/*` for episodes);
    what a constant answer cannot buy (rollwise.metrics.prior): `eval/<mode>_balanced_accuracy` (accuracy
    averaged over the distinct reference answers), `eval/<mode>_answer_mode_frac` / `_answer_mode` (the replies'
    most common answer and its share) and `eval/reference_mode_frac` (the references' own most common share);
    with k > 1 also `eval/pass@j` (j in `pass_ks(k)`) and `eval/avg@k`; with prompts of more than one
    `Prompt.origin`, the accuracies, pass@j, avg@k and n again as `eval/<origin>/...`.
    An accuracy is None when every reward of that mode failed (the errors are counted, never scored 0).
    `keep_samples`, when given, receives `(mode, samples)` for each mode (`rollwise eval --out`).
    `stop` (`rollout.stop`) ends responses, and `top_p` / `top_k` (`rollout.top_p`, `rollout.top_k`) truncate the
    sampled distribution, as they do in training, so evaluation decodes what training decodes (the greedy
    response takes the argmax: truncation does not change it).
    """
    if k < 1:
        raise ValueError(f"eval.k must be at least 1, got {k}")
    out: dict[str, float] = {"eval/n": float(len(prompts)),
                             "eval/reference_mode_frac": reference_mode_frac(p for p, _ in prompts)}
    modes = [("sampled", temperature, k)] + ([("greedy", 0.0, 1)] if greedy else [])
    base = SamplingParams(max_new_tokens=max_new_tokens, top_p=top_p, top_k=top_k, stop=tuple(stop))
    per_mode = _episode_samples(engine, prompts, modes, base, episodes) if episodes is not None \
        else _one_turn_samples(engine, prompts, modes, base)
    by_origin: dict[str, dict[str, float | None]] = {}
    for (label, _, n_samples), groups in zip(modes, per_mode):
        samples = [s for g in groups for s in g]
        metrics = score_samples(samples, reward_fn, reward_timeout_s)
        n = max(1, len(samples))
        prefix = "eval/" if label == "sampled" else "eval/greedy_"
        out[f"eval/{label}_accuracy"] = accuracy(samples)
        out[f"{prefix}response_len_mean"] = sum(len(s.response_ids) for s in samples) / n
        out[f"{prefix}truncated_frac"] = sum(s.status.value == "truncated" for s in samples) / n
        out[f"{prefix}reward_errors"] = metrics.get("reward/errors", 0.0)
        out.update(prior_metrics(groups, label))
        if n_samples > 1:
            out.update(correctness_metrics(groups, n_samples))
        for origin, subset in _by_origin(groups).items():
            part = by_origin.setdefault(origin, {f"eval/{origin}/n": float(len(subset))})
            part[f"eval/{origin}/{label}_accuracy"] = accuracy([s for g in subset for s in g])
            if n_samples > 1:
                part.update(correctness_metrics(subset, n_samples, f"eval/{origin}/"))
        if episodes is not None:
            from rollwise.envs.episode import episode_metrics

            out.update({f"eval/{label}_{key}": v for key, v in episode_metrics(samples).items()})
        if keep_samples is not None:
            keep_samples.append((label, samples))
    for part in by_origin.values():
        out.update(part)
    return out


def origin_of(prompt: Prompt) -> str:
    """The mixture source a prompt came from ("" with one source)."""
    return getattr(prompt, "origin", "") or ""


def _by_origin(groups: list[list[Sample]]) -> dict[str, list[list[Sample]]]:
    """The groups of each origin, when there is more than one; else {}."""
    split: dict[str, list[list[Sample]]] = {}
    for g in groups:
        if g:
            split.setdefault(origin_of(g[0].prompt), []).append(g)
    return split if len(split) > 1 else {}


def known_metric(name: str, k: int, greedy: bool) -> bool:
    """Whether an evaluation with `k` samples per prompt (and greedy or not) writes `name`: the keys of
    `evaluate`, `eval/<mode>_episode/*`, and any `eval/<source>/<key>` of a per-source key (the sources are
    known only once the prompts are)."""
    keys = set(SAMPLED_KEYS) | (set(GREEDY_KEYS) if greedy else set())
    figures = [f"pass@{j}" for j in pass_ks(k)] + [f"avg@{k}"] if k > 1 else []
    keys |= {f"eval/{f}" for f in figures}
    if name in keys or name.startswith("eval/sampled_episode/") or (greedy and name.startswith("eval/greedy_episode/")):
        return True
    parts = name.split("/")
    per_source = {"n", "sampled_accuracy", *figures} | ({"greedy_accuracy"} if greedy else set())
    return len(parts) == 3 and parts[0] == "eval" and bool(parts[1]) and parts[2] in per_source


def metric_names(k: int, greedy: bool) -> list[str]:
    """The run-wide keys an evaluation writes (for error messages)."""
    figures = [f"eval/pass@{j}" for j in pass_ks(k)] + [f"eval/avg@{k}"] if k > 1 else []
    return [*SAMPLED_KEYS, *(GREEDY_KEYS if greedy else ()), *figures]


def _at(base: SamplingParams, temperature: float, seed: int) -> SamplingParams:
    """`base` (max_new_tokens, top_p, top_k, stop) at `temperature` with `seed`; greedy without truncation."""
    if temperature == 0:
        return replace(base, temperature=0.0, top_p=1.0, top_k=0, seed=seed)
    return replace(base, temperature=temperature, seed=seed)


def _mode_params(modes, base: SamplingParams) -> list[list[SamplingParams]]:
    """The sampling params of each response of one prompt, per mode. Sample j of a mode draws with seed
    EVAL_SEED + j: its own stream on every engine (a server seeds each request by itself, so one seed for the
    k samples of a prompt would make them the same response)."""
    return [[_at(base, t, EVAL_SEED + j) for j in range(n)] for _, t, n in modes]


def _one_turn_samples(engine: Engine, prompts, modes, base: SamplingParams) -> list[list[list[Sample]]]:
    """Per mode, per prompt, its samples. One engine call, the responses of each prompt next to each other:
    they share that prompt's prefill."""
    params = [p for mode in _mode_params(modes, base) for p in mode]
    width = len(params)
    requests = [GenerationRequest(i * width + j, ids, p) for i, (_, ids) in enumerate(prompts)
                for j, p in enumerate(params)]
    results = engine.generate(requests)
    out, offset = [], 0
    for _, _, n in modes:
        mode_results = [results[i * width + offset + j] for i in range(len(prompts)) for j in range(n)]
        out.append([g.samples for g in make_groups(prompts, n, mode_results)])
        offset += n
    return out


def _episode_samples(engine: Engine, prompts, modes, base: SamplingParams, episodes) -> list[list[list[Sample]]]:
    """Per mode, per prompt, its episodes: one run of the episodes per mode, the k episodes of a prompt one
    group drawing from one seeded stream (distinct draws on the torch and vLLM engines)."""
    out = []
    ids = count()
    for _, temperature, n in modes:
        params = _at(base, temperature, EVAL_SEED)
        groups = new_groups(prompts, n, 0)
        episodes.run(engine, groups, params, ids)
        out.append([g.samples for g in groups])
    return out
