"""The algorithm registries (kept apart so that entry modules can import them without cycles).

Every registry holds callables of one signature (checked by `tests/test_registry_contract.py`):

| registry | signature |
|---|---|
| `ADVANTAGES` | `fn(rewards [N], group_ids [N], **options) -> advantages [N]` |
| `TOKEN_ADVANTAGES` | `fn(rewards [N] or [N,T], values [N,T], mask [N,T], **options) -> (advantages, returns) [N,T]` |
| `POLICY_LOSSES` | `fn(logp, old_logp, advantages [N] or [N,T], mask, **options) -> (per_token_loss [N,T], metrics)` |
| `AGGREGATIONS` | `fn(per_token_loss [N,T], mask [N,T], num_tokens=None, num_seqs=None, **options) -> scalar` |
| `KL_ESTIMATORS` | `fn(logp [N,T], ref_logp [N,T]) -> [N,T]` |
| `IS_CORRECTIONS` | `fn(old_logp [N,T], behaviour_logp [N,T], mask [N,T], **options) -> (weights [N,T], metrics)` |
| `SHAPING` | `fn(rewards [N], lengths [N], group_ids [N], correct [N] bool, **options) -> shaped rewards [N]` |
| `DISTILL` | `fn(student, teacher, mask [N,T], **options) -> (per_token [N,T], metrics)`; log-probs `[N,T]` or logits `[N,T,V]` as `fn.takes` says |

`metrics` is always a `dict[str, Tensor]` of detached scalar tensors.
"""

from rollwise.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
TOKEN_ADVANTAGES: Registry = Registry("token-level advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
AGGREGATIONS: Registry = Registry("loss aggregation")
KL_ESTIMATORS: Registry = Registry("KL estimator")
IS_CORRECTIONS: Registry = Registry("importance-sampling correction")
SHAPING: Registry = Registry("reward shaping")
DISTILL: Registry = Registry("distillation objective")
