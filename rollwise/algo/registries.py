"""The algorithm registries (kept apart so that entry modules can import them without cycles)."""

from rollwise.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
AGGREGATIONS: Registry = Registry("loss aggregation")
KL_ESTIMATORS: Registry = Registry("KL estimator")
