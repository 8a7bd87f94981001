"""Vision-language prompts (Qwen2-VL family): the processor, per-row vision inputs, and the placeholder repair.

The seed's ``MultimodalDataProcessor`` splits a batch into text-only and multimodal prompts, runs the tokenizer
on the first and the model's processor on the second, expands both by ``n_samples_per_prompt`` and merges them
back in the original order, slicing ``image_grid_thw`` rows by each sample's image count. Here each prompt is
processed once, on its own, when the request is decoded (:meth:`VisionProcessor.process`), and a batch's rows
are assembled from their prompts (:func:`stack_rows`), so order and alignment hold by construction; the pure
functions below are what the property tests check.

Shapes: D = C * temporal_patch_size * patch_size**2 (Qwen2-VL: 3 * 2 * 14 * 14 = 1176); an item with grid
``(t, h, w)`` has ``t * h * w`` patch rows and ``t * h * w / merge_size**2`` placeholder tokens in the prompt.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastexp.types import VisionInputs
from services.common.media import DecodedMedia
from services.common.models import is_vision_language
from services.experience.config import PromptVision

logger = logging.getLogger(__name__)


def _empty_grid() -> torch.Tensor:
    return torch.zeros((0, 3), dtype=torch.int64)


def stack_rows(rows: Sequence[PromptVision | None]) -> VisionInputs | None:
    """Concatenate each row's vision inputs in row order (a text-only row is ``None`` and contributes 0 items).

    Returns None when no row has an image or a video.
    """
    if all(r is None or (r.image_count == 0 and r.video_count == 0) for r in rows):
        return None
    images = [r.pixel_values for r in rows if r is not None and r.pixel_values is not None]
    videos = [r.pixel_values_videos for r in rows if r is not None and r.pixel_values_videos is not None]
    return VisionInputs(
        pixel_values=torch.cat(images) if images else None,
        image_grid_thw=torch.cat([r.image_grid_thw for r in rows if r is not None] or [_empty_grid()]),
        image_count=tuple(0 if r is None else r.image_count for r in rows),
        pixel_values_videos=torch.cat(videos) if videos else None,
        video_grid_thw=torch.cat([r.video_grid_thw for r in rows if r is not None] or [_empty_grid()]),
        video_count=tuple(0 if r is None else r.video_count for r in rows),
    )


@dataclass(frozen=True)
class VisionTokens:
    """The policy's placeholder token ids and patch merge factor (from its config)."""

    image_token_id: int
    video_token_id: int
    merge_size: int  # spatial_merge_size: merge_size**2 patches become one placeholder token

    def placeholders(self, grid: torch.Tensor) -> int:
        """Placeholder tokens the items of ``grid`` (K, 3) occupy in a prompt."""
        return int(grid.prod(dim=1).sum()) // (self.merge_size**2) if grid.numel() else 0

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Qwen2-VL's modality of each token (0 text, 1 image, 2 video), as its processor returns it.

        Shape: input_ids (b, L) int64 -> (b, L) int32.
        """
        types = torch.zeros_like(input_ids, dtype=torch.int32)
        types[input_ids == self.image_token_id] = 1
        types[input_ids == self.video_token_id] = 2
        return types


def repair_placeholders(
    sequences: torch.Tensor, vision: VisionInputs | None, tokens: VisionTokens | None, pad_token_id: int
) -> tuple[torch.Tensor, int]:
    """Replace placeholder tokens beyond each row's patch count with ``pad_token_id`` (the seed's
    ``_fix_qwen_vl_image_tokens``, per row and for videos too), counting the tokens replaced.

    A policy can sample ``<|image_pad|>`` in a response; a forward pass would then look for image features that
    do not exist and fail. Extra placeholders are replaced from the end of the row (responses follow the prompt,
    whose placeholders the processor made to match). Rows are never shortened.

    Shape:
        sequences: (B, S) int64, left-padded prompts and right-padded responses; returns (a copy, count).

    Raises:
        ValueError: a row has *fewer* placeholders than its patches need (its prompt was not the processor's).
    """
    if tokens is None:
        return sequences, 0
    if vision is None:
        none = (0,) * sequences.shape[0]
        vision = VisionInputs(None, _empty_grid(), none, None, _empty_grid(), none)
    out, repaired = sequences.clone(), 0
    for token_id, grid, counts in (
        (tokens.image_token_id, vision.image_grid_thw, vision.image_count),
        (tokens.video_token_id, vision.video_grid_thw, vision.video_count),
    ):
        found = (out == token_id).sum(dim=1)
        if not bool(found.any()) and grid.numel() == 0:
            continue
        offsets = [0, *itertools.accumulate(counts)]
        for row in range(out.shape[0]):
            expected = tokens.placeholders(grid[offsets[row] : offsets[row + 1]])
            extra = int(found[row]) - expected
            if extra < 0:
                raise ValueError(f"row {row}: {int(found[row])} placeholders of token {token_id}, {expected} needed")
            if extra:
                positions = (out[row] == token_id).nonzero().flatten()[-extra:]
                out[row, positions] = pad_token_id
                repaired += extra
    return (out, repaired) if repaired else (sequences, 0)


# Qwen2-VL's chat template (the one its checkpoints ship): image/video content parts become
# <|vision_start|><|image_pad|><|vision_end|> (resp. <|video_pad|>), one each; the processor expands them.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class VisionProcessor:
    """The policy's transformers processor (tokenizer + image processor + video processor)."""

    def __init__(self, processor: Any, tokens: VisionTokens) -> None:
        self._processor = processor
        self.tokens = tokens
        tokenizer = processor.tokenizer
        self.image_placeholder = "<|vision_start|>" + tokenizer.convert_ids_to_tokens(tokens.image_token_id) + "<|vision_end|>"
        self.video_placeholder = "<|vision_start|>" + tokenizer.convert_ids_to_tokens(tokens.video_token_id) + "<|vision_end|>"

    @classmethod
    def load(cls, path: str) -> VisionProcessor | None:
        """The processor of the model folder ``path``, or None for a text-only model.

        Raises:
            OSError / ValueError: a vision-language folder without a loadable processor (from transformers).
        """
        if not is_vision_language(path):
            return None
        from transformers import AutoConfig, AutoProcessor

        config = AutoConfig.from_pretrained(path)
        tokens = VisionTokens(
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            merge_size=config.vision_config.spatial_merge_size,
        )
        return cls(AutoProcessor.from_pretrained(path), tokens)

    @property
    def tokenizer(self) -> Any:
        return self._processor.tokenizer

    def render_chat(self, messages: list[dict[str, str]], num_images: int, num_videos: int) -> str:
        """Render ``messages`` with the processor's chat template, the images then the videos placed as content
        parts before the text of the first user message (or a new user message when there is none)."""
        parts = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos
        rendered: list[dict[str, Any]] = [dict(m) for m in messages]
        if parts:
            target = next((m for m in rendered if m["role"] == "user"), None)
            if target is None:
                rendered.append({"role": "user", "content": parts})
            else:
                target["content"] = [*parts, {"type": "text", "text": target["content"]}]
        template = self._processor.chat_template or self.tokenizer.chat_template
        return self._processor.apply_chat_template(
            rendered, chat_template=template, add_generation_prompt=True, tokenize=False
        )

    def placeholder_counts(self, text: str) -> tuple[int, int]:
        """How many image and video placeholders ``text`` holds."""
        return text.count(self.image_placeholder), text.count(self.video_placeholder)

    def process(self, text: str, media: DecodedMedia) -> PromptVision:
        """Run the processor on one prompt: placeholders expanded, pixels patchified.

        Raises:
            ValueError: from the processor (e.g. placeholders and items disagree).
        """
        kwargs: dict[str, Any] = {}
        if media.images:
            kwargs["images"] = list(media.images)
        if media.videos:
            kwargs["videos"] = [v.frames for v in media.videos]
            kwargs["do_sample_frames"] = False  # the frames are the ones the caller sampled
        out = self._processor(text=[text], return_tensors="pt", **kwargs)
        return PromptVision(
            token_ids=tuple(out["input_ids"][0].tolist()),
            pixel_values=out["pixel_values"].float() if "pixel_values" in out else None,
            image_grid_thw=out["image_grid_thw"].long() if "image_grid_thw" in out else _empty_grid(),
            pixel_values_videos=out["pixel_values_videos"].float() if "pixel_values_videos" in out else None,
            video_grid_thw=out["video_grid_thw"].long() if "video_grid_thw" in out else _empty_grid(),
        )
