"""The local trainer over a PEFT LoRA model (`lora.rank > 0`; rollwise.train.lora holds the PEFT functions).

Only the adapters train. What differs from the full-weight `Trainer`, each behind the trainer backend's own
methods, so the session and the Sync stage never ask which backend they hold:
- the KL reference is the same network with its adapters off (`AdapterOffReference`): no second copy of the base;
- `policy_state()` is the merged weights W + (alpha / r) B A (engines that take full tensors);
- `adapter_folder(folder)` writes the adapter alone (engines that serve adapters: `EngineCaps.adapters`);
- a checkpoint holds the adapter under `adapter/` (and the merged model under `merged/` with `lora.save_merged`),
  no full model at its root (`write_lora_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollwise.train.batching import MicroBatch
from rollwise.train.lora import merged_state_dict, save_adapter, write_lora_checkpoint
from rollwise.train.trainer import Trainer


class AdapterOffReference:
    """KL reference log-probs from the LoRA policy with its adapters disabled: the base weights."""

    model = None  # no module of its own

    def logprobs(self, trainer: Trainer, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        with trainer.model.disable_adapter():
            return trainer._frozen_logprobs(trainer.model, mbs)


class LoraTrainer(Trainer):
    """`Trainer` whose model is a PEFT model (see the module docstring). `tokenizer` is written into checkpoints
    beside the adapter; `save_merged` adds the merged model (`lora.save_merged`)."""

    has_adapter = True

    def __init__(self, model, train_cfg, algo_cfg, pad_id: int, *, tokenizer, save_merged: bool = False,
                 temperature: float = 1.0, max_new_tokens: int = 64):
        super().__init__(model, train_cfg, algo_cfg, pad_id, temperature=temperature,
                         max_new_tokens=max_new_tokens, reference=AdapterOffReference())
        self.tokenizer, self.save_merged = tokenizer, save_merged

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The merged weights under the base model's parameter names (the trained model is left as it is)."""
        return merged_state_dict(self.model)

    def adapter_folder(self, folder: Path) -> Path:
        """Write the adapter alone to `folder` (atomically) for an engine that serves it."""
        return save_adapter(self.model, folder)

    def write_checkpoint(self, directory: Path) -> None:
        write_lora_checkpoint(directory, self.model, self.tokenizer, self.save_merged)
