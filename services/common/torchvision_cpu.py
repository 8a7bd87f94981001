"""Let PyPI's torchvision import on a CPU-only torch build.

Qwen2-VL's processor classes in transformers (its video processor, and with it `Qwen2VLProcessor` itself) and
vLLM's multimodal input processing import torchvision for frame resizing. PyPI ships torchvision only as a CUDA
build: its compiled ops library (`torchvision/_C.so`) links `libtorch_cuda.so`, which a `+cpu` torch does not
have. torchvision tolerates that library failing to load (its detection ops then raise when called) except for
two fake-tensor registrations it makes unconditionally at import, for `torchvision::nms` and `torchvision::qnms`,
which fail with "operator torchvision::nms does not exist".

This module declares those two operator schemas, with no kernel, before torchvision is imported, so the pure
Python parts (transforms, the ones fastexp and the processors use) work. Calling `torchvision.ops.nms` still
raises, as it would with the library missing. Where torchvision's library does load (a CUDA torch, or the CPU
build from PyTorch's own index, as the Docker images use) nothing is declared: the real operators register.

It is activated by a one-line `.pth` file the Makefile writes into the virtual environment (`import
services.common.torchvision_cpu`), so that it also applies in the engine processes vLLM spawns. That line only installs
an import hook; torch is not imported until something imports torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_DECLARED = False
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARIES: list[object] = []  # torch.library.Library objects must stay alive for their definitions to stay


def _library_loads() -> bool:
    """Whether torchvision's compiled ops library loads with this torch (it then registers the real operators)."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    folders = spec.submodule_search_locations if spec is not None and spec.submodule_search_locations else []
    library = next((lib for folder in folders for lib in Path(folder).glob("_C*.so")), None)
    if library is None:
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:  # e.g. libtorch_cuda.so missing: a CUDA build of torchvision on a CPU torch
        return False
    return True


def declare_torchvision_operators() -> None:
    """Declare `torchvision::nms`/`qnms` when torchvision's own library cannot load (idempotent)."""
    global _DECLARED
    if _DECLARED:
        return
    _DECLARED = True
    import torch

    if torch.version.cuda is not None or _library_loads():
        return
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        except RuntimeError:
            library.define(schema)
    _LIBRARIES.append(library)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs `declare_torchvision_operators` the first time `torchvision` is imported, then steps aside."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib's signature
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            declare_torchvision_operators()
        return None


def install() -> None:
    """Install the import hook (idempotent)."""
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


install()
