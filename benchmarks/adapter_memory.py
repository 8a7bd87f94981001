"""Resident memory of the experience service's LoRA adapters (issue 33: "resident memory with 1, 4 and 16 adapters
loaded"): :class:`~services.experience.workers.adapters.AdapterForwards` over the reference model, the service's
dtype (bfloat16), adapters of rank 16 on every attention and MLP projection (the operator's default
``lora_target_modules``), loaded one after another.

Measured, not asserted: the process's resident set (``psutil``) after the base model and one set of adapter tensors
(the upload every load copies from, kept alive so that freeing it adds no noise), then after 1, 4 and 16 adapters,
freed heap handed back first (glibc ``malloc_trim``). Figures:

- ``adapter_memory_tensor_bytes_per_adapter``: the LoRA tensors one adapter adds to the module (exact; float32 on a
  half-precision base, peft's ``autocast_adapter_dtype``);
- ``adapter_memory_rss_delta_bytes``: ``{n: RSS with n adapters - RSS with none}`` (peft imported before);
- ``adapter_memory_rss_per_adapter_bytes``: ``(delta_16 - delta_1) / 15``, what each adapter after the first adds
  (the first also brings peft's wrapper layers), and ``adapter_memory_rss_vs_tensor_bytes``, its ratio to the
  tensor bytes (1: no overhead beyond the tensors);
- ``adapter_memory_base_model_bytes``: the base model's own tensors, for scale (the reference a LoRA run uses,
  at no extra cost).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib

import torch

from services.common.lora import AdapterConfig, expected_tensors
from services.experience.runs.limits import DEFAULT_LORA_TARGET_MODULES
from services.experience.workers.adapters import AdapterForwards, linear_modules
from services.experience.workers.logprobs import LogProbModel
from services.experience.workers.offload import module_bytes


def resident_bytes() -> int:
    """This process's resident set size, after collecting garbage and handing freed heap back (where glibc can)."""
    import psutil

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the figure keeps what the allocator holds
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def run(model_path: str, counts: tuple[int, ...] = (1, 4, 16), rank: int = 16, dtype: str = "bfloat16",
        target_modules: tuple[str, ...] = DEFAULT_LORA_TARGET_MODULES) -> dict:
    """Load ``max(counts)`` adapters of ``rank`` on ``target_modules`` into the model at ``model_path``; returns
    the figures of the module docstring and the settings."""
    model = LogProbModel.load(model_path, dtype=dtype, device="cpu")
    config = AdapterConfig(rank=rank, alpha=2.0 * rank, target_modules=tuple(target_modules))
    generator = torch.Generator().manual_seed(0)
    upload = {name: torch.randn(shape, generator=generator) * 0.01
              for name, shape in expected_tensors(config, linear_modules(model.module)).items()}
    base_bytes = module_bytes(model.module)
    adapters = AdapterForwards(model, max_rank=rank)
    importlib.import_module("peft")  # before the baseline: peft's own code is not an adapter's memory
    before = resident_bytes()
    deltas, tensor_bytes = {}, 0
    for n in range(1, max(counts) + 1):
        adapters.load(f"run-{n}", config, upload, version=1)
        if n == 1:
            tensor_bytes = module_bytes(model.module) - base_bytes
        if n in counts:
            deltas[n] = resident_bytes() - before
    first, last = min(counts), max(counts)
    per_adapter = (deltas[last] - deltas[first]) / (last - first) if last > first else float(deltas[last])
    return {
        "adapter_memory_tensor_bytes_per_adapter": tensor_bytes,
        "adapter_memory_rss_delta_bytes": deltas,
        "adapter_memory_rss_per_adapter_bytes": per_adapter,
        "adapter_memory_rss_vs_tensor_bytes": per_adapter / tensor_bytes,
        "adapter_memory_base_model_bytes": base_bytes,
        "adapter_memory_settings": {"rank": rank, "target_modules": list(target_modules), "dtype": dtype,
                                    "adapter_tensors": len(upload), "counts": list(counts)},
    }


if __name__ == "__main__":  # alone: python -m benchmarks.adapter_memory
    import json

    from services.common.models import SMOLLM2_ALIAS, resolve_model

    print(json.dumps(run(resolve_model(SMOLLM2_ALIAS)), indent=2))
