"""Rollout strategies: how one round of generation turns groups of prompts into samples.

`rollout.strategy` names an entry of `ROLLOUT_STRATEGIES`, a factory `(cfg, context) -> strategy`; the strategy
is an object with

- `run(engine, groups, params, ids, stop) -> GenerateStats`: generate every unfinished sample of `groups` in
  place (what `rollwise.rollout.run_groups` does for `plain`), with the engine, the sampling params, the
  request-id counter and the partial-rollout `StopRule` (None without partial rollouts);
- `metrics() -> dict[str, float]`: what it did since the last call (`rollout/strategy/...` and its own keys),
  logged in the step's row through `Rollouts.pop_metrics`;
- optionally `state_dict() -> dict` and `load_state_dict(state)`: what a resumed run needs to go on as the
  uninterrupted one would (running rates, its RNG), saved in every checkpoint.

`build.py` builds the strategy with a `StrategyContext` (the tokenizer, the initial policy, the seed, the
reward) and hands it to `LocalRollouts`. Built-in strategies: `plain` (today's single call per round), `rethink` (Forced
Rethinking, VL-Rethinker), `adhint` (ADHint hint prefixes), `tandem` (Tandem RL senior/junior segments),
`eepo` (EEPO two-stage rollouts with unlearning), `tree` (rStar-Math / MedS3 tree-search rollouts).
Tokens a strategy writes into a response that the policy did not sample (a trigger, a hint, the junior's
segment) carry loss mask 0 and a behaviour log-prob placeholder 0.0 (`force_tokens`), as tool tokens do.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from typing import Any, Protocol

from rollwise.registry import Registry
from rollwise.rollout import run_groups
from rollwise.generate.groups import GenerateStats, StopRule
from rollwise.types import GenerationRequest, Group, Sample, SamplingParams


class RolloutStrategy(Protocol):
    def run(self, engine, groups: list[Group], params: SamplingParams, ids: count,
            stop: StopRule | None = None) -> GenerateStats: ...

    def metrics(self) -> dict[str, float]: ...


@dataclass
class StrategyContext:
    """What a strategy may need besides the config: the run's tokenizer, the initial policy model (a frozen
    copy for a junior), the seed of its own random choices and the run's reward function (tree-search leaves)."""

    tokenizer: Any
    model: Any = None
    seed: int = 0
    reward_fn: Any = None  # the run's reward function (the `tree` strategy scores its search leaves with it)


ROLLOUT_STRATEGIES: Registry = Registry("rollout strategy")


@ROLLOUT_STRATEGIES.register("plain")
def plain_strategy(cfg, context: StrategyContext) -> "PlainStrategy":
    return PlainStrategy()


ROLLOUT_STRATEGIES.register_lazy("rethink", "rollwise.rollout_strategies.rethink:rethink_strategy")
ROLLOUT_STRATEGIES.register_lazy("adhint", "rollwise.rollout_strategies.adhint:adhint_strategy")
ROLLOUT_STRATEGIES.register_lazy("tandem", "rollwise.rollout_strategies.tandem:tandem_strategy")
ROLLOUT_STRATEGIES.register_lazy("eepo", "rollwise.rollout_strategies.eepo:eepo_strategy")
ROLLOUT_STRATEGIES.register_lazy("tree", "rollwise.rollout_strategies.tree:tree_strategy")
ROLLOUT_STRATEGIES.register_lazy("duet", "rollwise.methods.duet:duet_strategy")  # with algo.method = "duet"


class PlainStrategy:
    """One engine call for every unfinished sample (`run_groups`): the behaviour before strategies existed."""

    def run(self, engine, groups: list[Group], params: SamplingParams, ids: count,
            stop: StopRule | None = None) -> GenerateStats:
        return run_groups(engine, groups, params, ids, stop)

    def metrics(self) -> dict[str, float]:
        return {}


def build_strategy(cfg, context: StrategyContext) -> RolloutStrategy:
    """The strategy `cfg.rollout.strategy` names, built for this run."""
    return ROLLOUT_STRATEGIES.get(cfg.rollout.strategy)(cfg, context)


# -- helpers the strategies share ----------------------------------------------------------------------------
def force_tokens(sample: Sample, ids: list[int]) -> None:
    """Append `ids` the policy did not sample: loss mask 0, log-prob placeholder 0.0, recorded in
    `sample.info["forced_spans"]` as `(start, end)` so later merges keep them masked."""
    if not ids:
        return
    start = len(sample.response_ids)
    sample.response_ids = sample.response_ids + list(ids)
    sample.behaviour_logprobs = sample.behaviour_logprobs + [0.0] * len(ids)
    sample.full_logprobs = list(sample.full_logprobs or []) + [0.0] * len(ids)
    sample.loss_mask = sample.loss_mask + [0] * len(ids)
    sample.info["forced_spans"] = sample.info.get("forced_spans", []) + [(start, start + len(ids))]


def drop_last_token(sample: Sample) -> None:
    """Remove the response's last token (an EOS before a continuation), from every per-token list and span."""
    n = len(sample.response_ids) - 1
    sample.response_ids, sample.behaviour_logprobs = sample.response_ids[:n], sample.behaviour_logprobs[:n]
    sample.full_logprobs, sample.loss_mask = sample.full_logprobs[:n], sample.loss_mask[:n]
    sample.version_spans = [(a, min(b, n), v) for a, b, v in sample.version_spans if a < n]


def generate_on(other, engine, requests, on_finish) -> None:
    """`other.generate(requests, on_finish)` with its counters added to `engine`'s (the run's `rollout/tokens`
    and perf rows read the policy engine's stats: a second engine's work must show there too)."""
    mine, theirs = getattr(engine, "stats", None), getattr(other, "stats", None)
    before = dict(vars(theirs)) if theirs is not None and other is not engine else None
    other.generate(requests, on_finish=on_finish)
    if before is not None and mine is not None:
        for key, value in vars(theirs).items():
            if isinstance(value, int) and key in vars(mine):
                setattr(mine, key, getattr(mine, key) + value - before.get(key, 0))


def require_continuation(engine) -> None:
    """Raise when `engine` cannot continue a response from its tokens (what every non-plain strategy does)."""
    caps = getattr(engine, "caps", None)
    if caps is not None and not getattr(caps, "continue_aborted", True):
        raise RuntimeError(f"rollout.strategy: the {type(engine).__name__} engine cannot continue a response from "
                           "its tokens; use rollout.engine = 'torch' (or rollout.strategy = 'plain')")


def continue_samples(engine, samples: list[Sample], params: SamplingParams, ids: count,
                     new_tokens: int, counted_on=None) -> int:
    """Continue each sample from its tokens (forced ones included) for up to `new_tokens` more tokens, in one
    engine call; the sample's forced spans stay masked. `counted_on`: the engine whose stats also count this
    call's work (the policy's, when `engine` is a second one). Returns the number of tokens the engine added."""
    from rollwise.generate.groups import merge_result

    if not samples:
        return 0
    require_continuation(engine)
    todo: dict[int, Sample] = {}
    requests = []
    for s in samples:
        budget = SamplingParams(**{**params.__dict__, "max_new_tokens": len(s.response_ids) + new_tokens})
        req = GenerationRequest(next(ids), s.prompt_ids, budget, response_ids=list(s.response_ids),
                                response_logprobs=list(s.behaviour_logprobs),
                                response_full_logprobs=list(s.full_logprobs))
        todo[req.request_id] = s
        requests.append(req)
    before = sum(len(s.response_ids) for s in samples)

    def on_finish(result) -> None:
        sample = todo[result.request_id]
        merge_result(sample, result)
        for start, end in sample.info.get("forced_spans", []):
            sample.loss_mask[start:end] = [0] * (end - start)

    generate_on(engine, counted_on or engine, requests, on_finish)
    return sum(len(s.response_ids) for s in samples) - before


def engine_rng_state(engine) -> Any:
    """The sampling RNG state of a strategy's own engine (EEPO's explorer, Tandem's junior), for its `state_dict`:
    None when the engine keeps none it can give (`caps.rng_state`)."""
    caps = getattr(engine, "caps", None)
    return engine.rng_state() if caps is not None and caps.rng_state else None


def set_engine_rng_state(engine, state: Any) -> None:
    """Restore what `engine_rng_state` gave (nothing when it gave None)."""
    caps = getattr(engine, "caps", None)
    if state is not None and caps is not None and caps.rng_state:
        engine.set_rng_state(state)
