"""``fastexp.v1`` media messages <-> :class:`~services.common.media.EncodedMedia` (the servicers' and clients' edge).
"""

from __future__ import annotations

from collections.abc import Sequence

from fastexp.v1 import media_pb2
from services.common.media import EncodedMedia


def media_from_pb(
    images: Sequence[media_pb2.Image], videos: Sequence[media_pb2.Video]
) -> EncodedMedia:
    """The encoded record of a prompt's ``images`` and ``videos`` fields (bytes shared, not copied by protobuf)."""
    return EncodedMedia(images=tuple(image.data for image in images),
                        videos=tuple(tuple(video.frames) for video in videos))


def media_to_pb(media: EncodedMedia | None) -> media_pb2.PromptMedia:
    """A ``PromptMedia`` message (empty for ``None``: a text-only prompt)."""
    if media is None:
        return media_pb2.PromptMedia()
    return media_pb2.PromptMedia(
        images=[media_pb2.Image(data=data) for data in media.images],
        videos=[media_pb2.Video(frames=frames) for frames in media.videos],
    )
