"""A step's metrics, accumulated where they are computed and read back to the host once.

`Trainer.step` adds a handful of metrics per micro-batch (loss, entropy, the loss's own figures, the engine
mismatch). Reading each back with `float()` is a host-device synchronisation on a GPU (about ten per
micro-batch before); here values and weights may be 0-dim tensors on the trainer's device, summed there, and
`means()` reads every one back in one transfer (`materialize`).
"""

from __future__ import annotations

import math

import torch

Number = float | torch.Tensor


class Accumulator:
    """Weighted means of metrics across micro-batches, plus running maxima.

    - `add(key, value, weight)`: weighted mean of `value` (weight 0.0 given as a Python float: a running maximum,
      kept for older callers);
    - `add_total(key, total, weight)`: the mean is sum(total) / sum(weight); a key whose weights sum to 0 is
      left out (e.g. a mismatch figure when no token was current);
    - `keep_max(key, value)`: the largest value seen (NaN stays NaN); -inf (never seen) is left out.
    """

    def __init__(self) -> None:
        self.sums: dict[str, Number] = {}
        self.weights: dict[str, Number] = {}
        self.maxima: set[str] = set()  # keys of `keep_max`

    def add(self, key: str, value: Number, weight: Number) -> None:
        if isinstance(weight, float) and weight == 0.0:
            self.keep_max(key, value)
            return
        self.add_total(key, value * weight, weight)

    def add_total(self, key: str, total: Number, weight: Number) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + total
        self.weights[key] = self.weights.get(key, 0.0) + weight

    def keep_max(self, key: str, value: Number) -> None:
        old = self.sums.get(key, -math.inf)
        if isinstance(old, torch.Tensor) or isinstance(value, torch.Tensor):
            old_t = old if isinstance(old, torch.Tensor) else torch.tensor(old, device=value.device)
            new_t = value if isinstance(value, torch.Tensor) else torch.tensor(value, device=old_t.device)
            self.sums[key] = torch.maximum(old_t.float(), new_t.float())  # NaN-propagating
        else:
            self.sums[key] = math.nan if math.isnan(old) or math.isnan(value) else max(old, value)
        self.weights[key] = 0.0
        self.maxima.add(key)

    def materialize(self) -> None:
        """Every tensor sum and weight as a Python float, in one read-back per device."""
        slots = [(d, k) for d in (self.sums, self.weights) for k, v in d.items() if isinstance(v, torch.Tensor)]
        if not slots:
            return
        by_device: dict[torch.device, list] = {}
        for d, k in slots:
            by_device.setdefault(d[k].device, []).append((d, k))
        for device, items in by_device.items():
            values = torch.stack([d[k].detach().float().reshape(()) for d, k in items]).tolist()
            for (d, k), value in zip(items, values):
                d[k] = value

    def means(self) -> dict[str, float]:
        self.materialize()
        out = {}
        for key, total in self.sums.items():
            weight = self.weights[key]
            if key in self.maxima:
                if total != -math.inf:
                    out[key] = total
            elif weight:
                out[key] = total / weight
        return out
