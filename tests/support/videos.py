"""Real video files made by the tests with PyAV (FFmpeg): solid-colour frames whose grey level encodes the frame's
index, so a decoded frame says which one it was."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

#: Grey level of frame i (multiples of 12 stay apart after lossy compression).
STEP = 12


def write_video(path_or_none: Path | None, *, frames: int, fps: int, codec: str = "libx264",
                container: str = "mp4", size: tuple[int, int] = (64, 48)) -> bytes:
    """Encode ``frames`` frames at ``fps`` (frame i is grey ``STEP * i``); write them to ``path_or_none`` if given.

    Returns the file's bytes.
    """
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            pixels = np.full((size[1], size[0], 3), STEP * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    data = buffer.getvalue()
    if path_or_none is not None:
        path_or_none.write_bytes(data)
    return data


def frame_index(png: bytes) -> int:
    """Which frame of :func:`write_video` a decoded PNG frame is (from its mean grey level)."""
    from PIL import Image

    return round(float(np.asarray(Image.open(io.BytesIO(png)).convert("L")).mean()) / STEP)
