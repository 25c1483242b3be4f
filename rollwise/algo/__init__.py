"""RL math as pure tensor functions, registered by name (see docs/algorithms.md).

One signature per registry (checked by `tests/test_registry_contract.py`):

- advantage estimators (`ADVANTAGES`): `fn(rewards [N], group_ids [N], **options) -> advantages [N]`
- token-level advantage estimators (`TOKEN_ADVANTAGES`, e.g. `gae`):
  `fn(rewards [N] | [N,T], values [N,T], mask [N,T], **options) -> (advantages [N,T], returns [N,T])`
- policy losses (`POLICY_LOSSES`): `fn(logp [N,T], old_logp [N,T], advantages [N] | [N,T], mask [N,T],
  **options) -> (per_token_loss [N,T], metrics: dict[str, Tensor])`
- aggregations (`AGGREGATIONS`): `fn(per_token_loss [N,T], mask [N,T], num_tokens=None, num_seqs=None,
  **options) -> scalar`
- KL estimators (`KL_ESTIMATORS`): `fn(logp [N,T], ref_logp [N,T]) -> [N,T]`
- importance corrections (`IS_CORRECTIONS`): `fn(old_logp [N,T], behaviour_logp [N,T], mask [N,T],
  **options) -> (weights [N,T] detached, metrics)`
- reward shaping (`SHAPING`): `fn(rewards [N], lengths [N], group_ids [N], correct [N] bool, **options)
  -> shaped rewards [N]`

This package imports only torch (and the stdlib registry).
"""

from __future__ import annotations

import inspect

import torch

from rollwise.algo import advantages as _advantages  # noqa: F401  (registers entries)
from rollwise.algo import aggregation as _aggregation  # noqa: F401
from rollwise.algo import importance as _importance  # noqa: F401
from rollwise.algo import kl as _kl  # noqa: F401
from rollwise.algo import losses as _losses  # noqa: F401
from rollwise.algo import progress as _progress  # noqa: F401
from rollwise.algo import moa as _moa  # noqa: F401  (MOA: multi-objective advantages)
from rollwise.algo import shaping as _shaping  # noqa: F401
from rollwise.algo import slas as _slas  # noqa: F401  (SLAS: super-linear advantage shaping)
from rollwise.algo import tool_shaping as _tool_shaping  # noqa: F401
from rollwise.algo import value as _value  # noqa: F401
from rollwise.algo.advantages import group_stats
from rollwise.algo.distillation import distill
from rollwise.algo.aggregation import batch_normalisers
from rollwise.algo.kl import kl_reward_penalty
from rollwise.algo.losses import entropy_bonus
from rollwise.algo.registries import (
    ADVANTAGES,
    AGGREGATIONS,
    DISTILL,
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    SHAPING,
    TOKEN_ADVANTAGES,
)
from rollwise.algo.shaping import group_solve_rate
from rollwise.algo.value import outcome_token_rewards, value_loss

Metrics = dict[str, torch.Tensor]


def is_token_advantage(name: str) -> bool:
    """True when `name` is a token-level estimator (needs values and mask, returns `[N, T]`)."""
    return name in TOKEN_ADVANTAGES.names()


def is_group_advantage(name: str) -> bool:
    """An outcome estimator (`ADVANTAGES`, built-in or plugin): it compares the rewards of a prompt's samples
    (a group with equal rewards has no signal), as opposed to a token-level one with a critic (`gae`)."""
    return not is_token_advantage(name)


def advantage(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, **options) -> torch.Tensor:
    """Advantages from rewards: `[N]` for outcome estimators.

    For a token-level estimator (`is_token_advantage(name)`, e.g. `gae`) pass `values=[N,T]` and
    `mask=[N,T]` as keywords; `group_ids` is ignored and the result is `[N, T]` (use `token_advantage`
    to also get the returns).
    """
    if is_token_advantage(name):
        if "values" not in options or "mask" not in options:
            raise ValueError(f"token-level advantage {name!r} needs values=[N,T] and mask=[N,T] keywords")
        values, mask = options.pop("values"), options.pop("mask")
        return TOKEN_ADVANTAGES.get(name)(rewards, values, mask, **options)[0]
    return ADVANTAGES.get(name)(rewards, group_ids, **options)


def token_advantage(
    name: str, rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, **options
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level advantages and value targets `(advantages [N,T], returns [N,T])`; rewards `[N]` or `[N,T]`."""
    return TOKEN_ADVANTAGES.get(name)(rewards, values, mask, **options)


def policy_loss(
    name: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **options,
) -> tuple[torch.Tensor, Metrics]:
    """Per-token policy loss `[N, T]` and metrics; `advantages` is `[N]` or `[N, T]`."""
    return POLICY_LOSSES.get(name)(logp, old_logp, advantages, mask, **options)


def aggregate(name: str, per_token_loss: torch.Tensor, mask: torch.Tensor, **options) -> torch.Tensor:
    """Reduce a per-token loss `[N, T]` to a scalar; pass batch-global `num_tokens`/`num_seqs` for micro-batches."""
    return AGGREGATIONS.get(name)(per_token_loss, mask, **options)


def kl(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate `[N, T]` of the policy from the reference."""
    return KL_ESTIMATORS.get(name)(logp, ref_logp)


def is_weights(
    name: str, old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, **options
) -> tuple[torch.Tensor, Metrics]:
    """Detached importance weights `[N, T]` (multiply the per-token policy loss) and metrics."""
    return IS_CORRECTIONS.get(name)(old_logp, behaviour_logp, mask, **options)


def shape_rewards(
    name: str,
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    group_ids: torch.Tensor,
    correct: torch.Tensor,
    parts: dict[str, torch.Tensor] | None = None,
    **options,
) -> torch.Tensor:
    """Shaped outcome rewards `[N]`. `parts` (reward parts by name, `[N]` each; the env's per-episode sums are
    `env/<part>`) go to shaping functions that declare a `parts` keyword (tool-use shaping)."""
    fn = SHAPING.get(name)
    if "parts" in inspect.signature(fn).parameters:
        options["parts"] = parts or {}
    return fn(rewards, lengths, group_ids, correct, **options)


__all__ = [
    "is_group_advantage",
    "ADVANTAGES",
    "AGGREGATIONS",
    "IS_CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "SHAPING",
    "DISTILL",
    "TOKEN_ADVANTAGES",
    "advantage",
    "aggregate",
    "batch_normalisers",
    "distill",
    "entropy_bonus",
    "group_solve_rate",
    "group_stats",
    "is_token_advantage",
    "is_weights",
    "kl",
    "kl_reward_penalty",
    "outcome_token_rewards",
    "policy_loss",
    "shape_rewards",
    "token_advantage",
    "value_loss",
]
