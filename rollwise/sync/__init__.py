"""The Sync stage: push the trainer's weights to the engines, versioned."""

from __future__ import annotations

import torch

from rollwise.generate.base import Engine


def sync_weights(model: torch.nn.Module, engines: list[Engine], version: int) -> None:
    """Send the policy's current parameters to every engine as `version`."""
    state = {name: p.detach() for name, p in model.named_parameters()}
    for engine in engines:
        engine.update_weights(state, version)
