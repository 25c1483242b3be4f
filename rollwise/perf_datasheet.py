"""Datasheet peaks: the dense matmul rate a device's maker states, for MFU as peers publish it.

rollwise reports MFU against two peaks side by side:
- measured (`rollwise.perf.matmul_peak_gflops`, `cuda_peak_gflops`): what this machine's matmul sustains
  (an 8192^3 bf16 matmul reaches about 800 TFLOP/s on an H100 SXM), so MFU against it says how close the
  code comes to what the hardware does in practice;
- datasheet (here): the vendor's dense figure for the precision used, the denominator prime-rl, Megatron and
  most papers use, so figures compare across projects. Against it MFU reads lower (about 0.8x on an H100).

GPU figures are dense (no 2:4 sparsity), TFLOP/s, from NVIDIA's product datasheets: H100 SXM5 / H200 SXM:
bf16 989.4, fp32 (no TF32) 66.9; H100 PCIe: bf16 756.5, fp32 51.2; H100 NVL: bf16 835.5, fp32 60; A100 (SXM4
and PCIe): bf16 312, fp32 19.5; L40S: bf16 362.05, fp32 91.6; L4: bf16 121, fp32 30.3; A10 / A10G: bf16 125,
fp32 31.2. PyTorch's default fp32 matmul does not use TF32 (`torch.backends.cuda.matmul.allow_tf32` False),
so fp32 is held to the non-tensor-core rate. A GPU not in the table has no datasheet MFU (None), never a guess.
On a CPU the datasheet figure is `rollwise.perf.nominal_gflops` (cores x base clock x FLOP/cycle of the widest
matmul ISA the CPU flags name).
"""

from __future__ import annotations

import torch

# (substring of torch.cuda.get_device_name(), lower case; the first match wins) -> TFLOP/s by dtype name
GPU_DATASHEET_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("h200", {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9}),
    ("h100 pcie", {"bfloat16": 756.5, "float16": 756.5, "float32": 51.2}),
    ("h100 nvl", {"bfloat16": 835.5, "float16": 835.5, "float32": 60.0}),
    ("h100", {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9}),  # SXM5 (e.g. "NVIDIA H100 80GB HBM3")
    ("a100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("l40s", {"bfloat16": 362.05, "float16": 362.05, "float32": 91.6}),
    ("l4", {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3}),
    ("a10", {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2}),
]


def gpu_datasheet_gflops(device_name: str, dtype: torch.dtype) -> float | None:
    """The datasheet dense peak (GFLOP/s) of the GPU named `device_name` in `dtype`; None when unknown."""
    name = device_name.lower()
    key = str(dtype).removeprefix("torch.")
    for pattern, peaks in GPU_DATASHEET_TFLOPS:
        if pattern in name:
            tflops = peaks.get(key)
            return None if tflops is None else tflops * 1000.0
    return None


def datasheet_gflops(dtype: torch.dtype, on_cpu: bool, threads: int | None = None) -> float | None:
    """The datasheet peak of where a stage runs: the current CUDA device's, or `threads` CPU cores'."""
    if on_cpu:
        from rollwise.perf import nominal_gflops

        return nominal_gflops(dtype, threads or torch.get_num_threads())
    if not torch.cuda.is_available():
        return None
    return gpu_datasheet_gflops(torch.cuda.get_device_name(), dtype)
