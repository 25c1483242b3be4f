"""`progress`: the RL step with the progress advantage (`rollwise.algo.progress`, TOKEN_ADVANTAGES "progress").

Per micro-batch the terms read the trainer's log-probs of the sampled tokens before the update (`own_logp`) and a
frozen reference's (the run's starting model, `rollwise.methods.reference`), and train the token advantage

    A_t = A_outcome + algo.progress.coef x P_{k(t)},   P_k = sum over step k's tokens of log pi(y_t) - log pi_ref(y_t)

with steps of `algo.progress.step_tokens` trained tokens. At step 0 pi = pi_ref and the run is plain GRPO; as the
policy moves away from its reference, steps it has come to prefer (P_k > 0) gain advantage and steps it has come
to avoid lose it, within every response (a step-level credit that outcome advantages do not have).
`algo.advantage` stays an outcome estimator (grpo, ...): it gives A_outcome. Set it to "progress" with the plain
method and the trainer would treat it as a critic estimator; that is what this method is for.
`train.old_logprobs = "behaviour"` is refused at --dry-run: the trainer would then hand the terms the engine's
log-probs (bf16 or int8 ones), and the ratio would not be 0 at step 0.
Logged: `progress/logratio_mean` (per trained token), `progress/step_abs_mean` (|P_k| per token),
`progress/adv_shift_abs_mean` (|coef x P| per token: how far the step scores move the advantages).
"""

from __future__ import annotations

import torch

from rollwise import algo
from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.methods.base import Method, Prepared, StepInput, outcome_advantage_errors
from rollwise.methods.reference import FrozenReference
from rollwise.train.batching import MicroBatch
from rollwise.train.terms import PolicyTerms


class ProgressTerms(PolicyTerms):
    """Token advantages: the outcome advantage plus the step's progress (module docstring)."""

    def __init__(self, reference: FrozenReference, coef: float, step_tokens: int) -> None:
        self.reference, self.coef, self.step_tokens = reference, coef, step_tokens
        self.cache: dict[int, tuple[MicroBatch, torch.Tensor]] = {}
        self.sums: dict[str, float] = {}

    def start(self) -> None:
        self.cache, self.sums = {}, {}

    def advantages(self, own_logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None) -> torch.Tensor:
        if id(mb) not in self.cache:  # the reference is fixed: one pass per micro-batch of the step
            self.cache[id(mb)] = (mb, self.reference.logprobs(mb))
            first = True
        else:
            first = False
        ref = self.cache[id(mb)][1]
        mask = mb.loss_mask
        ratio = (own_logp.detach().float() - ref) * mask  # [S, T]
        adv, _ = algo.token_advantage("progress", mb.advantages, ratio, mask, coef=self.coef,
                                      step_tokens=self.step_tokens)  # [S, T]
        if first:
            steps = algo.TOKEN_ADVANTAGES.get("progress")(torch.zeros_like(mb.advantages), ratio, mask, coef=1.0,
                                                          step_tokens=self.step_tokens)[0]  # P_{k(t)} [S, T]
            for key, value in (("tokens", mask.sum()), ("logratio", ratio.sum()), ("step_abs", steps.abs().sum())):
                self.sums[key] = self.sums.get(key, 0.0) + float(value)
        return adv

    def metrics(self) -> dict[str, float]:
        n = self.sums.get("tokens", 0.0)
        if not n:
            return {}
        return {"progress/logratio_mean": self.sums["logratio"] / n, "progress/step_abs_mean": self.sums["step_abs"] / n,
                "progress/adv_shift_abs_mean": self.coef * self.sums["step_abs"] / n}


class ProgressOptions(MethodOptions, section="algo", name="progress"):
    """`[algo.progress]`."""

    coef: float = Field(0.5, ge=0.0, description="weight beta of the progress advantage beta x sum of log(pi / "
                        "pi_ref) over a step's tokens, added to the outcome advantage")
    step_tokens: int = Field(8, ge=1, description="tokens per reasoning step (the response is cut into steps of "
                             "this many trained tokens)")


class Progress(Method):
    """The plain RL step with the progress advantage added per step of tokens."""

    options = ProgressOptions

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.reference = FrozenReference(setup.cfg, setup.policy, setup.tokenizer)

    @classmethod
    def checks(cls, cfg) -> list[str]:
        errors = outcome_advantage_errors("progress", cfg, "adds step scores to outcome advantages")
        if cfg.train.old_logprobs == "behaviour":  # the trainer would hand the terms the engine's log-probs
            errors.append("algo.method = 'progress' scores log pi - log pi_ref with the trainer's own log-probs; "
                          "train.old_logprobs = 'behaviour' hands it the engine's (bf16/int8 drift counts as "
                          "progress from step 0): set train.old_logprobs = 'recompute'")
        return errors

    def prepare(self, step: StepInput) -> Prepared:
        a = self.setup.cfg.algo
        return Prepared(step.samples, ProgressTerms(self.reference, self.opts.coef, self.opts.step_tokens))
