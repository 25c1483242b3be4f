"""Held-out accuracy that a constant answer cannot buy: balanced accuracy and the answer shares (issue 31).

On a task whose answers are skewed (56% of letter-counting problems have the answer 1), a policy that answers the
most common answer to every prompt scores that share in plain accuracy, and can look better than a model that
counts. Two figures tell a skill from that prior:

- `balanced_accuracy(groups)`: the accuracy of each reference answer's prompts, averaged over the distinct
  reference answers (macro-averaged recall, as in classification). A constant answer scores 1/(number of distinct
  answers) whatever their shares; a model right on every class scores as in plain accuracy. Prompts without a
  reference (`Prompt.answer` None: code tests, judges) are each a class of their own, so on a set whose answers
  are all distinct the figure equals plain accuracy.
- `reference_mode_frac(prompts)`: the share of prompts whose reference is the most common one, which is the
  accuracy of always giving that answer; and the replies' own `answer_mode_frac` (rollwise.metrics.collapse):
  a trained model whose replies give one answer far more often than the references do has learned the prior.

Worked example: references 1, 1, 1, 2 (reference_mode_frac 0.75), replies 1, 1, 1, 1: plain accuracy 0.75,
balanced (1/1 + 0/1) / 2 = 0.5; replies 1, 1, 2, 2: plain 0.75, balanced (2/3 + 1/1) / 2 = 0.833.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from rollwise.metrics.collapse import answer_metrics, normalise_answer
from rollwise.types import Prompt, Sample, Status


def reference_class(prompt: Prompt) -> str:
    """The class a prompt counts in: its normalised reference answer, or its own uid when it has none."""
    if prompt.answer is None or not str(prompt.answer).strip():
        return f"\0uid:{prompt.uid}"
    return normalise_answer(prompt.answer)


def balanced_accuracy(groups: Iterable[list[Sample]]) -> float | None:
    """Accuracy per reference class (over its prompts' scored samples), averaged over the classes with a scored
    sample; None when no sample was scored. `groups`: the samples of each prompt (any number per prompt)."""
    right: Counter[str] = Counter()
    scored: Counter[str] = Counter()
    for group in groups:
        for sample in group:
            if sample.status == Status.FAILED:
                continue
            cls = reference_class(sample.prompt)
            scored[cls] += 1
            right[cls] += bool(sample.correct)
    if not scored:
        return None
    return sum(right[c] / n for c, n in scored.items()) / len(scored)


def reference_mode_frac(prompts: Iterable[Prompt]) -> float | None:
    """Share of the prompts whose reference answer is the most common one (prompts without one never share);
    None for no prompts."""
    classes = [reference_class(p) for p in prompts]
    if not classes:
        return None
    return Counter(classes).most_common(1)[0][1] / len(classes)


def prior_metrics(groups: list[list[Sample]], label: str) -> dict[str, float | str | None]:
    """An evaluation mode's prior figures: `eval/<label>_balanced_accuracy`, `eval/<label>_answer_mode_frac`
    and `eval/<label>_answer_mode` (the replies' most common answer, rollwise.metrics.collapse)."""
    answers = answer_metrics(s for g in groups for s in g)
    return {f"eval/{label}_balanced_accuracy": balanced_accuracy(groups),
            f"eval/{label}_answer_mode_frac": answers.get("rollout/answer_mode_frac"),
            f"eval/{label}_answer_mode": answers.get("rollout/answer_mode")}
