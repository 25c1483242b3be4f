"""Prompt sources: the protocol, the task registry and the built-in procedural tasks.

A prompt source gives training prompts by position (0, 1, 2, ... counts prompts consumed, so a resumed run
continues the same order) and a FIXED held-out evaluation split that does not depend on the training seed.

Built-in tasks draw problems from a seeded RNG. Their evaluation split is drawn first, with a fixed seed; a
training draw whose text equals an evaluation prompt is redrawn, so the two never share a prompt text
(`data.split = "prompt"`). That split is by prompt TEXT only: the same problem can be trained under another
phrasing. `arith` also has `data.split = "fact"`: a fixed fifth of its (a, b, op) facts is held out and never
trained under any phrasing or operand order.
"""

from __future__ import annotations

import hashlib
import random
from functools import lru_cache
from importlib import resources
from typing import Any, Callable, Protocol, runtime_checkable

from rollwise.config import DataConfig
from rollwise.registry import Registry, load_dotted
from rollwise.types import Prompt

EVAL_SEED = 1_000_003  # fixed: the held-out split is the same whatever the training seed
MAX_REDRAWS = 1000  # training draws that may hit the eval split before we give up
SPLIT_NAMES = {"prompt": "by prompt text", "fact": "by fact"}


@runtime_checkable
class PromptSource(Protocol):
    """Where prompts come from: a procedural task or a file dataset."""

    name: str
    default_reward: str  # a name in rollwise.rewards.REWARDS

    def train_prompt(self, position: int) -> Prompt:
        """The training prompt at `position`: a deterministic function of (seed, position)."""
        ...

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first `n` prompts of the fixed held-out split; ValueError when `n` exceeds the split."""
        ...


TaskFactory = Callable[[DataConfig, int], PromptSource]
TASKS: Registry[TaskFactory] = Registry("task")
# The tool tasks live beside their environments (rollwise.envs), imported on first use: data never imports envs.
TASKS.register_lazy("calc", "rollwise.envs.calc:calc_task")
TASKS.register_lazy("lookup", "rollwise.envs.lookup:lookup_task")
TASKS.register_lazy("pyexec", "rollwise.envs.pyexec:pyexec_task")
# Task families: 'FAMILY:NAME' is task NAME of a family whose factory reads NAME from data.task (imported on first
# use). A family's name shadows a plugin module of the same name.
TASK_FAMILIES: dict[str, str] = {"reasoning_gym": "rollwise.data.reasoning_gym:reasoning_gym_task",
                                 "verifiers": "rollwise.agents.vf_env:verifiers_task"}  # verifiers v1 environments


def task_family(name: str) -> str | None:
    """The family of task `name` ('reasoning_gym:chain_sum' -> 'reasoning_gym'); None for any other task."""
    family, sep, _ = name.partition(":")
    return family if sep and family in TASK_FAMILIES else None


def task_factory(name: str) -> TaskFactory:
    """The factory of task `name`: a family member, a registered task or a plugin 'pkg.mod:fn'."""
    family = task_family(name)
    return load_dotted(TASK_FAMILIES[family]) if family else TASKS.get(name)


def user_prompt(uid: str, text: str, answer: str, source: str, info: dict[str, Any]) -> Prompt:
    """A one-user-turn prompt."""
    return Prompt(uid=uid, messages=[{"role": "user", "content": text}], answer=answer, source=source, info=info)


def text_uid(task: str, text: str) -> str:
    """A stable id derived from the prompt text: the same problem always has the same uid."""
    return f"{task}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def first_held_out(task: str, held_out: list[Prompt], n: int, hint: str = "data.eval_size") -> list[Prompt]:
    """The first `n` prompts of a task's held-out split; ValueError naming eval.n when it has fewer."""
    if n < 0 or n > len(held_out):
        raise ValueError(f"task {task!r}: asked for {n} eval prompts but the held-out split has {len(held_out)} "
                         f"({hint}); lower eval.n or raise data.eval_size")
    return list(held_out[:n])


def check_split(split: str, task: str, supported: tuple[str, ...]) -> None:
    """ValueError naming `data.split` when the task does not implement that split."""
    if split not in supported:
        raise ValueError(
            f'data.split = "{split}" is not available for task {task!r} (it has: {", ".join(supported)}); '
            f'only the built-in arith task holds out facts; remove data.split or set data.task = "arith"'
        )


class ProceduralTask:
    """Base of the built-in tasks: subclasses define `draw(rng)` and `num_distinct()`."""

    name = "task"
    default_reward = "exact"
    splits: tuple[str, ...] = ("prompt",)  # data.split values this task implements

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        check_split(cfg.split, self.name, self.splits)
        self.seed = seed
        self.split = cfg.split
        self.eval_size = cfg.eval_size

    def draw(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        """One random problem: (prompt text, answer, info)."""
        raise NotImplementedError

    def num_distinct(self) -> int:
        """How many distinct prompt texts `draw` can produce."""
        raise NotImplementedError

    def _build_eval_split(self) -> None:
        """Draw `eval_size` distinct prompts with the fixed eval seed; check room is left for training."""
        space = self.num_distinct()
        if space - self.eval_size < self.eval_size:
            raise ValueError(
                f"task {self.name!r}: only {space} distinct prompts ({self.describe()}), too few for an eval "
                f"split of {self.eval_size} (data.eval_size) plus a training pool at least as large; lower "
                f"data.eval_size to at most {space // 2} or enlarge the problem space"
            )
        rng = random.Random(f"{self.name}-eval-{EVAL_SEED}")
        self._eval: list[Prompt] = []
        self._eval_texts: set[str] = set()
        for _ in range(100 * self.eval_size + 10_000):
            if len(self._eval) == self.eval_size:
                return
            text, answer, info = self.draw(rng)
            if text not in self._eval_texts:
                self._eval_texts.add(text)
                source = f"{self.name}:eval {len(self._eval)}"
                self._eval.append(user_prompt(text_uid(self.name, text), text, answer, source, info))
        raise RuntimeError(f"task {self.name!r}: could not draw {self.eval_size} distinct eval prompts")

    def describe(self) -> str:
        """Short description of the problem space, for error messages."""
        return self.name

    def is_held_out(self, text: str, info: dict[str, Any]) -> bool:
        """Whether a drawn problem belongs to the held-out split (here: its text is an eval prompt)."""
        return text in self._eval_texts

    def train_prompt(self, position: int) -> Prompt:
        """Training prompt at `position`; never a held-out problem (`is_held_out`)."""
        if position < 0:
            raise ValueError(f"task {self.name!r}: position must be >= 0, got {position}")
        rng = random.Random(f"{self.name}-train-{self.seed}-{position}")
        for _ in range(MAX_REDRAWS):
            text, answer, info = self.draw(rng)
            if not self.is_held_out(text, info):
                source = f"{self.name}:train {position}"
                return user_prompt(text_uid(self.name, text), text, answer, source, info)
        raise RuntimeError(f"task {self.name!r}: {MAX_REDRAWS} draws in a row hit the eval split")

    @property
    def num_eval(self) -> int:
        """Size of the held-out split."""
        return len(self._eval)

    def split_summary(self) -> str:
        """The held-out split in one phrase, for the start-of-run data line."""
        return (f"task {self.name} ({self.describe()}) -> {len(self._eval)} held-out prompts, split by prompt text "
                f"(data.split=\"prompt\"; a held-out problem may be trained under another phrasing)")

    def eval_prompts(self, n: int) -> list[Prompt]:
        """First `n` prompts of the fixed held-out split."""
        return first_held_out(self.name, self._eval, n)


# --------------------------------------------------------------------------------------------- arith

GENERIC_PHRASINGS = (
    "What is {a} {op} {b}?",
    "Compute {a} {op} {b}.",
    "Calculate {a} {op} {b}.",
    "{a} {op} {b} = ?",
    "What does {a} {op} {b} equal?",
    "Find the value of {a} {op} {b}.",
)
WORDED_PHRASINGS = {
    "+": ("What do you get when you add {b} to {a}?", "What is the sum of {a} and {b}?"),
    "-": ("What do you get when you subtract {b} from {a}?", "What is {a} minus {b}?"),
    "*": ("What do you get when you multiply {a} by {b}?", "What is the product of {a} and {b}?"),
}


def arith_phrasings(op: str) -> tuple[str, ...]:
    """All phrasings for one operator (each one maps distinct operands to distinct texts)."""
    return GENERIC_PHRASINGS + WORDED_PHRASINGS[op]


Fact = tuple[int, int, str]  # (larger operand, smaller operand, op)
FACT_HOLDOUT_FRACTION = 0.2  # data.split = "fact": share of the facts of each operator held out
MAX_LISTED_DIGITS = 2  # up to this many digits the facts are listed: exactly 20% held out, eval split ordered


def arith_fact(a: int, b: int, op: str) -> Fact:
    """The fact a problem asks about. `+` and `*` commute, so `3 + 5` and `5 + 3` are one fact (held out
    together: a model cannot answer a held-out sum by recalling its swapped twin); `-` always has a >= b."""
    return (max(a, b), min(a, b), op)


def fact_score(fact: Fact) -> float:
    """A fixed pseudo-random number in [0, 1) per fact (from EVAL_SEED only, not the training seed)."""
    digest = hashlib.sha1(f"arith-fact-{EVAL_SEED}-{fact[2]}-{fact[0]}-{fact[1]}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def facts_of(op: str, digits: int) -> list[Fact]:
    """Every fact of one operator with `digits`-digit operands: (a, b) with a >= b, 10^d (10^d + 1) / 2 of them."""
    values = 10**digits
    return [(a, b, op) for a in range(values) for b in range(a + 1)]


def fact_problems(fact: Fact) -> list[tuple[str, int, int]]:
    """Every (prompt text, a, b) of a fact: each phrasing, and for `+`/`*` with a != b both operand orders."""
    big, small, op = fact
    orders = [(big, small)] if op == "-" or big == small else [(big, small), (small, big)]
    return [(t.format(a=a, b=b, op=op), a, b) for a, b in orders for t in arith_phrasings(op)]


def arith_value(a: int, b: int, op: str) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


class ArithTask(ProceduralTask):
    """Integer arithmetic: `a op b` with `cfg.digits`-digit operands; subtraction results are >= 0.

    `data.split = "prompt"` holds out prompt texts (see ProceduralTask). `data.split = "fact"` holds out
    FACT_HOLDOUT_FRACTION of the facts of each operator (`arith_fact`), chosen by `fact_score` so the same facts
    are held out for every training seed and every `data.ops`; training redraws any problem about a held-out
    fact. Up to MAX_LISTED_DIGITS digits exactly round(20%) of each operator's facts are held out and the eval
    split lists one phrasing of every held-out fact before a second one of any; above that a fact is held out
    when its score is below 0.2 and the eval split is drawn at random from those facts.
    """

    name = "arith"
    default_reward = "arith"
    splits = ("prompt", "fact")

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        super().__init__(cfg, seed)
        self.digits = cfg.digits
        self.ops = list(dict.fromkeys(cfg.ops))  # de-duplicated, order kept
        self._held_facts: set[Fact] | None = None  # listed held-out facts (split "fact", few digits)
        if self.split == "fact":
            self._build_fact_split()
        else:
            self._build_eval_split()

    def describe(self) -> str:
        return f"{self.digits}-digit operands, ops {' '.join(self.ops)}"

    def num_facts(self) -> int:
        """Distinct facts over all operators (`arith_fact` counts a commuted pair once)."""
        values = 10**self.digits
        return len(self.ops) * values * (values + 1) // 2

    def fact_is_held_out(self, fact: Fact) -> bool:
        """Split "fact": whether training must never see this fact."""
        if self._held_facts is not None:
            return fact in self._held_facts
        return fact_score(fact) < FACT_HOLDOUT_FRACTION

    def is_held_out(self, text: str, info: dict[str, Any]) -> bool:
        if self.split == "fact":
            return self.fact_is_held_out(arith_fact(info["a"], info["b"], info["op"]))
        return super().is_held_out(text, info)

    def _build_fact_split(self) -> None:
        """Held-out facts, then up to `eval_size` distinct prompt texts about them (all of them when fewer)."""
        rng = random.Random(f"{self.name}-fact-eval-{EVAL_SEED}")
        problems: list[tuple[str, int, int, str]] = []  # (text, a, b, op)
        if self.digits <= MAX_LISTED_DIGITS:
            self._held_facts = set()
            for op in self.ops:
                facts = sorted(facts_of(op, self.digits), key=fact_score)
                self._held_facts.update(facts[: round(FACT_HOLDOUT_FRACTION * len(facts))])
            held = sorted(self._held_facts, key=fact_score)  # a fixed order, then shuffled by the eval rng
            rng.shuffle(held)
            per_fact = [rng.sample(fact_problems(f), len(fact_problems(f))) for f in held]
            rounds = max(len(p) for p in per_fact)  # round r: the r-th phrasing of every fact that has one
            problems = [(*p[r], f[2]) for r in range(rounds) for f, p in zip(held, per_fact) if r < len(p)]
            problems = problems[: self.eval_size]
        else:
            seen: set[str] = set()
            for _ in range(100 * self.eval_size + 10_000):
                if len(problems) == self.eval_size:
                    break
                text, _, info = self.draw(rng)
                if text not in seen and self.fact_is_held_out(arith_fact(info["a"], info["b"], info["op"])):
                    seen.add(text)
                    problems.append((text, info["a"], info["b"], info["op"]))
        self._eval = [
            user_prompt(text_uid(self.name, text), text, str(arith_value(a, b, op)), f"{self.name}:eval {i}",
                        {"a": a, "b": b, "op": op})
            for i, (text, a, b, op) in enumerate(problems)
        ]
        self._eval_texts = {p[0] for p in problems}

    def split_summary(self) -> str:
        if self.split != "fact":
            return super().split_summary()
        if self._held_facts is not None:
            held = f"{len(self._held_facts)} of {self.num_facts()} facts"
        else:
            held = f"{FACT_HOLDOUT_FRACTION:.0%} of {self.num_facts()} facts"
        return (f"task {self.name} ({self.describe()}) -> {len(self._eval)} held-out prompts, split by fact "
                f"(data.split=\"fact\": {held} held out, never trained under any phrasing or operand order)")

    def num_distinct(self) -> int:
        values = 10**self.digits
        pairs = {"+": values * values, "*": values * values, "-": values * (values + 1) // 2}
        return sum(pairs[op] * len(arith_phrasings(op)) for op in self.ops)

    def draw(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        op = rng.choice(self.ops)
        a = rng.randrange(10**self.digits)
        b = rng.randrange(10**self.digits)
        if op == "-" and a < b:
            a, b = b, a
        text = rng.choice(arith_phrasings(op)).format(a=a, b=b, op=op)
        return text, str(arith_value(a, b, op)), {"a": a, "b": b, "op": op}


@TASKS.register("arith")
def arith_task(cfg: DataConfig, seed: int) -> ArithTask:
    """Built-in arithmetic task (see `ArithTask`)."""
    return ArithTask(cfg, seed)


# ------------------------------------------------------------------------------------------- letters

COUNT_PHRASINGS = (
    "How many times does the letter '{letter}' appear in '{word}'?",
    "How many times does the letter '{letter}' appear in the word '{word}'?",
    "Count how many times the letter '{letter}' occurs in '{word}'.",
    "In the word '{word}', how many times does the letter '{letter}' appear?",
    "How many '{letter}' letters are there in '{word}'?",
)
LENGTH_PHRASINGS = (
    "How many letters are in the word '{word}'?",
    "How many letters does the word '{word}' have?",
    "Count the letters in the word '{word}'.",
    "What is the length of the word '{word}', in letters?",
)
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
COUNT_FRACTION = 0.75  # share of letter-count questions; the rest ask for the word length
ABSENT_FRACTION = 0.2  # share of count questions about a letter the word does not contain


@lru_cache(maxsize=1)
def load_words() -> tuple[str, ...]:
    """The packaged word list (`rollwise/data/words.txt`): lowercase a-z words, comments skipped."""
    text = resources.files("rollwise.data").joinpath("words.txt").read_text(encoding="utf-8")
    words = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    bad = [w for w in words if not (w.isascii() and w.isalpha() and w.islower())]
    if bad:
        raise ValueError(f"rollwise/data/words.txt: not lowercase a-z words: {bad[:5]}")
    return tuple(dict.fromkeys(words))


class LettersTask(ProceduralTask):
    """Letter counting ('r' in 'strawberry') and word length questions over the packaged word list."""

    name = "letters"
    default_reward = "letters"

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        super().__init__(cfg, seed)
        self.words = load_words()
        self._build_eval_split()

    def describe(self) -> str:
        return f"{len(self.words)} words"

    def num_distinct(self) -> int:
        return len(self.words) * (len(ALPHABET) * len(COUNT_PHRASINGS) + len(LENGTH_PHRASINGS))

    def draw(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        word = rng.choice(self.words)
        if rng.random() >= COUNT_FRACTION:
            text = rng.choice(LENGTH_PHRASINGS).format(word=word)
            return text, str(len(word)), {"kind": "length", "word": word}
        present = sorted(set(word))
        absent = [c for c in ALPHABET if c not in present]
        letter = rng.choice(absent if rng.random() < ABSENT_FRACTION and absent else present)
        text = rng.choice(COUNT_PHRASINGS).format(word=word, letter=letter)
        return text, str(word.count(letter)), {"kind": "count", "word": word, "letter": letter}


@TASKS.register("letters")
def letters_task(cfg: DataConfig, seed: int) -> LettersTask:
    """Built-in letters task (see `LettersTask`)."""
    return LettersTask(cfg, seed)
