"""Put a repository into a real Hugging Face hub-cache layout, without network, as `hf download` leaves it:

    <cache>/models--org--name/blobs/<etag>               each file's bytes, named by its etag
    <cache>/models--org--name/snapshots/<commit>/<path>  relative symlinks to ../../blobs/<etag>
    <cache>/models--org--name/refs/<branch>              the commit hash the branch points at (no newline)

(`datasets--org--name` for a dataset.) The etag is the sha256 of an LFS file (weights, Parquet) and the git blob
sha1 of any other, as the hub reports them; `huggingface_hub.scan_cache_dir` reads the result as a valid cache.

`gsm8k_folder(root)` writes the dataset repository the tests use: GSM8K-shaped rows laid out as openai/gsm8k is on
the hub (a dataset card naming the configurations `main` and `socratic`, Parquet files per split).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils.sha import git_hash

LFS_SUFFIXES = (".safetensors", ".parquet", ".bin", ".arrow")


def commit_hash(label: str) -> str:
    """A stable 40-hex commit id for a test revision."""
    return hashlib.sha1(label.encode()).hexdigest()


def place_in_hub_cache(cache: Path, repo_id: str, source: Path, repo_type: str = "model", branch: str | None = "main",
                       commit: str | None = None) -> Path:
    """Copy every file under `source` into `cache` as revision `commit` of `repo_id`, with `refs/<branch>` pointing
    at it (no ref when `branch` is None: reachable by its commit hash only); returns the snapshot folder."""
    commit = commit or commit_hash(f"{repo_id}@{branch}")
    repo = Path(cache) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in Path(source).rglob("*") if p.is_file()):
        data = file.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if file.suffix in LFS_SUFFIXES else git_hash(data)
        blob = repo / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if branch is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return snapshot


# GSM8K-shaped rows: the question, and a worked solution ending in "#### <answer>".
TRAIN = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many apples does he have now?",
          "answer": f"Tom has {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n#### {2 * i + 3}"}
         for i in range(12)]
TEST = [{"question": f"A box holds {i} pens. How many pens are in 4 boxes?",
         "answer": f"4 * {i} = <<4*{i}={4 * i}>>{4 * i} pens.\n#### {4 * i}"} for i in range(1, 6)]
CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-00000-of-00001.parquet
  - split: test
    path: main/test-00000-of-00001.parquet
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-00000-of-00001.parquet
---
# gsm8k-mini: GSM8K-shaped rows for tests
"""


def write_parquet(path: Path, records: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


def gsm8k_folder(root: Path) -> Path:
    """A dataset folder laid out as openai/gsm8k is on the hub: a card naming two configurations, Parquet splits."""
    (root / "README.md").parent.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text(CARD)
    write_parquet(root / "main" / "train-00000-of-00001.parquet", TRAIN)
    write_parquet(root / "main" / "test-00000-of-00001.parquet", TEST)
    write_parquet(root / "socratic" / "train-00000-of-00001.parquet", TRAIN[:4])
    return root
