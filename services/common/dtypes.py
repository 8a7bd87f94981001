"""The floating-point type models run in: ``auto`` picks bfloat16 where the device computes it natively, float32
where it does not.

bfloat16 halves the memory traffic of every matmul, which is what a forward pass or a decode step on a CPU is
bound by, but only where the CPU multiplies bfloat16 itself (x86: AVX-512 BF16 or AMX; Arm: the BF16 extension).
Elsewhere each bfloat16 matmul converts to float32 and back, and float32 is the faster of the two. On CUDA,
bfloat16 where the GPU supports it (Ampere and later), float32 on older cards (float16 has a smaller range; a
deployment that wants it names it).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Literal

import torch

Precision = Literal["bfloat16", "float16", "float32"]
DtypeSetting = Literal["auto", "bfloat16", "float16", "float32"]


def resolve_dtype(setting: DtypeSetting, device: str) -> Precision:
    """The dtype models run in on ``device`` ("cpu", "cuda", "cuda:1", ...): ``setting`` itself unless it is
    ``auto``, which is bfloat16 where :func:`native_bfloat16`, float32 otherwise."""
    if setting != "auto":
        return setting
    return "bfloat16" if native_bfloat16(device) else "float32"


@functools.cache
def native_bfloat16(device: str) -> bool:
    """Whether ``device`` multiplies bfloat16 natively (the CPU's instruction set extensions, or the GPU's
    compute capability as torch reports it)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if platform.machine() in ("x86_64", "AMD64"):
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bf16" in _cpu_flags()


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (Arm: "Features"; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def agreed_dtype(*dtypes: str) -> str:
    """The one floating-point type ``dtypes`` ("bfloat16", ...) all name; "" where they differ or one is unknown
    (""): what a deployment reports as the type its policy is served in (``ServerInfo.policy_dtype``)."""
    return dtypes[0] if dtypes and "" not in dtypes and len(set(dtypes)) == 1 else ""
