"""reasoning-gym's own scoring as rollwise rewards: the dataset's `score_answer(answer, entry)` on the answer
extracted from the response.

    reward.fn = "reasoning_gym"                              # the dataset named by the item's metadata
    reward.fn = "rollwise.rewards.reasoning_gym:chain_sum"   # one dataset (what `reasoning_gym:<name>` tasks use)

The entry scored is the prompt's item: `{"question": last user turn, "answer": Prompt.answer, "metadata":
Prompt.info["metadata"]}` (what `rollwise.data.reasoning_gym` stores; a file of dumped reasoning-gym items read
with `data.prompt_field = "question"` carries its `metadata` the same way). The dataset is built once per
process with the task's options (`Prompt.info["rg_options"]`; some scorers read their config).

Answer extraction follows reasoning-gym's convention: the text inside the last `<answer>...</answer>`
(`reasoning_gym.utils.extract_answer`). Without one, a lenient fallback is scored instead and counted in the
part `answer_fallback` (`reward/part/answer_fallback`: the share of responses scored by it):
an unclosed last `<answer>` tag -> the text after it; a numeric reference -> the response's last number (else
its last number word up to ten: "twice" -> 2); otherwise the last non-empty line, without a
leading "Answer:" / "The answer is" and a final period.

Result: value = the dataset's score in [0, 1] (its partial credit), `correct` only at full score (1.0), parts
`score`, `correct`, `format` (1.0 when the answer was in tags) and `answer_fallback`, and the answer scored in
`info["answer"]` (`rollwise.rewards.verifiers.answer_info`; absent when there was none). A scorer that raises is
a reward failure (counted in `reward/errors`, never a quiet 0).
"""

from __future__ import annotations

import contextlib
import re
import sys
from functools import lru_cache
from typing import Any

from rollwise.rewards.verifiers import NUMBER_RE, answer_info, final_number
from rollwise.types import RewardResult, Sample

TAG_OPEN, TAG_CLOSE = "<answer>", "</answer>"
NUMBER_WORDS = {"zero": 0, "once": 1, "one": 1, "twice": 2, "two": 2, "thrice": 3, "three": 3,
                "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
WORD_RE = re.compile(r"\b(" + "|".join(NUMBER_WORDS) + r")\b", re.IGNORECASE)
LEAD_RE = re.compile(r"^(?:\**\s*)(?:final answer|the answer is|answer)\s*[:=]?\s*", re.IGNORECASE)
FULL_SCORE = 1.0 - 1e-9


def extract_answer(text: str, reference: str | None) -> tuple[str | None, bool]:
    """(answer, used the fallback): reasoning-gym's last `<answer>` tag, else the lenient fallback (module
    docstring); (None, False) when the response holds nothing to score."""
    from reasoning_gym.utils import extract_answer as tagged

    answer = tagged(text, tag_name="answer")
    if answer is not None:
        return answer, False
    if TAG_OPEN in text:
        tail = text.rsplit(TAG_OPEN, 1)[1].split("</", 1)[0].strip()
        if tail:
            return tail, True
    if reference is not None and NUMBER_RE.fullmatch(reference.strip().replace(",", "")):
        number = final_number(text)
        if number is None and (words := WORD_RE.findall(text)):  # "appears twice" -> 2
            number = str(NUMBER_WORDS[words[-1].lower()])
        return (number, True) if number is not None else (None, False)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None, False
    last = LEAD_RE.sub("", lines[-1]).strip().strip("*").strip()
    return (last.removesuffix(".").strip() or None), bool(last)


@lru_cache(maxsize=64)
def scorer(dataset: str, options: tuple[tuple[str, Any], ...]):
    """The `score_answer` of dataset `dataset` built with `options` (once per process; `seed` and `size` as
    `rollwise.data.reasoning_gym` would not matter to a scorer)."""
    import reasoning_gym

    with contextlib.redirect_stdout(sys.stderr):
        return reasoning_gym.create_dataset(dataset, **dict(options), seed=0, size=1).score_answer


def entry_of(sample: Sample) -> dict[str, Any]:
    """The reasoning-gym item a prompt was made of."""
    prompt = sample.prompt
    question = next((m["content"] for m in reversed(prompt.messages) if m["role"] == "user"), "")
    return {"question": question, "answer": prompt.answer, "metadata": prompt.info.get("metadata") or {}}


def score(sample: Sample, dataset: str) -> RewardResult:
    """The result of `dataset`'s scorer on the sample's extracted answer (module docstring)."""
    entry = entry_of(sample)
    answer, fallback = extract_answer(sample.response_text, entry["answer"])
    options = sample.prompt.info.get("rg_options") or {}
    with contextlib.redirect_stdout(sys.stderr):
        value = float(scorer(dataset, tuple(sorted(options.items())))(answer, entry))
    correct = value >= FULL_SCORE
    tagged = answer is not None and not fallback
    return RewardResult(value=value, correct=correct,
                        parts={"score": value, "correct": float(correct), "format": float(tagged),
                               "answer_fallback": float(fallback)}, info=answer_info(answer))


def dataset_of(sample: Sample) -> str:
    """The dataset of a sample's item: its metadata's `source_dataset` (reasoning-gym sets it on every item), else
    the `rg_dataset` rollwise's task stored; ValueError naming the prompt otherwise."""
    info = sample.prompt.info
    name = (info.get("metadata") or {}).get("source_dataset") or info.get("rg_dataset")
    if not name:
        raise ValueError(f"prompt {sample.prompt.source or sample.prompt.uid!r} names no reasoning-gym dataset "
                         "(metadata.source_dataset); give rows that are reasoning-gym items (question, answer, "
                         "metadata) or reward.fn = 'rollwise.rewards.reasoning_gym:<dataset>'")
    return str(name)


def reasoning_gym_reward(sample: Sample) -> RewardResult:
    """reasoning-gym's `score_answer` of the dataset named by the item's metadata (`source_dataset`): partial
    credit as the value, correct only at full score; `<answer>` tags, else a counted lenient fallback."""
    return score(sample, dataset_of(sample))


class DatasetReward:
    """The reward of one reasoning-gym dataset (for rows that carry no metadata, e.g. `rollwise eval --data`)."""

    def __init__(self, dataset: str) -> None:
        self.dataset = dataset
        self.__name__ = f"reasoning_gym:{dataset}"
        self.__doc__ = f"reasoning-gym's score_answer of {dataset} (see rollwise.rewards.reasoning_gym)"

    def __call__(self, sample: Sample) -> RewardResult:
        named = (sample.prompt.info.get("metadata") or {}).get("source_dataset")
        return score(sample, str(named or self.dataset))


@lru_cache(maxsize=None)
def _dataset_reward(name: str) -> DatasetReward:
    return DatasetReward(name)


def __getattr__(name: str) -> DatasetReward:
    """`rollwise.rewards.reasoning_gym:<dataset>` (a plugin path) -> that dataset's reward."""
    if name.startswith("__"):
        raise AttributeError(name)
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise AttributeError(f"reasoning-gym has no dataset {name!r}")
    return _dataset_reward(name)
