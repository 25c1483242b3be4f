"""Inference linears with oneDNN-prepacked weights (CPU).

At decode time a linear layer multiplies tens of rows by a large weight; a plain `F.linear` re-lays the
weight out for the kernel on every call. Reordering it once into oneDNN's blocked format (what
`torch.compile`'s weight freezing does) was faster in both bf16 and fp32 for the shapes of SmolLM2-135M at
16-64 rows on this project's development CPU (the end-to-end effect: `benchmarks/rollout.py`). Results are
identical to `F.linear` (same kernel family); packing is checked once per dtype and skipped where the
operators are missing or disagree, so the plain path is always the fallback.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """True when oneDNN weight packing is available for `dtype` and reproduces `F.linear` on a probe."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        w, b = torch.randn(48, 32, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return torch.allclose(got.float(), F.linear(x, w, b).float(), atol=1e-2, rtol=1e-2)


class PackedLinear:
    """`y = x @ weight.T + bias` for 2-D `x` [M, in]; the weight [out, in] is packed once for ~`rows_hint` rows.

    Only the packed copy is kept when packing works (the plain weight is dropped to save memory).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 64):
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.packed = None
        if weight.device.type == "cpu" and packing_works(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows_hint)
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, in] -> [M, out]."""
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
