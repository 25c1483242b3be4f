"""`echorl`: EchoRL, supervision from advantage-degenerated (all-success) groups.

The abstract: as RLVR proceeds, more prompts have every rollout verified-successful, so the group's reward std
and every advantage are zero and the policy gradient vanishes. EchoRL identifies an *EchoClip* from such
verified-success rollouts by their step-level entropy and feeds it back as an auxiliary supervised signal in the RL
objective.

Here, per step:
- an all-success group is a group of >= 2 usable samples every one of which is verified correct
  (`sample.correct is True`, set by the reward); its samples are the echo samples (their advantage is 0);
- the EchoClip of an echo sample is the contiguous span of `k = ceil(algo.echorl.clip_frac x n)` of its n trained
  tokens whose mean policy entropy is the lowest (entropy of the trainer's own forward pass, per token: the
  abstract's step-level entropy at token granularity; the paper derives it from the low entropy of expert
  "golden" trajectories, which we do not have: the policy's own confident span stands in);
- the loss gains `algo.echorl.coef x aggregate(-log pi(y_t), EchoClip mask)`, aggregated like the policy loss
  with the batch's normalisers (an SFT term on those tokens only, gradient through the trainer's log-probs).

Groups whose rewards are all equal are kept for the method (`keeps_uniform_groups`); those that are not
all-success (e.g. all wrong) are then left out again when `algo.filter_zero_variance` is on, as plain GRPO would.
Logged: `echorl/echo_groups`, `echorl/echo_samples`, `echorl/clip_tokens`, `echorl/clip_nll_mean`,
`echorl/clip_entropy_mean` against `echorl/echo_entropy_mean` (the whole echo responses: the clip is lower), over
the step's batch as its first pass reads it (`train.ppo_epochs` passes count each micro-batch once).
"""

from __future__ import annotations

import math

import torch

from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.methods.base import Method, Prepared, StepInput
from rollwise.train.batching import MicroBatch
from rollwise.train.terms import PolicyTerms
from rollwise.types import Group, Sample, Status


def all_success(group: Group) -> bool:
    """Every usable sample of the group (>= 2 of them) is verified correct."""
    usable = group.usable()
    return len(usable) >= 2 and all(s.correct is True for s in usable)


def echo_clip_mask(entropy: torch.Tensor, mask: torch.Tensor, frac: float) -> torch.Tensor:
    """The EchoClip of each row: `[S, T]` entropy and trained-token mask -> `[S, T]` 0/1 mask.

    Over a row's n trained positions (in order), the window of k = ceil(frac x n) consecutive ones with the lowest
    summed entropy (the first such window on ties); rows without trained tokens get none."""
    clip = torch.zeros_like(mask, dtype=torch.float32)
    for row in range(mask.shape[0]):
        idx = torch.nonzero(mask[row] > 0).flatten()
        n = int(idx.numel())
        if n == 0:
            continue
        k = max(1, math.ceil(frac * n))
        cum = torch.cat([entropy.new_zeros(1), torch.cumsum(entropy[row, idx].detach().float(), 0)])
        sums = cum[k:] - cum[: n - k + 1]  # [n - k + 1]: window sums
        start = int(torch.argmin(sums))
        clip[row, idx[start : start + k]] = 1.0
    return clip


class EchoTerms(PolicyTerms):
    """Policy terms plus the EchoClip NLL of the echo samples (by identity)."""

    def __init__(self, echo: set[int], coef: float, frac: float) -> None:
        self.echo, self.coef, self.frac = echo, coef, frac
        self.sums: dict[str, float] = {}
        self.seen: set[int] = set()
        self.batches: list[MicroBatch] = []  # keeps the ids in `seen` unique for the step

    def start(self) -> None:
        self.sums, self.seen, self.batches = {}, set(), []

    def _add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def extra_loss(self, logp, hidden, head, mb: MicroBatch, aggregate, entropy=None) -> torch.Tensor:
        rows = torch.tensor([id(s) in self.echo for s in mb.samples], device=logp.device)
        if self.coef == 0.0 or not bool(rows.any()):
            return logp.new_zeros(())
        if entropy is None:
            raise RuntimeError("echorl selects its clips by policy entropy; the trainer passed none")
        echo_mask = mb.loss_mask * rows[:, None].to(mb.loss_mask.dtype)  # [S, T]
        clip = echo_clip_mask(entropy, echo_mask, self.frac).to(logp.dtype)  # [S, T]
        if id(mb) not in self.seen:  # several passes (ppo_epochs) read the same micro-batch: count its first once
            self.seen.add(id(mb))
            self.batches.append(mb)
            self._count(logp, entropy, clip, echo_mask)
        return self.coef * aggregate(-logp * clip, clip)

    def _count(self, logp, entropy, clip, echo_mask) -> None:
        with torch.no_grad():
            self._add("clip_tokens", float(clip.sum()))
            self._add("echo_tokens", float(echo_mask.sum()))
            self._add("clip_nll", float((-logp * clip).sum()))
            self._add("clip_entropy", float((entropy * clip).sum()))
            self._add("echo_entropy", float((entropy * echo_mask).sum()))

    def metrics(self) -> dict[str, float]:
        s = self.sums
        if not s.get("clip_tokens"):
            return {"echorl/clip_tokens": 0.0}
        return {"echorl/clip_tokens": s["clip_tokens"], "echorl/clip_nll_mean": s["clip_nll"] / s["clip_tokens"],
                "echorl/clip_entropy_mean": s["clip_entropy"] / s["clip_tokens"],
                "echorl/echo_entropy_mean": s["echo_entropy"] / s["echo_tokens"]}


class EchoRLOptions(MethodOptions, section="algo", name="echorl"):
    """`[algo.echorl]`."""

    coef: float = Field(0.1, ge=0.0, description="weight of the auxiliary NLL of the EchoClips (low-entropy spans of "
                        "correct responses in all-success groups)")
    clip_frac: float = Field(0.25, gt=0.0, le=1.0, description="an EchoClip's length as a fraction of the "
                             "response's trained tokens (the contiguous span of lowest mean entropy)")


class EchoRL(Method):
    """The plain RL step plus EchoRL's auxiliary NLL on EchoClips (module docstring)."""

    options = EchoRLOptions

    keeps_uniform_groups = True

    def prepare(self, step: StepInput) -> Prepared:
        a = self.setup.cfg.algo
        fresh = {id(s) for s in step.samples}
        echo_groups = [g for g in step.groups if all_success(g)]
        echo = {id(s) for g in echo_groups for s in g.usable() if id(s) in fresh}
        samples = step.samples
        if a.filter_zero_variance:  # uniform groups that are not all-success carry nothing: leave them out
            uniform = {id(s) for g in step.groups if _uniform(g) and not all_success(g) for s in g.samples}
            samples = [s for s in samples if id(s) not in uniform]
        metrics = {"echorl/echo_groups": float(len(echo_groups)), "echorl/echo_samples": float(len(echo))}
        return Prepared(samples, EchoTerms(echo, self.opts.coef, self.opts.clip_frac), metrics,
                        record=lambda s: {"echorl_echo": id(s) in echo})


def _uniform(group: Group) -> bool:
    """The usable samples' training rewards are all equal (no GRPO signal)."""
    rewards = [_reward(s) for s in group.samples if s.status != Status.FAILED]
    return len(set(rewards)) <= 1


def _reward(s: Sample) -> float | None:
    return s.reward if s.train_reward is None else s.train_reward
