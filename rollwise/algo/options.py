"""The keywords an outcome estimator (ADVANTAGES) takes from a run's settings, for every caller alike
(`rollwise.advantages` and methods that run the estimator on rewards of their own, e.g. SGRPO)."""

from __future__ import annotations

import inspect

import torch

from rollwise.algo.registries import ADVANTAGES
from rollwise.config import Config
from rollwise.types import Sample


def estimator_options(cfg: Config, samples: list[Sample] | None = None) -> dict:
    """Keywords the configured outcome estimator declares: `scale` (`algo.scale_rewards`); `parts` (reward parts
    by name, `[N]` float32 each on CPU, NaN where a sample has none) and `weights` (`[algo.moa] weights`) for the
    multi-objective `moa`; `power` (`[algo.slas] power`) for `slas`."""
    accepts = inspect.signature(ADVANTAGES.get(cfg.algo.advantage)).parameters
    options: dict = {"scale": cfg.algo.scale_rewards == "group"} if "scale" in accepts else {}
    if "parts" in accepts and samples is not None:
        names = sorted({k for s in samples for k in s.reward_parts})
        options["parts"] = {k: torch.tensor([s.reward_parts.get(k, float("nan")) for s in samples],
                                            dtype=torch.float32) for k in names}
    if "weights" in accepts:
        from rollwise.algo.moa import MoaOptions

        options["weights"] = dict(MoaOptions.of(cfg).weights)
    if "power" in accepts:
        from rollwise.algo.slas import SlasOptions

        options["power"] = SlasOptions.of(cfg).power
    return options
