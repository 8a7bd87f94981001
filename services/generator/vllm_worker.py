"""vLLM worker extension (``worker_extension_cls``): loads weight updates and LoRA adapters inside each worker
process.

vLLM mixes this class into its workers; the generator calls it through ``AsyncLLM.collective_rpc``, which the
engine core runs between scheduler steps.

Weight updates: the tensors are read lazily from the staging or checkpoint folder (shared by file system), one at a
time, and handed to vLLM's in-place ``reload_weights``, which maps checkpoint names onto vLLM's fused layers
(qkv_proj, gate_up_proj), skips a tied ``lm_head.weight``, and re-runs the kernels' post-load weight processing.

Adapters: vLLM 0.32 loads LoRA adapters from folders only (``WorkerLoRAManager._load_adapter`` reads
``adapter_config.json`` and ``adapter_model.safetensors``). Here the adapter's tensors arrive in the RPC (as raw
bytes with dtype and shape: vLLM's RPC encoder rebuilds tensors only where a type says so; from a caller in this
process, an inline engine's, as the tensors themselves), stay in this worker's memory, and the worker's LoRA manager
builds its ``LoRAModel`` from them (``LoRAModel.from_lora_tensors``,
what ``_load_adapter`` does after reading the files; verl's ``TensorLoRARequest`` does the same). No disk round
trip, and an adapter that vLLM's LRU cache (``max_cpu_loras``) evicted is rebuilt from the kept tensors when a
request needs it again instead of failing on a missing folder.
"""

from __future__ import annotations

from typing import Any


class WeightLoaderExtension:
    """Adds :meth:`fastexp_load_weights`, :meth:`fastexp_load_adapter`, :meth:`fastexp_remove_adapter` and
    :meth:`fastexp_cpu_threads` to vLLM's workers (reached as ``self`` of the worker)."""

    def fastexp_load_weights(self, kind: str, folder: str) -> int:
        """Load the update in ``folder`` (``kind``: "staged" or "checkpoint") into this worker's model.

        Returns:
            The number of tensors read.
        """
        from services.common.weights import update_entries

        entries = update_entries(kind, folder)
        # vLLM's in-place reload: restores the loaders that post-load processing (weight repacking for CPU/GPU
        # kernels) removed, loads checkpoint-format tensors, and processes them again.
        self.model_runner.reload_weights(  # type: ignore[attr-defined] - the vLLM worker's model runner
            weights_iterator=((entry.name, entry.load()) for entry in entries), is_checkpoint_format=True
        )
        return len(entries)

    def fastexp_load_adapter(self, name: str, slot_id: int, peft_fields: dict, tensors: dict[str, tuple]) -> int:
        """Keep an adapter's tensors as ``slot_id`` and load them into vLLM's LoRA cache (already checked by the
        engine: :func:`services.common.lora.check_adapter`).

        Args:
            name, slot_id: the adapter's name and its load's id (vLLM's ``lora_int_id``).
            peft_fields: ``LoraConfig`` fields (``r``, ``lora_alpha``, ``target_modules``, ...).
            tensors: peft name → (dtype, shape, raw bytes): :func:`services.generator.vllm_lora.packed`; or the
                tensors themselves from a caller in this process, kept as they are (the caller no longer changes
                them: :class:`services.generator.vllm_lora.WorkerAdapters`).

        Returns:
            The number of tensors kept. Raises what vLLM raises building the adapter (nothing is kept then).
        """
        from services.generator.vllm_lora import lora_request, unpacked

        kept = _kept_adapters(self)
        kept[slot_id] = (peft_fields, unpacked(tensors))
        try:
            self.model_runner.add_lora(lora_request(name, slot_id))  # type: ignore[attr-defined]
        except BaseException:
            kept.pop(slot_id, None)
            raise
        return len(tensors)

    def fastexp_setup_cpu(self) -> int:
        """Prepare a CPU worker at the generator's start: install fastexp's LoRA ops
        (:mod:`services.generator.vllm_cpu_lora`) before any request, so that base-model batches of an engine with
        LoRA enabled skip the adapters' work (vLLM's own ops gather and multiply zero adapters for every token:
        1.6x the time of an engine without LoRA here), and group each forward's rows by adapter once for all its
        layers (:class:`~services.generator.vllm_cpu_lora.SlotGroupedLinear`); returns the threads the model runs
        on."""
        from services.generator.vllm_cpu_lora import prepare_cpu_lora

        prepare_cpu_lora(self.model_runner)  # type: ignore[attr-defined]
        return self.fastexp_cpu_threads()

    def fastexp_cpu_threads(self, threads: int = 0) -> int:
        """Set the threads this worker's model runs on from its next step (``threads`` >= 1), or leave them (0);
        returns the threads now. On CPU vLLM binds one OpenMP thread per core at start and replaces
        ``torch.set_num_threads`` with a no-op; torch's own binding still sets the OpenMP team size, and the bound
        threads stay on their cores (a smaller team uses the first ones)."""
        import torch

        if threads:
            torch._C.set_num_threads(threads)
        return torch.get_num_threads()

    def fastexp_remove_adapter(self, slot_id: int) -> None:
        """Forget the adapter load ``slot_id`` (a superseded or unloaded version no request runs on any more)."""
        _kept_adapters(self).pop(slot_id, None)
        self.model_runner.remove_lora(slot_id)  # type: ignore[attr-defined]


def _kept_adapters(worker: Any) -> dict[int, tuple[dict, dict]]:
    """The worker's kept adapters (slot id → peft fields, tensors); on first use, its LoRA manager's loader is
    replaced by one that builds kept adapters from memory (others still load from their folder), and on CPU the
    LoRA ops are replaced first (:mod:`services.generator.vllm_cpu_lora`)."""
    kept = getattr(worker, "_fastexp_adapters", None)
    if kept is None:
        from services.generator.vllm_cpu_lora import prepare_cpu_lora

        prepare_cpu_lora(worker.model_runner)
        kept = worker._fastexp_adapters = {}
        manager = worker.model_runner.lora_manager
        from_folder = manager._load_adapter

        def load_adapter(request: Any) -> Any:
            if request.lora_int_id not in kept:
                return from_folder(request)
            peft_fields, tensors = kept[request.lora_int_id]
            return _lora_model(manager, request.lora_int_id, peft_fields, tensors)

        manager._load_adapter = load_adapter
    return kept


def _lora_model(manager: Any, slot_id: int, peft_fields: dict, tensors: dict) -> Any:
    """vLLM's ``LoRAModel`` from tensors, as ``WorkerLoRAManager._load_adapter`` builds it from files."""
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict({**peft_fields, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    # vLLM folds a module's scaling into its lora_B in place where the scaling is not 1 (LoRALayerWeights.optimize;
    # lora_B may be the kept tensor itself, converted to no other dtype), and the kept tensors must stay as sent for
    # the next rebuild: copies then. With a scaling of 1 everywhere nothing is written to them.
    folded = helper.vllm_lora_scaling_factor != 1 or helper.rank_pattern or helper.alpha_pattern
    return manager._lora_model_cls.from_lora_tensors(
        lora_model_id=slot_id, tensors={k: v.clone() for k, v in tensors.items()} if folded else dict(tensors),
        peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )

