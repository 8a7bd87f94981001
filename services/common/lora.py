"""LoRA adapters over a base model, as both services see them: the config, the peft tensor names, and the checks an
adapter passes before anything applies it (the generator's engines, the experience service's forwards). Pure:
nothing here imports vLLM, peft or gRPC.

Tensors are named as peft's ``get_peft_model_state_dict`` names them:
``base_model.model.<module>.lora_A.weight`` of shape ``(rank, in_features)`` and
``base_model.model.<module>.lora_B.weight`` of shape ``(out_features, rank)``, where ``<module>`` is a linear
layer of the base checkpoint (``model.layers.0.self_attn.q_proj``) that the config's ``target_modules`` select.
The adapter adds ``scaling * B @ A`` to the module's weight, ``scaling = alpha / rank`` (``alpha / sqrt(rank)``
with rsLoRA, Kalajdzievski 2023, arXiv 2312.03732). An adapter's name is a run id (1-256 letters, digits, ``._-``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from services.common.errors import InvalidRequest
from services.common.weights.checks import all_finite
from services.common.weights.records import TensorSpec

PEFT_PREFIX = "base_model.model."
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,255}")
# Checkpoint modules that are not LoRA targets here: embeddings and the output head (vLLM adapts them with extra
# vocabulary machinery) and vision towers (vLLM adapts the language model only unless told otherwise).
NOT_TARGETS = ("embed_tokens", "lm_head", "visual.", "vision_tower", "vision_model", "multi_modal_projector")


@dataclass(frozen=True)
class AdapterConfig:
    """peft ``LoraConfig`` fields an engine needs: ``rank`` (``r``), ``alpha`` (``lora_alpha``), the module-name
    suffixes adapted (``target_modules``, peft's list form: ``("q_proj", "v_proj")``), and rsLoRA scaling."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """The factor on ``B @ A``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def peft_fields(self) -> dict:
        """The ``adapter_config.json`` / ``LoraConfig`` keywords of this config."""
        return {"r": self.rank, "lora_alpha": self.alpha, "target_modules": list(self.target_modules),
                "use_rslora": self.use_rslora, "bias": "none"}


def linear_modules(spec: Mapping[str, TensorSpec]) -> dict[str, tuple[int, int]]:
    """The base checkpoint's LoRA-able linear layers: module name → ``(out_features, in_features)``, read from its
    2-D ``<module>.weight`` tensors (:func:`services.common.weights.model_spec`), embeddings, the output head and
    vision towers left out."""
    modules = {}
    for name, tensor in spec.items():
        if name.endswith(".weight") and len(tensor.shape) == 2 and not any(part in name for part in NOT_TARGETS):
            modules[name.removesuffix(".weight")] = (int(tensor.shape[0]), int(tensor.shape[1]))
    return modules


def targets(modules: Mapping[str, tuple[int, int]], target_modules: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """The modules ``target_modules`` select, by peft's rule for a list: the module's name is the entry or ends
    with ``"." + entry``."""
    return {m: shape for m, shape in modules.items() if any(m == t or m.endswith("." + t) for t in target_modules)}


def expected_tensors(config: AdapterConfig, modules: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """peft name → shape of every tensor an adapter with ``config`` has on these modules."""
    expected = {}
    for module, (out_features, in_features) in targets(modules, config.target_modules).items():
        expected[f"{PEFT_PREFIX}{module}.lora_A.weight"] = (config.rank, in_features)
        expected[f"{PEFT_PREFIX}{module}.lora_B.weight"] = (out_features, config.rank)
    return expected


def check_adapter(
    name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], modules: Mapping[str, tuple[int, int]],
    max_rank: int, *, values: bool = True,
) -> dict[str, tuple[int, int]]:
    """Check a whole adapter before an engine applies any of it.

    Args:
        name, config: as :func:`check_config`.
        tensors: peft-named tensors (see the module docstring), every one the config produces on this model,
            each of floating dtype, the expected shape and finite.
        modules: the base's linear layers (:func:`linear_modules`).
        values: also scan every value for NaN and infinity (False: the caller scanned these very tensors already;
            names, shapes and dtypes are checked either way).

    Returns:
        The modules the adapter adapts: name → ``(out_features, in_features)``.

    Raises:
        InvalidRequest: naming ``adapter``, ``config.rank``, ``config.alpha``, ``config.target_modules`` or the
            tensor (``tensors[base_model.model....lora_B.weight]``) and why.
    """
    expected = check_config(name, config, modules, max_rank)
    for tensor_name, tensor in tensors.items():
        check_tensor(tensor_name, tensor.dtype, tuple(tensor.shape), expected)
        if values and not all_finite(tensor):
            raise InvalidRequest(f"tensors[{tensor_name}]", "holds NaN or infinite values")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise InvalidRequest(f"tensors[{missing[0]}]", f"missing: target_modules {list(config.target_modules)} "
                             f"adapt this module ({len(missing)} of {len(expected)} tensors absent)")
    return targets(modules, config.target_modules)


def check_config(
    name: str, config: AdapterConfig, modules: Mapping[str, tuple[int, int]], max_rank: int
) -> dict[str, tuple[int, int]]:
    """Check an adapter's name and config; returns the tensors it must have (:func:`expected_tensors`).

    ``name``: 1-256 letters, digits, ``._-``, not starting with a symbol; ``config.rank`` at most ``max_rank``,
    ``alpha`` > 0, ``target_modules`` selecting at least one module.

    Raises:
        InvalidRequest: naming ``adapter``, ``config.rank``, ``config.alpha`` or ``config.target_modules``.
    """
    check_name(name)
    if not 1 <= config.rank <= max_rank:
        raise InvalidRequest("config.rank", f"{config.rank}; this generator takes ranks 1 to {max_rank} "
                             "(max_lora_rank)")
    if not (math.isfinite(config.alpha) and config.alpha > 0):
        raise InvalidRequest("config.alpha", f"{config.alpha}; must be a positive number")
    expected = expected_tensors(config, modules)
    if not expected:
        suffixes = sorted({m.rsplit(".", 1)[-1] for m in modules})
        raise InvalidRequest("config.target_modules", f"{list(config.target_modules)} select no linear layer of "
                             f"the model (its layers end in {suffixes})")
    return expected


def check_name(name: str, field: str = "adapter") -> None:
    """Check an adapter's name: 1-256 letters, digits, ``._-``, not starting with a symbol.

    Raises:
        InvalidRequest: naming ``field``.
    """
    if not _NAME.fullmatch(name or ""):
        raise InvalidRequest(field, f"{name!r} is not an adapter name (1-256 letters, digits, '.', '_', '-')")


def check_tensor(name: str, dtype: torch.dtype, shape: tuple[int, ...], expected: Mapping[str, tuple[int, int]]) -> None:
    """Check one tensor's name, dtype and shape against the adapter's ``expected`` tensors (a stream checks each
    tensor's first chunk so, before its bytes arrive).

    Raises:
        InvalidRequest: naming the tensor (``tensors[<name>]``).
    """
    field = f"tensors[{name}]"
    if name not in expected:
        example = next(iter(expected))
        raise InvalidRequest(field, f"not a LoRA tensor of the config's target modules on this model (names as "
                             f"peft's get_peft_model_state_dict gives them, e.g. {example!r})")
    if not dtype.is_floating_point:
        raise InvalidRequest(field, f"dtype {str(dtype).removeprefix('torch.')}; must be floating point")
    if tuple(shape) != expected[name]:
        what = "(rank, in_features)" if ".lora_A." in name else "(out_features, rank)"
        raise InvalidRequest(field, f"shape {tuple(shape)}; expected {expected[name]} {what}")


