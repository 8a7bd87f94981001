"""Offloading the experience service's models to host memory and back, for a trainer that shares the accelerator
(the seed's ``offload_model`` / ``reload_model`` around its forwards; LightRFT's colocated mode).

The :class:`~services.experience.pipeline.forwarder.Forwarder` calls :class:`Offloader` between forward passes (its lock);
while offloaded, forwards are refused. Where the models already live in host memory (a CPU service) there is
nothing to free, and where accelerate spread a model over devices (``device_map``) one ``.to()`` cannot put it
back: both answer :class:`~services.common.errors.FailedPrecondition` saying so.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.common.errors import FailedPrecondition


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (tied tensors once)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Offloader:
    """Moves named modules to host memory (:meth:`offload`) and back to where each was (:meth:`reload`)."""

    def __init__(self, modules: Mapping[str, torch.nn.Module]) -> None:
        self._modules = dict(modules)
        self._devices: dict[str, torch.device] | None = None  # set while offloaded: each module's device

    @property
    def offloaded(self) -> bool:
        """Whether the modules were moved to host memory and not yet back."""
        return self._devices is not None

    def require_loaded(self, what: str) -> None:
        """Raises FailedPrecondition naming ``what`` while the models are offloaded."""
        if self._devices is not None:
            raise FailedPrecondition(f"{what}: the experience service's models are offloaded to host memory; call "
                                     "ReloadModels first")

    def offload(self) -> tuple[int, tuple[str, ...]]:
        """Move every module to host memory; returns (bytes moved, module names).

        Raises:
            FailedPrecondition: already offloaded, a module placed with ``device_map``, or every module already in
                host memory.
        """
        self.require_loaded("OffloadModels")
        spread = [name for name, module in self._modules.items() if getattr(module, "hf_device_map", None)]
        if spread:
            raise FailedPrecondition(f"OffloadModels: {', '.join(spread)} placed with device_map (several devices) "
                                     "cannot be offloaded and put back as it was")
        devices = {name: _device_of(module) for name, module in self._modules.items()}
        if all(device.type == "cpu" for device in devices.values()):
            raise FailedPrecondition("OffloadModels: the models already live in host memory (device cpu); there is "
                                     "no accelerator memory to free")
        moved = 0
        for name, module in self._modules.items():
            if devices[name].type != "cpu":
                moved += module_bytes(module)
                module.to("cpu")
        torch.cuda.empty_cache()
        self._devices = devices
        return moved, tuple(name for name, device in devices.items() if device.type != "cpu")

    def reload(self) -> tuple[int, tuple[str, ...]]:
        """Move every offloaded module back to its device; returns (bytes moved, module names).

        Raises:
            FailedPrecondition: not offloaded.
        """
        if self._devices is None:
            raise FailedPrecondition("ReloadModels: the models are not offloaded")
        moved, names = 0, []
        for name, module in self._modules.items():
            device = self._devices[name]
            if device.type != "cpu":
                module.to(device)
                moved += module_bytes(module)
                names.append(name)
        self._devices = None
        return moved, tuple(names)


def _device_of(module: torch.nn.Module) -> torch.device:
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")
