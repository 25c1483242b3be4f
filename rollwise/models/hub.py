"""Hugging Face hub ids: `org/name` or `org/name@revision`, resolved to a snapshot folder of the local HF cache.

    parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct@main")  # -> ("Qwen/Qwen2.5-0.5B-Instruct", "main"), None if not an id
    folder = hub_snapshot("Qwen/Qwen2.5-0.5B-Instruct", None, MODEL)   # Path: <cache>/models--Qwen--.../snapshots/<sha>
    cached_snapshot(repo_id, revision, DATASET)      # the cached folder or None; never touches the network

The revision after `@` is a branch, a tag or a commit hash (default `main`). Online, `huggingface_hub`'s
`snapshot_download` fetches what the cache lacks (for a model only what a run reads: config, tokenizer and
safetensors files). Offline it reads the cache only: when `HF_HUB_OFFLINE=1` (or `TRANSFORMERS_OFFLINE=1`; for
datasets also `HF_DATASETS_OFFLINE=1`), and when the hub cannot be reached. A repository that is not cached then
raises `HubError` with one line naming the id and how to get it.

The cache is `HF_HUB_CACHE`, else `HF_HOME/hub`, else huggingface_hub's default (`~/.cache/huggingface/hub`); the
environment is read at each call, not when huggingface_hub was imported.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from rollwise.errors import UserError

MODEL, DATASET = "model", "dataset"
# Files of a model repository a run reads: weights (safetensors only), config and generation config, tokenizer
# (tokenizer.json, vocab / merges, sentencepiece .model, tiktoken) and chat template files.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
# Copies of the weights in other layouts that some repositories also hold (Llama's original/, Mistral's
# consolidated.safetensors, ONNX exports): never needed, often as large as the model.
MODEL_SKIP = ["original/*", "consolidated*", "onnx/*", "openvino/*"]
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
_TRUE = {"1", "true", "yes", "on"}


class HubError(UserError, RuntimeError):
    """A hub id cannot be resolved: not cached while offline, unknown on the hub, gated or incomplete."""


@dataclass(frozen=True)
class HubId:
    """A parsed hub id: the repository and the revision (None = the default branch)."""

    repo_id: str
    revision: str | None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_hub_id(name: str) -> HubId | None:
    """`org/name[@revision]` as a HubId; None when `name` cannot be a hub repository id (e.g. `a/b/c`, `/x`)."""
    match = _ID.fullmatch(name.strip())
    if match is None or "--" in match["repo"] or ".." in match["repo"] or len(match["repo"]) > 96:
        return None
    return HubId(match["repo"], match["revision"])


def hub_cache() -> Path:
    """The HF hub cache folder, from the environment now (`HF_HUB_CACHE`, `HF_HOME`/hub, else the default)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline(kind: str = MODEL) -> bool:
    """Whether the environment asks for offline mode now (`HF_HUB_OFFLINE`, `TRANSFORMERS_OFFLINE`, and for
    datasets `HF_DATASETS_OFFLINE`)."""
    names = ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"] + (["HF_DATASETS_OFFLINE"] if kind == DATASET else [])
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in names)


def cached_snapshot(repo_id: str, revision: str | None, kind: str) -> Path | None:
    """The cached snapshot folder of `repo_id` at `revision` (a ref or a commit), or None; no network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = _patterns(kind)
    try:
        return Path(snapshot_download(repo_id, repo_type=kind, revision=revision, cache_dir=hub_cache(),
                                      local_files_only=True, **patterns))
    except LocalEntryNotFoundError as exc:  # IncompleteSnapshotError is one: its folder is still worth a try
        folder = getattr(exc, "snapshot_path", None)
        return Path(folder) if folder else None


def hub_snapshot(repo_id: str, revision: str | None, kind: str) -> Path:
    """The snapshot folder of `repo_id`: downloaded into the cache when online, the cached one when offline or
    when the hub cannot be reached; HubError (one line, naming the id and the fix) when neither works."""
    from huggingface_hub import snapshot_download

    if offline(kind):
        return _require_cached(repo_id, revision, kind, "HF_HUB_OFFLINE is set")
    try:
        return Path(snapshot_download(repo_id, repo_type=kind, revision=revision, cache_dir=hub_cache(),
                                      **_patterns(kind)))
    except Exception as exc:  # noqa: BLE001 - each hub failure is translated (unreachable: the cache is tried)
        known = hub_failure(exc, repo_id, revision, kind)
        if known is not None:
            raise known from exc
        return _require_cached(repo_id, revision, kind, f"the hub cannot be reached ({short_reason(root_cause(exc))})")


def hub_failure(exc: BaseException, repo_id: str, revision: str | None, kind: str) -> HubError | None:
    """The one-line HubError for an answer of the hub (unknown repository or revision, gated); None when the
    failure is that the hub could not be reached (then the cache decides)."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    name, key = f"{kind} {repo_id!r}", _key(kind)
    chain = _chain(exc)
    if any(isinstance(e, RevisionNotFoundError) for e in chain):
        return HubError(f"{name} has no revision {revision!r} on the Hugging Face hub: fix the part after '@' in "
                        f"{key} (a branch, a tag or a commit hash)")
    if any(isinstance(e, GatedRepoError) for e in chain):
        return HubError(f"{name} is gated: accept its terms on https://huggingface.co/{_url_path(repo_id, kind)} and "
                        "log in with `hf auth login` (or set HF_TOKEN)")
    if any(isinstance(e, RepositoryNotFoundError) for e in chain):
        return HubError(f"{name} does not exist on the Hugging Face hub (or is private: log in with `hf auth login`); "
                        f"check {key}")
    return None


def download_hint(repo_id: str, revision: str | None, kind: str) -> str:
    """The command that puts the repository into the cache on a machine with network."""
    parts = ["hf download", repo_id] + (["--repo-type dataset"] if kind == DATASET else [])
    return " ".join(parts + ([f"--revision {revision}"] if revision else []))


def not_cached_message(repo_id: str, revision: str | None, kind: str, why: str) -> str:
    """One line: what is missing, where it was looked for, why nothing was downloaded, and the fix."""
    name = f"{kind} {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    local = "a local directory" if kind == MODEL else "a local file or dataset folder"
    return (f"{name} is not {local} and not in the Hugging Face cache ({hub_cache()}), and {why}: download it on "
            f"a machine with network ({download_hint(repo_id, revision, kind)}) and copy that cache here (or point "
            f"HF_HOME at it), or set {_key(kind)} to {local}")


def _require_cached(repo_id: str, revision: str | None, kind: str, why: str) -> Path:
    folder = cached_snapshot(repo_id, revision, kind)
    if folder is None:
        raise HubError(not_cached_message(repo_id, revision, kind, why))
    return folder


def _patterns(kind: str) -> dict:
    return {"allow_patterns": MODEL_FILES, "ignore_patterns": MODEL_SKIP} if kind == MODEL else {}


def _key(kind: str) -> str:
    return "model.name" if kind == MODEL else "data.path"


def _url_path(repo_id: str, kind: str) -> str:
    return repo_id if kind == MODEL else f"datasets/{repo_id}"


def root_cause(exc: BaseException) -> BaseException:
    """The innermost cause of `exc`: the connection error under the libraries' wrappers."""
    return _chain(exc)[-1]


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and its causes / contexts (libraries wrap the hub's errors in their own)."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def short_reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:120]}" if text else type(exc).__name__
