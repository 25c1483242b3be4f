"""Hard-sample substitution (ToolExpander, Chen et al. 2025, "ToolExpander: Extending the Frontiers of
Tool-Using Reinforcement Learning to Weak LLMs").

A weak policy gets no signal from a prompt it never solves: every sample is wrong, the group has zero variance
and is dropped. For such a group, when the task can give a GUIDED version of the prompt (`guided_prompt`: the
same problem behind a worked example), `guided_samples` episodes are sampled on the guided prompt; the correct
ones replace wrong samples of the group (at most `max_replaced_frac` of it). A substituted sample keeps the
group's own prompt: its response (tool calls, answer) is trained as an answer to the unguided prompt.

Like with like: the substituted response's behaviour log-probs are recomputed by the engine under the prompt it
is trained with (`engine.probe_logprobs`, temperature 1), so importance ratios and the mismatch metrics
compare the same tokens in the same context; `sample.info["substituted"] = True` marks them.
Needs `rollout.temperature = 1` and no top-k / top-p (the probe is the untruncated temperature-1 policy).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import count

from rollwise.envs.base import EnvError
from rollwise.generate.groups import new_groups
from rollwise.rewards import score_sample
from rollwise.types import Group, Sample, SamplingParams


class HardSampleSubstitution:
    """Called by the Controller on a round's scored groups, before the filters (see the module docstring)."""

    def __init__(self, source, episodes, engine, encoder, reward_fn, reward_timeout_s: float,
                 guided_samples: int = 4, max_replaced_frac: float = 0.5) -> None:
        if not engine.caps.probe_logprobs:
            raise EnvError(f"hard-sample substitution recomputes log-probs with probe_logprobs; "
                           f"{type(engine).__name__} has none")
        self.source, self.episodes, self.engine, self.encoder = source, episodes, engine, encoder
        self.reward_fn, self.reward_timeout_s = reward_fn, reward_timeout_s
        self.guided_samples, self.max_replaced_frac = guided_samples, max_replaced_frac
        self._ids = count(10**9)  # request ids apart from the Generate stage's
        self.counts = {"groups_hard": 0, "groups_rescued": 0, "samples_substituted": 0}

    def __call__(self, groups: list[Group], params: SamplingParams) -> tuple[list[Sample], list[Sample]]:
        """Substitute into the hard groups in place; returns (new samples, already scored; samples replaced)."""
        hard = [(g, self.source.guided_prompt(g.prompt)) for g in groups
                if g.usable() and not any(s.correct for s in g.usable())]
        hard = [(g, p) for g, p in hard if p is not None]
        if not hard:
            return [], []
        self.counts["groups_hard"] += len(hard)
        encoded = [(p, self.encoder.encode(p)) for _, p in hard]
        keep = [i for i, (_, ids) in enumerate(encoded) if ids is not None]
        guided = new_groups([encoded[i] for i in keep], self.guided_samples, 0)
        self.episodes.run(self.engine, guided, params, self._ids)
        added, removed = [], []
        for i, g_guided in zip(keep, guided):
            group = hard[i][0]
            wins = [s for s in g_guided.samples if score_sample(s, self.reward_fn, self.reward_timeout_s) and s.correct]
            limit = int(self.max_replaced_frac * len(group.samples))
            wrong = [k for k, s in enumerate(group.samples) if not s.correct][:limit]
            for k, win in zip(wrong, wins):
                removed.append(group.samples[k])
                group.samples[k] = self._as_answer_to(group.samples[k], win)
                added.append(group.samples[k])
            self.counts["groups_rescued"] += bool(wins and wrong)
        self.counts["samples_substituted"] += len(added)
        return added, removed

    def _as_answer_to(self, original: Sample, win: Sample) -> Sample:
        """`win`'s response under `original`'s prompt, with behaviour log-probs recomputed in that context."""
        full = original.prompt_ids + win.response_ids
        logp = self.engine.probe_logprobs(full)[len(original.prompt_ids) - 1:]
        logp = [lp if m else 0.0 for lp, m in zip(logp, win.loss_mask)]
        version = self.engine.version
        spans = [(a, b, version) for a, b, role in win.turns if role == "assistant"]
        head = original.episode.messages[:original.episode.prompt_messages]
        episode = replace(win.episode, messages=[*head, *win.episode.messages[win.episode.prompt_messages:]],
                          prompt_messages=len(head))
        sample = Sample(prompt=original.prompt, prompt_ids=list(original.prompt_ids),
                        response_ids=list(win.response_ids), behaviour_logprobs=logp, loss_mask=list(win.loss_mask),
                        status=win.status, group_id=original.group_id, version_spans=spans, full_logprobs=list(logp),
                        turns=list(win.turns), tool_calls=list(win.tool_calls), episode=episode,
                        response_text=win.response_text, info={"substituted": True})
        score_sample(sample, self.reward_fn, self.reward_timeout_s)
        return sample

    def metrics(self) -> dict[str, float]:
        """This step's counts (`substitution/*`), then reset for the next step."""
        out = {f"substitution/{k}": float(v) for k, v in self.counts.items()}
        self.counts = dict.fromkeys(self.counts, 0)
        return out
