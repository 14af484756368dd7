"""The machine a measurement describes: what the SPS(B) profiles, the kernel choices and the bench results
record, and what a cached measurement must match to be reused."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

# instruction-set features that move step costs by large factors (native bf16 or not, vector width)
_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx_ne_convert", "asimd", "sve", "bf16")


def _cpu() -> tuple[str, list[str]]:
    """The CPU's model name and its relevant ISA flags (from /proc/cpuinfo where there is one)."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = val.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(val.split())
    except OSError:
        pass
    return model or platform.processor(), sorted(f for f in _ISA_FLAGS if f in flags)


def host_fingerprint(device: torch.device) -> dict:
    """The machine: device, torch version and threads, CPU model and ISA flags, and the GPU on CUDA."""
    device = torch.device(device)
    cpu, isa = _cpu()
    info = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": platform.processor(), "cpu": cpu, "isa": isa}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
