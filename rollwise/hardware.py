"""Run-time facts about the machine: physical cores, native bf16 support."""

from __future__ import annotations

import os
from pathlib import Path


def physical_cores() -> int:
    """Cores this process may use, counting SMT siblings once."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    seen: set[str] = set()
    for cpu in allowed:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            seen.add(path.read_text().strip())
        except OSError:
            seen.add(str(cpu))
    return max(1, len(seen))


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_is_native(device_type: str = "cpu") -> bool:
    """bf16 runs natively: on CUDA, or on a CPU with bf16 dot-product instructions."""
    if device_type == "cuda":
        return True
    return device_type == "cpu" and cpu_has_native_bf16()


def configure_threads(threads: int = 0) -> int:
    """Set torch's intra-op threads (0 = physical cores); returns the number set."""
    import torch

    n = threads or physical_cores()
    torch.set_num_threads(n)
    return n
