"""The critic: a causal-LM backbone with a scalar value head, loaded from (and saved to) a checkpoint folder.

Checkpoint format (OpenRLHF's critic layout, so a critic the trainer saves loads here unchanged):

- ``config.json`` of the backbone's architecture (any ``AutoModel`` architecture);
- ``*.safetensors`` holding the backbone's weights, with or without the causal LM's ``base_model_prefix``
  (``model.layers.0...`` or ``layers.0...``; an ``lm_head`` is ignored), and the value head as
  ``value_head.weight`` (1, H) [+ ``value_head.bias`` (1,)] or, OpenRLHF's newer default prefix,
  ``score.weight`` [+ ``score.bias``].

:func:`save_value_model` writes that format (the trainer SDK re-exports it), and ``fastexp init-critic`` makes a
first critic from a policy or reward model with a zero value head.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastexp.critic import save_value_model
from services.experience.workers.attention import use_span_attention
from services.experience.workers.inputs import ForwardChunk
from services.experience.workers.logprobs import DTYPES

logger = logging.getLogger(__name__)

VALUE_HEAD_PREFIXES = ("value_head", "score")


def _read_value_head(path: Path) -> dict[str, torch.Tensor]:
    """Only the value head's tensors (``weight``, optional ``bias``) from the folder's safetensors files.

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``path``.
        ValueError: no value head under any of ``VALUE_HEAD_PREFIXES``.
    """
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for prefix in VALUE_HEAD_PREFIXES:
        head: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as tensors:
                for key in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if key.startswith(f"{prefix}."):
                        head[key.removeprefix(f"{prefix}.")] = tensors.get_tensor(key)
        if "weight" in head:
            return head
    raise ValueError(
        f"{path} has no value head ({' or '.join(p + '.weight' for p in VALUE_HEAD_PREFIXES)}); "
        "make one with `fastexp init-critic` or save the trainer's critic with save_value_model"
    )


class ValueModel:
    """Backbone + linear value head; ``values`` are read at the positions that predict each response token.

    ``values[i, j]`` is the critic's V(prompt + response[:j]) — the state before action j — as OpenRLHF's critic
    (hidden state of the token preceding action j).
    """

    def __init__(self, backbone: Any, value_head: torch.nn.Linear) -> None:
        self._backbone = backbone
        self._value_head = value_head
        # packed chunks attend span by span on SDPA, on the CPU (as LogProbModel)
        self._span_attention = backbone.device.type == "cpu" and use_span_attention(backbone)

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        """The backbone and the value head (for offloading)."""
        return {"critic": self._backbone, "critic_value_head": self._value_head}

    @classmethod
    def load(cls, path: str, *, dtype: str, device: str, device_map: str | None = None) -> ValueModel:
        """Load a critic checkpoint folder (format in the module docstring) on ``device``, or with its backbone's
        layers spread by ``device_map`` (accelerate's; the value head then sits on ``device``).

        Raises:
            FileNotFoundError: no safetensors in ``path``.
            OSError: no loadable ``config.json`` (from transformers).
            ValueError: no value head in the checkpoint, or backbone weights missing for its config.
        """
        from transformers import AutoModel

        folder = Path(path)
        head_state = _read_value_head(folder)
        # from_pretrained strips the causal LM's prefix, reads shards, and leaves lm_head/value-head keys unused
        placement = {"device_map": device_map} if device_map else {}
        backbone, info = AutoModel.from_pretrained(
            folder, dtype=DTYPES[dtype], output_loading_info=True, **placement
        )
        if info["missing_keys"]:
            raise ValueError(
                f"{path}: backbone weights missing for {backbone.config.model_type}: {sorted(info['missing_keys'])[:5]}"
            )
        weight = head_state["weight"]
        head = torch.nn.Linear(weight.shape[1], 1, bias="bias" in head_state, dtype=torch.float32)
        head.load_state_dict({k: v.float().reshape(getattr(head, k).shape) for k, v in head_state.items()})
        logger.info("loaded critic %s (%s, %s)", path, dtype, device)
        if not device_map:
            backbone = backbone.to(device)
        return cls(backbone.eval(), head.to(device).eval())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors under their checkpoint names (``model.layers.0...``, ``value_head.weight``), the names
        a critic update uses (:func:`save_value_model` writes them)."""
        prefix = self._backbone.base_model_prefix
        named = {f"{prefix}.{k}": v for k, v in self._backbone.state_dict(keep_vars=True).items()}
        named.update({f"value_head.{k}": v for k, v in self._value_head.state_dict(keep_vars=True).items()})
        return named

    @torch.inference_mode()
    def values(self, chunks: Sequence[ForwardChunk]) -> torch.Tensor:
        """Critic values for the response positions of one Rollout, (B, A) float32 on the CPU (head in float32).

        Positions past a row's response are computed on padding (padded layout) or are 0 (packed); mask them.
        """
        device = self._backbone.device  # its first layers' (with a device_map, the last may sit elsewhere)
        head_device = next(self._value_head.parameters()).device
        out = []
        for chunk in chunks:
            last = self._backbone(
                input_ids=chunk.input_ids.to(device),
                **chunk.attention_inputs(self._backbone.dtype, device, self._span_attention),
                position_ids=chunk.position_ids.to(device),
                use_cache=False,
            ).last_hidden_state
            hidden = last[:, chunk.hidden_index.to(last.device)].to(head_device)
            out.append(chunk.to_rows(self._value_head(hidden.float()).squeeze(-1).cpu()))
        return torch.cat(out)


def init_critic(model_path: str, out: str | Path, dtype: str = "bfloat16") -> Path:
    """A first critic from a causal LM or reward-model folder: its backbone and a zero value head (V = 0).

    Raises:
        OSError: ``model_path`` is not a loadable HF model folder.
    """
    from transformers import AutoModel, AutoTokenizer

    backbone = AutoModel.from_pretrained(model_path, dtype=DTYPES[dtype])
    head = torch.nn.Linear(backbone.config.hidden_size, 1, bias=False)
    torch.nn.init.zeros_(head.weight)
    return save_value_model(backbone, head, out, AutoTokenizer.from_pretrained(model_path))
