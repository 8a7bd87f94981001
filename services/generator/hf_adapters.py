"""The HF backend's LoRA adapters through peft: LoRA layers injected into the engine's model (``PeftModel``), every
adapter resident; a request picks one (``set_adapter``) or none (``disable_adapter``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from services.generator.adapters import AdapterSlot


def model_linear_modules(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """The model's ``nn.Linear`` layers as peft names them: module name → ``(out_features, in_features)``,
    embeddings, the output head and vision towers left out (call before any adapter is injected)."""
    from services.common.lora import linear_modules
    from services.common.weights import TensorSpec

    spec = {f"{name}.weight": TensorSpec((m.out_features, m.in_features), "")
            for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return linear_modules(spec)


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors under their checkpoint names (peft's wrapped ``<module>.base_layer.weight`` as
    ``<module>.weight``), adapters' tensors left out: what a full weight update copies into."""
    return {name.replace(".base_layer.", "."): tensor for name, tensor in model.state_dict(keep_vars=True).items()
            if ".lora_" not in name}


class PeftAdapters:
    """LoRA adapters injected into one model, each load under its own peft name (``slot<slot_id>``), so that a
    request keeps the version it started on while a newer one loads. Not thread-safe: the engine calls it under
    its lock."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._peft = None  # the PeftModel around ``model``, from the first load on

    def add(self, slot: AdapterSlot, tensors: Mapping[str, torch.Tensor]) -> None:
        """Add the load ``slot`` with its tensors (checked already: peft-named, without the adapter name)."""
        from peft import LoraConfig, PeftModel, set_peft_model_state_dict

        config = slot.config
        lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=list(config.target_modules),
                          use_rslora=config.use_rslora, lora_dropout=0.0, bias="none", inference_mode=True)
        if self._peft is None:
            self._peft = PeftModel(self._model, lora, adapter_name=_key(slot))
        else:
            self._peft.add_adapter(_key(slot), lora)
        result = set_peft_model_state_dict(self._peft, dict(tensors), adapter_name=_key(slot))
        if getattr(result, "unexpected_keys", None):  # check_adapter accepted the names: a peft naming change
            self._peft.delete_adapter(_key(slot))
            raise RuntimeError(f"peft did not place adapter tensors {result.unexpected_keys[:3]}")

    def remove(self, slot: AdapterSlot) -> None:
        """Delete the load ``slot`` (superseded or unloaded, no request on it). The last one leaves peft's LoRA
        layers in place, empty (the model computes the base's output; parameter names stay as they are, which a
        sleeping engine's dropped weights are keyed by)."""
        key = _key(slot)
        others = [k for k in self._peft.peft_config if k != key]
        if key in self._peft.active_adapters and others:  # step off it first (peft would warn and pick one)
            self._peft.set_adapter(others[0])
        self._peft.delete_adapter(key)

    @contextlib.contextmanager
    def active(self, slot: AdapterSlot | None) -> Iterator[None]:
        """Run the model with the load ``slot`` (None: the base model, adapters off) inside the block."""
        if self._peft is None or (slot is None and not self._peft.peft_config):  # no adapter: the base's output
            yield
        elif slot is None:
            with self._peft.disable_adapter():
                yield
        else:
            self._peft.set_adapter(_key(slot))
            yield


def _key(slot: AdapterSlot) -> str:
    """peft's name of a load (adapter names may hold '.', which peft's module dicts refuse)."""
    return f"slot{slot.slot_id}"
