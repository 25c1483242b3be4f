"""Tandem RL (Tandem Reinforcement Learning, 2025; the abstract in ../shared/seeds): the trained senior and a
frozen, weaker junior alternate stochastically to co-generate each rollout; the whole response is rewarded (a
team reward) and the GRPO loss is applied to the senior's tokens only.

`rollout.strategy = "tandem"`: every response is written in segments of `rollout.tandem.segment_tokens` tokens.
The first segment is the senior's (the policy's engine); each later one is the junior's with probability
`rollout.tandem.junior_prob`, else the senior's, drawn per segment with the run's seed. Each segment is one engine
call over all the round's unfinished responses (senior ones batched on the policy engine, junior ones on the
junior's own torch engine), continuing from the tokens both wrote so far, until a response ends (EOS or a stop
string, from either author) or reaches `rollout.max_new_tokens`. The junior's tokens enter the response with loss
mask 0 and log-prob placeholder 0.0 (`force_tokens`); the senior's keep the engine's behaviour log-probs,
sampled in the exact context (junior tokens included) the trainer scores. The reward sees the whole text.

The junior is `rollout.tandem.junior` (a local model directory, a hub id or "smollm2-135m-instruct": it must
share the policy's tokenizer), or None: a frozen copy of the initial policy (the weakest form of the idea, useful
as a drift anchor on one model).

Filled in (the abstract leaves these open): segment length fixed in tokens, not at sentence or step boundaries;
the handoff probability constant; the first segment always the senior's (every response has tokens to train).
Metrics: `tandem/junior_token_frac` (junior tokens / response tokens), `tandem/segments_mean` (per response),
`tandem/junior_segment_frac`.
"""

from __future__ import annotations

import random
from itertools import count

from rollwise.generate.groups import FINAL, GenerateStats, StopRule, is_complete, merge_result
from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.rollout_strategies import (StrategyContext, engine_rng_state, force_tokens, generate_on,
                                        require_continuation, set_engine_rng_state)
from rollwise.types import GenerationRequest, Group, Sample, SamplingParams, Status


class TandemOptions(MethodOptions, section="rollout", name="tandem"):
    """`[rollout.tandem]`: Tandem RL, a frozen junior writes some segments."""

    junior: str | None = Field(None, description="the frozen junior (a local model directory, a hub id or "
                               "'smollm2-135m-instruct', sharing the policy's tokenizer); None = a frozen copy of the "
                               "initial policy")
    segment_tokens: int = Field(8, ge=1, description="tokens of one segment (one author)")
    junior_prob: float = Field(0.5, ge=0.0, le=1.0, description="probability that a segment after the first (always "
                               "the senior's) is written by the junior")

    def errors(self, cfg) -> list[str]:
        if self.junior is None and cfg.lora.rank > 0:
            return ["rollout.tandem.junior = None copies the initial policy, which LoRA wraps in adapters; name the "
                    "junior's model directory in rollout.tandem.junior (e.g. model.name)"]
        return []


def tandem_strategy(cfg, context: StrategyContext) -> "TandemStrategy":
    from rollwise.generate.factory import engine_dtype
    from rollwise.generate.torch_engine import TorchEngine

    r, o = cfg.rollout, TandemOptions.of(cfg)
    initial = None
    if o.junior is None:
        junior = context.model  # the engine takes its own frozen copy of the initial weights
        initial = cfg.model.name  # on resume `context.model` holds the trained weights: the junior reads these again
    else:
        from rollwise.models import load_model

        junior, tokenizer = load_model(o.junior)
        if tokenizer.get_vocab() != context.tokenizer.get_vocab():
            raise ValueError(f"rollout.tandem.junior = {o.junior!r} has another tokenizer than the policy; "
                             "the junior must share it (the two write into one token sequence)")
    engine = TorchEngine(junior, context.tokenizer,
                         dtype=engine_dtype(cfg.model.dtype, next(context.model.parameters()).device),
                         max_batch_size=r.max_batch_size, seed=context.seed + 7)
    return TandemStrategy(engine, o.segment_tokens, o.junior_prob, context.seed, initial=initial)


tandem_strategy.options = TandemOptions


def _initial_weights(name: str) -> dict:
    """The starting model's weights (fp32, as the run loads its policy), read again from `model.name`."""
    import torch

    from rollwise.models import load_model

    model, _ = load_model(name, dtype=torch.float32)
    return model.state_dict()


class TandemStrategy:
    """Args:
        junior: the junior's engine (frozen: it never receives weights).
        segment_tokens: tokens per segment.
        junior_prob: probability that a segment after the first is the junior's.
        seed: seed of the authors' draw.
        initial: with no `rollout.tandem.junior`, the starting model (`model.name`) the junior copies: a resumed
            run's policy is the trained one, so `load_state_dict` gives the junior these weights again.
    """

    def __init__(self, junior, segment_tokens: int, junior_prob: float, seed: int, initial: str | None = None):
        self.junior, self.segment_tokens, self.junior_prob = junior, segment_tokens, junior_prob
        self.initial = initial
        self.rng = random.Random(seed)
        self._counts = {"responses": 0, "segments": 0, "junior_segments": 0, "tokens": 0, "junior_tokens": 0}

    def run(self, engine, groups: list[Group], params: SamplingParams, ids: count,
            stop: StopRule | None = None) -> GenerateStats:
        require_continuation(engine)
        todo = [s for g in groups for s in g.samples if s.status not in FINAL]
        first = {id(s) for s in todo if not s.response_ids}
        active = list(todo)
        while active:
            senior, junior = [], []
            for s in active:
                own = id(s) in first or self.rng.random() >= self.junior_prob
                (senior if own else junior).append(s)
                first.discard(id(s))
            self._segment(engine, senior, params, ids, junior=False, counted_on=engine)
            self._segment(self.junior, junior, params, ids, junior=True, counted_on=engine)
            self._counts["segments"] += len(active)
            self._counts["junior_segments"] += len(junior)
            active = [s for s in active if s.status == Status.PENDING]
        self._counts["responses"] += len(todo)
        self._counts["tokens"] += sum(len(s.response_ids) for s in todo)
        self._counts["junior_tokens"] += sum(len(s.response_ids) - sum(s.loss_mask) for s in todo)
        return GenerateStats(requests=len(todo), aborted=0, groups_completed=sum(is_complete(g) for g in groups))

    def _segment(self, engine, samples: list[Sample], params: SamplingParams, ids: count, junior: bool,
                 counted_on) -> None:
        """One segment of each of `samples` by `engine`; a response that neither ended nor is full goes on."""
        if not samples:
            return
        todo: dict[int, Sample] = {}
        requests = []
        for s in samples:
            budget = min(len(s.response_ids) + self.segment_tokens, params.max_new_tokens)
            segment = SamplingParams(**{**params.__dict__, "max_new_tokens": budget})
            req = GenerationRequest(next(ids), s.prompt_ids, segment,
                                    response_ids=list(s.response_ids), response_logprobs=list(s.behaviour_logprobs),
                                    response_full_logprobs=list(s.full_logprobs))
            todo[req.request_id] = s
            requests.append(req)

        def on_finish(result) -> None:
            sample = todo[result.request_id]
            grew = len(result.response_ids) > len(sample.response_ids)
            if junior:
                force_tokens(sample, list(result.response_ids[len(sample.response_ids):]))
                sample.response_text = result.text
                sample.status = result.status
            else:
                merge_result(sample, result)
                for start, end in sample.info.get("forced_spans", []):
                    sample.loss_mask[start:end] = [0] * (end - start)
            if sample.status == Status.TRUNCATED and grew and len(sample.response_ids) < params.max_new_tokens:
                sample.status = Status.PENDING  # the segment ended, not the response

        generate_on(engine, counted_on, requests, on_finish)  # junior tokens count in rollout/tokens too

    def state_dict(self) -> dict:
        """The authors' draw and the junior engine's sampling RNG: a resumed run writes what the uninterrupted
        one would."""
        return {"rng": self.rng.getstate(), "junior_rng": engine_rng_state(self.junior)}

    def load_state_dict(self, state: dict) -> None:
        """Called on resume only (once the strategy is built from the checkpoint's policy)."""
        self.rng.setstate(state["rng"])
        set_engine_rng_state(self.junior, state.get("junior_rng"))
        if self.initial is not None:  # the junior copied the resumed (trained) policy: back to the starting one
            self.junior.update_weights(_initial_weights(self.initial), self.junior.version)

    def metrics(self) -> dict[str, float]:
        c, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return {
            "tandem/junior_token_frac": c["junior_tokens"] / max(1, c["tokens"]),
            "tandem/segments_mean": c["segments"] / max(1, c["responses"]),
            "tandem/junior_segment_frac": c["junior_segments"] / max(1, c["segments"]),
        }
