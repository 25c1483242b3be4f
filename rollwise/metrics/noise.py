"""How far a held-out accuracy moves by chance: the yardstick of "below its best" (best checkpoint, warnings).

An accuracy measured on `n` held-out prompts is a binomial proportion; its standard error is
`sqrt(p (1 - p) / n)`. Two evaluations of the same policy on the same prompts differ only by sampling (none at
all for greedy decoding), and two policies' accuracies on the same prompts are paired, so twice the standard
error at the better value is a conservative band: a drop larger than it is not chance at about the 95% level.
At p = 0 or 1 the formula gives 0, so the band is never narrower than one prompt (`1 / n`).

    accuracy_noise(0.4, 200)   # 2 * sqrt(0.24 / 200) = 0.0693
    accuracy_noise(0.0, 50)    # 1 / 50 = 0.02
"""

from __future__ import annotations

import math


def accuracy_noise(accuracy: float, n: int) -> float:
    """Twice the binomial standard error of `accuracy` on `n` prompts, at least `1 / n` (module docstring)."""
    if n <= 0:
        raise ValueError(f"accuracy_noise: n = {n}; an accuracy needs at least one prompt")
    p = min(1.0, max(0.0, float(accuracy)))
    return max(2.0 * math.sqrt(p * (1.0 - p) / n), 1.0 / n)


def below_by_more_than_noise(value: float, best: float, n: int) -> bool:
    """Whether `value` is under `best` by more than `accuracy_noise(best, n)`."""
    return best - value > accuracy_noise(best, n)
