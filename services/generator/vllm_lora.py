"""vLLM's side of LoRA adapters: its engine options, the ``LoRARequest`` of one adapter load, the adapter's
tensors as they travel to the workers (:class:`services.generator.vllm_worker.WeightLoaderExtension`), and the
loads' adding to and removal from the workers (:class:`WorkerAdapters`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from services.generator.adapters import AdapterSlot
    from services.generator.engine import SleepState

logger = logging.getLogger(__name__)


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
    """peft name → (dtype name, shape, raw bytes in native byte order): what vLLM's RPC carries to workers in
    another process untouched (its encoder rebuilds torch tensors only where a type says so). Inverse:
    :func:`unpacked`."""
    out = {}
    for name, tensor in tensors.items():
        host = tensor.detach().cpu().contiguous()
        out[name] = (str(host.dtype).removeprefix("torch."), list(host.shape), host.view(torch.uint8).numpy().tobytes())
    return out


def unpacked(tensors: Mapping[str, tuple[str, list[int], bytes] | torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors :func:`packed` packed, each owning its memory; a tensor given as it is (an in-process worker's:
    :class:`WorkerAdapters`) is kept as it is."""
    return {name: value if isinstance(value, torch.Tensor) else _unpacked(*value) for name, value in tensors.items()}


def _unpacked(dtype: str, shape: list[int], data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


class WorkerAdapters:
    """Adapter loads in the workers of one vLLM engine (``AsyncLLM``), added and removed through ``collective_rpc``
    (:class:`~services.generator.vllm_worker.WeightLoaderExtension`). A removal while the engine sleeps waits for
    :meth:`woke` (vLLM's LoRA weights may be unmapped then: removing zeroes a slot in place). Event loop only.

    ``in_process``: the engine's one worker runs in this process (:class:`~services.generator.vllm_inline.InlineLLM`),
    where ``collective_rpc`` hands its arguments over as they are: the adapter's tensors go to it as they are (the
    worker keeps them; nothing else changes them), not :func:`packed` into bytes and rebuilt, two copies of every
    byte. A worker in another process gets them packed."""

    def __init__(self, engine: Any, sleep_state: SleepState, in_process: bool = False) -> None:
        self._engine = engine
        self._in_process = in_process
        self._sleep_state = sleep_state
        self._removing: set[asyncio.Task] = set()  # removals running in the background
        self._asleep: list[AdapterSlot] = []  # removals waiting for wake-up

    async def add(self, slot: AdapterSlot, tensors: Mapping[str, torch.Tensor], peft_fields: dict) -> None:
        """Build the load ``slot`` in every worker from its (checked) peft-named tensors; raises what vLLM raises."""
        payload = ({k: v.detach().cpu() for k, v in tensors.items()} if self._in_process  # CPU ones: as they are
                   else await asyncio.to_thread(packed, tensors))
        await self._engine.collective_rpc("fastexp_load_adapter", args=(slot.name, slot.slot_id, peft_fields, payload))

    def retire(self, slot: AdapterSlot) -> asyncio.Task | None:
        """Drop the load ``slot`` (no request runs on it) from every worker in the background: the task, or None
        while the engine sleeps (dropped by :meth:`woke`)."""
        if self._sleep_state.level:
            self._asleep.append(slot)
            return None
        task = asyncio.create_task(self._remove(slot))
        self._removing.add(task)
        task.add_done_callback(self._removing.discard)
        return task

    def woke(self) -> None:
        """The engine is awake again: drop the loads retired while it slept."""
        retired, self._asleep = self._asleep, []
        for slot in retired:
            self.retire(slot)

    async def _remove(self, slot: AdapterSlot) -> None:
        try:
            await self._engine.collective_rpc("fastexp_remove_adapter", args=(slot.slot_id,))
        except Exception:  # the engine is gone or going: its workers' memory with it
            logger.warning("adapter %s version %d not dropped from the workers", slot.name, slot.version,
                           exc_info=True)

    def close(self) -> None:
        """Cancel the removals still running (the engine is shutting down)."""
        for task in self._removing:
            task.cancel()
