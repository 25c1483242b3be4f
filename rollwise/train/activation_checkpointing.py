"""`train.gradient_checkpointing`: each decoder layer keeps only its input in the forward pass and recomputes its
activations during backward (non-reentrant `torch.utils.checkpoint`, through transformers'
`gradient_checkpointing_enable`). The loss, log-probs and gradients are those without it (tests/test_memory.py);
activation memory falls from T (L s + o) to T (4 H L + o) plus one layer (`rollwise.train.memory`), for about one
more forward pass of compute.

`"auto"` (the default) turns it on from `rollwise.train.memory.AUTO_PARAMS` parameters, or when the trainer's
estimate without it (optimizer state plus the step's peak, which are not allocated yet when the trainer is
built) passes `AUTO_HEADROOM` of the memory the device has left once the policy, its reference and the engine
are loaded (CUDA: free plus this process's unused cache; CPU: MemAvailable; `ROLLWISE_DEVICE_MEMORY_GIB`
overrides the device's total). `rollwise train --dry-run` decides the same way from the whole run's estimate.

Every backend takes it: the local trainer, LoRA (PEFT's base model is the one set; only adapters train) and
FSDP2 (per-layer `fully_shard` modules are recomputed inside their own hooks, which gather their parameters
again).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rollwise.errors import UserError
from rollwise.train.memory import StepSetup, decide_checkpointing, shape_of, training_estimate
from rollwise.train.trainable import parse_layers


class CheckpointingError(UserError, ValueError):
    """The model cannot recompute its layers (no gradient checkpointing support in its transformers class)."""


def configure_checkpointing(trainer) -> bool:
    """Resolve `trainer.cfg.gradient_checkpointing` for `trainer.model` and apply it; True when on. Called once
    by `Trainer.__init__`, after the trained parameters are chosen and before the optimizer exists."""
    setting = trainer.cfg.gradient_checkpointing
    if setting is False:
        return False
    try:
        params, need, available = (0, 0, 1) if setting is True else _need_and_available(trainer)
    except AttributeError:  # not a transformers causal LM (a test double): nothing to decide "auto" from
        return False
    on, why = decide_checkpointing(setting, params, need, available)
    if on:
        enable(trainer.model)
        if setting == "auto" and getattr(trainer, "rank", 0) == 0:
            print(f"rollwise: gradient checkpointing on ({why})", flush=True)
    return on


def enable(model) -> None:
    """Non-reentrant gradient checkpointing on every decoder layer of `model` (a PEFT model: its base)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise CheckpointingError(f"{type(base).__name__} does not support gradient checkpointing; set "
                                 "train.gradient_checkpointing = false")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # non-reentrant checkpoints need no grad-requiring input: without transformers' hook, frozen layers below the
    # first trained one (train.trainable) keep nothing
    base.disable_input_require_grads()


def _need_and_available(trainer) -> tuple[int, int, int]:
    """(parameters, bytes the trainer will still allocate without checkpointing, bytes the device has left)."""
    model, cfg = trainer.model, trainer.cfg
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora = _lora_targets(model)
    setup = StepSetup(tokens=cfg.micro_batch_tokens, bf16=trainer.bf16, checkpointing=False, lora=lora,
                      trained_layers=parse_layers(cfg.trainable),
                      reference=trainer.ref_model is not None, world_size=trainer.world_size,
                      trainable_params=trained)
    shape = shape_of(model)
    est = training_estimate(shape, setup)
    return shape.params, est.parts["optimizer"] + est.step_peak, available_bytes(trainer.device, model)


def _lora_targets(model) -> tuple[int, list[str]] | None:
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return None
    targets = config.target_modules
    return config.r, (["all-linear"] if targets == "all-linear" else sorted(targets))


def available_bytes(device: torch.device, model) -> int:
    """Memory `device` has left for this process now (see the module docstring)."""
    from rollwise.train.memory_config import MEMORY_ENV

    override = os.environ.get(MEMORY_ENV)
    if device.type == "cuda":
        held = torch.cuda.memory_allocated(device)
        if override:
            return int(float(override) * 2**30) - held
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - held
    if override:
        return int(float(override) * 2**30) - sum(p.numel() * p.element_size() for p in model.parameters())
    return mem_available_bytes()


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
