"""A trainer's peft LoRA adapter as a fastexp LoRA run: the run's spec read from the adapter's ``LoraConfig``, the
run found or created, and the adapter's tensors under the names ``update_weights(run_id=...)`` takes.

A LoRA run (docs/trainer/runs.md) samples and forwards the deployment's base model with the run's own adapter;
its trainer sends the whole adapter (peft's ``get_peft_model_state_dict``) before the run's first stream and after
each optimizer step, and every row carries the run's own adapter version (1 after the first upload).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from fastexp.client import ExperienceClient
from fastexp.errors import AlreadyExists, NotFound
from fastexp.runs import LoraSpec, Run

#: The adapter GRPOTrainer(peft_config=...) and ``get_peft_model`` create: peft's default name.
ADAPTER_NAME = "default"
#: LoraConfig fields a LoRA run cannot express (the service adapts every layer of each target module with
#: ``B @ A * alpha / r`` and takes no other tensors): the value each must keep, and those that must be empty.
_KEPT = {"use_rslora": False, "use_dora": False, "bias": "none"}
_EMPTY = ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern", "exclude_modules",
          "target_parameters")


def lora_config(model: Any) -> Any:
    """The ``peft.LoraConfig`` of ``model``'s adapter ``"default"``.

    ``model``: a ``peft.PeftModel`` (what ``GRPOTrainer(peft_config=...)`` trains, unwrapped from the accelerator).

    Raises:
        ValueError: ``model`` is not a PeftModel, or has no LoRA adapter named ``"default"``.
    """
    from peft import LoraConfig, PeftModel

    if not isinstance(model, PeftModel):
        raise ValueError(f"run_id needs a peft LoRA model (GRPOTrainer(peft_config=LoraConfig(...)) or "
                         f"get_peft_model); got {type(model).__name__}")
    config = model.peft_config.get(ADAPTER_NAME)
    if not isinstance(config, LoraConfig):
        raise ValueError(f"run_id needs a LoRA adapter named {ADAPTER_NAME!r}; this PeftModel has "
                         f"{ {name: type(c).__name__ for name, c in model.peft_config.items()} }")
    return config


def run_spec(config: Any) -> LoraSpec:
    """The LoRA run a ``peft.LoraConfig`` trains: rank ``r``, alpha ``lora_alpha``, ``target_modules`` as a sorted
    tuple of module-name suffixes (peft keeps them as a set; the service takes suffixes such as ``"q_proj"``).

    Raises:
        ValueError: ``target_modules`` a regex string, ``"all-linear"`` or empty; or a field a LoRA run cannot
            express (rsLoRA, DoRA, a bias, ``modules_to_save``, per-layer or per-module ranks), naming it.
    """
    modules = config.target_modules
    if modules is None or isinstance(modules, str) or not modules:
        raise ValueError(f"target_modules: a LoRA run takes a list of module names (e.g. ['q_proj', 'v_proj']); "
                         f"got {modules!r}")
    wrong = [f"{name}={getattr(config, name)!r}" for name, kept in _KEPT.items() if getattr(config, name, kept) != kept]
    wrong += [f"{name}={getattr(config, name)!r}" for name in _EMPTY if getattr(config, name, None)]
    if wrong:
        raise ValueError(f"a LoRA run cannot train this LoraConfig: {', '.join(wrong)} (keep peft's defaults: "
                         f"{', '.join(f'{n}={v!r}' for n, v in _KEPT.items())}, {', '.join(_EMPTY)} unset)")
    return LoraSpec(rank=int(config.r), alpha=float(config.lora_alpha), target_modules=tuple(sorted(modules)))


def adapter_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter ``"default"`` of a peft LoRA ``model`` as ``update_weights(run_id=...)`` takes it: peft's
    ``get_peft_model_state_dict`` names and tensors (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
    (r, in_features), ``...lora_B.weight`` (out_features, r)), every target module, detached, in the trainer's
    dtype (the services cast them); embeddings are never included.

    Raises:
        ValueError: as :func:`lora_config`.
    """
    from peft import get_peft_model_state_dict

    lora_config(model)
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME, save_embedding_layers=False)
    for name, tensor in state.items():
        yield name, tensor.detach()


def ensure_run(client: ExperienceClient, run_id: str, spec: LoraSpec) -> Run:
    """The LoRA run ``run_id`` with adapter ``spec``: the client's token's run of that id, created if there is none
    (a run created meanwhile by this token, ALREADY_EXISTS, is taken as found).

    Raises:
        ValueError: the run exists as a base-model run, or with another rank, alpha or target modules.
        fastexp.errors.PermissionDenied: the run is another token's.
        fastexp.errors.InvalidRequest: the service refused ``spec`` (a rank over its ``max_lora_rank``, a module it
            does not allow; the field named).
        fastexp.errors.FailedPrecondition: the deployment serves no adapters of that rank.
    """
    try:
        run = client.get_run(run_id)
    except NotFound:
        try:
            return client.create_run(run_id, lora_rank=spec.rank, lora_alpha=spec.alpha,
                                     target_modules=list(spec.target_modules))
        except AlreadyExists:
            run = client.get_run(run_id)
    lora = run.lora
    # alpha travels as a 32-bit float: 12.8 comes back as 12.800000190734863
    if lora is None or lora.rank != spec.rank or not math.isclose(lora.alpha, spec.alpha, rel_tol=1e-6) or set(
            lora.target_modules) != set(spec.target_modules):
        raise ValueError(f"run {run_id!r} exists with adapter {lora} (None: the base model); this trainer's "
                         f"adapter is {spec}: use another run_id, or delete the run first")
    return run
