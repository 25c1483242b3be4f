"""`train.compile`: `torch.compile` each decoder layer of the trained model (inductor, dynamic shapes).

Layers rather than the whole model: the LM head and loss (`rollwise.train.logprobs`) are already a chunked kernel
of their own, every decoder layer has the same code (one compiled graph, reused), and packed rows change length
every micro-batch (`dynamic=True` keeps that to one graph rather than one per length). Gradient checkpointing
composes with it (the checkpointed call wraps the compiled layer).

Off by default: on a 2-core Xeon (AVX512-BF16, AMX) the Train stage at the default recipe's shape ran 0.67x as
fast in bf16 with it (`benchmarks/train_step.py --a . --b . --b-set compile=true`, BENCHMARKS.md); it has not
yet been measured on a GPU, where fused elementwise kernels are what it usually pays for.
"""

from __future__ import annotations

import torch

from rollwise.errors import UserError
from rollwise.train.trainable import decoder_layers


class CompileError(UserError, RuntimeError):
    """`train.compile = true` on a torch without `torch.compile` (before 2.0) or a model with no layer list."""


def compile_layers(model) -> int:
    """Compile every decoder layer of `model` (a PEFT model: its base) in place; returns how many."""
    if not hasattr(torch, "compile"):
        raise CompileError(f"train.compile = true needs torch.compile (torch >= 2.0; this is {torch.__version__}); "
                           "set train.compile = false")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        layers = decoder_layers(base)
    except Exception as err:  # noqa: BLE001 - TrainableError names the missing list; say which key to change
        raise CompileError(f"train.compile = true: {err}; set train.compile = false") from err
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
