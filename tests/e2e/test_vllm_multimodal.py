"""Images and videos end to end through the real CLI processes and vLLM, on a small Qwen2-VL built by the test.

vLLM's own processor expands each placeholder from the images it receives; the experience service's processor
does the same from the request's bytes, and the two must agree (no prompt mismatch repaired), so the actor's
log-probs of the sampled tokens track vLLM's.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from fastexp import ExperienceClient, Sampling, invalid_prompt_indices
from services.launcher import LocalCluster, free_port
from tests.support.vlm import sample_photos, video_frames

pytestmark = pytest.mark.vllm

PHOTOS = sample_photos()
JPEG, PNG = PHOTOS["grace_hopper.jpg"], PHOTOS["Minduka_Present_Blue_Pack.png"]


@pytest.fixture(scope="module")
def cluster(tiny_vlm_path, tmp_path_factory):
    metrics_port = free_port()
    overrides = {
        "generator": {"model": tiny_vlm_path, "backend": "vllm", "max_model_len": 1024,
                      "kv_cache_memory_bytes": 256 * 1024**2},
        "experience": {"actor_model": tiny_vlm_path, "reference_model": tiny_vlm_path, "dtype": "float32",
                       "metrics_port": metrics_port, "max_images_per_prompt": 2},
    }
    with LocalCluster(overrides=overrides, log_dir=tmp_path_factory.mktemp("logs")) as running:
        running.experience_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        yield running


def test_mixed_text_image_video_request_through_vllm(cluster):
    prompts = [
        "Plain text: what is 2 + 2?",
        [{"role": "user", "content": "What is in this photograph?"}],
        [{"role": "user", "content": "Compare the two photographs and the clip."}],
    ]
    images = [[], [JPEG], [PNG, JPEG]]
    videos = [[], [], [video_frames(JPEG, 4)]]
    with ExperienceClient(cluster.address("experience"), timeout_s=600) as client:
        batches = list(client.make_experiences(
            prompts, images=images, videos=videos, references=["4", "", ""], n_samples_per_prompt=2,
            micro_rollout_batch_size=4, sampling=Sampling(max_new_tokens=8, seed=5),
        ))
    rows = sorted((p, s) for e in batches for p, s in zip(e.prompt_index, e.sample_index, strict=True))
    assert rows == [(p, s) for p in range(3) for s in range(2)]
    seen_vision = 0
    for e in batches:
        counts = [(len(images[p]), len(videos[p])) for p in e.prompt_index]
        if e.vision is None:
            assert all(c == (0, 0) for c in counts)
            continue
        seen_vision += 1
        assert list(zip(e.vision.image_count, e.vision.video_count, strict=True)) == counts
        assert e.vision.image_grid_thw.shape[0] == sum(c[0] for c in counts)
        patches = int(e.vision.image_grid_thw.prod(dim=1).sum())
        assert e.vision.pixel_values.shape == (patches, 3 * 2 * 14 * 14)
        mask = e.action_mask
        # vLLM (bf16) and the HF actor (fp32) score the same sampled tokens on the same image features
        assert (e.rollout_log_probs[mask] - e.action_log_probs[mask]).abs().mean() < 0.1
    assert seen_vision
    text = httpx.get(cluster.experience_metrics, timeout=10).text
    # vLLM's expansion of every placeholder agreed with the experience service's processor
    assert 'fastexp_vision_token_repairs_total{kind="prompt_mismatch"}' not in text


def test_bad_image_is_refused_naming_the_prompt_and_others_can_be_resent(cluster):
    prompts = [[{"role": "user", "content": f"Picture {i}?"}] for i in range(3)]
    images = [[JPEG], [b"\x89PNG\r\n\x1a\n broken"], [PNG, PNG, PNG]]
    with ExperienceClient(cluster.address("experience"), timeout_s=600) as client:
        with pytest.raises(grpc.RpcError) as caught:
            list(client.make_experiences(prompts, images=images, n_samples_per_prompt=2))
        error = caught.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompts[1].images[0]: not a decodable image" in error.details()
        assert "prompts[2].images: 3 images; at most 2 per prompt" in error.details()
        invalid = invalid_prompt_indices(error)
        assert invalid == [1, 2]
        keep = [i for i in range(3) if i not in invalid]
        batches = list(client.make_experiences(
            [prompts[i] for i in keep], images=[images[i] for i in keep], n_samples_per_prompt=2,
            sampling=Sampling(max_new_tokens=4, seed=1),
        ))
    assert sorted(p for e in batches for p in e.prompt_index) == [0, 0]
