"""Video files for vision-language prompts: decoded with PyAV (FFmpeg) on the trainer's side and sampled to frames.

A video travels as its frames, each an encoded PNG (``fastexp.v1.Video.frames``), so the services never run a video
decoder. :func:`video_frames` turns a file path or the file's encoded bytes (mp4, webm, mkv, avi, … whatever FFmpeg
reads) into those frames by one rule (:class:`VideoSampling`):

- frames are taken at ``fps`` frames per second of the video's own timeline: the first decoded frame at or after
  each time ``k / fps`` (k = 0, 1, …) while it lies inside the video (Qwen2-VL's default is 2 fps);
- when that gives more than ``max_frames``, ``max_frames`` of them are kept, evenly spaced over the clip (indices
  ``round(i * (m - 1) / (max_frames - 1))``, first and last included);
- a clip shorter than ``1 / fps`` gives its first frame.

Needs the ``video`` extra (``pip install "fastexp[video]"``: PyAV and Pillow).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class VideoSampling:
    """How a video file becomes frames: ``fps`` frames per second of video (> 0), at most ``max_frames`` (>= 1)."""

    fps: float = 2.0
    max_frames: int = 32

    def __post_init__(self) -> None:
        if not self.fps > 0:
            raise ValueError(f"VideoSampling.fps must be > 0, got {self.fps}")
        if self.max_frames < 1:
            raise ValueError(f"VideoSampling.max_frames must be >= 1, got {self.max_frames}")


DEFAULT_VIDEO_SAMPLING = VideoSampling()


def is_video_file(video: object) -> bool:
    """Whether ``video`` is a whole encoded video (a path or the file's bytes), not a list of frames."""
    return isinstance(video, str | os.PathLike | bytes | bytearray | memoryview)


def video_frames(video: str | os.PathLike | bytes, sampling: VideoSampling = DEFAULT_VIDEO_SAMPLING) -> list[bytes]:
    """The frames of a video file sampled by ``sampling``'s rule (module docstring), each encoded as PNG.

    Raises:
        ImportError: PyAV or Pillow is not installed (the ``video`` extra).
        OSError: a path that cannot be read.
        ValueError: bytes or a file FFmpeg cannot decode, or a file without a video stream (the message says which).
    """
    try:
        import av
    except ImportError as error:
        raise ImportError('video files need PyAV and Pillow: pip install "fastexp[video]"') from error
    if isinstance(video, bytes | bytearray | memoryview):
        source: io.BytesIO | str = io.BytesIO(bytes(video))
    else:
        source = os.fspath(video)
        open(source, "rb").close()  # OSError for a path that cannot be read (FFmpeg would report it as undecodable)
    try:
        with av.open(source) as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            frames = _frames_at_rate(container, Fraction(sampling.fps).limit_denominator(1000))
    except av.error.FFmpegError as error:
        raise ValueError(f"not a decodable video: {error}") from error
    if not frames:
        raise ValueError("the video has no decodable frames")
    return [_png(frame) for frame in _evenly_spaced(frames, sampling.max_frames)]


def _frames_at_rate(container, fps: Fraction) -> list:
    """The first decoded frame at or after each ``k / fps`` seconds (as PIL images)."""
    stream = container.streams.video[0]
    picked, next_time = [], Fraction(0)
    for frame in container.decode(stream):
        time = Fraction(frame.pts) * stream.time_base if frame.pts is not None else next_time
        if time >= next_time or not picked:
            picked.append(frame.to_image())
            next_time = (time * fps).__floor__() / fps + 1 / fps  # the next grid point after this frame
    return picked


def _evenly_spaced(frames: list, count: int) -> list:
    """``count`` of ``frames``, evenly spaced, first and last included (all of them when there are fewer)."""
    if len(frames) <= count:
        return frames
    if count == 1:
        return frames[:1]
    last = len(frames) - 1
    return [frames[round(i * last / (count - 1))] for i in range(count)]


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
