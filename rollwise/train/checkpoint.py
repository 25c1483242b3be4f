"""Crash-safe training checkpoints: HF-format model + tokenizer + trainer state, one directory per step.

```
run_dir/checkpoints/step-N/    config.json, model.safetensors, generation_config.json, tokenizer files,
                               trainer_state.pt, COMPLETE (written last: file names and sizes)
run_dir/checkpoints/latest     the name of the newest complete checkpoint (written last, atomically)
run_dir/checkpoints/best       the name of the checkpoint of the best evaluation (whenever the run evaluates,
                               rollwise.early_stop; written atomically once that checkpoint is complete, never
                               pruned)
```
A checkpoint is written into `.step-N.tmp-<pid>`, fsynced, marked COMPLETE and renamed into place; only then
is `latest` replaced. A SIGKILL at any moment leaves the previous checkpoints and `latest` intact; the temp
directory it leaves is removed by the next `latest_checkpoint` or `save_checkpoint`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from rollwise.errors import UserError, is_disk_full
from rollwise.models.atomic import fsync_dir, fsync_tree, publish_dir, remove_dir, write_text_atomic

CHECKPOINTS = "checkpoints"
LATEST = "latest"
BEST = "best"
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TEMP_DIR = re.compile(r"^\.step-(\d+)\.(tmp|old|del)-(\d+)$")
_LATEST_TMP = re.compile(r"^\.(?:latest|best)\.tmp-(\d+)-\w+$")
_saving = 0  # saves in progress in this process: its own temp directories are not stale meanwhile
_saving_lock = threading.Lock()


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, trainer_state: dict, keep: int = 0, *,
                    state_dict: dict[str, torch.Tensor] | None = None,
                    write_extra: Callable[[Path], None] | None = None) -> Path:
    """Save `run_dir/checkpoints/step-<step>` and point `latest` at it; return the checkpoint directory.

    `trainer_state` (optimizer / scheduler state dicts, RNG states, data position, ...) is saved with
    `torch.save`; `step` is added to it when absent. An existing `step-<step>` is replaced safely. `keep > 0`
    then deletes the oldest complete checkpoints beyond `keep` (never the ones `latest` and `best` name).
    `state_dict`, when given, holds the weights to write in `model`'s format (e.g. FSDP2's gathered full state
    dict; `model` then gives only the config). `write_extra(temp_dir)` writes more files (e.g. sharded trainer
    state in a subdirectory) before COMPLETE, which lists them too.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root)
    name = f"step-{step}"
    _check_finite(model, name, state_dict)
    needed = estimate_bytes(model, trainer_state, state_dict)
    tmp = root / f".{name}.tmp-{os.getpid()}"
    if shutil.disk_usage(root).free < needed:
        raise _disk_full(root / name, needed, shutil.disk_usage(root).free)
    with _saving_now():
        try:
            _write_checkpoint(tmp, step, model, tokenizer, trainer_state, state_dict, write_extra)
            publish_dir(tmp, root / name, root / f".{name}.old-{os.getpid()}")
        except Exception as exc:
            # safetensors and torch.save report ENOSPC in their own words ("os error 28", "unexpected pos"):
            # a write that failed with the disk (nearly) full counts as a full disk
            free = shutil.disk_usage(root).free
            if not (is_disk_full(exc) or free < MIN_FREE_BYTES):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise _disk_full(root / name, needed, shutil.disk_usage(root).free) from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        write_text_atomic(root / LATEST, name + "\n")
        if keep > 0:
            _prune(root, keep)
    return root / name


class CheckpointError(UserError, OSError):
    """A checkpoint could not be written (disk full) or would hold non-finite weights; nothing was replaced."""


MIN_FREE_BYTES = 1 << 20  # a write that fails with less than this free failed for want of space


def _disk_full(path: Path, needed: int, free: int) -> "CheckpointError":
    return CheckpointError(
        f"disk full: checkpoint {path} needs about {needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free; "
        "the previous checkpoint and 'latest' are intact. Free space (or set run.keep_checkpoints) and "
        "resume with --resume")


def estimate_bytes(model, trainer_state: dict, state_dict: dict | None = None) -> int:
    """Bytes a checkpoint will take, roughly: the weights as saved plus the optimizer's tensors (sharded
    optimizer state written by `write_extra`: about twice the weights, AdamW's two moments)."""
    tensors = (model.state_dict() if state_dict is None else state_dict).values()
    weights = sum(t.numel() * t.element_size() for t in tensors)
    if trainer_state.get("fsdp") is not None:
        return 3 * weights
    optimizer = (trainer_state.get("optimizer") or {}).get("state", {})
    moments = sum(v.numel() * v.element_size() for st in optimizer.values() for v in st.values()
                  if isinstance(v, torch.Tensor))
    return weights + moments


def _check_finite(model, name: str, state_dict: dict | None = None) -> None:
    for key, tensor in (model.state_dict() if state_dict is None else state_dict).items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"refusing to write checkpoint {name}: weight {key} holds NaN/Inf "
                                  "(the previous checkpoint and 'latest' are unchanged)")


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint to resume from: the one `latest` names if complete, else the newest complete one.

    Stale temp directories left by dead processes are deleted (a checkpoint moved aside by an interrupted
    re-save is restored).
    """
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    _remove_stale(root)
    named = _read_latest(root)
    if named is not None and is_complete(root / named):
        return root / named
    complete = list_checkpoints(run_dir)
    return complete[-1] if complete else None


def mark_best(run_dir: Path, step: int) -> Path:
    """Point `checkpoints/best` at the complete checkpoint `step-<step>` (atomically, as `latest`); return it.
    FileNotFoundError when that checkpoint is not complete (a pointer never names a partial checkpoint)."""
    root = Path(run_dir) / CHECKPOINTS
    name = f"step-{step}"
    if not is_complete(root / name):
        raise FileNotFoundError(f"{root / name} is not a complete checkpoint; `best` cannot name it")
    write_text_atomic(root / BEST, name + "\n")
    return root / name


def best_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `checkpoints/best` names when it is complete; None without one (no evaluation, or
    train.keep_best = false)."""
    root = Path(run_dir) / CHECKPOINTS
    named = _read_pointer(root, BEST)
    return root / named if named is not None and is_complete(root / named) else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete `step-N` directories, oldest step first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def load_trainer_state(ckpt_dir: Path) -> dict:
    """The trainer state dict saved in a checkpoint (unpickled: we wrote it, so `weights_only=False`)."""
    path = Path(ckpt_dir) / TRAINER_STATE
    if not is_complete(Path(ckpt_dir)):
        raise FileNotFoundError(f"{ckpt_dir} is not a complete checkpoint (no valid {COMPLETE} marker)")
    return torch.load(path, map_location="cpu", weights_only=False)


def is_complete(ckpt_dir: Path) -> bool:
    """True when `ckpt_dir` has its COMPLETE marker, it lists at least one file, and every file it lists has the
    recorded size (an empty list would pass `all` on nothing)."""
    try:
        files = json.loads((ckpt_dir / COMPLETE).read_text())["files"]
        return bool(files) and all((ckpt_dir / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_checkpoint(tmp: Path, step: int, model, tokenizer, trainer_state: dict, state_dict: dict | None = None,
                      write_extra: Callable[[Path], None] | None = None) -> None:
    """Write every file into `tmp`, fsync them, then the COMPLETE marker last (it lists files in subdirectories
    under their relative paths)."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    if getattr(model, "peft_config", None) is None:  # a LoRA model's files come from `write_extra`
        with _without_quantization_config(model):
            model.save_pretrained(tmp, **({} if state_dict is None else {"state_dict": state_dict}))
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, **trainer_state}, tmp / TRAINER_STATE)
    if write_extra is not None:
        write_extra(tmp)
    files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    fsync_tree(tmp)
    with open(tmp / COMPLETE, "w") as fh:
        json.dump({"step": step, "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)


@contextmanager
def _saving_now() -> Iterator[None]:
    """Count a save in progress, so this process's own temp directories are not taken for stale meanwhile."""
    global _saving
    with _saving_lock:
        _saving += 1
    try:
        yield
    finally:
        with _saving_lock:
            _saving -= 1


@contextmanager
def _without_quantization_config(model) -> Iterator[None]:
    """Hide `config.quantization_config` while saving, so the checkpoint is a plain float model."""
    config = model.config
    saved = getattr(config, "quantization_config", None)
    if saved is not None:
        del config.quantization_config
    try:
        yield
    finally:
        if saved is not None:
            config.quantization_config = saved


def _read_latest(root: Path) -> str | None:
    return _read_pointer(root, LATEST)


def _read_pointer(root: Path, pointer: str) -> str | None:
    """The checkpoint name the pointer file `root/pointer` holds (None: absent or not a `step-N` name)."""
    try:
        name = (root / pointer).read_text().strip()
    except OSError:
        return None
    return name if _STEP_DIR.match(name) else None


def _remove_stale(root: Path) -> None:
    """Delete temp files and directories whose writer is gone; restore a checkpoint that an interrupted re-save
    had moved aside."""
    for path in sorted(root.iterdir()):
        if (match := _LATEST_TMP.match(path.name)) and _is_stale(int(match.group(1))):
            path.unlink(missing_ok=True)
        match = _TEMP_DIR.match(path.name)
        if match is None or not _is_stale(int(match.group(3))):
            continue
        final = root / f"step-{match.group(1)}"
        if match.group(2) == "old" and not final.exists() and is_complete(path):
            os.rename(path, final)
            fsync_dir(root)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _is_stale(pid: int) -> bool:
    """A temp entry is stale when its writer is dead, or is this process while it is not saving."""
    if pid == os.getpid():
        with _saving_lock:
            return _saving == 0
    return not _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie (a killed, unreaped process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _prune(root: Path, keep: int) -> None:
    """Delete the oldest complete checkpoints beyond `keep`, never the ones `latest` and `best` name."""
    named = {_read_latest(root), _read_pointer(root, BEST)}
    complete = list_checkpoints(root.parent)
    for path in complete[: max(len(complete) - keep, 0)]:
        if path.name not in named:
            remove_dir(path, root / f".{path.name}.del-{os.getpid()}")
