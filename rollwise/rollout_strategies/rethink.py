"""Forced Rethinking (VL-Rethinker; Wang et al. 2025, "VL-Rethinker: Incentivizing Self-Reflection of
Vision-Language Models with Reinforcement Learning"): append a textual rethinking trigger to the end of initial
rollouts and continue them, so every trained response of that kind contains an explicit self-reflection step.

`rollout.strategy = "rethink"`:
1. generate the round as `plain` does;
2. pick `rollout.rethink.fraction` of the responses that ended on their own (status COMPLETED: EOS or a stop
   string; a truncated response has no room left), independently per response with the run's seed;
3. drop the final EOS token (the trigger replaces it: a model does not read past its EOS), append the tokens of
   `rollout.rethink.trigger` with loss mask 0 and behaviour log-prob placeholder 0.0, and continue the response
   for up to `rollout.rethink.max_new_tokens` more tokens in one engine call.
The continuation is sampled by the engine conditioned on prompt + first answer + trigger, so its behaviour
log-probs are those of the exact context the trainer scores (`mismatch/*` checks it in every step); the
trigger and the dropped EOS never enter the loss. The reward scores the whole response (the final answer after
the rethinking step counts).

Filled in / departures (the abstract leaves these open): which responses are rethought (a random fraction of
the completed ones, not a learned or answer-conditioned choice); VL-Rethinker applies it to a VLM with SSR
replay, here it is a text model and SSR is `replay.kind = "ssr"` if wanted; no filtering of rethought responses
by correctness. A stop string that ends the first answer stays in it (the continuation follows it).

Metrics: `rethink/samples_frac` (rethought / completed responses considered), `rethink/trigger_tokens`,
`rethink/continuation_tokens_mean` (tokens sampled after the trigger, per rethought response).
"""

from __future__ import annotations

import random
from itertools import count

from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.generate.groups import GenerateStats, StopRule
from rollwise.rollout import run_groups
from rollwise.rollout_strategies import StrategyContext, continue_samples, drop_last_token, force_tokens
from rollwise.types import Group, SamplingParams, Status


class RethinkOptions(MethodOptions, section="rollout", name="rethink"):
    """`[rollout.rethink]`: Forced Rethinking."""

    trigger: str = Field("\nWait, let me check.", min_length=1, description="text appended (loss mask 0) to a "
                         "completed response before it is continued")
    fraction: float = Field(0.5, ge=0.0, le=1.0, description="probability that a completed response gets the "
                            "trigger and is continued")
    max_new_tokens: int = Field(0, ge=0, description="tokens the continuation may add after the trigger; 0 = "
                                "rollout.max_new_tokens")

    def errors(self, cfg) -> list[str]:
        if cfg.rollout.stop:
            return ["rollout.strategy = 'rethink' continues responses that ended on a stop string, which the engine "
                    "would see again at once; set rollout.stop = [] (EOS ends responses)"]
        return []


def rethink_strategy(cfg, context: StrategyContext) -> "RethinkStrategy":
    o = RethinkOptions.of(cfg)
    trigger_ids = context.tokenizer.encode(o.trigger, add_special_tokens=False)
    eos = {context.tokenizer.eos_token_id} - {None}
    return RethinkStrategy(trigger_ids, o.fraction, o.max_new_tokens or cfg.rollout.max_new_tokens, eos, context.seed)


rethink_strategy.options = RethinkOptions


class RethinkStrategy:
    """Args:
        trigger_ids: token ids of the rethinking trigger (appended, loss-masked).
        fraction: probability that a completed response is rethought.
        new_tokens: tokens the continuation may add after the trigger.
        eos_ids: ids that end a response (dropped before the trigger; the engine's own are added at run time).
        seed: seed of the choice of responses.
    """

    def __init__(self, trigger_ids: list[int], fraction: float, new_tokens: int, eos_ids: set[int], seed: int):
        if not trigger_ids:
            raise ValueError("rollout.rethink.trigger encodes to no tokens; give a non-empty trigger text")
        self.trigger_ids, self.fraction, self.new_tokens = list(trigger_ids), fraction, new_tokens
        self.eos_ids = set(eos_ids)
        self.rng = random.Random(seed)
        self._counts = {"considered": 0, "rethought": 0, "continued_tokens": 0}

    def run(self, engine, groups: list[Group], params: SamplingParams, ids: count,
            stop: StopRule | None = None) -> GenerateStats:
        stats = run_groups(engine, groups, params, ids, stop)
        eos = self.eos_ids | set(getattr(engine, "eos_ids", ()) or ())
        chosen = []
        for s in (s for g in groups for s in g.samples):
            if s.status != Status.COMPLETED or s.info.get("rethink"):
                continue
            self._counts["considered"] += 1
            if self.rng.random() >= self.fraction:
                continue
            if s.response_ids and s.response_ids[-1] in eos:
                drop_last_token(s)
            force_tokens(s, self.trigger_ids)
            s.info["rethink"] = True
            chosen.append(s)
        self._counts["rethought"] += len(chosen)
        self._counts["continued_tokens"] += continue_samples(engine, chosen, params, ids, self.new_tokens)
        return stats

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])

    def metrics(self) -> dict[str, float]:
        c, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return {
            "rethink/samples_frac": c["rethought"] / max(1, c["considered"]),
            "rethink/trigger_tokens": float(len(self.trigger_ids)),
            "rethink/continuation_tokens_mean": c["continued_tokens"] / max(1, c["rethought"]),
        }
