"""The weights-folder format: a model as an HF folder of safetensors that vLLM, SGLang and Ray actors load.

    folder = write_initial_weights(model, tokenizer, run_dir)          # run_dir/sync/initial, at start
    folder, nbytes = write_version_dir(state_dict, version, sync_dir, model_dir, dtype=engine.dtype)
    engine.reload_from(folder, version); delete_older_versions(sync_dir, keep=folder)

A version folder is `sync_dir/v<version>/model.safetensors` plus the model folder's config files, written to a
temporary folder and renamed into place. The state dict must be whole (`check_whole`): a missing weight, or
part of a fused group (q/k/v, gate/up), is refused, because vLLM fuses those groups on load and a partial
group loads NaN / stale rows. The Sync stage's `safetensors` transport (`rollwise.sync.transports`) and the
engines that take weights through a folder (`VLLMEngine.update_weights`, the HTTP engines) write it here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch

from rollwise.models.atomic import fsync_dir

WEIGHTS_FILE = "model.safetensors"
# files of the model folder copied next to the weights, so the folder is a loadable HF model on its own
SIDE_FILES = ("config.json", "generation_config.json")
# checkpoint names vLLM loads as one fused tensor: every member must come together
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
VERSION_DIR = re.compile(r"^v(\d+)$")


def write_initial_weights(model, tokenizer, run_dir: Path) -> Path:
    """The policy as an HF folder that vLLM and Ray actors load at start (rewritten by every start)."""
    folder = Path(run_dir) / "sync" / "initial"
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# -- a version folder for the Sync stage ----------------------------------------------------------------------------
def state_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def checkpoint_names(model_dir: str | Path) -> set[str]:
    """Tensor names stored in the model folder's `*.safetensors` files (headers only, nothing loaded)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file; save the model with save_pretrained "
                                f"(safe_serialization) first")
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            names.update(fh.keys())
    return names


def tied_embeddings(model_dir: Path) -> bool:
    """Whether the model folder's config ties the LM head to the embedding (top level or `text_config`)."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def check_whole(state_dict: dict[str, torch.Tensor], expected: set[str]) -> None:
    """Refuse a state dict that is not the whole checkpoint `expected` (names as `save_pretrained` writes).

    Raises ValueError naming the missing tensors, and first any fused group (q/k/v, gate/up) sent in part.
    """
    given = set(state_dict)
    partial = []
    for name in sorted(given):
        for group in FUSED_GROUPS:
            for member in group:
                if f".{member}." not in name:
                    continue
                siblings = [name.replace(f".{member}.", f".{other}.") for other in group]
                lacking = [s for s in siblings if s not in given and s in expected]
                if lacking:
                    partial.append(f"{name} without {', '.join(lacking)}")
    if partial:
        raise ValueError(f"weight sync refused: part of a fused group ({'; '.join(partial[:4])}"
                         f"{'...' if len(partial) > 4 else ''}); vLLM loads q/k/v and gate/up as one tensor, "
                         f"send whole groups (the full state dict)")
    missing = sorted(expected - given)
    if missing:
        raise ValueError(f"weight sync refused: {len(missing)} tensor(s) missing from the state dict "
                         f"({', '.join(missing[:6])}{'...' if len(missing) > 6 else ''}); send the full state "
                         f"dict (model.state_dict() names)")
    unknown = sorted(given - expected)
    if unknown:
        raise ValueError(f"weight sync refused: {len(unknown)} tensor(s) not in the engine's checkpoint "
                         f"({', '.join(unknown[:6])}); state dict names must be the HF names save_pretrained writes")


def whole_state(state_dict: dict[str, torch.Tensor], expected: set[str], tied: bool) -> dict[str, torch.Tensor]:
    """The state dict as the engine's checkpoint names it: a tied model's `lm_head.weight` (in `state_dict()`, not
    in the checkpoint) dropped, then `check_whole` (ValueError for a missing tensor or a partial fused group)."""
    state = dict(state_dict)
    if tied and "lm_head.weight" in state and "lm_head.weight" not in expected:
        del state["lm_head.weight"]
    check_whole(state, expected)
    return state


def write_version_dir(state_dict: dict[str, torch.Tensor], version: int, sync_dir: str | Path,
                      model_dir: str | Path, expected: set[str] | None = None, tied: bool | None = None,
                      dtype: torch.dtype | None = None) -> tuple[Path, int]:
    """Write the state dict as `sync_dir/v<version>/model.safetensors` (+ config files), atomically.

    A tied model's `lm_head.weight` (present in `state_dict()`, absent from `named_parameters()`) is dropped:
    the embedding is written once, as `save_pretrained` does. Floating tensors are cast to `dtype` (the
    engine's) when given. Returns (folder, tensor bytes written).
    """
    from safetensors.torch import save_file

    model_dir, sync_dir = Path(model_dir), Path(sync_dir)
    expected = checkpoint_names(model_dir) if expected is None else expected
    tied = tied_embeddings(model_dir) if tied is None else tied
    state = whole_state(state_dict, expected, tied)
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.to("cpu").contiguous().clone()  # own storage: safetensors refuses shared tensors
    sync_dir.mkdir(parents=True, exist_ok=True)
    final = sync_dir / f"v{int(version)}"
    tmp = sync_dir / f".tmp-v{int(version)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for side in SIDE_FILES:
            if (model_dir / side).exists():
                shutil.copyfile(model_dir / side, tmp / side)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(sync_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final, state_bytes(tensors)


def delete_older_versions(sync_dir: str | Path, keep: Path) -> None:
    """Remove every `v<N>` folder of `sync_dir` but `keep` (and stale tmp folders of this process)."""
    for path in Path(sync_dir).iterdir():
        if path == keep or not path.is_dir():
            continue
        if VERSION_DIR.match(path.name) or path.name.startswith(".tmp-v") and f"-{os.getpid()}-" in path.name:
            shutil.rmtree(path, ignore_errors=True)
