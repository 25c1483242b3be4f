"""RL math as pure tensor functions, registered by name.

One signature per registry (checked by `tests/test_registry_contract.py`):

- advantage estimators: `fn(rewards [N], group_ids [N], **options) -> advantages [N]`
- policy losses: `fn(logp [N,T], old_logp [N,T], advantages [N] | [N,T], mask [N,T], **options)
  -> (per_token_loss [N,T], metrics: dict[str, Tensor])`
- aggregations: `fn(per_token_loss [N,T], mask [N,T], **options) -> scalar`
- KL estimators: `fn(logp [N,T], ref_logp [N,T]) -> [N,T]`

This package imports only torch (and the stdlib registry).
"""

from __future__ import annotations

import torch

from rollwise.algo import advantages as _advantages  # noqa: F401  (registers entries)
from rollwise.algo import losses as _losses  # noqa: F401
from rollwise.algo.registries import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES


def advantage(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, **options) -> torch.Tensor:
    """Per-sample advantages `[N]` from outcome rewards `[N]` and group ids `[N]`."""
    return ADVANTAGES.get(name)(rewards, group_ids, **options)


def policy_loss(
    name: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss `[N, T]` and metrics; `advantages` is `[N]` or `[N, T]`."""
    return POLICY_LOSSES.get(name)(logp, old_logp, advantages, mask, **options)


def aggregate(name: str, per_token_loss: torch.Tensor, mask: torch.Tensor, **options) -> torch.Tensor:
    """Reduce a per-token loss `[N, T]` to a scalar."""
    return AGGREGATIONS.get(name)(per_token_loss, mask, **options)


def kl(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate `[N, T]` of the policy from the reference."""
    return KL_ESTIMATORS.get(name)(logp, ref_logp)


__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "advantage",
    "aggregate",
    "kl",
    "policy_loss",
]
