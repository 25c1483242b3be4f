"""reasoning-gym datasets as rollwise tasks: `data.task = "reasoning_gym:<dataset>"`, `data.options` -> its config.

reasoning-gym (open-thought/reasoning-gym, `pip install 'rollwise[reasoning-gym]'`) registers ~100 procedural
generators: `reasoning_gym.create_dataset(name, **config)` builds one from its config dataclass, and item `idx`
is a dict `{question, answer, metadata}` scored by the dataset's own `score_answer(answer, entry)`
(`rollwise.rewards.reasoning_gym`).

How reasoning-gym seeds items, and how rollwise splits them. A dataset's config holds `seed` and `size`; almost
every generator draws item `idx` from `random.Random(config.seed + idx)`, a few precompute `size` items from
`config.seed` when built (acre, ...). rollwise owns both fields (`data.options` may not set them):

- the held-out split is items 0, 1, 2, ... of the dataset seeded EVAL_BASE (fixed: the same for every training
  seed), de-duplicated by question text, the first `data.eval_size` distinct ones;
- training reads a stream: stream index j is item j % CHUNK of the dataset seeded train_base + (j - j % CHUNK),
  which for a `Random(seed + idx)` generator is rng seed train_base + j. train_base lies in [0, 2^31) and the
  stream in [0, 2^24), the held-out items at 2^31 + 2^24 and above: the two never share an rng seed;
- and whatever a generator does, a training item whose question text is a held-out question is redrawn (stream
  index j + r * REDRAW_STRIDE for the r-th redraw), so no held-out question is ever trained. A small item space
  shows here: too few distinct questions for the held-out split, or MAX_REDRAWS redraws in a row, fail with a
  line naming data.eval_size and data.options.

Prompts carry the dataset's system prompt (reasoning-gym's `SYSTEM_PROMPTS["default"]`, which asks for the
final answer in `<answer>...</answer>`) as their first turn unless `data.system_prompt` is set.
"""

from __future__ import annotations

import contextlib
import sys
from functools import lru_cache
from typing import Any

from rollwise.config import DataConfig
from rollwise.data.tasks import first_held_out, text_uid
from rollwise.errors import UserError
from rollwise.types import Prompt

PREFIX = "reasoning_gym:"
EXTRA = "pip install 'rollwise[reasoning-gym]'"
OWNED_FIELDS = ("seed", "size")  # config fields rollwise sets itself
CHUNK = 256  # items per training dataset instance (generators that precompute build this many at once)
STREAM = 2**24  # training stream indices per seed
TRAIN_BASES = 2**31 // STREAM  # distinct training streams (train.seed modulo this)
EVAL_BASE = 2**31 + STREAM  # seed of the held-out dataset: above every training rng seed
EVAL_DRAWS_PER_ITEM = 2  # held-out draws allowed per item: more duplicates mean the split would fill ~80% of the space
REDRAW_STRIDE = 2**18  # the r-th redraw of a training position reads stream index position + r * stride
MAX_REDRAWS = 64
CACHED_CHUNKS = 4


class ReasoningGymError(UserError, ValueError):
    """A reasoning-gym task name or option is wrong, or reasoning-gym is not installed."""


def import_reasoning_gym():
    """The `reasoning_gym` module; ReasoningGymError with the pip line when it is not installed."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ReasoningGymError(f"reasoning-gym tasks need the 'reasoning_gym' package: {EXTRA} ({exc})") from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset reasoning-gym registers."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def dataset_of(task: str) -> str:
    """'reasoning_gym:chain_sum' -> 'chain_sum'."""
    return task[len(PREFIX):] if task.startswith(PREFIX) else task


def config_fields(name: str) -> list[str]:
    """The fields of dataset `name`'s config dataclass, without the ones rollwise sets (seed, size)."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    return [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in OWNED_FIELDS]


def check_task(task: str, options: dict[str, Any], key: str = "data.task") -> str:
    """The dataset name of `task` after checking it and `options` against reasoning-gym's registry and the
    dataset's config (its own `validate()` included); ReasoningGymError in one line otherwise."""
    name = dataset_of(task)
    names = dataset_names()
    if name not in names:
        raise ReasoningGymError(f"{key} = {task!r}: reasoning-gym has no dataset {name!r}; valid: "
                                f"{', '.join(PREFIX + n for n in names)}")
    if name == "composite":
        raise ReasoningGymError(f"{key} = {task!r}: composite takes a list of dataset specs, which data.options "
                                "cannot hold; mix datasets with [[data.mix]] tables instead (one per dataset, each "
                                "with its weight and options)")
    owned = sorted(set(options) & set(OWNED_FIELDS))
    if owned:
        raise ReasoningGymError(f"{key} = {task!r}: data.options may not set {', '.join(owned)}: rollwise seeds the "
                                "training stream from train.seed and the held-out split with its own fixed seed")
    fields = config_fields(name)
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ReasoningGymError(f"{key} = {task!r}: unknown data.options {', '.join(unknown)}; the fields of its "
                                f"config are: {', '.join(fields)}")
    try:
        build_dataset(name, tuple(sorted(options.items())), 0, 1)
    except ReasoningGymError:
        raise
    except Exception as exc:  # the config's own validate(): AssertionError, or a TypeError of a bad value
        raise ReasoningGymError(f"{key} = {task!r}: data.options {dict(options)} rejected by its config: "
                                f"{type(exc).__name__}: {exc}") from None
    return name


def build_dataset(name: str, options: tuple[tuple[str, Any], ...], seed: int, size: int):
    """`reasoning_gym.create_dataset(name, **options, seed=seed, size=size)`; the generators' prints go to stderr
    (`rollwise eval` keeps stdout for its JSON)."""
    reasoning_gym = import_reasoning_gym()
    with contextlib.redirect_stdout(sys.stderr):
        return reasoning_gym.create_dataset(name, **dict(options), seed=seed, size=size)


@lru_cache(maxsize=1)
def default_system_prompt() -> str:
    """reasoning-gym's default system prompt: think, then the final answer alone in <answer>...</answer>."""
    import_reasoning_gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def reward_name(dataset: str) -> str:
    """The reward that scores `dataset`'s items (rollwise.rewards.reasoning_gym resolves the attribute)."""
    return f"rollwise.rewards.reasoning_gym:{dataset}"


class ReasoningGymTask:
    """A reasoning-gym dataset as a prompt source (see the module docstring for the split)."""

    splits = ("prompt",)

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        self.dataset = check_task(cfg.task, dict(cfg.options))
        self.name = PREFIX + self.dataset
        self.options = tuple(sorted(cfg.options.items()))
        self.default_reward = reward_name(self.dataset)
        own = cfg.system_prompt is None
        self.system_prompt = default_system_prompt() if own else cfg.system_prompt  # `rollwise eval --data` reads it
        self._own_system = own  # else the encoder adds data.system_prompt itself
        self.seed = seed
        self.eval_size = cfg.eval_size
        self._train_base = (seed % TRAIN_BASES) * STREAM
        self._chunks: dict[int, Any] = {}
        self._eval: list[Prompt] = []
        self._eval_questions: set[str] = set()
        self._eval_draws = 0
        self._build_eval_split()

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options)
        return self.dataset + (f" ({opts})" if opts else "")

    def _build_eval_split(self) -> None:
        """The first `eval_size` distinct questions of the dataset seeded EVAL_BASE."""
        draws = EVAL_DRAWS_PER_ITEM * self.eval_size + 16
        held = build_dataset(self.dataset, self.options, EVAL_BASE, draws)
        for idx in range(draws):
            if len(self._eval) == self.eval_size:
                break
            item = self._item(held, idx)
            if item["question"] not in self._eval_questions:
                self._eval_questions.add(item["question"])
                self._eval.append(self._prompt(item, f"{self.name}:eval {len(self._eval)}"))
            self._eval_draws = idx + 1
        if len(self._eval) < self.eval_size:
            raise ReasoningGymError(
                f"task {self.name!r}: only {len(self._eval)} distinct questions in {draws} draws of "
                f"{self.describe()}, too few for a held-out split of data.eval_size={self.eval_size} and training "
                f"besides; lower data.eval_size (e.g. {max(1, len(self._eval) // 4)}) or widen data.options")

    @staticmethod
    def _item(dataset, idx: int) -> dict[str, Any]:
        with contextlib.redirect_stdout(sys.stderr):
            return dataset[idx]

    def _stream_item(self, j: int) -> dict[str, Any]:
        """Item j of this seed's training stream (module docstring)."""
        chunk, offset = divmod(j % STREAM, CHUNK)
        dataset = self._chunks.get(chunk)
        if dataset is None:
            dataset = build_dataset(self.dataset, self.options, self._train_base + chunk * CHUNK, CHUNK)
            if len(self._chunks) >= CACHED_CHUNKS:
                self._chunks.pop(next(iter(self._chunks)))
            self._chunks[chunk] = dataset
        return self._item(dataset, offset)

    def _prompt(self, item: dict[str, Any], source: str) -> Prompt:
        """A prompt of one item: [system,] user question; the answer and the item's metadata for its scorer."""
        question = str(item["question"])
        answer = item.get("answer")
        messages = [{"role": "user", "content": question}]
        if self._own_system:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        info = {"metadata": item.get("metadata", {}), "rg_dataset": self.dataset, "rg_options": dict(self.options)}
        return Prompt(uid=text_uid(self.name, question), messages=messages,
                      answer=None if answer is None else str(answer), source=source, info=info)

    def train_prompt(self, position: int) -> Prompt:
        """The training prompt at `position`: never a held-out question."""
        if position < 0:
            raise ValueError(f"task {self.name!r}: position must be >= 0, got {position}")
        for redraw in range(MAX_REDRAWS):
            item = self._stream_item(position + redraw * REDRAW_STRIDE)
            if item["question"] not in self._eval_questions:
                return self._prompt(item, f"{self.name}:train {position}")
        raise ReasoningGymError(
            f"task {self.name!r}: {MAX_REDRAWS} training draws in a row were held-out questions: the held-out "
            f"split of data.eval_size={self.eval_size} covers nearly all of {self.describe()}; lower "
            "data.eval_size or widen data.options")

    @property
    def num_eval(self) -> int:
        return len(self._eval)

    def split_summary(self) -> str:
        return (f"task {self.name} ({self.describe()}) -> {len(self._eval)} held-out prompts (seed {EVAL_BASE}, "
                f"{self._eval_draws} draws, distinct questions), never trained: training redraws a held-out "
                "question")

    def eval_prompts(self, n: int) -> list[Prompt]:
        return first_held_out(self.name, self._eval, n)


def reasoning_gym_task(cfg: DataConfig, seed: int) -> ReasoningGymTask:
    """`data.task = "reasoning_gym:<dataset>"`: a reasoning-gym dataset with `data.options` as its config."""
    return ReasoningGymTask(cfg, seed)
