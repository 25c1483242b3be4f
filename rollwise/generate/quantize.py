"""Weight-only low-precision rollouts: the engine's linear weights rounded to int8 or FP8 and kept in the engine's
dtype (fake quantization: the numbers a quantized engine computes with, without its kernels).

    fake_quantize_(model, "int8")   # in place; the LM head, embeddings and norms stay as they are

- `int8`: symmetric per output channel, `w_q = round(w / s) * s`, `s = max_j |w_ij| / 127` (weight-only W8 as in
  LLM.int8 / GPTQ-style serving, without outlier handling).
- `fp8`: E4M3 with one scale per output channel, `s = max_j |w_ij| / 448` (448 is E4M3's largest finite value),
  rounded through `torch.float8_e4m3fn` (the FP8 rollouts of Jet-RL / FP8-RL, weights only).

The trainer keeps full precision, so such an engine samples from a slightly different policy: the training-inference
discrepancy that `mismatch/*` measures, the importance corrections (`algo.is_correction`) correct and the
`acrl` / `dcmdp` methods control. On the torch engine: `rollout.engine_options = {weight_quant = "int8"}`.
"""

from __future__ import annotations

import torch

SCHEMES = ("int8", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    """`weight [out, in]` rounded per output channel to `scheme`, returned in its own dtype."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)  # [out, 1]
    if scheme == "int8":
        scale = amax / 127.0
        q = torch.round(w / scale).clamp(-127, 127) * scale
    elif scheme == "fp8":
        scale = amax / FP8_MAX
        q = (w / scale).to(torch.float8_e4m3fn).float() * scale
    else:
        raise ValueError(f"weight_quant = {scheme!r} is not one of {', '.join(SCHEMES)}")
    return q.to(weight.dtype)


@torch.no_grad()
def fake_quantize_(model: torch.nn.Module, scheme: str | None) -> int:
    """Round every `nn.Linear` weight of `model` except its output head to `scheme` (None: nothing); returns how
    many weights it rounded."""
    if scheme is None:
        return 0
    head = model.get_output_embeddings()
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.weight.copy_(quantize_weight(module.weight, scheme))
            count += 1
    return count
