"""File datasets: JSONL, Parquet and HF `datasets` directories, mapped to `Prompt`s.

Every error names the file, the line (JSONL, 1-based physical lines) or row index (Parquet, HF), the field
and what was expected. Training walks a seeded permutation of its rows, one per epoch.

The held-out split:
- `data.eval_path` given: all of that file; training is all of `data.path` (minus rows whose chat equals a
  held-out prompt, counted in `dropped_overlap`). `data.eval_size` does not apply.
- else: `min(data.eval_size, rows // 4)` rows of `data.path`, picked with a fixed seed (the same for every
  training seed). A quarter keeps three quarters for training while giving a small file an eval split that
  measures something (64 rows -> 16 held out; a tenth would give 6). Under 4 rows nothing is held out and
  training uses every row; such a run must set `eval.n = 0` or give `data.eval_path`
  (`rollwise.session.encode_eval_prompts` says so).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

from rollwise.errors import UserError
from rollwise.config import DataConfig
from rollwise.data.tasks import EVAL_SEED
from rollwise.types import Prompt

ROLES = ("system", "user", "assistant")
SUFFIXES = (".jsonl", ".parquet")


class DatasetError(UserError, ValueError):
    """A dataset file is missing, unreadable or has a bad row; the message says where and what was expected."""


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def to_messages(value: Any, where: str, field: str) -> list[dict[str, str]]:
    """A prompt field as a chat: a string becomes one user turn; a list must hold {role, content} dicts."""
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: field {field!r} is an empty string; expected prompt text")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DatasetError(
            f"{where}: field {field!r} is {_type_name(value)}; expected a string or a non-empty list of "
            f"chat messages {{'role': ..., 'content': ...}}"
        )
    messages = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise DatasetError(f"{where}: field {field!r}[{i}] is {_type_name(msg)}; expected a message object")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise DatasetError(f"{where}: field {field!r}[{i}].role is {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DatasetError(f"{where}: field {field!r}[{i}].content is {_type_name(content)}; expected a string")
        messages.append({"role": role, "content": content})
    return messages


def to_answer(value: Any, where: str, field: str) -> str:
    """The reference answer as a string (numbers are converted)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DatasetError(f"{where}: field {field!r} is {_type_name(value)}; expected a string or a number")


def row_to_prompt(row: Any, where: str, uid: str, source: str, cfg: DataConfig) -> Prompt:
    """One dataset row -> Prompt; other fields of the row go to `Prompt.info`."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: row is {_type_name(row)}; expected an object with fields")
    for field in (cfg.prompt_field, cfg.answer_field):
        if field not in row:
            raise DatasetError(
                f"{where}: missing field {field!r} (row has: {', '.join(map(str, row)) or 'no fields'}); "
                f"set data.prompt_field / data.answer_field to the right names"
            )
    messages = to_messages(row[cfg.prompt_field], where, cfg.prompt_field)
    answer = to_answer(row[cfg.answer_field], where, cfg.answer_field)
    info = {k: v for k, v in row.items() if k not in (cfg.prompt_field, cfg.answer_field)}
    return Prompt(uid=uid, messages=messages, answer=answer, source=source, info=info)


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each non-blank line."""
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    where = f"{path}, line {lineno}"
                    raise DatasetError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from exc
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _table_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a Parquet file or an HF `datasets` directory (the 'train' split of a DatasetDict)."""
    if path.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as exc:  # datasets raises FileNotFoundError or its own types
            raise DatasetError(f"{path}: not a datasets.save_to_disk directory: {exc}") from exc
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DatasetError(f"{path}: DatasetDict without a 'train' split (splits: {', '.join(ds)})")
            ds = ds["train"]
        return ds.to_list()
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise DatasetError(f"{path}: cannot read Parquet: {exc}") from exc


def load_prompts(path: str | Path, cfg: DataConfig) -> list[Prompt]:
    """All rows of a JSONL / Parquet file or HF directory as prompts; DatasetError when none or bad."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset not found: {path}")
    if path.is_dir():
        rows = enumerate(_table_rows(path))
        unit = "row"
    elif path.suffix == ".jsonl":
        rows, unit = _jsonl_rows(path), "line"
    elif path.suffix == ".parquet":
        rows, unit = enumerate(_table_rows(path)), "row"
    else:
        raise DatasetError(
            f"{path}: unsupported dataset format {path.suffix!r}; expected one of {', '.join(SUFFIXES)} "
            f"or a datasets.save_to_disk directory"
        )
    prompts = [
        row_to_prompt(row, f"{path}, {unit} {n}", f"{path}#{n}", f"{path.name}:{unit} {n}", cfg) for n, row in rows
    ]
    if not prompts:
        raise DatasetError(f"{path}: dataset is empty (no rows)")
    return prompts


HELD_OUT_FRACTION_DENOM = 4  # without data.eval_path, at most a quarter of the rows are held out


class EpochOrder:
    """Positions 0, 1, 2, ... over `size` items, each epoch in its own seeded permutation (seeded by `key` and the
    epoch): the item at a position depends only on (key, position), so a resumed run continues the order."""

    def __init__(self, size: int, key: str) -> None:
        self.size, self.key = size, key
        self._epoch, self._perm = -1, []

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, self.size)
        if epoch != self._epoch:
            self._perm = list(range(self.size))
            random.Random(f"{self.key}-{epoch}").shuffle(self._perm)
            self._epoch = epoch
        return self._perm[offset]


def held_out_size(num_rows: int, eval_size: int) -> int:
    """Rows held out when there is no eval file: min(eval_size, rows // 4); 0 under 4 rows."""
    return min(eval_size, num_rows // HELD_OUT_FRACTION_DENOM)


class FileDataset:
    """Prompts from a file (`data.path`), with a fixed eval split and a seeded order per epoch."""

    default_reward = "math"
    splits = ("prompt",)  # data.split values this source implements (a file's split is by row)

    def __init__(self, cfg: DataConfig, seed: int) -> None:
        assert cfg.path is not None, "FileDataset needs data.path"
        if cfg.split != "prompt":
            raise DatasetError(
                f'data.split = "{cfg.split}" applies only to the built-in arith task, not to a file dataset '
                f"(data.path = {cfg.path}); remove data.split: a file's held-out split is data.eval_path or a "
                f"fixed slice of its rows"
            )
        self.name = Path(cfg.path).name
        self.seed = seed
        rows = load_prompts(cfg.path, cfg)
        self.num_rows = len(rows)
        self._eval_name = None if cfg.eval_path is None else Path(cfg.eval_path).name
        self._eval_size = cfg.eval_size
        if cfg.eval_path is not None:
            self._eval, train = load_prompts(cfg.eval_path, cfg), rows
        else:
            self._eval, train = self._split(rows, cfg)
        eval_chats = {_chat_key(p) for p in self._eval}
        self._train = [p for p in train if _chat_key(p) not in eval_chats]
        self.dropped_overlap = len(train) - len(self._train)  # training rows equal to an eval prompt
        if not self._train:
            raise DatasetError(
                f"{cfg.path}: no training rows left after removing the {self.dropped_overlap} equal to held-out "
                f"prompts of {cfg.eval_path or cfg.path}; give a data.eval_path with other prompts"
            )
        self._order = EpochOrder(len(self._train), f"{self.name}-train-{self.seed}")

    def _split(self, rows: list[Prompt], cfg: DataConfig) -> tuple[list[Prompt], list[Prompt]]:
        """(held-out rows, training rows): `held_out_size` rows picked with the fixed eval seed."""
        picked = random.Random(EVAL_SEED).sample(range(len(rows)), held_out_size(len(rows), cfg.eval_size))
        chosen = set(picked)
        return [rows[i] for i in picked], [p for i, p in enumerate(rows) if i not in chosen]

    def split_summary(self) -> str:
        """What the split is, in one phrase: rows, training rows, held-out rows and why that many."""
        removed = f" ({self.dropped_overlap} equal to a held-out prompt removed)" if self.dropped_overlap else ""
        head = f"{self.num_rows} rows in {self.name} -> {len(self._train)} train{removed}, {len(self._eval)} held-out"
        if self._eval_name is not None:
            return f"{head} = all of {self._eval_name} (data.eval_path)"
        if not self._eval:
            return f"{head} (under {HELD_OUT_FRACTION_DENOM} rows: none held out; give data.eval_path to evaluate)"
        if len(self._eval) < self._eval_size:
            return f"{head} (data.eval_size={self._eval_size} capped at a quarter of the rows)"
        return f"{head} (data.eval_size)"

    def train_prompt(self, position: int) -> Prompt:
        """Row at `position` of the concatenated per-epoch permutations."""
        if position < 0:
            raise ValueError(f"dataset {self.name!r}: position must be >= 0, got {position}")
        return self._train[self._order.index(position)]

    def eval_prompts(self, n: int) -> list[Prompt]:
        """First `n` prompts of the held-out split."""
        if n < 0 or n > len(self._eval):
            raise ValueError(
                f"dataset {self.name!r}: asked for {n} eval prompts but the held-out split has {len(self._eval)}; "
                f"lower eval.n, raise data.eval_size or give a larger data.eval_path"
            )
        return list(self._eval[:n])

    @property
    def num_train(self) -> int:
        return len(self._train)

    @property
    def num_eval(self) -> int:
        """Size of the held-out split (0 for a file under 4 rows without data.eval_path)."""
        return len(self._eval)


def _chat_key(prompt: Prompt) -> tuple[tuple[str, str], ...]:
    return tuple((m["role"], m["content"]) for m in prompt.messages)
