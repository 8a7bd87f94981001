"""Images and videos end to end with the HF backend: the three services in process on a small Qwen2-VL.

The remote reward endpoint is a real HTTP server that decodes what it receives; the experience's vision tensors
are checked against the processor run by hand, and the actor's log-probs are recomputed from the batch alone.
"""

from __future__ import annotations

import base64
import io

import grpc
import pytest
import torch
from fastapi import FastAPI
from PIL import Image

from fastexp import Sampling, build_request, invalid_prompt_indices
from fastexp.v1 import experience_pb2_grpc
from fastexp.wire import experience_from_pb
from services.common.media import MediaLimits, decode_media
from services.common.media_wire import media_from_pb
from services.experience.server import start_experience
from services.experience.settings import ExperienceSettings
from services.experience.workers.vision import VisionProcessor
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings
from tests.support.http_servers import serving
from tests.support.vlm import sample_photos, video_frames

PHOTOS = sample_photos()
JPEG, PNG = PHOTOS["grace_hopper.jpg"], PHOTOS["Minduka_Present_Blue_Pack.png"]


MAX_REQUEST_PIXELS = 8_000_000  # 22 images of 600 x 600: above every other test's request


@pytest.fixture(scope="module")
def reward_server():
    """An OpenRLHF-style reward endpoint that decodes each base64 image and records what it got."""
    app = FastAPI()
    received: list[dict] = []

    @app.post("/get_reward")
    async def get_reward(body: dict) -> dict:
        received.append(body)
        images = body.get("images") or [[] for _ in body["query"]]
        sizes = [[Image.open(io.BytesIO(base64.b64decode(b))).size for b in per_query] for per_query in images]
        return {"rewards": [float(len(s)) for s in sizes], "extra_logs": {"images": [len(s) for s in sizes]}}

    with serving(app) as url:
        yield url + "/get_reward", received


@pytest.fixture(scope="module")
async def stack(tiny_vlm_path, reward_server):
    url, _ = reward_server
    engine = HFEngine.start(tiny_vlm_path, dtype="float32", max_model_len=1024, max_batch_size=4)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=1024), engine)
    scorer_settings = ScorerSettings(port=0, sources=[{"type": "remote", "name": "vlm_rm", "url": url, "timeout_s": 30}])
    scorer_core = build_scorer(scorer_settings)
    scorer = await start_scorer(scorer_settings, scorer_core)
    experience = await start_experience(
        ExperienceSettings(
            port=0, generator_address=f"127.0.0.1:{generator.port}", scorer_address=f"127.0.0.1:{scorer.port}",
            actor_model=tiny_vlm_path, reference_model=tiny_vlm_path, dtype="float32", forward_micro_batch_size=3,
            max_images_per_prompt=3, max_image_pixels=600 * 600, max_request_pixels=MAX_REQUEST_PIXELS,
        )
    )
    await experience.wait_ready(60)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{experience.running.port}")
    yield experience_pb2_grpc.ExperienceServiceStub(channel)
    await channel.close()
    await experience.running.stop(1)
    await experience.close()
    await scorer.stop(1)
    await scorer_core.close()
    await generator.stop(1)
    await engine.close()


PROMPTS = [
    [{"role": "user", "content": "Describe the picture."}],
    "Plain text prompt, no image.",
    [{"role": "user", "content": "Compare the two pictures, then the clip."}],
    [{"role": "user", "content": "Count to three."}],
]
IMAGES = [[JPEG], [], [PNG, JPEG], []]
VIDEOS = [[], [], [video_frames(JPEG, 4)], []]


async def test_mixed_text_image_video_request_streams_aligned_experiences(stack, reward_server, tiny_vlm_path):
    _, received = reward_server
    received.clear()
    n = 2
    request = build_request(PROMPTS, images=IMAGES, videos=VIDEOS, n_samples_per_prompt=n, micro_rollout_batch_size=4,
                            sampling=Sampling(max_new_tokens=5, seed=1))
    batches = [experience_from_pb(m) async for m in stack.MakeExperiences(request, timeout=600)]
    rows = sorted((p, s) for e in batches for p, s in zip(e.prompt_index, e.sample_index, strict=True))
    assert rows == [(p, s) for p in range(4) for s in range(n)]

    processor = VisionProcessor.load(tiny_vlm_path)
    for e in batches:
        if all(len(IMAGES[p]) + len(VIDEOS[p]) == 0 for p in e.prompt_index):
            assert e.vision is None
            continue
        vision = e.vision
        assert vision.image_count == tuple(len(IMAGES[p]) for p in e.prompt_index)
        assert vision.video_count == tuple(len(VIDEOS[p]) for p in e.prompt_index)
        for row, p in enumerate(e.prompt_index):
            mine = vision.select(slice(row, row + 1))
            item = request.prompts[p]
            if not item.images and not item.videos:
                assert mine.pixel_values is None and mine.pixel_values_videos is None
                continue
            text = processor.render_chat(
                [{"role": m.role, "content": m.content} for m in item.chat.messages], len(item.images), len(item.videos)
            )
            expected = processor.process(text, decode_media(media_from_pb(item.images, item.videos), "p", MediaLimits()))
            assert torch.equal(mine.image_grid_thw, expected.image_grid_thw)
            assert torch.equal(mine.video_grid_thw, expected.video_grid_thw)
            for got, want in ((mine.pixel_values, expected.pixel_values),
                              (mine.pixel_values_videos, expected.pixel_values_videos)):
                assert (got is None and want is None) or torch.equal(got, want)
            # the row's prompt is the processor's: placeholders expanded to its patches
            real = e.sequences[row][e.attention_mask[row].bool()]
            assert real[: len(expected.token_ids)].tolist() == list(expected.token_ids)
        # the trainer recomputes the actor's log-probs from the batch alone
        _assert_log_probs_reproduce(e, tiny_vlm_path)

    # the remote reward model got one base64 string per image of each query's prompt, decodable, in order
    seen = {}
    for body in received:
        for prompt, images in zip(body["prompts"], body.get("images") or [[]] * len(body["prompts"]), strict=True):
            seen[prompt] = [base64.b64decode(b) for b in images]
    by_words = {words: images for prompt, images in seen.items() for words in ("Describe", "Compare", "Plain", "Count")
                if words in prompt}
    assert by_words == {"Describe": [JPEG], "Compare": [PNG, JPEG], "Plain": [], "Count": []}
    for e in batches:
        for row, p in enumerate(e.prompt_index):
            assert e.reward[row].item() == float(len(IMAGES[p]))


def _assert_log_probs_reproduce(e, path):
    from transformers import AutoModelForImageTextToText

    from services.experience.workers.vision import VisionTokens

    model = _MODELS.get(path) or _MODELS.setdefault(path, AutoModelForImageTextToText.from_pretrained(path).eval())
    tokens = VisionTokens(model.config.image_token_id, model.config.video_token_id, 2)
    v = e.vision
    with torch.inference_mode():
        logits = model(
            input_ids=e.sequences, attention_mask=e.attention_mask, pixel_values=v.pixel_values,
            image_grid_thw=v.image_grid_thw if v.pixel_values is not None else None,
            pixel_values_videos=v.pixel_values_videos,
            video_grid_thw=v.video_grid_thw if v.pixel_values_videos is not None else None,
            mm_token_type_ids=tokens.mm_token_type_ids(e.sequences),
        ).logits.float()
    a = e.action_mask.shape[1]
    log_probs = torch.log_softmax(logits[:, -a - 1 : -1], dim=-1).gather(-1, e.sequences[:, -a:, None])[..., 0]
    assert torch.allclose(log_probs * e.action_mask, e.action_log_probs, atol=1e-4)


_MODELS: dict = {}


async def _refused(stack, request) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [m async for m in stack.MakeExperiences(request, timeout=60)]
    return caught.value


@pytest.mark.parametrize(
    ("images", "message", "invalid"),
    [
        ([[b"not an image at all"], [JPEG]], "prompts[0].images[0]: not a decodable image", [0]),
        ([[JPEG], [JPEG[: len(JPEG) // 3]]], "prompts[1].images[0]: not a decodable image", [1]),
        ([[JPEG], [PNG, PNG, PNG, PNG]], "prompts[1].images: 4 images; at most 3 per prompt", [1]),
        ([[b""], [b"GIF89a"]], "prompts[0].images[0]: empty image bytes; prompts[1].images[0]", [0, 1]),
    ],
)
async def test_bad_images_are_invalid_argument_naming_every_bad_prompt(stack, images, message, invalid):
    chats = [[{"role": "user", "content": "x"}], [{"role": "user", "content": "y"}]]
    error = await _refused(stack, build_request(chats, images=images, n_samples_per_prompt=2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    assert invalid_prompt_indices(error) == invalid


async def test_oversized_image_beyond_the_pixel_budget_is_refused_unread(stack):
    big = io.BytesIO()
    Image.new("RGB", (800, 700)).save(big, format="PNG")
    error = await _refused(stack, build_request(
        ["first", [{"role": "user", "content": "y"}]], images=[[], [big.getvalue()]], n_samples_per_prompt=2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts[1].images[0]: 800x700 = 560000 pixels exceeds the budget of 360000" in error.details()
    assert invalid_prompt_indices(error) == [1]


async def test_text_prompt_placeholders_must_match_its_images(stack):
    error = await _refused(stack, build_request(["no placeholder here"], images=[[JPEG]], n_samples_per_prompt=2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts[0].text: holds 0 image and 0 video placeholders" in error.details()


async def test_a_video_file_is_sampled_to_frames_and_reaches_the_models(stack, tmp_path):
    """A trainer passes an mp4 path: the SDK decodes it (PyAV) and samples it by its VideoSampling; the models get
    exactly the patches of those frames (the same batch as sending the sampled frames by hand)."""
    from fastexp import VideoSampling
    from fastexp import video_frames as sample_video
    from tests.support.videos import write_video

    path = tmp_path / "clip.mp4"
    write_video(path, frames=12, fps=6, size=(56, 56))  # 2 s
    sampling = VideoSampling(fps=2.0, max_frames=4)
    prompt = [[{"role": "user", "content": "What changes in the clip?"}]]
    common = dict(n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=4, temperature=0.0))
    from_file = [experience_from_pb(m) async for m in stack.MakeExperiences(
        build_request(prompt, videos=[[str(path)]], video_sampling=sampling, **common), timeout=300)]
    by_hand = [experience_from_pb(m) async for m in stack.MakeExperiences(
        build_request(prompt, videos=[[sample_video(path, sampling)]], **common), timeout=300)]
    (a,), (b,) = from_file, by_hand
    assert a.vision.video_count == (1, 1) and a.vision.video_grid_thw[0, 0] == 2  # 4 frames, 2 per temporal patch
    assert torch.equal(a.vision.pixel_values_videos, b.vision.pixel_values_videos)
    assert torch.equal(a.vision.video_grid_thw, b.vision.video_grid_thw) and torch.equal(a.sequences, b.sequences)


async def test_a_request_over_the_pixel_budget_is_resource_exhausted_before_decoding(stack):
    """24 images of 600 x 600 (each within max_image_pixels) hold 8.64 M pixels, over the request's 8 M."""
    canvas = io.BytesIO()
    Image.new("RGB", (600, 600), (10, 20, 30)).save(canvas, format="PNG")
    request = build_request([[{"role": "user", "content": "Describe the pictures."}]] * 8,
                            images=[[canvas.getvalue()] * 3] * 8, n_samples_per_prompt=2,
                            sampling=Sampling(max_new_tokens=2))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [m async for m in stack.MakeExperiences(request, timeout=120)]
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.details().startswith(f"max_request_pixels: the request's images and video frames hold more "
                                             f"than {MAX_REQUEST_PIXELS} pixels")
