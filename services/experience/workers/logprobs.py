"""Actor / reference log-probs (and entropy) of response tokens by a real forward pass of an HF causal LM."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch

from services.common.models import is_vision_language
from services.experience.workers.attention import use_span_attention
from services.experience.workers.inputs import ForwardChunk
from services.experience.workers.vision import VisionTokens

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Positions whose logits are reduced in float32 at a time on an accelerator: the model's logits (K, V) in its own
#: dtype are read in slices of this many rows instead of one float32 copy of all of them (few kernel launches).
REDUCTION_POSITIONS = 256
#: Bytes of float32 logits reduced at a time on a CPU. The reduction reads each slice five times (the float32 copy,
#: max, exp, sum, gather), so a slice that stays in the cores' L2 caches is read from them, not from memory: on a
#: 2-core Xeon with 2 MiB of L2 per core, 1,024 positions of a 49,152-token vocabulary took 176 ms in slices of 256
#: positions (50 MB) and 45-55 ms in slices of 8-24 (`benchmarks/README.md`, 2026-11-27).
CPU_REDUCTION_BYTES = 4 * 1024**2


def reduction_positions(rows: int, vocab_size: int, device: torch.device) -> int:
    """Positions per row in one float32 reduction slice of logits ``(rows, K, vocab_size)``: a slice of
    :data:`CPU_REDUCTION_BYTES` on a CPU (at least one position), :data:`REDUCTION_POSITIONS` on an accelerator.
    Any slicing gives the same numbers: each position's reduction is its own."""
    if device.type == "cpu":
        return max(1, CPU_REDUCTION_BYTES // (4 * vocab_size * max(rows, 1)))
    return REDUCTION_POSITIONS


class LogProbModel:
    """A frozen causal LM that scores response tokens (the actor replica or the reference model)."""

    def __init__(self, model: Any, vision_tokens: VisionTokens | None = None, span_attention: bool = True) -> None:
        """``span_attention``: a text model on SDPA on the CPU attends span by span in packed chunks
        (:mod:`services.experience.workers.attention`, measured there); False keeps its attention under the (T, T)
        mask (the benchmarks' baseline). Vision rows are always padded: nothing to gain there. On GPUs the
        per-span calls are unmeasured against SDPA's masked kernels, so models there keep the mask."""
        self._model = model
        self.vision_tokens = vision_tokens
        self._accepts = frozenset(inspect.signature(model.forward).parameters)
        self._span_attention = (span_attention and vision_tokens is None and model.device.type == "cpu"
                                and use_span_attention(model))

    @classmethod
    def load(cls, path: str, *, dtype: str, device: str, device_map: str | None = None) -> LogProbModel:
        """Load ``path`` in eval mode on ``device`` (``dtype``: a key of ``DTYPES``): ``AutoModelForCausalLM``, or
        ``AutoModelForImageTextToText`` for a vision-language model (a config with ``vision_config``).
        ``device_map`` (``"auto"``, ``"balanced"``, ...: accelerate's) spreads its layers over every visible GPU
        instead (a model larger than one GPU); inputs then go to the device of its first layers.

        Raises:
            OSError: ``path`` is not a loadable model folder (from transformers).
            KeyError: unknown ``dtype`` (settings validate it first).
        """
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        vision = is_vision_language(path)
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        if device_map:
            model = auto.from_pretrained(path, dtype=DTYPES[dtype], device_map=device_map).eval()
        else:
            model = auto.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
        tokens = None
        if vision:
            config = model.config
            tokens = VisionTokens(config.image_token_id, config.video_token_id, config.vision_config.spatial_merge_size)
        placed = f"device_map {device_map}" if device_map else device
        logger.info("loaded %s (%s, %s%s)", path, dtype, placed, ", vision-language" if vision else "")
        return cls(model, tokens)

    @property
    def module(self) -> torch.nn.Module:
        """The network (for offloading; forwards go through :meth:`action_log_probs`)."""
        return self._model

    def _inputs(self, chunk: ForwardChunk, device: torch.device) -> dict[str, Any]:
        """The forward's keyword arguments for ``chunk``: with vision inputs, only those the model accepts, and no
        position ids (the model derives its M-RoPE positions from the ids, grids and attention mask)."""
        inputs: dict[str, Any] = {
            "input_ids": chunk.input_ids.to(device),
            **chunk.attention_inputs(self._model.dtype, device, self._span_attention),
            "position_ids": chunk.position_ids.to(device),
            "logits_to_keep": chunk.hidden_index.to(device),
            "use_cache": False,
        }
        vision = chunk.vision
        if vision is None:
            return inputs
        if self.vision_tokens is None:
            raise ValueError("rows with images or videos reached a text-only model")
        inputs["position_ids"] = None
        extra = {
            "pixel_values": vision.pixel_values,
            "image_grid_thw": vision.image_grid_thw if vision.pixel_values is not None else None,
            "pixel_values_videos": vision.pixel_values_videos,
            "video_grid_thw": vision.video_grid_thw if vision.pixel_values_videos is not None else None,
            "mm_token_type_ids": self.vision_tokens.mm_token_type_ids(chunk.input_ids),
        }
        for name, value in extra.items():
            if value is not None and name in self._accepts:
                inputs[name] = value.to(device, self._model.dtype) if value.is_floating_point() else value.to(device)
        return inputs

    def tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors under their checkpoint names (``model.layers.0...``, ``lm_head.weight``); with LoRA
        layers injected (:class:`~services.experience.workers.adapters.AdapterForwards`), the base's only, under the
        names they had before (peft keeps the wrapped layer as ``<module>.base_layer``)."""
        return {name.replace(".base_layer.", "."): tensor for name, tensor in self._model.state_dict(keep_vars=True).items()
                if ".lora_" not in name}

    @torch.inference_mode()
    def action_log_probs(
        self, chunks: Sequence[ForwardChunk], with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (nats, temperature 1) of each response token given everything before it, and optionally the
        entropy (nats) of the model's next-token distribution at each response position.

        Only the positions that predict response tokens go through the LM head (``logits_to_keep`` with the
        chunk's ``hidden_index``); ``log p = logit[token] - logsumexp(logits)`` and
        ``H = logsumexp(logits) - sum_v softmax(logits)_v * logits_v`` are computed in float32, one slice of
        :func:`reduction_positions` positions at a time (the same numbers as all at once: each position's reduction
        is its own).

        Shape:
            chunks: the rows of one Rollout, in order (:func:`services.experience.workers.inputs.chunks`).
            returns ``(log_probs (B, A), entropy (B, A) or None)`` float32 on the CPU. Positions past a row's
            response are computed on padding (padded layout) or are 0 (packed) and must be masked by
            ``action_mask``.
        """
        device = self._model.device
        log_probs, entropies = [], []
        for chunk in chunks:
            logits = self._model(**self._inputs(chunk, device)).logits  # (b, K, V), the model's dtype
            targets = chunk.targets.to(logits.device)  # device_map: the last GPU's
            step = reduction_positions(logits.shape[0], logits.shape[-1], logits.device)
            parts = [_reduce(logits[:, s : s + step], targets[:, s : s + step], with_entropy)
                     for s in range(0, max(logits.shape[1], 1), step)]
            log_probs.append(chunk.to_rows(torch.cat([part[0] for part in parts], dim=1).cpu()))
            if with_entropy:
                entropies.append(chunk.to_rows(torch.cat([part[1] for part in parts], dim=1).cpu()))
        return torch.cat(log_probs), torch.cat(entropies) if with_entropy else None


def _reduce(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and the entropy (nats) of one slice of logits, in float32.

    Shape:
        logits: (b, k, V) any float dtype; targets: (b, k). Returns ``(log_probs (b, k), entropy (b, k) or None)``.
    """
    logits = logits.float()
    normalizer = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen - normalizer, None
    expected_logit = (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return chosen - normalizer, normalizer - expected_logit
