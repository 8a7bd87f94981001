"""One prompt of a ``MakeExperiencesRequest`` as the policy sees it (:class:`PromptSpec`), and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastexp.v1 import experience_pb2
from services.common.errors import InvalidRequest
from services.common.media import EncodedMedia, MediaLimits, decode_media
from services.common.media_wire import media_from_pb
from services.experience.vision import PromptVision, VisionProcessor


@dataclass(frozen=True)
class PromptSpec:
    """One prompt as the policy sees it: rendered text, its token ids, and its supervision.

    A multimodal prompt also keeps its images/videos as sent (``media``, forwarded to the generator and the
    scorer unchanged) and as the processor made them (``vision``: expanded token ids and pixel patches);
    ``token_ids`` are then the *unexpanded* ids (one placeholder per item) that the generator's engine expands.
    """

    text: str
    token_ids: tuple[int, ...]
    reference: str
    label: str
    media: EncodedMedia | None = None
    vision: PromptVision | None = None

    @property
    def model_token_ids(self) -> tuple[int, ...]:
        """The prompt as the models see it (placeholders expanded for a multimodal prompt)."""
        return self.vision.token_ids if self.vision is not None else self.token_ids


class InvalidPrompts(InvalidRequest):
    """One or more prompts are invalid; every one is named (``prompt_indices``, ascending), so a trainer can
    drop them and send the others again at once (trailing metadata ``fastexp-invalid-prompt-indices``)."""

    def __init__(self, errors: dict[int, InvalidRequest]) -> None:
        first = errors[min(errors)]
        super().__init__(first.field, first.reason)
        self.prompt_indices = sorted(errors)
        self.args = ("; ".join(str(errors[i]) for i in self.prompt_indices),)


def render_prompt(
    index: int,
    prompt: experience_pb2.PromptInput,
    tokenizer: Any,
    max_model_len: int,
    vision: VisionProcessor | None,
    media_limits: MediaLimits,
) -> PromptSpec:
    """One ``PromptInput`` as the policy sees it: chat rendered with the template (or the processor's), text
    checked for its image/video placeholders, tokenized, its media decoded and processed, its length checked.

    Raises:
        InvalidRequest: naming ``prompts[index]`` or one of its fields.
    """
    field = f"prompts[{index}]"
    encoded = media_from_pb(prompt.images, prompt.videos)
    multimodal = not encoded.empty
    if multimodal and vision is None:
        what = "images" if prompt.images else "videos"
        raise InvalidRequest(f"{field}.{what}", "the policy is a text-only model; it takes no images or videos")
    media = decode_media(encoded, field, media_limits) if multimodal else None
    kind = prompt.WhichOneof("prompt")
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
        if not messages:
            raise InvalidRequest(f"{field}.chat", "a conversation needs at least one message")
        if any(not m["role"] for m in messages):
            raise InvalidRequest(f"{field}.chat", "every message needs a role")
        if vision is not None:  # the processor's template renders text-only and multimodal chats alike
            text = vision.render_chat(messages, len(prompt.images), len(prompt.videos))
        else:
            if tokenizer.chat_template is None:
                raise InvalidRequest(f"{field}.chat", "the policy has no chat template; send text prompts")
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    elif kind == "text":
        text = prompt.text
        if vision is not None:
            counts = vision.placeholder_counts(text)
            if counts != (len(prompt.images), len(prompt.videos)):
                raise InvalidRequest(
                    f"{field}.text",
                    f"holds {counts[0]} image and {counts[1]} video placeholders ({vision.image_placeholder!r}, "
                    f"{vision.video_placeholder!r}) for {len(prompt.images)} images and {len(prompt.videos)} videos",
                )
    else:
        raise InvalidRequest(field, "set text or chat")
    if not text:
        raise InvalidRequest(field, "prompt is empty")
    ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise InvalidRequest(field, "prompt is empty after tokenization")
    processed = None
    if media is not None:
        try:
            processed = vision.process(text, media)
        except (ValueError, TypeError) as error:
            raise InvalidRequest(field, f"the processor refused it: {error}") from None
    length = len(processed.token_ids) if processed is not None else len(ids)
    if length >= max_model_len:
        raise InvalidRequest(field, f"{length} tokens; the model's limit is {max_model_len} (prompt + response)")
    return PromptSpec(
        text=text, token_ids=ids, reference=prompt.reference, label=prompt.label,
        media=encoded if multimodal else None,
        vision=processed,
    )
