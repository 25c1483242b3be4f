"""The loss of one micro-batch, assembled from `rollwise.algo` entries named in `[algo]`.

    loss = aggregate(w * policy_loss)                    # w: importance weights (algo.is_correction)
         - entropy_coef * aggregate(entropy)             # entropy bonus
         + kl_coef * aggregate(kl(logp, ref))            # unless algo.kl_in_reward
         + vf_coef * aggregate(value_loss)               # critic runs (advantage = gae)

Every aggregate gets the whole batch's normalisers, so micro-batch losses sum to the batch loss.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from rollwise import algo
from rollwise.config import AlgoConfig


def _accepts(fn, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def check_options(registry, name: str, options: dict, where: str) -> None:
    """Fail early, naming the config key, when `options` are not keywords of the entry `name`."""
    signature = inspect.signature(registry.get(name))
    try:
        signature.bind_partial(**options)
    except TypeError as err:
        valid = [n for n, p in signature.parameters.items() if p.default is not p.empty]
        raise ValueError(f"{where}: {err}; options of {name!r}: {', '.join(valid) or 'none'}") from None


@dataclass
class Objective:
    """Options resolved once per run; `seed` varies per micro-batch for the stochastic entries."""

    cfg: AlgoConfig
    max_new_tokens: int

    def __post_init__(self) -> None:
        self.loss_fn = algo.POLICY_LOSSES.get(self.cfg.loss)
        self.agg_fn = algo.AGGREGATIONS.get(self.cfg.aggregation)
        algo.KL_ESTIMATORS.get(self.cfg.kl_estimator)
        self.is_fn = algo.IS_CORRECTIONS.get(self.cfg.is_correction)
        check_options(algo.POLICY_LOSSES, self.cfg.loss, self._loss_options(0), "algo.loss_options")
        check_options(algo.IS_CORRECTIONS, self.cfg.is_correction, dict(self.cfg.is_options), "algo.is_options")

    def _loss_options(self, seed: int) -> dict:
        options = {"clip_low": self.cfg.clip_low, "clip_high": self.cfg.clip_high, **self.cfg.loss_options}
        if _accepts(self.loss_fn, "seed"):
            options.setdefault("seed", seed)
        return options

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor, norms: dict) -> torch.Tensor:
        options = dict(norms)
        if _accepts(self.agg_fn, "norm_tokens"):
            options["norm_tokens"] = self.cfg.norm_tokens or self.max_new_tokens
        return self.agg_fn(per_token, mask, **options)

    def loss(self, logp, old_logp, behaviour_logp, advantages, mask, norms: dict, seed: int,
             entropy=None, ref_logp=None) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """Scalar loss of one micro-batch (without the value term) and its metrics (0-dim tensors stay on the
        device).

        logp, old_logp, behaviour_logp, mask, entropy, ref_logp: [S, T]; advantages: [S] or [S, T].
        """
        per_token, metrics = self.loss_fn(logp, old_logp, advantages, mask, **self._loss_options(seed))
        out = {f"train/{k}": _detached(v) for k, v in metrics.items()}  # read back once per step
        if self.cfg.is_correction != "none":
            is_options = dict(self.cfg.is_options)
            if _accepts(self.is_fn, "seed"):
                is_options.setdefault("seed", seed)
            weights, is_metrics = self.is_fn(old_logp, behaviour_logp, mask, **is_options)
            per_token = per_token * weights
            out.update({f"is/{k}": _detached(v) for k, v in is_metrics.items()})
        loss = self.aggregate(per_token, mask, norms)
        if self.cfg.entropy_coef > 0 and entropy is not None:
            loss = loss + self.aggregate(algo.entropy_bonus(entropy, self.cfg.entropy_coef), mask, norms)
        if ref_logp is not None and not self.cfg.kl_in_reward:
            kl_tok = algo.kl(self.cfg.kl_estimator, logp, ref_logp)  # [S, T]
            loss = loss + self.cfg.kl_coef * self.aggregate(kl_tok, mask, norms)
            out["train/kl"] = (kl_tok.detach() * mask).sum() / mask.sum().clamp(min=1)
        return loss, out


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else float(value)
