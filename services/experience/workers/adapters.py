"""The actor's LoRA adapters for LoRA runs (issue 33, "Forwards"): many adapters injected with peft into the one base
model the service loads as its actor (the base the generator serves), a log-prob forward of one run's rows with its
adapter on, and the run's reference log-probs from the same module with every adapter off. A LoRA run's reference
is the base model, so it costs no memory beyond the adapters themselves (rank 16 on every attention and MLP
projection of SmolLM2-135M: 19.5 MB of float32 tensors, 21.9 MB resident, per adapter;
``benchmarks/adapter_memory.py``).

Tensors are named as peft's ``get_peft_model_state_dict`` names them:
``base_model.model.<module>.lora_A.weight`` of shape ``(rank, in_features)`` and
``base_model.model.<module>.lora_B.weight`` of shape ``(out_features, rank)``, where ``<module>`` is a linear
layer of the base model (``model.layers.0.self_attn.q_proj``) whose name is an entry of ``target_modules`` or ends
with ``"." + entry`` (peft's rule for a list). The adapter adds ``scaling * B @ A`` to the module's output
(``scaling = alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA). The config and the checks are the ones the
generator applies (:mod:`services.common.lora`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.common.errors import InvalidRequest
from services.common.lora import NOT_TARGETS, PEFT_PREFIX, AdapterConfig, check_adapter
from services.experience.workers.inputs import ForwardChunk
from services.experience.workers.logprobs import LogProbModel


@dataclass(frozen=True)
class LoadedAdapter:
    """A named adapter as loaded: its config and the policy ``version`` its tensors are."""

    name: str
    config: AdapterConfig
    version: int


class AdapterLogProbs(NamedTuple):
    """One run's forward outputs, float32 on the CPU (nats, temperature 1).

    Shape:
        action_log_probs: (B, A) with the run's adapter on; entropy: (B, A) or None (not asked);
        base_action_log_probs: (B, A) of the base model, adapters off, or None (not asked). Positions past a
        row's response are padding or 0, as :meth:`LogProbModel.action_log_probs` leaves them.
    """

    action_log_probs: torch.Tensor
    entropy: torch.Tensor | None
    base_action_log_probs: torch.Tensor | None


def linear_modules(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """The module's LoRA-able ``nn.Linear`` layers: name → ``(out_features, in_features)``, embeddings, the output
    head and vision towers left out (read before any adapter is injected)."""
    return {name: (layer.out_features, layer.in_features) for name, layer in module.named_modules()
            if isinstance(layer, torch.nn.Linear) and not any(part in name for part in NOT_TARGETS)}


class AdapterForwards:
    """The LoRA runs' adapters on the actor's module, and the log-prob forwards of one run's rows.

    Every adapter is resident (peft's LoRA layers hold one ``lora_A``/``lora_B`` pair per adapter, in float32 on a
    half-precision base: peft's ``autocast_adapter_dtype``). Between calls the module rests with every adapter
    off, so the actor's own :meth:`LogProbModel.action_log_probs` (base-model runs) still computes the base;
    :meth:`log_probs` turns one adapter on for its actor pass and off again. With no adapter left the LoRA layers
    are unloaded and the module is the base model again.

    Not thread-safe: the forwarder calls every method, and the actor's own forwards, in its worker thread
    under its lock (they share the module's adapter state).
    """

    def __init__(self, base: LogProbModel, max_rank: int) -> None:
        """``base``: the service's actor model (its module gets the LoRA layers); ``max_rank``: the largest
        rank :meth:`load` accepts (the operator's ``max_lora_rank``).

        Raises:
            ValueError: ``base`` already holds LoRA layers (another AdapterForwards owns it).
        """
        if any(hasattr(module, "lora_A") for module in base.module.modules()):
            raise ValueError("the model already holds LoRA layers (one AdapterForwards per model)")
        self._base = base
        self._max_rank = max_rank
        self._modules = linear_modules(base.module)
        self._peft = None  # the PeftModel around ``base.module``, while an adapter is loaded
        self._loaded: dict[str, LoadedAdapter] = {}
        self._keys: dict[str, str] = {}  # adapter name → peft's name for it (peft's module dicts refuse '.')
        self._next_key = 0

    def modules(self) -> dict[str, tuple[int, int]]:
        """The base's LoRA-able linear layers, read before any adapter (name → (out, in)): :func:`check_adapter`
        may run on an upload with them before the forwarder's lock is taken (:meth:`load` checks again)."""
        return dict(self._modules)

    def adapters(self) -> dict[str, LoadedAdapter]:
        """The loaded adapters by name."""
        return dict(self._loaded)

    def load(self, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], version: int, *,
             values_checked: bool = False) -> LoadedAdapter:
        """Load ``name`` at ``version``, replacing its tensors in place when it is loaded with the same config
        (otherwise a new set of LoRA layers, the old one deleted after). Nothing is applied unless the whole adapter
        passes :func:`check_adapter` (its scan for NaN and infinity skipped where ``values_checked``: the caller ran
        it on these tensors). Tensors are cast to the LoRA layers' dtype.

        Raises:
            InvalidRequest: :func:`check_adapter`'s (the adapter named before is unchanged).
        """
        targets_ = check_adapter(name, config, tensors, self._modules, self._max_rank, values=not values_checked)
        old = self._loaded.get(name)
        if old is not None and old.config == config:
            self._copy(self._keys[name], tensors)
        else:
            key = self._add(config, sorted(targets_))
            self._copy(key, tensors)
            if old is not None:
                self._delete(self._keys[name])
            self._keys[name] = key
        self._loaded[name] = LoadedAdapter(name, config, version)
        return self._loaded[name]

    @torch.no_grad()
    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A copy of adapter ``name``'s tensors under peft's names, float32 on the CPU (what a generator that lacks
        it is sent).

        Raises:
            KeyError: no adapter of that name is loaded.
        """
        key = self._keys[name]
        found = {}
        for module_name, layer in self._base.module.named_modules():
            for kind in ("lora_A", "lora_B"):
                table = getattr(layer, kind, None)
                if isinstance(table, torch.nn.ModuleDict) and key in table:
                    weight = table[key].weight
                    found[f"{PEFT_PREFIX}{module_name}.{kind}.weight"] = weight.detach().to("cpu", torch.float32).clone()
        return found

    def remove(self, name: str) -> bool:
        """Delete adapter ``name``; returns whether it was loaded (removing an absent one does nothing)."""
        if name not in self._loaded:
            return False
        del self._loaded[name]
        self._delete(self._keys.pop(name))
        return True

    def log_probs(
        self, name: str, chunks: Sequence[ForwardChunk], with_entropy: bool = False, with_reference: bool = True
    ) -> AdapterLogProbs:
        """The rows of one run through the base model with adapter ``name`` on (and, ``with_reference``, off),
        computed by :meth:`LogProbModel.action_log_probs` (same layouts and math as the base-model path).

        Shape:
            chunks: the rows of one run only (:func:`services.experience.workers.inputs.chunks`); returns
            :class:`AdapterLogProbs`, each (B, A) float32 on the CPU.

        Raises:
            InvalidRequest: ``adapter``: no adapter of that name is loaded.
        """
        if name not in self._loaded:
            raise InvalidRequest("adapter", f"no adapter named {name!r} is loaded here (loaded: "
                                 f"{sorted(self._loaded)})")
        reference = None
        with self._adapter_on(self._keys[name]):
            actor, entropy = self._base.action_log_probs(chunks, with_entropy)
            if with_reference:
                with self._peft.disable_adapter():
                    reference, _ = self._base.action_log_probs(chunks)
        return AdapterLogProbs(actor, entropy, reference)

    @contextlib.contextmanager
    def _adapter_on(self, key: str) -> Iterator[None]:
        self._peft.set_adapter(key, inference_mode=True)
        self._peft.base_model.enable_adapter_layers()
        try:
            yield
        finally:
            self._peft.base_model.disable_adapter_layers()

    def _add(self, config: AdapterConfig, modules: list[str]) -> str:
        """New LoRA layers for ``config`` on exactly ``modules`` (the checked ones), under a new peft name (B is
        zero until copied into); the module is left at rest (adapters off)."""
        from peft import LoraConfig, PeftModel

        self._next_key += 1
        key = f"adapter{self._next_key}"
        lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=modules,
                          use_rslora=config.use_rslora, lora_dropout=0.0, bias="none", inference_mode=True)
        if self._peft is None:
            self._peft = PeftModel(self._base.module, lora, adapter_name=key)
        else:
            self._peft.add_adapter(key, lora)
        self._peft.base_model.disable_adapter_layers()  # new LoRA layers start on
        return key

    @torch.no_grad()
    def _copy(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checked peft-named tensors into the LoRA layers of peft name ``key``, in place."""
        layer = self._base.module.get_submodule  # by path: not a walk of every module of the model per update
        for name, tensor in tensors.items():
            module, kind = name.removeprefix(PEFT_PREFIX).removesuffix(".weight").rsplit(".", 1)
            getattr(layer(module), kind)[key].weight.copy_(tensor)

    def _delete(self, key: str) -> None:
        """Delete peft's adapter ``key``; the last one unloads the LoRA layers (the module is the base again)."""
        if len(self._peft.peft_config) == 1:
            self._peft.base_model.unload()
            self._peft = None
            return
        if key in self._peft.active_adapters:  # step off it first, so peft need not pick another
            self._peft.set_adapter(next(k for k in self._peft.peft_config if k != key), inference_mode=True)
        self._peft.delete_adapter(key)
