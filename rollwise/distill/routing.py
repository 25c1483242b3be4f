"""Self-Routing: each sample of a teacher step to the reward's push, the teacher's pull, both, or neither.

The rule is ours (the paper routes by correctness and confidence): a correct and confident response has nothing
left to teach (`skip`); a correct unsure one is reinforced (`grpo`); a wrong unsure one learns from the
privileged teacher (`self_distill`); a wrong confident one gets both (`regularise`). Confidence is the policy's
geometric-mean token probability over the trained tokens. The route and its loss weights go into the step's
`StepMarks`, never onto the sample.
"""

from __future__ import annotations

import math

from rollwise.distill.terms import StepMarks
from rollwise.types import Sample

# (reward advantage, teacher term, sft NLL) weights of each route
ROUTES = {"grpo": (1.0, 0.0, 0.0), "self_distill": (0.0, 1.0, 0.0), "regularise": (1.0, 1.0, 0.0),
          "skip": (0.0, 0.0, 0.0)}


def confidence(sample: Sample) -> float:
    """`exp(mean_t logp_t)` of the untruncated sampling log-probs over the trained tokens (1.0 for none)."""
    logps = sample.full_logprobs or sample.behaviour_logprobs
    values = [lp for lp, m in zip(logps, sample.loss_mask) if m]
    return math.exp(sum(values) / len(values)) if values else 1.0


def route(sample: Sample, threshold: float) -> str:
    """The route of one sample (see the module docstring)."""
    confident = confidence(sample) >= threshold
    if sample.correct:
        return "skip" if confident else "grpo"
    return "regularise" if confident else "self_distill"


def route_samples(samples: list[Sample], threshold: float, marks: StepMarks) -> tuple[list[Sample], dict[str, float]]:
    """Route every sample into `marks` (route and loss weights), drop the skipped; `route/<name>_frac`."""
    counts = dict.fromkeys(ROUTES, 0)
    kept = []
    for s in samples:
        name = route(s, threshold)
        counts[name] += 1
        marks.routes[id(s)] = name
        marks.set_weights(s, ROUTES[name])
        if name != "skip":
            kept.append(s)
    n = max(1, len(samples))
    return kept, {f"route/{name}_frac": c / n for name, c in counts.items()}
