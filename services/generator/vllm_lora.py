"""vLLM's side of LoRA adapters: its engine options, the ``LoRARequest`` of one adapter load, and the adapter's
tensors as they travel to the workers (:class:`services.generator.vllm_worker.WeightLoaderExtension`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def lora_options(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> dict[str, Any]:
    """vLLM engine arguments for LoRA: ``max_loras`` adapters in one batch (0: LoRA off), ranks up to
    ``max_lora_rank`` (one of vLLM's 1, 8, 16, 32, 64, 128, 256, 320, 512), ``max_cpu_loras`` kept built in vLLM's
    LRU cache (None: ``max_loras``; the generator rebuilds evicted ones from the tensors it keeps)."""
    if not max_loras:
        return {}
    return dict(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank,
                max_cpu_loras=max_cpu_loras or max_loras)  # vLLM refuses fewer than max_loras, saying so


def lora_request(name: str, slot_id: int) -> Any:
    """vLLM's ``LoRARequest`` for load ``slot_id`` of adapter ``name``. The name and path are unique per load:
    vLLM keys its prefix cache on them, so a new version never reuses KV computed under an older one. The path
    names no folder: the workers build the adapter from tensors they keep."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"{name}@{slot_id}", lora_int_id=slot_id,
                       lora_path=f"fastexp-adapter://{name}/{slot_id}")


def packed(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    """peft name → (dtype name, shape, raw bytes in native byte order): what vLLM's RPC carries to the workers
    untouched (its encoder rebuilds torch tensors only where a type says so). Inverse: :func:`unpacked`."""
    out = {}
    for name, tensor in tensors.items():
        host = tensor.detach().cpu().contiguous()
        out[name] = (str(host.dtype).removeprefix("torch."), list(host.shape), host.view(torch.uint8).numpy().tobytes())
    return out


def unpacked(tensors: Mapping[str, tuple[str, list[int], bytes]]) -> dict[str, torch.Tensor]:
    """The tensors :func:`packed` packed, each owning its memory."""
    return {name: torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
            for name, (dtype, shape, data) in tensors.items()}
