"""Writing a critic checkpoint that the experience service's value model reads (``critic_model``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_value_model(backbone: Any, value_head: torch.nn.Linear, path: str | Path, tokenizer: Any = None) -> Path:
    """Write a critic checkpoint that the experience service's ``ValueModel.load`` reads (safetensors, which
    transformers installs, is imported here).

    Args:
        backbone: an HF ``PreTrainedModel`` without LM head (``AutoModel``), or a causal LM whose backbone is used.
        value_head: ``Linear(H, 1)``; saved as ``value_head.weight`` (1, H) [and ``value_head.bias``].
        tokenizer: saved alongside when given.
    """
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    base = getattr(backbone, backbone.base_model_prefix, backbone) if hasattr(backbone, "lm_head") else backbone
    state = {f"{base.base_model_prefix}.{k}": v.detach().contiguous() for k, v in base.state_dict().items()}
    state.update({f"value_head.{k}": v.detach().float().contiguous() for k, v in value_head.state_dict().items()})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    base.config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
