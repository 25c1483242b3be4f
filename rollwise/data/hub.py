"""Datasets read by `datasets.load_dataset`: a hub id `org/name[@revision]` or a local dataset folder, one
split of one configuration at a time, as a list of row dicts (`rollwise.data.files` turns rows into prompts).

    rows = load_split("openai/gsm8k", "main", "test", "data.eval_split_name")     # list[dict]
    rows = load_split("my_dataset/", None, "train", "data.split_name")           # a folder: data files + README.md

A dataset folder holds Parquet / JSONL / CSV files; its README.md may name configurations and their splits
(`configs:` in the card's YAML header, as on the hub), else the splits come from the file names (train.jsonl,
test.jsonl) and everything else is `train`. Dataset scripts (`*.py`) are not run: datasets 4 and later refuse them.

Hub ids are cached like models (`rollwise.models.hub`). Online, `datasets` fetches the files of the split into the
HF hub cache and prepares them under `HF_DATASETS_CACHE` (default `HF_HOME/datasets`). Offline (`HF_HUB_OFFLINE`,
`HF_DATASETS_OFFLINE`), or when the hub cannot be reached, the id's snapshot in the hub cache is read as a local
folder (`hf download ID --repo-type dataset` puts it there), else a split `datasets` prepared before; a dataset in
neither fails with one line naming the id and the fix.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rollwise.data.errors import DatasetError
from rollwise.models.hub import (DATASET, download_hint, hub_failure, not_cached_message, offline, parse_hub_id,
                                 root_cause, short_reason)


def datasets_cache() -> Path:
    """Where `datasets` keeps prepared splits: `HF_DATASETS_CACHE`, else `HF_HOME`/datasets, else its default."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "datasets"
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE)


# A missing path with one of these endings is a mistyped file name, not a hub id.
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt", ".py")


def is_dataset_id(text: str) -> bool:
    """Whether `text` names a hub dataset (`org/name[@revision]`): not an existing path, not a file name."""
    if Path(text).expanduser().exists() or text.lower().endswith(FILE_SUFFIXES):
        return False
    return parse_hub_id(text) is not None


def check_dataset_source(text: str, key: str) -> None:
    """A cheap check before any work (`--dry-run`): `text` is an existing path, or a hub dataset id that is cached
    when offline (online, an id that is not cached is fetched when the run starts). DatasetError otherwise."""
    if Path(text).expanduser().exists():
        return
    hub_id = parse_hub_id(text) if is_dataset_id(text) else None
    if hub_id is None:
        raise DatasetError(f"{key} = {text!r}: no such file or directory (relative paths start at {Path.cwd()}), "
                           "and not a hub dataset id 'org/name[@revision]'")
    if offline(DATASET) and not _cached_anywhere(hub_id.repo_id, hub_id.revision):
        raise DatasetError(not_cached_message(hub_id.repo_id, hub_id.revision, DATASET, "HF_HUB_OFFLINE is set"))


def _cached_anywhere(repo_id: str, revision: str | None) -> bool:
    """In the hub cache (a snapshot), or prepared by `datasets` before (its cache folder `org___name`)."""
    from rollwise.models.hub import cached_snapshot

    if cached_snapshot(repo_id, revision, DATASET) is not None:
        return True
    org, _, name = repo_id.partition("/")
    return any(p.is_dir() for p in datasets_cache().glob(f"{org}___{_snake(name)}/*/*/*"))


def _snake(name: str) -> str:
    """datasets' folder name of a dataset (`camelcase_to_snakecase`): MyData -> my_data."""
    import datasets.naming

    return datasets.naming.camelcase_to_snakecase(name)


def load_split(source: str, config: str | None, split: str, split_key: str) -> list[dict[str, Any]]:
    """Rows of `split` (configuration `config`) of a local dataset folder or a hub id; DatasetError (one line)
    naming the dataset and the key to change when it is missing, has no such configuration or split, or cannot
    be read. `split_key` is the config key that chose `split` (data.split_name or data.eval_split_name)."""
    if Path(source).expanduser().exists():
        return _read(str(Path(source).expanduser()), config, split, split_key, label=source)
    hub_id = parse_hub_id(source)
    if hub_id is None:
        raise DatasetError(f"dataset not found: {source} is neither a file or folder (relative paths start at "
                           f"{Path.cwd()}) nor a hub id 'org/name[@revision]'")
    if offline(DATASET):
        return _from_cache(hub_id.repo_id, hub_id.revision, config, split, split_key, "HF_HUB_OFFLINE is set")
    unreachable = _unreachable(hub_id.repo_id, hub_id.revision)
    if unreachable is not None:
        return _from_cache(hub_id.repo_id, hub_id.revision, config, split, split_key,
                           f"the hub cannot be reached ({unreachable})")
    try:
        return _read(hub_id.repo_id, config, split, split_key, label=source, revision=hub_id.revision)
    except DatasetError:
        raise
    except Exception as exc:  # noqa: BLE001 - a download that broke off: say which dataset and what to do
        raise DatasetError(f"dataset {source!r} could not be read from the Hugging Face hub "
                           f"({short_reason(root_cause(exc))}): run again, or download it with "
                           f"`{download_hint(hub_id.repo_id, hub_id.revision, DATASET)}` and run offline") from exc


def _unreachable(repo_id: str, revision: str | None) -> str | None:
    """One quick metadata call before `datasets` downloads (which retries a dead network for about 20 s): None
    when the hub answers, the reason when it cannot be reached; DatasetError when it answers that the dataset
    or revision does not exist or is gated."""
    from huggingface_hub import HfApi

    try:
        HfApi().dataset_info(repo_id, revision=revision, timeout=10)
    except Exception as exc:  # noqa: BLE001 - the hub's answers are translated, anything else is "unreachable"
        known = hub_failure(exc, repo_id, revision, DATASET)
        if known is not None:
            raise DatasetError(str(known)) from exc
        return short_reason(root_cause(exc))
    return None


def _from_cache(repo_id: str, revision: str | None, config: str | None, split: str, split_key: str,
                why: str) -> list[dict[str, Any]]:
    """The split from the id's hub-cache snapshot (read as a folder), else from datasets' prepared cache."""
    from rollwise.models.hub import cached_snapshot

    label = repo_id if revision is None else f"{repo_id}@{revision}"
    folder = cached_snapshot(repo_id, revision, DATASET)
    if folder is not None:
        return _read(str(folder), config, split, split_key, label=label)
    try:  # a split `datasets` prepared on an earlier online run (its own offline fallback)
        with _datasets_offline():
            return _read(repo_id, config, split, split_key, label=label, revision=revision)
    except DatasetError:
        raise
    except Exception as exc:  # noqa: BLE001 - not prepared either: the one-line message below
        raise DatasetError(not_cached_message(repo_id, revision, DATASET, why)) from exc


def _read(path: str, config: str | None, split: str, split_key: str, label: str,
          revision: str | None = None) -> list[dict[str, Any]]:
    """`datasets.load_dataset(path, config, split=split)` as row dicts; a bad configuration or split, a dataset
    script or an empty folder is a DatasetError naming `label` and the key to change."""
    import datasets

    if Path(path, Path(path).name + ".py").is_file():
        raise DatasetError(f"{label}: a dataset script; datasets {datasets.__version__} no longer runs dataset "
                           "scripts: write the rows as Parquet or JSONL files in a folder (a README.md `configs:` "
                           "header names configurations and splits) and set data.path to that folder")
    try:
        with _quiet(datasets):
            table = datasets.load_dataset(path, config, split=split, revision=revision, cache_dir=str(datasets_cache()))
    except ValueError as exc:
        raise DatasetError(_choice_message(path, config, split, split_key, label, exc)) from exc
    except (datasets.exceptions.DataFilesNotFoundError, datasets.data_files.EmptyDatasetError) as exc:
        raise DatasetError(f"{label}: no data files that datasets can read; expected a datasets.save_to_disk "
                           "directory or Parquet / JSONL / CSV files (a README.md may name configurations and "
                           "splits)") from exc
    return table.to_list()


def _choice_message(path: str, config: str | None, split: str, split_key: str, label: str, exc: ValueError) -> str:
    """Which of data.config / the split key is wrong, with the valid names."""
    import datasets

    try:
        configs = datasets.get_dataset_config_names(path)
    except Exception:  # noqa: BLE001 - the names are a courtesy; the original reason still goes out
        configs = []
    if config is None and len(configs) > 1:
        return f"{label} has several configurations ({', '.join(configs)}): set data.config to one of them"
    if config is not None and configs and config not in configs:
        return f"data.config = {config!r} is not a configuration of {label}; valid: {', '.join(configs)}"
    try:
        splits = datasets.get_dataset_split_names(path, config, cache_dir=str(datasets_cache()))
    except Exception:  # noqa: BLE001
        splits = re.findall(r"'([^']+)'", str(exc).partition("one of")[2])
    if splits and split not in splits:
        where = f"{label} (configuration {config})" if config else label
        return f"{split_key} = {split!r} is not a split of {where}; splits: {', '.join(splits)}"
    return f"{label}: cannot read split {split!r}: {' '.join(str(exc).split())}"


@contextmanager
def _datasets_offline() -> Iterator[None]:
    """`datasets` and `huggingface_hub` read their offline switch once, at import: force it on for one call, so a
    dead network is not retried and datasets goes straight to its own cache (restored afterwards)."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


@contextmanager
def _quiet(datasets) -> Iterator[None]:
    """No per-split progress bars on the console while a split is read (restored afterwards)."""
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
