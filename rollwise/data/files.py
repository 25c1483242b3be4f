"""File datasets: JSONL, Parquet, HF `datasets` directories and hub dataset ids, mapped to `Prompt`s.

`data.path` is a JSONL or Parquet file, a `datasets.save_to_disk` directory, a dataset folder that
`datasets.load_dataset` reads, or a hub dataset id `org/name[@revision]` (the last two through
`rollwise.data.hub`, which also caches and works offline). A dataset with splits is read at `data.split_name`
(configuration `data.config`); a single file is one split.

Every error names the file, the line (JSONL, 1-based physical lines) or row index (Parquet, HF), the field
and what was expected. Training walks a seeded permutation of its rows, one per epoch.

The held-out split:
- `data.eval_path` given: all of it (split `data.eval_split_name`, default `train`, when it has splits);
  training is all of `data.path` (minus rows whose chat equals a held-out prompt, counted in
  `dropped_overlap`). `data.eval_size` does not apply.
- `data.eval_split_name` without `data.eval_path`: all of that split of `data.path`, likewise.
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

from rollwise.config import DataConfig
from rollwise.data.errors import DatasetError
from rollwise.data.tasks import EVAL_SEED
from rollwise.types import Prompt

ROLES = ("system", "user", "assistant")
SUFFIXES = (".jsonl", ".parquet")


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


def _table_rows(path: Path | str, split: str = "train", split_key: str = "data.split_name",
                config: str | None = None) -> list[dict[str, Any]]:
    """Rows of a Parquet file, of split `split` of a `datasets.save_to_disk` directory, or of a dataset folder or
    hub id that `datasets.load_dataset` reads (configuration `config`; `rollwise.data.hub`)."""
    local = Path(path).expanduser()
    if local.is_dir() and _saved_dataset(local):
        return _saved_rows(local, split, split_key)
    if local.is_dir() or not local.exists():
        from rollwise.data.hub import load_split

        return load_split(str(path), config, split, split_key)
    import pyarrow.parquet as pq

    try:
        return pq.read_table(local).to_pylist()
    except Exception as exc:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise DatasetError(f"{path}: cannot read Parquet: {exc}") from exc


def _saved_dataset(path: Path) -> bool:
    """A directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _saved_rows(path: Path, split: str, split_key: str) -> list[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError or its own types
        raise DatasetError(f"{path}: not a readable datasets.save_to_disk directory: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DatasetError(f"{split_key} = {split!r} is not a split of the DatasetDict {path}; splits: "
                               f"{', '.join(ds)}")
        return ds[split].to_list()
    if split != "train":
        raise DatasetError(f"{split_key} = {split!r}: {path} is a single datasets.Dataset (one split, read as "
                           f"'train'); remove {split_key} or save a DatasetDict")
    return ds.to_list()


def split_tag(config: str | None, split: str) -> str:
    """What tells rows of one configuration / split apart in labels and uids: '' for the default 'train' split
    without a configuration, else '[main/test]', '[test]', '[main]'."""
    parts = ([config] if config else []) + ([split] if split != "train" else [])
    return f"[{'/'.join(parts)}]" if parts else ""


def source_tag(path: str | Path, config: str | None, split: str) -> str:
    """`split_tag` of a dataset with splits; '' for a single file (one split, no configurations)."""
    return "" if Path(path).expanduser().is_file() else split_tag(config, split)


def dataset_label(path: str | Path) -> str:
    """A dataset's short name: a local file's or folder's name, or a hub id as written."""
    local = Path(path).expanduser()
    return local.name if local.exists() else str(path)


def load_prompts(path: str | Path, cfg: DataConfig, split: str | None = None,
                 split_key: str = "data.split_name") -> list[Prompt]:
    """All rows of one split of a dataset as prompts; DatasetError when there are none or one is bad.

    `path`: a JSONL or Parquet file (one split: `split` must be 'train'), a `datasets.save_to_disk` directory, a
    dataset folder that `datasets.load_dataset` reads, or a hub dataset id `org/name[@revision]`. `split`
    defaults to `cfg.split_name`; `split_key` is the config key named when that split does not exist."""
    split = split or cfg.split_name
    local = Path(path).expanduser()
    if local.is_file():
        if split != "train":
            raise DatasetError(f"{split_key} = {split!r}: {path} is a single file, one split; remove {split_key}, "
                               "or give a dataset folder or hub id that has that split")
        rows, unit, tag = _file_rows(local, path), ("line" if local.suffix == ".jsonl" else "row"), ""
    elif local.exists() or _is_dataset_id(str(path)):
        rows, unit = enumerate(_table_rows(path, split, split_key, cfg.config)), "row"
        tag = source_tag(path, cfg.config, split)
    else:
        raise DatasetError(f"dataset not found: {path} (relative paths start at {Path.cwd()})")
    name = dataset_label(path) + tag
    prompts = [row_to_prompt(row, f"{path}{tag}, {unit} {n}", f"{path}{tag}#{n}", f"{name}:{unit} {n}", cfg)
               for n, row in rows]
    if not prompts:
        raise DatasetError(f"{path}{tag}: dataset is empty (no rows)")
    return prompts


def _file_rows(local: Path, path: str | Path) -> Iterator[tuple[int, Any]]:
    """(number, row) of a JSONL (lines) or Parquet (rows) file."""
    if local.suffix == ".jsonl":
        return _jsonl_rows(Path(path))
    if local.suffix == ".parquet":
        return enumerate(_table_rows(local))
    if local.suffix == ".py":
        raise DatasetError(f"{path}: a dataset script; datasets no longer runs dataset scripts: write the rows as "
                           "Parquet or JSONL files in a folder and set data.path to that folder")
    raise DatasetError(
        f"{path}: unsupported dataset format {local.suffix!r}; expected one of {', '.join(SUFFIXES)}, a dataset "
        "folder (a datasets.save_to_disk directory, or data files datasets.load_dataset reads) or a hub dataset id"
    )


def _is_dataset_id(text: str) -> bool:
    from rollwise.data.hub import is_dataset_id

    return is_dataset_id(text)


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
    """Prompts from a dataset (`data.path`: a file, a dataset folder or a hub id), with a fixed held-out split and
    a seeded order per epoch."""

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
        if cfg.config is not None and Path(cfg.path).expanduser().is_file():
            raise DatasetError(f"data.config = {cfg.config!r} names a configuration of a dataset that has several; "
                               f"data.path = {cfg.path} is a single file: remove data.config")
        self.name = dataset_label(cfg.path) + source_tag(cfg.path, cfg.config, cfg.split_name)
        self.seed = seed
        rows = load_prompts(cfg.path, cfg)
        self.num_rows = len(rows)
        self._eval_size = cfg.eval_size
        self._eval_name, self._eval_key = self._eval_source(cfg)
        if self._eval_name is not None:
            source = cfg.eval_path or cfg.path
            split = cfg.eval_split_name or "train"  # without data.eval_path, eval_split_name is set
            self._eval, train = load_prompts(source, cfg, split, "data.eval_split_name"), rows
        else:
            self._eval, train = self._split(rows, cfg)
        eval_chats = {_chat_key(p) for p in self._eval}
        self._train = [p for p in train if _chat_key(p) not in eval_chats]
        self.dropped_overlap = len(train) - len(self._train)  # training rows equal to an eval prompt
        if not self._train:
            raise DatasetError(
                f"{cfg.path}: no training rows left after removing the {self.dropped_overlap} equal to held-out "
                f"prompts of {self._eval_name}; give a data.eval_path or data.eval_split_name with other prompts"
            )
        self._order = EpochOrder(len(self._train), f"{self.name}-train-{self.seed}")

    @staticmethod
    def _eval_source(cfg: DataConfig) -> tuple[str | None, str | None]:
        """(label of the held-out source, the key that chose it); (None, None) for a slice of data.path."""
        if cfg.eval_path is not None:
            tag = source_tag(cfg.eval_path, cfg.config, cfg.eval_split_name or "train")
            return dataset_label(cfg.eval_path) + tag, "data.eval_path"
        if cfg.eval_split_name is not None:
            label = dataset_label(cfg.path) + source_tag(cfg.path, cfg.config, cfg.eval_split_name)
            return label, "data.eval_split_name"
        return None, None

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
            return f"{head} = all of {self._eval_name} ({self._eval_key})"
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
