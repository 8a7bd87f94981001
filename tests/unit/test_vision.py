"""Vision inputs of mixed text/image/video batches: order, per-row alignment, the placeholder repair (pure parts),
and the real processor agreeing with per-prompt processing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidRequest
from services.common.generation import CompletionRecord
from services.common.media import EncodedMedia, MediaLimits, decode_media
from services.experience.config import PromptSpec, PromptVision
from services.experience.workers.sequences import build_rollout
from services.experience.workers.vision import (
    VisionProcessor,
    VisionTokens,
    repair_placeholders,
    stack_rows,
)

settings.register_profile("fastexp-vision", deadline=None, max_examples=80, derandomize=True)
settings.load_profile("fastexp-vision")

IMAGE, VIDEO, PAD, TEXT = 900, 901, 0, 5
TOKENS = VisionTokens(image_token_id=IMAGE, video_token_id=VIDEO, merge_size=2)
D = 12  # patch feature width (Qwen2-VL's is 1176; any width works here)

# a prompt: (images, videos), each item a (t, h, w) grid with even h, w (merge 2)
grid = st.tuples(st.integers(1, 2), st.sampled_from([2, 4]), st.sampled_from([2, 4, 6]))
prompt_items = st.tuples(st.lists(grid, max_size=3), st.lists(grid, max_size=2))


def _prompt_vision(index: int, images: list, videos: list) -> PromptVision | None:
    """A prompt whose patch rows are filled with (prompt index, item index, patch index) so slices are traceable."""
    if not images and not videos:
        return None

    def patches(items, kind):
        rows = [
            torch.tensor([[index, kind * 100 + k, j] + [0] * (D - 3) for j in range(t * h * w)], dtype=torch.float32)
            for k, (t, h, w) in enumerate(items)
        ]
        return torch.cat(rows) if rows else None

    ids = [TEXT] + [IMAGE] * sum(t * h * w // 4 for t, h, w in images) + [VIDEO] * sum(t * h * w // 4 for t, h, w in videos)
    return PromptVision(
        token_ids=tuple(ids),
        pixel_values=patches(images, 1),
        image_grid_thw=torch.tensor(images, dtype=torch.int64).reshape(-1, 3),
        pixel_values_videos=patches(videos, 2),
        video_grid_thw=torch.tensor(videos, dtype=torch.int64).reshape(-1, 3),
    )


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@given(prompts=st.lists(prompt_items, min_size=1, max_size=5), n=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_rows_of_mixed_batches_keep_order_and_their_own_items_after_expansion(prompts, n, seed):
    """Expanding by n and merging text-only and multimodal prompts in any row order: every row's slice is its
    prompt's own processor output, and counts/grids/patches stay aligned (the seed's MultimodalDataProcessor)."""
    visions = [_prompt_vision(i, images, videos) for i, (images, videos) in enumerate(prompts)]
    specs = [PromptSpec(f"p{i}", (TEXT,), "", "", vision=v) for i, v in enumerate(visions)]
    order = torch.randperm(len(prompts) * n, generator=torch.Generator().manual_seed(seed)).tolist()
    completions = [
        CompletionRecord(r // n, r % n, specs[r // n].model_token_ids, (TEXT, TEXT), np.zeros(2, np.float32), "stop", "",
                         0)
        for r in order
    ]
    rollout = build_rollout(completions, specs, PAD, TOKENS)
    assert rollout.prompt_index == tuple(r // n for r in order)
    if all(v is None for v in visions):
        assert rollout.vision is None
        return
    vision = rollout.vision
    assert vision.image_count == tuple(len(prompts[r // n][0]) for r in order)
    assert vision.video_count == tuple(len(prompts[r // n][1]) for r in order)
    for row, r in enumerate(order):
        mine, want = vision.select(slice(row, row + 1)), visions[r // n]
        if want is None:
            assert mine.pixel_values is None and mine.pixel_values_videos is None
            assert mine.image_grid_thw.shape == (0, 3) and mine.video_grid_thw.shape == (0, 3)
            continue
        assert torch.equal(mine.image_grid_thw, want.image_grid_thw)
        assert torch.equal(mine.video_grid_thw, want.video_grid_thw)
        assert _equal(mine.pixel_values, want.pixel_values)
        assert _equal(mine.pixel_values_videos, want.pixel_values_videos)
    # a contiguous slice is the concatenation of its rows' slices
    half = len(order) // 2
    part, rows = vision.select(slice(0, half)), [vision.select(slice(i, i + 1)) for i in range(half)]
    assert part.image_count == tuple(c for r in rows for c in r.image_count)
    assert torch.equal(part.image_grid_thw, torch.cat([r.image_grid_thw for r in rows] or [part.image_grid_thw]))
    for name in ("pixel_values", "pixel_values_videos"):
        pieces = [getattr(r, name) for r in rows if getattr(r, name) is not None]
        assert _equal(getattr(part, name), torch.cat(pieces) if pieces else None)
    assert rollout.repaired_vision_tokens == 0 and rollout.vision_prompt_mismatches == 0


def test_sampled_placeholders_are_replaced_from_the_end_and_counted():
    vision = _prompt_vision(0, [(1, 2, 2)], [])  # one image: 4 patches, 1 placeholder
    spec = PromptSpec("p", (TEXT, IMAGE), "", "", vision=vision)
    sampled = (7, IMAGE, 8, IMAGE, VIDEO)  # the policy sampled two image and one video placeholder
    completion = CompletionRecord(0, 0, vision.token_ids, sampled, np.zeros(5, np.float32), "stop", "", 0)
    rollout = build_rollout([completion], [spec], PAD, TOKENS)
    assert rollout.sequences[0, -5:].tolist() == [7, PAD, 8, PAD, PAD]
    assert (rollout.sequences[0, :-5] == IMAGE).sum() == 1  # the prompt's own placeholder stays
    assert rollout.repaired_vision_tokens == 3
    assert rollout.action_mask.all()


def test_a_text_only_row_of_a_vision_policy_loses_sampled_placeholders_too():
    spec = PromptSpec("p", (TEXT,), "", "")
    completion = CompletionRecord(0, 0, (TEXT,), (IMAGE, 3), np.zeros(2, np.float32), "stop", "", 0)
    rollout = build_rollout([completion], [spec], PAD, TOKENS)
    assert rollout.sequences[0].tolist() == [TEXT, PAD, 3] and rollout.repaired_vision_tokens == 1
    # a text-only policy has no placeholders to repair
    assert build_rollout([completion], [spec], PAD).sequences[0].tolist() == [TEXT, IMAGE, 3]


def test_fewer_placeholders_than_patches_is_an_internal_error():
    vision = _prompt_vision(0, [(1, 2, 2)], [])
    with pytest.raises(ValueError, match="placeholders"):
        repair_placeholders(torch.tensor([[TEXT, TEXT]]), stack_rows([vision]), TOKENS, PAD)


def test_a_generator_prompt_that_differs_from_the_processor_is_replaced_and_counted():
    vision = _prompt_vision(0, [(1, 2, 2)], [])
    spec = PromptSpec("p", (TEXT, IMAGE), "", "", vision=vision)
    completion = CompletionRecord(0, 0, (TEXT, IMAGE, IMAGE), (3,), np.zeros(1, np.float32), "stop", "", 0)
    rollout = build_rollout([completion], [spec], PAD, TOKENS)
    assert rollout.sequences[0].tolist() == [*vision.token_ids, 3]
    assert rollout.vision_prompt_mismatches == 1


def test_the_real_processor_per_prompt_equals_one_batched_call(tiny_vlm_path):
    """Processing prompts one at a time (as the service does) gives what the seed's single batched processor call
    gives, sliced by each prompt's counts: same ids, grids and patches."""
    from tests.support.vlm import sample_photos, video_frames

    processor = VisionProcessor.load(tiny_vlm_path)
    photos = list(sample_photos().values())

    prompts = [
        ([photos[0]], []), ([], []), ([photos[1], photos[0]], [video_frames(photos[0], 3)]), ([], [video_frames(photos[1], 2)]),
    ]
    texts, singles, all_images, all_videos = [], [], [], []
    for images, videos in prompts:
        media = decode_media(EncodedMedia(tuple(images), tuple(tuple(f) for f in videos)), "p", MediaLimits())
        text = processor.render_chat([{"role": "user", "content": "hi"}], len(images), len(videos))
        texts.append(text)
        singles.append(processor.process(text, media) if not media.empty else None)
        all_images.extend(media.images)
        all_videos.extend(v.frames for v in media.videos)
    batched = processor._processor(text=texts, images=all_images, videos=all_videos, do_sample_frames=False,
                                   return_tensors="pt", padding=True)
    stacked = stack_rows(singles)
    assert torch.equal(stacked.image_grid_thw, batched["image_grid_thw"])
    assert torch.equal(stacked.video_grid_thw, batched["video_grid_thw"])
    assert torch.allclose(stacked.pixel_values, batched["pixel_values"].float())
    assert torch.allclose(stacked.pixel_values_videos, batched["pixel_values_videos"].float())
    for single, ids, mask in zip(singles, batched["input_ids"], batched["attention_mask"], strict=True):
        if single is not None:
            assert list(single.token_ids) == ids[mask.bool()].tolist()


def test_media_limits_name_the_field():

    limits = MediaLimits(max_images_per_prompt=1, max_videos_per_prompt=1, max_video_frames=2, max_image_pixels=10**6)
    cases = [
        (([b"x", b"y"], []), "p.images: 2 images; at most 1"),
        (([], [[], []]), "p.videos: 2 videos; at most 1"),
        (([], [[]]), "p.videos[0].frames: a video needs at least one frame"),
        (([], [[b"a", b"b", b"c"]]), "p.videos[0].frames: 3 frames; at most 2"),
    ]
    for (images, videos), message in cases:
        with pytest.raises(InvalidRequest) as caught:
            decode_media(EncodedMedia(tuple(images), tuple(tuple(f) for f in videos)), "p", limits)
        assert message in str(caught.value)
