"""vLLM worker extension (``worker_extension_cls``): loads a weight update inside each worker process.

vLLM mixes this class into its workers; the generator calls it through ``AsyncLLM.collective_rpc`` while the
scheduler is paused, so the update lands between engine steps. The tensors are read lazily from the staging or
checkpoint folder (shared by file system), one at a time, and handed to vLLM's in-place ``reload_weights``, which
maps checkpoint names onto vLLM's fused layers (qkv_proj, gate_up_proj), skips a tied ``lm_head.weight``, and
re-runs the kernels' post-load weight processing.
"""

from __future__ import annotations


class WeightLoaderExtension:
    """Adds :meth:`fastexp_load_weights` to vLLM's workers (reached as ``self`` of the worker)."""

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
