"""`mipu`: Monotonic Inference Policy Update, an update kept only when the engine's policy improves.

Paper: "Monotonic Inference Policy Improvement" (MIPI) and its algorithm MIPU, a two-step LLM RL framework that
"constructs sampler-referenced candidate updates and selectively accepts synchronized candidates using an
inference-side gap proxy" (abstract in shared/seeds/004). Under training-inference mismatch an update that improves
the trainer's policy need not improve the engine's (the one deployed); MIPU checks the engine's.

One step here:

1. Candidate: the plain RL update, its PPO ratio referenced to the sampler: `train.old_logprobs = "behaviour"`
   (the engine's sampling log-probs) is required, so the ratio is pi_trainer / mu_engine. Before it, the trainer's
   trainable parameters and optimizer state are copied (`prepare`).
2. After the update (`after_update`, before the step's own sync) the candidate is synced to the engine through
   the run's Sync stage, and the engine scores the step's own tokens under it (`probe_logprobs`: temperature 1,
   untruncated). With r = exp(logp_engine_new - logp_old) per trained token (logp_old = the engine's untruncated
   sampling log-probs, `full_logprobs`, else `behaviour_logprobs`) and A the response's advantage, the proxy is

       gain  = mean_tokens(r x A) - mean_tokens(A)          (importance-sampled surrogate improvement of the
                                                             engine's policy over the sampler)
       kl    = mean_tokens(r - 1 - log r)                   (k3 estimate of KL(sampler || engine_new))
       proxy = gain - algo.mipu.kl_coef x kl

3. Accept when proxy >= -algo.mipu.tolerance; else reject: the trainer's parameters and optimizer state are put
   back bit for bit, and the step's sync (in the loop, right after) sends the engine those restored weights.
   A candidate whose sync check fails (the engine's copy differs from the trainer's by more than
   `sync.max_logprob_diff`, e.g. a ruined update rounded to int8) is rejected the same way, with no proxy; a
   transport that is really broken then fails the loop's sync of the restored weights and stops the run.

What the abstract leaves open, filled in here: the gap proxy's form. The surrogate gain alone accepts a ruined
policy whenever the long responses had negative advantages (r ~ 0 makes gain = -mean(A)), so the proxy is a
TRPO-style lower bound, gain minus a KL penalty measured on the inference side (`kl_coef = 0` gives the bare
surrogate). Departures: the learning-rate schedule and the policy version still advance on a rejected step (as
`skip_step`); the candidate costs one extra sync and one engine scoring pass per step; a run stops when
`algo.mipu.max_rejects_in_row` updates in a row are rejected (the policy could not move). Only the local trainer
backend with an engine in this process (synchronous control) is supported: the method must hold both sides.

Logged per step: `mipu/proxy`, `mipu/gain`, `mipu/kl`, `mipu/accepted` (1 or 0), `mipu/rejected_steps` (so far in
the run), `mipu/sync_rejected` (1 when the candidate failed its sync check), `mipu/tokens` (tokens the proxy
read), `mipu/check_s` (seconds of the extra sync and scoring)."""

from __future__ import annotations

import copy
import math
import time

import torch

from rollwise.errors import UserError
from pydantic import Field

from rollwise.config_methods import MethodOptions
from rollwise.methods.base import Method, Prepared, StepInput
from rollwise.sync import SyncError


class MIPURejectError(UserError, RuntimeError):
    """Every candidate update was rejected for `algo.mipu.max_rejects_in_row` steps in a row."""


def inference_proxy(engine_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    kl_coef: float) -> dict[str, float]:
    """The inference-side gap proxy over the trained tokens of a step (all flat `[n]`, float64 inside).

    engine_logp: the engine's log-probs of the tokens under the candidate weights; old_logp: under the sampler;
    advantages: each token's (its response's) advantage. Returns `gain` = mean(r A) - mean(A), `kl` =
    mean(r - 1 - log r), `proxy` = gain - kl_coef x kl, with r = exp(engine_logp - old_logp); all 0 for n = 0."""
    if engine_logp.numel() == 0:
        return {"gain": 0.0, "kl": 0.0, "proxy": 0.0}
    log_ratio = engine_logp.double() - old_logp.double()
    ratio = log_ratio.exp()
    a = advantages.double()
    gain = float((ratio * a).mean() - a.mean())
    kl = float((ratio - 1.0 - log_ratio).mean())
    return {"gain": gain, "kl": kl, "proxy": gain - kl_coef * kl}


class MIPUOptions(MethodOptions, section="algo", name="mipu"):
    """`[algo.mipu]`."""

    tolerance: float = Field(1e-3, ge=0.0, description="a candidate update is kept when the engine-side proxy "
                             "(surrogate gain - kl_coef x KL, in advantage units) is >= -tolerance; else the "
                             "trainer's weights and optimizer state are restored")
    kl_coef: float = Field(1.0, ge=0.0, description="weight of the engine-side KL(sampler || candidate) estimate "
                           "subtracted from the surrogate gain in the proxy; 0 = the bare surrogate")
    max_rejects_in_row: int = Field(10, ge=0, description="the run stops when this many updates in a row are "
                                    "rejected (the policy cannot move); 0 = never stop")


class MIPU(Method):
    """The plain RL step as a candidate, kept only when the engine's policy improves by the gap proxy."""

    options = MIPUOptions

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.saved: tuple[list[torch.Tensor], dict] | None = None  # trainable parameters, optimizer state
        self.samples: list = []
        self.metrics: dict[str, float] = {}
        self.rejected, self.accepted, self.rejects_in_row = 0, 0, 0

    @classmethod
    def checks(cls, cfg) -> list[str]:
        from rollwise import algo

        errors = []
        name = f"algo.method = {cfg.algo.method!r}"
        if cfg.train.old_logprobs != "behaviour":
            errors.append(f"{name} references its candidate update to the sampler: set train.old_logprobs = "
                          "'behaviour'")
        if cfg.rollout.temperature != 1.0:
            errors.append(f"{name} compares the engine's temperature-1 log-probs with the sampler's: set "
                          f"rollout.temperature = 1.0 (it is {cfg.rollout.temperature:g})")
        if cfg.train.backend != "local":
            errors.append(f"{name} restores a rejected update in this process: set train.backend = 'local'")
        if cfg.control.mode == "async" or cfg.rollout.source == "service":
            errors.append(f"{name} scores each candidate on the engine before the step's sync: set control.mode = "
                          "'sync' and rollout.source = 'local'")
        if algo.is_token_advantage(cfg.algo.advantage):
            errors.append(f"{name} weighs each token by its response's advantage: algo.advantage = "
                          f"{cfg.algo.advantage!r} is per token; use an outcome advantage such as 'grpo'")
        return errors

    def prepare(self, step: StepInput) -> Prepared:
        trainer = self.setup.trainer
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        self.saved = ([p.detach().clone() for p in params], copy.deepcopy(trainer.optimizer.state_dict()))
        self.samples = step.samples
        self.metrics = {"mipu/rejected_steps": float(self.rejected)}
        return Prepared(step.samples, metrics=self.metrics)  # filled in by after_update (the row reads it later)

    def after_update(self, policy) -> None:
        start = time.perf_counter()
        engine = self._engine()
        try:
            self.setup.sync.push(self.setup.trainer.version)  # the candidate, synchronized
        except SyncError as exc:  # the engine's copy of the candidate is far from the trainer's: reject it
            values, why = {"proxy": -math.inf}, f"its sync check failed ({str(exc).split(';')[0]})"
            engine_logp = torch.zeros(0)
        else:
            engine_logp, old_logp, advantages = self._token_logprobs(engine)
            values = inference_proxy(engine_logp, old_logp, advantages, self.opts.kl_coef)
            why = f"proxy {values['proxy']:.4g} < -{self.opts.tolerance:g} (algo.mipu.tolerance)"
        accept = math.isfinite(values["proxy"]) and values["proxy"] >= -self.opts.tolerance
        if accept:
            self.accepted += 1
            self.rejects_in_row = 0
        else:
            self._restore()
            self.rejected += 1
            self.rejects_in_row += 1
            print(f"rollwise: mipu rejected the update of step {self.setup.trainer.version}: {why}; weights and "
                  "optimizer state restored", flush=True)
        self.metrics.update({f"mipu/{k}": v for k, v in values.items() if math.isfinite(v)})
        self.metrics.update({"mipu/accepted": float(accept), "mipu/rejected_steps": float(self.rejected),
                             "mipu/sync_rejected": float("gain" not in values),
                             "mipu/tokens": float(engine_logp.numel()),
                             "mipu/check_s": time.perf_counter() - start})
        limit = self.opts.max_rejects_in_row
        if limit and self.rejects_in_row >= limit:
            raise MIPURejectError(
                f"mipu rejected {self.rejects_in_row} updates in a row (algo.mipu.max_rejects_in_row = {limit}): the "
                "policy cannot move; lower train.lr, raise algo.mipu.tolerance or lower algo.mipu.kl_coef")

    def _engine(self):
        sync = self.setup.sync
        engine = getattr(sync, "engine", None)
        if engine is None or not engine.caps.probe_logprobs:
            raise UserError("algo.method = 'mipu' scores its candidates with the engine's probe_logprobs: this "
                            "run's engine has none; use rollout.engine = 'torch' (or another engine in this process "
                            "that scores given tokens)")
        return engine

    def _token_logprobs(self, engine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat `[n]` (engine log-probs under the candidate, sampler log-probs, advantages) over the trained
        tokens (loss mask 1) of the step's fresh samples; one engine pass per sample."""
        new, old, adv = [], [], []
        for s in self.samples:
            n = len(s.response_ids)
            if n == 0 or not any(s.loss_mask):
                continue
            scored = engine.probe_logprobs(list(s.prompt_ids) + list(s.response_ids))[-n:]
            reference = s.full_logprobs or s.behaviour_logprobs
            for t in range(n):
                if s.loss_mask[t]:
                    new.append(scored[t])
                    old.append(reference[t])
                    adv.append(s.advantage)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
        return as_tensor(new), as_tensor(old), as_tensor(adv)

    def _restore(self) -> None:
        """Put the trainable parameters and the optimizer state back as `prepare` copied them (bit for bit)."""
        trainer = self.setup.trainer
        values, optimizer_state = self.saved
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for p, value in zip(params, values):
                p.copy_(value)
        trainer.optimizer.load_state_dict(optimizer_state)

    def state_dict(self) -> dict:
        return {"accepted": self.accepted, "rejected": self.rejected, "rejects_in_row": self.rejects_in_row}

    def load_state_dict(self, state: dict) -> None:
        self.accepted = int(state.get("accepted", 0))
        self.rejected = int(state.get("rejected", 0))
        self.rejects_in_row = int(state.get("rejects_in_row", 0))
