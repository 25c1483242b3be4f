"""DeepLook: confidence-triggered lookahead decoding at evaluation time (`rollwise eval --decode deeplook`).

Paper: "DeepLook" (seed 000_10a6ffcf6624f30f): a training-free monitor-and-intervene decoder. Token confidence
is aggregated into segment-level signals; when a segment's confidence drops relative to the recent history,
`b` candidate continuations are explored with a fixed-horizon lookahead, ranked by Average Lookahead Confidence
(ALC: the mean segment confidence over each continuation), pruned to the best, and the final answers of several
traces are aggregated by voting. What is reported is accuracy against the tokens spent (every branch counts).

How it is built here, and what the abstract leaves open:
- Token confidence is the sampled token's behaviour log-probability (what every rollwise engine returns); a
  segment's confidence is the geometric-mean probability of its `segment_tokens` tokens, exp(mean log-prob).
  DeepConf (which DeepLook builds on) uses the mean negative log-prob of the top-k candidates instead, which
  needs the full distribution per token; the sampled token's log-prob is the signal every engine here gives.
- Trigger: segment confidence < `drop_ratio` x the mean of the trace's last `window` accepted segments (at least
  one needed), at most `max_triggers` times per trace.
- At a trigger the low-confidence segment is discarded; `branches` continuations of `horizon_tokens` tokens are
  sampled from where it began, each is scored by its ALC, and the trace continues from the best one (keeping
  its tokens: the lookahead is not thrown away). `keep` = 1: the paper prunes to a top set; one kept branch
  per trace with `voters` independent traces is the same budget shape with a simpler state.
- Voting: majority over the traces' final answers (`rollwise.rewards.verifiers.final_number` of the text, the
  stripped text when it has no number); a tie goes to the answer whose traces have the higher mean confidence.
  The voted trace is the one scored.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from itertools import count

from rollwise.generate.groups import make_groups
from rollwise.rewards import score_samples
from rollwise.rewards.verifiers import final_number
from rollwise.types import GenerationRequest, GenerationResult, SamplingParams, Status


@dataclass(frozen=True)
class DeepLookSettings:
    """The knobs of `eval.deeplook_*` (see rollwise/config.py EvalConfig for their descriptions)."""

    segment_tokens: int = 8
    drop_ratio: float = 0.9
    window: int = 4
    branches: int = 4
    horizon_tokens: int = 16
    voters: int = 4
    max_triggers: int = 4


@dataclass
class Trace:
    """One decoding trace of a prompt: its tokens so far, its accepted segments' confidences and what it cost."""

    prompt: int  # index into the prompts
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    history: list[float] = field(default_factory=list)  # segment confidences of the accepted tokens
    result: GenerationResult | None = None
    tokens_spent: int = 0  # every token sampled for this trace, branches and discarded segments included
    triggers: int = 0

    @property
    def done(self) -> bool:
        return self.result is not None and self.result.status != Status.TRUNCATED


def segment_confidence(logprobs: list[float]) -> float:
    """exp(mean log-prob) of a segment's sampled tokens: its geometric-mean probability, in (0, 1]."""
    return math.exp(sum(logprobs) / len(logprobs)) if logprobs else 1.0


def segment_confidences(logprobs: list[float], segment_tokens: int) -> list[float]:
    """The confidences of consecutive segments of `segment_tokens` tokens (the last one may be shorter)."""
    return [segment_confidence(logprobs[i : i + segment_tokens]) for i in range(0, len(logprobs), segment_tokens)]


def average_lookahead_confidence(logprobs: list[float], segment_tokens: int) -> float:
    """ALC of a continuation: the mean of its segment confidences (0 for an empty continuation)."""
    confs = segment_confidences(logprobs, segment_tokens)
    return sum(confs) / len(confs) if confs else 0.0


def triggers(history: list[float], confidence: float, settings: DeepLookSettings) -> bool:
    """Whether a new segment's confidence drops below `drop_ratio` x the mean of the last `window` ones."""
    recent = history[-settings.window :]
    return bool(recent) and confidence < settings.drop_ratio * sum(recent) / len(recent)


def vote(answers: list[str | None], confidences: list[float]) -> int:
    """Index of the trace to keep: one with the most frequent answer (None answers vote last), ties broken by
    the higher mean confidence of that answer's traces, then by order."""
    groups: dict[str | None, list[int]] = defaultdict(list)
    for i, a in enumerate(answers):
        groups[a].append(i)

    def rank(answer):
        members = groups[answer]
        return (answer is not None, len(members), sum(confidences[i] for i in members) / len(members))

    best = max(groups, key=rank)
    return max(groups[best], key=lambda i: confidences[i])


def answer_of(text: str) -> str | None:
    """The final answer voted on: the last number (inside the last \\boxed{} when there is one), else the text."""
    number = final_number(text)
    return number if number is not None else (text.strip() or None)


class DeepLook:
    """The decoder: `run(engine, prompts, temperature, max_new_tokens)` -> traces, voters per prompt in order.
    `sampling` gives the run's `top_p`, `top_k` and `stop` (`rollout.*`): every segment and branch samples with
    them, so a trace ends at a stop string as training's responses do."""

    def __init__(self, settings: DeepLookSettings, sampling: SamplingParams | None = None):
        self.s = settings
        self.sampling = sampling or SamplingParams()
        self._ids = count()

    def run(self, engine, prompts, temperature: float, max_new_tokens: int) -> list[Trace]:
        traces = [Trace(i) for i in range(len(prompts)) for _ in range(self.s.voters)]
        while True:
            active = [t for t in traces if not t.done and len(t.ids) < max_new_tokens]
            if not active:
                return traces
            results = self._extend(engine, prompts, active, self.s.segment_tokens, temperature, max_new_tokens)
            lookahead = []
            for trace, result in zip(active, results):
                new = result.logprobs[len(trace.ids) :]
                trace.tokens_spent += len(new)
                conf = segment_confidence(new)
                if trace.triggers < self.s.max_triggers and triggers(trace.history, conf, self.s):
                    trace.triggers += 1
                    lookahead.append(trace)  # discard the segment, look ahead from where it began
                else:
                    self._accept(trace, result)
            if lookahead:
                self._look_ahead(engine, prompts, lookahead, temperature, max_new_tokens)

    def _look_ahead(self, engine, prompts, traces: list[Trace], temperature: float, max_new_tokens: int) -> None:
        """`branches` continuations of `horizon_tokens` per trace; each trace continues from its best by ALC."""
        b = self.s.branches
        fanned = [t for t in traces for _ in range(b)]
        results = self._extend(engine, prompts, fanned, self.s.horizon_tokens, temperature, max_new_tokens)
        for j, trace in enumerate(traces):
            branches = results[j * b : (j + 1) * b]
            start = len(trace.ids)
            trace.tokens_spent += sum(len(r.response_ids) - start for r in branches)
            best = max(branches, key=lambda r: average_lookahead_confidence(r.logprobs[start:], self.s.segment_tokens))
            self._accept(trace, best)

    def _accept(self, trace: Trace, result: GenerationResult) -> None:
        new = result.logprobs[len(trace.ids) :]
        trace.history += segment_confidences(new, self.s.segment_tokens)
        trace.ids, trace.logprobs = list(result.response_ids), list(result.logprobs)
        trace.result = result

    def _extend(self, engine, prompts, traces: list[Trace], tokens: int, temperature: float,
                max_new_tokens: int) -> list[GenerationResult]:
        """Continue each trace by up to `tokens` tokens (one engine call, traces of a prompt side by side)."""
        requests = [GenerationRequest(next(self._ids), prompts[t.prompt][1],
                                      replace(self.sampling, max_new_tokens=min(max_new_tokens, len(t.ids) + tokens),
                                              temperature=temperature, seed=None),
                                      response_ids=list(t.ids), response_logprobs=list(t.logprobs))
                    for t in traces]
        return engine.generate(requests)


def deeplook_eval(engine, prompts, reward_fn, temperature: float, max_new_tokens: int, settings: DeepLookSettings,
                  reward_timeout_s: float | None = None, stop: tuple[str, ...] = (), top_p: float = 1.0,
                  top_k: int = 0) -> dict[str, float | None]:
    """Evaluate with DeepLook: `deeplook/accuracy` (the voted answer), `deeplook/trace_accuracy` (every trace),
    `deeplook/tokens_per_prompt` (all tokens sampled, branches included), `deeplook/response_len_mean`,
    `deeplook/triggers_per_trace`. prompts: [(Prompt, prompt ids)]; `stop`, `top_p`, `top_k`: the run's
    `rollout.*`, as plain evaluation samples."""
    if temperature <= 0:
        raise ValueError("--decode deeplook samples branches: use --temperature > 0")
    sampling = SamplingParams(top_p=top_p, top_k=top_k, stop=tuple(stop))
    traces = DeepLook(settings, sampling).run(engine, prompts, temperature, max_new_tokens)
    groups = make_groups(prompts, settings.voters, [t.result for t in traces])
    samples = [s for g in groups for s in g.samples]
    score_samples(samples, reward_fn, reward_timeout_s)
    voted = []
    for g, start in zip(groups, range(0, len(traces), settings.voters)):
        mine = traces[start : start + settings.voters]
        confs = [sum(t.history) / max(1, len(t.history)) for t in mine]
        voted.append(g.samples[vote([answer_of(s.response_text) for s in g.samples], confs)])
    n = max(1, len(prompts))
    return {
        "deeplook/accuracy": _accuracy(voted),
        "deeplook/trace_accuracy": _accuracy(samples),
        "deeplook/tokens_per_prompt": sum(t.tokens_spent for t in traces) / n,
        "deeplook/response_len_mean": sum(len(t.ids) for t in traces) / max(1, len(traces)),
        "deeplook/triggers_per_trace": sum(t.triggers for t in traces) / max(1, len(traces)),
    }


def vote_accuracy(samples, k: int) -> float | None:
    """Self-consistency baseline at the same number of traces: the majority answer of each prompt's `k` plain
    samples (prompt-major order, as `rollwise.evaluate` returns them), ties to the higher mean token confidence."""
    voted = []
    for start in range(0, len(samples), k):
        group = samples[start : start + k]
        confs = [segment_confidence(list(s.behaviour_logprobs)) for s in group]
        voted.append(group[vote([answer_of(s.response_text) for s in group], confs)])
    return _accuracy(voted)


def _accuracy(samples) -> float | None:
    scored = [s for s in samples if s.status != Status.FAILED]
    return sum(bool(s.correct) for s in scored) / len(scored) if scored else None
