"""`train.trainable`: which parameters of the policy the trainer updates (the layer-contribution study).

After the layer-wise study of RL post-training ("training a single transformer layer can recover most of the gains
of full-parameter RL"; high-contribution layers sit in the middle of the stack): `train.trainable = "layers:20-29"`
trains decoder layers 20..29 only (0-based, as in the HF parameter names `model.layers.N.`; several ranges:
"layers:3,10-12"). Every other parameter (embeddings, the other layers, the final norm, the LM head) is frozen:
it gets no gradient and no AdamW state, and stays at its starting value. The engine is still synced with the full
weights (`Trainer.policy_state`), so what it samples is exactly the trained policy. "all" (the default) trains
everything. The paper's *layer contribution* (the fraction of full-RL improvement one layer recovers) is a ratio
of two runs' evaluations: run the same recipe with "all" and with "layers:K".
"""

from __future__ import annotations

import re

import torch

from rollwise.errors import UserError

PATTERN = r"^(all|layers:\d+(-\d+)?(,\d+(-\d+)?)*)$"


class TrainableError(UserError, ValueError):
    """`train.trainable` names layers the model does not have, or a backend that cannot freeze them."""


def parse_layers(spec: str) -> list[int] | None:
    """`"all"` -> None; `"layers:2,5-7"` -> [2, 5, 6, 7] (sorted, unique). ValueError naming the key when
    malformed or when a range is reversed."""
    if spec == "all":
        return None
    if not re.match(PATTERN, spec):
        raise TrainableError(f"train.trainable = {spec!r}: use 'all' or 'layers:A-B' (0-based decoder layers, "
                             "e.g. 'layers:20-29' or 'layers:3,10-12')")
    layers: set[int] = set()
    for part in spec.split(":", 1)[1].split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise TrainableError(f"train.trainable = {spec!r}: range {part} runs backwards; write {b}-{a}")
        layers.update(range(a, b + 1))
    return sorted(layers)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's list of decoder layers (`model.model.layers` for HF causal LMs)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TrainableError(f"train.trainable: {type(model).__name__} has no list of decoder layers "
                             "(get_decoder().layers); use train.trainable = 'all'")
    return layers


def apply_trainable(model, spec: str) -> dict[str, int] | None:
    """Freeze every parameter of `model` outside the layers `spec` names (nothing for "all": None).

    Returns {"layers": count of trained layers, "trainable": trained parameters, "total": all parameters}.
    TrainableError naming the key when a layer index is not below the model's layer count."""
    chosen = parse_layers(spec)
    if chosen is None:
        return None
    layers = decoder_layers(model)
    if chosen[-1] >= len(layers):
        raise TrainableError(f"train.trainable = {spec!r}: the model has {len(layers)} decoder layers "
                             f"(0-{len(layers) - 1}); choose layers within that range")
    model.requires_grad_(False)
    for index in chosen:
        layers[index].requires_grad_(True)
    params = list(model.parameters())
    return {"layers": len(chosen), "trainable": sum(p.numel() for p in params if p.requires_grad),
            "total": sum(p.numel() for p in params)}


def freeze_for_trainer(trainer, model, spec: str) -> dict[str, int] | None:
    """`apply_trainable` from a trainer's constructor, before its optimizer collects the trainable parameters.
    A LoRA trainer chooses its own trainable parameters and FSDP2 shards them: both reject a layer subset."""
    if spec == "all":
        return None
    if trainer.has_adapter:
        raise TrainableError(f"train.trainable = {spec!r} chooses layers of the full model; with [lora] the adapters "
                             "are what trains: set train.trainable = 'all' or turn LoRA off")
    if trainer.world_size > 1 or getattr(trainer, "root", None) is not None:
        raise TrainableError(f"train.trainable = {spec!r} works with train.backend = 'local'; set it, or "
                             "train.trainable = 'all'")
    info = apply_trainable(model, spec)
    print(f"rollwise: train.trainable = {spec!r}: {info['layers']} decoder layers, {info['trainable']:,} of "
          f"{info['total']:,} parameters train", flush=True)
    return info
