"""Video files in prompts (client/fastexp/video.py): real mp4/webm files made here with PyAV, sampled to frames by the
documented rule; a path string is a file, never a sequence of characters."""

from __future__ import annotations

import pytest

from fastexp import build_request
from fastexp.video import VideoSampling, video_frames
from tests.support.videos import frame_index, write_video


def test_frames_at_the_requested_rate_then_evenly_capped(tmp_path):
    path = tmp_path / "clip.mp4"
    write_video(path, frames=20, fps=10)  # 2 s at 10 fps: frame i at i / 10 s
    frames = video_frames(path, VideoSampling(fps=2.0, max_frames=32))
    assert [frame_index(f) for f in frames] == [0, 5, 10, 15]  # t = 0, 0.5, 1.0, 1.5 s
    assert all(f.startswith(b"\x89PNG\r\n\x1a\n") for f in frames)
    capped = video_frames(str(path), VideoSampling(fps=2.0, max_frames=3))
    assert [frame_index(f) for f in capped] == [0, 10, 15]  # of the 4, evenly spaced: 0, round(1.5) = 2, 3
    assert [frame_index(f) for f in video_frames(path, VideoSampling(fps=100.0, max_frames=64))] == list(range(20))
    assert [frame_index(f) for f in video_frames(path, VideoSampling(fps=0.1))] == [0]  # shorter than 1 / fps


def test_encoded_bytes_of_another_container_and_bad_input():
    webm = write_video(None, frames=6, fps=3, codec="libvpx", container="webm")
    assert [frame_index(f) for f in video_frames(webm, VideoSampling(fps=1.0))] == [0, 3]
    with pytest.raises(ValueError, match="not a decodable video"):
        video_frames(b"certainly not a video")
    with pytest.raises(OSError):
        video_frames("/no/such/clip.mp4")
    with pytest.raises(ValueError, match="max_frames"):
        VideoSampling(max_frames=0)


def test_build_request_takes_a_video_path_or_bytes_as_one_video(tmp_path):
    path = tmp_path / "clip.mp4"
    data = write_video(path, frames=8, fps=4)
    request = build_request(["a", "b"], videos=[[str(path)], [data, [b"png0", b"png1"]]], n_samples_per_prompt=2,
                            video_sampling=VideoSampling(fps=2.0))
    first, second = request.prompts
    assert len(first.videos) == 1 and [frame_index(f) for f in first.videos[0].frames] == [0, 2, 4, 6]
    assert list(second.videos[0].frames) == list(first.videos[0].frames)  # the same file as bytes
    assert list(second.videos[1].frames) == [b"png0", b"png1"]  # frames as before
