"""One prompt of a ``MakeExperiencesRequest`` as the policy sees it (:class:`PromptSpec`), and its checks."""

from __future__ import annotations

from typing import Any, NamedTuple

from fastexp.v1 import experience_pb2
from services.common.errors import InvalidRequest
from services.common.media import MediaLimits, decode_media
from services.common.media_wire import media_from_pb
from services.experience.config import PromptSpec
from services.experience.workers.vision import VisionProcessor


class PromptTooLong(InvalidRequest):
    """A prompt over the request's limit (``prompt_overflow`` decides: reject, truncate or skip it)."""


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
    max_prompt_tokens: int,
    vision: VisionProcessor | None,
    media_limits: MediaLimits,
    truncate_left: bool = False,
    limit_reason: str = "max_prompt_tokens",
) -> tuple[PromptSpec, bool]:
    """One ``PromptInput`` as the policy sees it: chat rendered with the template (or the processor's), text
    checked for its image/video placeholders, tokenized, its media decoded and processed, its length checked
    against ``max_prompt_tokens``. With ``truncate_left`` a text-only prompt over it keeps its last
    ``max_prompt_tokens`` tokens (its text is then their decoding, special tokens kept).

    Returns:
        ``(prompt, truncated)``.

    Raises:
        PromptTooLong: over ``max_prompt_tokens`` (and not truncated), naming ``prompts[index]``.
        InvalidRequest: naming ``prompts[index]`` or one of its fields.
    """
    field = f"prompts[{index}]"
    encoded = media_from_pb(prompt.images, prompt.videos)
    multimodal = not encoded.empty
    if multimodal and vision is None:
        what = "images" if prompt.images else "videos"
        raise InvalidRequest(f"{field}.{what}", "the policy is a text-only model; it takes no images or videos")
    media = decode_media(encoded, field, media_limits) if multimodal else None
    text = _render_text(field, prompt, tokenizer, vision)
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
    truncated = length > max_prompt_tokens and truncate_left and processed is None
    if truncated:
        ids = ids[-max_prompt_tokens:]
        text = tokenizer.decode(ids, skip_special_tokens=False)
    elif length > max_prompt_tokens:
        why = " (image/video prompts are never truncated)" if truncate_left else ""
        raise PromptTooLong(field, f"{length} tokens; the limit is {max_prompt_tokens} prompt tokens ({limit_reason})"
                                   f"{why}; prompt_overflow can truncate or skip such prompts")
    spec = PromptSpec(
        text=text, token_ids=ids, reference=prompt.reference, label=prompt.label,
        media=encoded if multimodal else None,
        vision=processed,
        messages=tuple((m.role, m.content) for m in prompt.chat.messages) if prompt.HasField("chat") else (),
    )
    return spec, truncated


def _render_text(field: str, prompt: experience_pb2.PromptInput, tokenizer: Any, vision: VisionProcessor | None) -> str:
    """The prompt's text as the policy sees it: chat rendered with the template, text checked for placeholders."""
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
    return text


class RenderedPrompts(NamedTuple):
    """:func:`render_prompts`' answer: the prompts to sample and, when SKIP left some out, each one's index in the
    message (else empty); message indices of the skipped and truncated prompts."""

    prompts: tuple[PromptSpec, ...]
    prompt_indices: tuple[int, ...]
    skipped_prompt_indices: tuple[int, ...]
    truncated_prompt_indices: tuple[int, ...]


_OVERFLOW = {
    experience_pb2.PROMPT_OVERFLOW_REJECT: "reject",
    experience_pb2.PROMPT_OVERFLOW_TRUNCATE_LEFT: "truncate_left",
    experience_pb2.PROMPT_OVERFLOW_SKIP: "skip",
}


def render_prompts(
    message: experience_pb2.MakeExperiencesRequest, tokenizer: Any, max_model_len: int,
    vision: VisionProcessor | None, media_limits: MediaLimits,
) -> RenderedPrompts:
    """Every prompt of ``message`` rendered (:func:`render_prompt`), over-long ones handled as its
    ``prompt_overflow`` says, against ``max_prompt_tokens`` (0: ``max_model_len - 1``).

    Raises:
        InvalidRequest: ``prompt_overflow`` unknown, ``max_prompt_tokens`` not below ``max_model_len``, or every
            prompt skipped (naming ``prompts``).
        InvalidPrompts: every invalid (or, with REJECT, over-long) prompt, named with its index.
    """
    if message.prompt_overflow not in _OVERFLOW:
        raise InvalidRequest("prompt_overflow", f"unknown value {message.prompt_overflow}")
    overflow, limit = _OVERFLOW[message.prompt_overflow], message.max_prompt_tokens or max_model_len - 1
    reason = "max_prompt_tokens" if message.max_prompt_tokens else f"the model's limit is {max_model_len} (prompt + " \
        "response) tokens"
    if limit >= max_model_len:
        raise InvalidRequest("max_prompt_tokens", f"must be below the model's length {max_model_len}, got {limit}")
    prompts, errors, kept, skipped, truncated = [], {}, [], [], []
    for i, p in enumerate(message.prompts):
        try:
            spec, was_truncated = render_prompt(
                i, p, tokenizer, limit, vision, media_limits, overflow == "truncate_left", reason)
        except PromptTooLong as error:
            if overflow == "skip":
                skipped.append(i)
            else:
                errors[i] = error
            continue
        except InvalidRequest as error:
            errors[i] = error
            continue
        prompts.append(spec)
        kept.append(i)
        truncated.extend([i] if was_truncated else [])
    if errors:
        raise InvalidPrompts(errors)
    if not prompts:
        raise InvalidRequest("prompts", f"every prompt is longer than {limit} tokens (prompt_overflow SKIP left none)")
    return RenderedPrompts(tuple(prompts), tuple(kept) if skipped else (), tuple(skipped), tuple(truncated))
