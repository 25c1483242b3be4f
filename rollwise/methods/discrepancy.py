"""`dcmdp` and `acrl`: the plain RL step plus control of the engine-vs-trainer discrepancy (rollwise.algo.discrepancy).

Each step measures D, the discrepancy between the engine that sampled the batch and the trainer before any update
of the step, on the tokens of the current policy version (`measure` of `[algo.dcmdp]` / `[algo.acrl]`: `k3`
as `mismatch/k3`, or `abs_gap`), and acts on it:

- DCMDP: the loss gains `lambda x D_tokens` (aggregated like the policy loss, gradient through the trainer's
  log-probs), so the policy is pulled toward what the engine samples; after the update `lambda <- clip(lambda +
  dual_lr (D - target), 0, dual_max)`. Within the tolerance lambda decays to 0 and RL runs unchanged.
- ACRL: tokens whose log-prob gap exceeds the threshold `tau` get weight 0 in the policy loss (their advantage is
  zeroed), so the update trains on tokens of bounded discrepancy D_trained; after the update `tau` moves toward
  the largest threshold that would have kept the step's D_trained at `target` (the loosest,
  `threshold_max`, when nothing needed masking), within `[threshold_min, threshold_max]`.

Logged every step: `mismatch/discrepancy` (D of every current token, comparable across methods),
`mismatch/violation` (the controlled D minus the target: D for DCMDP, D_trained for ACRL), and `mismatch/lambda`,
or `mismatch/acrl_threshold` with `mismatch/acrl_trained_discrepancy` and `mismatch/acrl_masked_frac` (the values
this step's update used). The controller's
state is saved in checkpoints, so a resumed run goes on with the same lambda or tau.
"""

from __future__ import annotations

from typing import Literal

import torch

from rollwise.algo.discrepancy import discrepancy, dual_ascent, fit_threshold, gap_mask, threshold_control
from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.methods.base import Method, Prepared, StepInput
from rollwise.train.batching import MicroBatch
from rollwise.train.terms import PolicyTerms


class DiscrepancyTerms(PolicyTerms):
    """The policy terms of a step under discrepancy control: D measured over the batch (the trainer's log-probs
    before the update against the engine's untruncated ones, on current tokens), plus DCMDP's penalty
    (`penalty > 0`) or ACRL's gap mask (`threshold` not None)."""

    def __init__(self, measure: str, target: float, penalty: float = 0.0, threshold: float | None = None) -> None:
        self.measure, self.target, self.penalty, self.threshold = measure, target, penalty, threshold
        self.sums: dict[int, tuple[float, float, float, float]] = {}  # id(mb) -> see `totals`
        self.gaps: list[torch.Tensor] = []  # [n] per micro-batch: log-prob gaps of its current tokens
        self.values: list[torch.Tensor] = []  # [n]: their discrepancies
        self.batches: list[MicroBatch] = []  # keeps the ids in `sums` unique

    def start(self) -> None:
        self.sums, self.gaps, self.values, self.batches = {}, [], [], []

    def advantages(self, own_logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None) -> torch.Tensor:
        """`mb.advantages`, zeroed on ACRL's masked tokens ([S] or [S, T]); measures D on the first pass."""
        current = mb.loss_mask * mb.current  # [S, T]
        keep = current if self.threshold is None else gap_mask(own_logp, mb.full_logp, current, self.threshold)
        if id(mb) not in self.sums:
            d = discrepancy(own_logp, mb.full_logp, current, self.measure)  # [S, T]
            self.sums[id(mb)] = (float(d.sum()), float(current.sum()), float((d * keep).sum()), float(keep.sum()))
            self.batches.append(mb)
            if self.threshold is not None:
                at = current > 0
                self.gaps.append((own_logp - mb.full_logp)[at].detach().float().cpu())
                self.values.append(d[at].detach().float().cpu())
        if self.threshold is None:
            return mb.advantages
        weight = keep + (mb.loss_mask - current)  # stale tokens keep weight 1: is_correction weighs them
        advantages = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None]
        return advantages * weight

    def extra_loss(self, logp, hidden, head, mb: MicroBatch, aggregate, entropy=None) -> torch.Tensor:
        """DCMDP's `penalty x aggregate(D per token)`, gradient through `logp [S, T]`; 0 otherwise."""
        if self.penalty == 0.0:
            return logp.new_zeros(())
        per_token = discrepancy(logp, mb.full_logp, mb.loss_mask * mb.current, self.measure)  # [S, T]
        return self.penalty * aggregate(per_token, mb.loss_mask)

    def totals(self) -> tuple[float, ...]:
        """(sum of D, current tokens, sum of D on trained ones, trained ones) over the step's batch."""
        return tuple(sum(v[i] for v in self.sums.values()) for i in range(4))

    def measured(self) -> float | None:
        """D of the step's batch: the mean over its current tokens (None when it had none)."""
        total, count, _, _ = self.totals()
        return total / count if count else None

    def trained(self) -> float | None:
        """D over the current tokens the update trains on (all but ACRL's masked ones; None when none)."""
        _, _, total, count = self.totals()
        return total / count if count else None

    def metrics(self) -> dict[str, float]:
        measured = self.measured()
        if measured is None:
            return {}
        if self.threshold is None:
            return {"mismatch/discrepancy": measured, "mismatch/violation": measured - self.target}
        _, count, _, kept = self.totals()
        trained = self.trained()
        out = {"mismatch/discrepancy": measured, "mismatch/acrl_masked_frac": 1.0 - kept / count}
        if trained is not None:
            out.update({"mismatch/acrl_trained_discrepancy": trained, "mismatch/violation": trained - self.target})
        return out


MEASURE = Field("k3", description="the engine-vs-trainer discrepancy D of a step, on tokens of the current "
                "version: k3 = KL(engine || trainer) estimate (mismatch/k3), abs_gap = mean |log-prob gap|")


class DCMDPOptions(MethodOptions, section="algo", name="dcmdp"):
    """`[algo.dcmdp]`."""

    measure: Literal["k3", "abs_gap"] = MEASURE
    target: float = Field(0.01, gt=0.0, description="the tolerance D may reach")
    dual_lr: float = Field(10.0, gt=0.0, description="lambda <- clip(lambda + dual_lr x (D - target), 0, dual_max) "
                           "after each step")
    dual_max: float = Field(100.0, gt=0.0, description="lambda is kept at most this")


class ACRLOptions(MethodOptions, section="algo", name="acrl"):
    """`[algo.acrl]`."""

    measure: Literal["k3", "abs_gap"] = MEASURE
    target: float = Field(0.01, gt=0.0, description="the most D the tokens an update trains on may have")
    gain: float = Field(1.0, gt=0.0, le=1.0, description="the gap threshold moves this far (geometrically) toward "
                        "the one fitted to the last step: 1 = take it, below 1 = smooth it")
    threshold_max: float = Field(2.0, gt=0.0, description="the loosest (and first) threshold on a token's |log-prob "
                                 "gap| (2.0: a probability ratio of e^2 = 7.4)")
    threshold_min: float = Field(0.05, gt=0.0, description="the tightest threshold")


class DCMDP(Method):
    """Reward maximisation under the constraint D <= `[algo.dcmdp] target`, by Lagrangian relaxation."""

    options = DCMDPOptions

    label = "lambda"

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.value = self.initial()  # lambda (DCMDP) or tau (ACRL)
        self.terms: DiscrepancyTerms | None = None

    @classmethod
    def checks(cls, cfg) -> list[str]:
        if cfg.train.old_logprobs == "behaviour":
            return [f"algo.method = {cfg.algo.method!r} measures the trainer's log-probs against the engine's; "
                    "train.old_logprobs = 'behaviour' never computes them: set train.old_logprobs = 'recompute'"]
        return []

    def initial(self) -> float:
        return 0.0

    def make_terms(self) -> DiscrepancyTerms:
        a = self.opts
        return DiscrepancyTerms(a.measure, a.target, penalty=self.value)

    def prepare(self, step: StepInput) -> Prepared:
        self.terms = self.make_terms()
        return Prepared(step.samples, self.terms, {f"mismatch/{self.label}": self.value})

    def after_update(self, policy) -> None:
        measured = self.terms.measured() if self.terms is not None else None
        if measured is not None:
            self.value = self.update(measured)

    def update(self, measured: float) -> float:
        a = self.opts
        return dual_ascent(self.value, measured, a.target, a.dual_lr, a.dual_max)

    def state_dict(self) -> dict:
        return {self.label: self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state.get(self.label, self.initial()))


class ACRL(DCMDP):

    options = ACRLOptions
    """The tokens an update trains on kept at discrepancy D <= `[algo.acrl] target` by a per-token gap mask
    whose threshold is refitted each step."""

    label = "acrl_threshold"

    @classmethod
    def checks(cls, cfg) -> list[str]:
        a, errors = ACRLOptions.of(cfg), super().checks(cfg)
        if a.threshold_min > a.threshold_max:
            errors.append(f"algo.acrl.threshold_min = {a.threshold_min:g} is above algo.acrl.threshold_max = "
                          f"{a.threshold_max:g}")
        return errors

    def initial(self) -> float:
        return self.opts.threshold_max

    def make_terms(self) -> DiscrepancyTerms:
        a = self.opts
        return DiscrepancyTerms(a.measure, a.target, threshold=self.value)

    def after_update(self, policy) -> None:
        if self.terms is not None and self.terms.gaps:
            a = self.opts
            self.value = threshold_control(self.value, self.fitted(), a.gain, a.threshold_min, a.threshold_max)

    def fitted(self) -> float | None:
        """ACRL: the threshold that would have kept the last step's trained D at the target."""
        terms, a = self.terms, self.opts
        if not terms.gaps:
            return None
        return fit_threshold(torch.cat(terms.gaps), torch.cat(terms.values), a.target)
