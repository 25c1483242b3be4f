"""Built-in verifiers, registered in `REWARDS`: `arith`, `letters`, `math`, `gsm8k`, `exact`.

Each is `fn(sample) -> RewardResult` reading `sample.response_text` and `sample.prompt.answer`, with
value 1.0 / 0.0, parts `correct` (1.0 / 0.0) and `format` (1.0 when an answer could be extracted), `correct`
True / False on the result (scoring sets `sample.correct` from it; a reward never writes to the sample), and
`info["answer"]`: the answer extracted from the response (`answer_info`; absent when none was), which
`rollwise.metrics.collapse` counts to see a policy give one answer to every prompt. A missing or unusable
reference raises: `score_samples` counts that as an error.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Callable

from rollwise.registry import Registry
from rollwise.types import RewardResult, Sample

RewardFn = Callable[[Sample], "RewardResult | float | int | bool"]  # plain values: see rewards/scoring.py
REWARDS: Registry[RewardFn] = Registry("reward")

MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own signal-based limit per parse / comparison (main thread only)
REL_TOL = 1e-6  # numeric fallback of `math`

# A number: optional minus, digits with optional thousands commas ("1,234"), optional decimals.
NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
BOXED_RE = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def find_numbers(text: str) -> list[str]:
    """Numbers in `text` in order, commas removed; a minus glued to a word or digit ("6-5") is not a sign."""
    numbers = []
    for match in NUMBER_RE.finditer(text):
        number = match.group()
        if number.startswith("-") and match.start() > 0 and text[match.start() - 1].isalnum():
            number = number[1:]
        numbers.append(number.replace(",", ""))
    return numbers


def final_number(text: str) -> str | None:
    """The final answer: the last number inside the last `\\boxed{...}`, else the last number in the text."""
    boxed = BOXED_RE.findall(text)
    if boxed:
        inside = find_numbers(boxed[-1])
        if inside:
            return inside[-1]
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def as_integer(number: str | None) -> int | None:
    """'12' -> 12, '12.0' -> 12, '-3' -> -3; None when absent or not a whole number."""
    if number is None:
        return None
    if "." in number:
        whole, _, frac = number.partition(".")
        if frac.strip("0"):
            return None
        number = whole
    return int(number)


def final_integer(text: str) -> int | None:
    """The response's final answer as an integer (see `final_number`); None when there is none."""
    return as_integer(final_number(text))


def reference(sample: Sample) -> str:
    """The prompt's reference answer; ValueError naming the prompt when it has none."""
    answer = sample.prompt.answer
    if answer is None or not str(answer).strip():
        raise ValueError(f"prompt {sample.prompt.source or sample.prompt.uid!r} has no reference answer")
    return str(answer).strip()


ANSWER_MAX_CHARS = 100  # an extracted answer longer than this is cut (it is a label for counting, not the text)


def answer_info(answer: object) -> dict[str, str]:
    """`{"answer": text}`, the extracted answer stripped, whitespace collapsed, at most ANSWER_MAX_CHARS
    characters ('  1,080 \\n' -> '1,080'); `{}` when nothing was extracted (None or blank)."""
    if answer is None:
        return {}
    text = " ".join(str(answer).split())[:ANSWER_MAX_CHARS]
    return {"answer": text} if text else {}


def verdict(sample: Sample, correct: bool, found: bool, answer: object = None) -> RewardResult:
    """The 1.0 / 0.0 result with `correct` set and the extracted `answer` in `info` (`answer_info`); the sample
    is left as it is (scoring applies the result)."""
    value = 1.0 if correct else 0.0
    return RewardResult(value=value, parts={"correct": value, "format": 1.0 if found else 0.0},
                        correct=bool(correct), info=answer_info(answer))


def integer_reward(sample: Sample) -> RewardResult:
    """Correct when the last integer of the response equals the integer reference."""
    ref = reference(sample)
    gold = as_integer(ref.replace(",", "")) if NUMBER_RE.fullmatch(ref) else None
    if gold is None:
        raise ValueError(f"reference answer {ref!r} of prompt {sample.prompt.source!r} is not an integer")
    number = final_number(sample.response_text)
    pred = as_integer(number)
    return verdict(sample, pred == gold, found=pred is not None, answer=number if pred is None else pred)


REWARDS.register("arith")(integer_reward)
REWARDS.register("letters")(integer_reward)
REWARDS.register_lazy("lookup", "rollwise.envs.lookup:lookup_reward")  # beside its task and tool
REWARDS.register_lazy("reasoning_gym", "rollwise.rewards.reasoning_gym:reasoning_gym_reward")  # needs the extra
REWARDS.register_lazy("mixture", "rollwise.rewards.mixture:mixture_reward")  # [[data.mix]]: the source's own
REWARDS.register_lazy("judge", "rollwise.rewards.judge:judge")  # an LLM judge over HTTP (reward.judge_*)
REWARDS.register_lazy("cme", "rollwise.rewards.cme:cme")  # Cross-Model Entropy under reward.cme.model


def _math_verify_timeout() -> int | None:
    """math-verify's timeouts use SIGALRM, which only works in the main thread; elsewhere run without."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _as_latex(ref: str) -> str:
    """Wrap a plain gold answer in `$...$` so math-verify parses it ('12', '\\frac{1}{2}')."""
    if "$" in ref or "\\boxed" in ref or "\\(" in ref or "\\[" in ref:
        return ref
    return f"${ref}$"


def numeric_match(ref: str, text: str) -> tuple[bool, bool]:
    """Fallback: (correct, found) comparing the last number of `text` (`final_number`) with a numeric reference."""
    pred = final_number(text)
    try:
        gold = float(ref.replace(",", ""))
    except ValueError:
        return False, pred is not None
    if pred is None:
        return False, False
    return math.isclose(float(pred), gold, rel_tol=REL_TOL), True


def parsed_answer(parsed: list) -> str:
    """The answer math-verify extracted: the string it parsed (`[1/2, '\\frac{1}{2}']` -> '\\frac{1}{2}'), else
    its expression as text."""
    return str(parsed[1] if len(parsed) > 1 else parsed[0])


GSM8K_MARK = "####"  # GSM8K's reference solutions end with "#### <answer>"
# A thousands separator: a comma between a digit and exactly three digits ("1,080", "12,345,678"; not "1,2").
THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def after_mark(text: str) -> str | None:
    """The answer after the last '####' (GSM8K's final-answer mark): the rest of that line, stripped
    ('... #### 1,080' -> '1,080'; '#### 72\\nHope this helps' -> '72'); None when there is no mark."""
    if GSM8K_MARK not in text:
        return None
    rest = text.rsplit(GSM8K_MARK, 1)[1].strip()
    return rest.splitlines()[0].strip() if rest else ""


def math_answer(sample: Sample, ref: str) -> RewardResult:
    """math-verify equivalence of the response's final answer and the reference answer `ref`.

    The response's answer is what follows its last '####' when it has one (GSM8K style), else the whole text
    (math-verify takes the last `\\boxed{}`, else the last expression). When the reference is a plain number,
    thousands separators in the response are removed first ('$1,080' -> '$1080'). When either side does not
    parse, the last numbers are compared (`numeric_match`)."""
    from math_verify import parse, verify

    text = sample.response_text
    text = after_mark(text) if GSM8K_MARK in text else text
    if NUMBER_RE.fullmatch(ref.replace(" ", "")):
        ref, text = ref.replace(",", "").replace(" ", ""), THOUSANDS_RE.sub("", text)
    limit = _math_verify_timeout()
    gold = parse(_as_latex(ref), parsing_timeout=limit)
    pred = parse(text, parsing_timeout=limit)
    if gold and pred:
        return verdict(sample, bool(verify(gold, pred, timeout_seconds=limit)), found=True,
                       answer=parsed_answer(pred))
    correct, found = numeric_match(ref, text)
    return verdict(sample, correct, found, answer=parsed_answer(pred) if pred else final_number(text))


@REWARDS.register("math")
def math_reward(sample: Sample) -> RewardResult:
    """math-verify equivalence of the response and the reference (a MATH solution's last `\\boxed{}`, a GSM8K
    solution's answer after '####', or a bare answer); numeric fallback when either won't parse."""
    ref = reference(sample)
    return math_answer(sample, after_mark(ref) or ref)


@REWARDS.register("gsm8k")
def gsm8k_reward(sample: Sample) -> RewardResult:
    """GSM8K: the reference is a worked solution ending in '#### <answer>' (e.g. '... #### 1,080'), compared with
    the response's final number, `\\boxed{}` answer or '#### <answer>' line by math-verify. A reference without
    '####' raises (counted as a reward error): data.answer_field probably names the wrong field."""
    ref = reference(sample)
    gold = after_mark(ref)
    if not gold:
        raise ValueError(f"reference of prompt {sample.prompt.source or sample.prompt.uid!r} has no '#### <answer>' "
                         f"line (GSM8K's format), got {ref[-60:]!r}; check data.answer_field or use reward.fn = 'math'")
    return math_answer(sample, gold)


@REWARDS.register("exact")
def exact_reward(sample: Sample) -> RewardResult:
    """Stripped string equality of the response and the reference."""
    ref = reference(sample)
    text = sample.response_text.strip()
    return verdict(sample, text == ref, found=bool(text), answer=text)
