"""Images and videos of multimodal prompts: the encoded record (:class:`EncodedMedia`), decoding and checks.

The wire carries encoded files (PNG/JPEG/... bytes; a video as encoded frames). Every service that needs
pixels decodes them here with Pillow, so the checks and error messages are the same everywhere; nothing is
re-encoded on the way (the experience service forwards the request's bytes to the generator and the scorer).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from services.common.errors import InvalidRequest, Overloaded


@dataclass(frozen=True)
class EncodedMedia:
    """One prompt's images and videos as the wire carries them (``fastexp.v1.PromptMedia``): each image's encoded
    file bytes (PNG/JPEG/...), each video as its encoded frames in time order."""

    images: tuple[bytes, ...] = ()
    videos: tuple[tuple[bytes, ...], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.images and not self.videos


@dataclass(frozen=True)
class MediaLimits:
    """What one prompt may carry. ``max_image_pixels`` bounds width * height of each image and video frame, and
    ``max_request_pixels`` their sum over a whole request, both *before* decoding (Pillow reads the size from the
    header), so an oversized file or request is refused unread."""

    max_images_per_prompt: int = 8
    max_videos_per_prompt: int = 2
    max_video_frames: int = 64
    max_image_pixels: int = 4096 * 4096
    max_request_pixels: int = 64 * 1024 * 1024  # all images and video frames of one request together


@dataclass(frozen=True)
class DecodedVideo:
    """A video's frames as one uint8 array ``(T, H, W, 3)`` RGB."""

    frames: np.ndarray


@dataclass(frozen=True)
class DecodedMedia:
    """One prompt's images (RGB Pillow images) and videos, in placeholder order."""

    images: tuple[Image.Image, ...] = ()
    videos: tuple[DecodedVideo, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.images and not self.videos


def decode_image(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """Decode one encoded image into an RGB Pillow image.

    Raises:
        InvalidRequest: ``field`` is empty, not an image Pillow can decode, truncated, or larger than
            ``max_pixels`` (width * height).
    """
    if not data:
        raise InvalidRequest(field, "empty image bytes")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > max_pixels:
            raise InvalidRequest(
                field, f"{width}x{height} = {width * height} pixels exceeds the budget of {max_pixels} (max_image_pixels)"
            )
        return image.convert("RGB")  # reads the whole file: truncated data fails here
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError) as error:
        raise InvalidRequest(field, f"not a decodable image ({type(error).__name__}: {error})") from None


def decode_video(frames: Sequence[bytes], field: str, limits: MediaLimits) -> DecodedVideo:
    """Decode a video's encoded frames into ``(T, H, W, 3)`` uint8.

    Raises:
        InvalidRequest: no frames, more than ``max_video_frames``, a frame that does not decode or is over the
            pixel budget, or frames of different sizes.
    """
    if not frames:
        raise InvalidRequest(f"{field}.frames", "a video needs at least one frame")
    if len(frames) > limits.max_video_frames:
        raise InvalidRequest(f"{field}.frames", f"{len(frames)} frames; at most {limits.max_video_frames}")
    pixels = [
        np.asarray(decode_image(data, f"{field}.frames[{k}]", limits.max_image_pixels))
        for k, data in enumerate(frames)
    ]
    first = pixels[0].shape
    for k, frame in enumerate(pixels):
        if frame.shape != first:
            raise InvalidRequest(
                f"{field}.frames[{k}]", f"{frame.shape[1]}x{frame.shape[0]}, but frame 0 is {first[1]}x{first[0]}"
            )
    return DecodedVideo(frames=np.stack(pixels))


def decode_media(media: EncodedMedia, field: str, limits: MediaLimits) -> DecodedMedia:
    """Decode and check one prompt's images and videos; ``field`` prefixes error names (``prompts[3]``).

    Raises:
        InvalidRequest: too many images or videos, or one of them is bad (named: ``prompts[3].images[1]``).
    """
    images, videos = media.images, media.videos
    if len(images) > limits.max_images_per_prompt:
        raise InvalidRequest(f"{field}.images", f"{len(images)} images; at most {limits.max_images_per_prompt} per prompt")
    if len(videos) > limits.max_videos_per_prompt:
        raise InvalidRequest(f"{field}.videos", f"{len(videos)} videos; at most {limits.max_videos_per_prompt} per prompt")
    return DecodedMedia(
        images=tuple(decode_image(data, f"{field}.images[{k}]", limits.max_image_pixels) for k, data in enumerate(images)),
        videos=tuple(decode_video(frames, f"{field}.videos[{k}]", limits) for k, frames in enumerate(videos)),
    )


def header_pixels(data: bytes) -> int:
    """width * height from an encoded image's header (nothing decoded); 0 when the header is unreadable (the
    decoder then names the file)."""
    try:
        width, height = Image.open(io.BytesIO(data)).size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        return 0
    return width * height


def check_pixel_budget(media: Sequence[EncodedMedia], max_pixels: int) -> None:
    """Refuse a request whose images and video frames, all prompts together, hold more than ``max_pixels``
    pixels (read from their headers, before anything is decoded).

    Raises:
        Overloaded: naming ``max_request_pixels`` with the request's total and the budget (RESOURCE_EXHAUSTED).
    """
    total = 0
    for item in media:
        for data in (*item.images, *(frame for video in item.videos for frame in video)):
            total += header_pixels(data)
            if total > max_pixels:
                raise Overloaded(f"max_request_pixels: the request's images and video frames hold more than "
                                 f"{max_pixels} pixels (width x height, summed); send fewer or smaller ones")
