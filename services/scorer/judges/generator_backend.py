"""A judge served by a fastexp generator (or a fleet of them behind one address): one ``Generate`` per call of up to
``batch_size`` prompts, ``n_samples_per_prompt`` 1, ``skip_special_tokens``.

Messages become prompt text through the chat template of the judge model's tokenizer (``apply_chat_template``; the
tokenizer folder the generator reports in ``GetModelInfo``, read once on the first call, so it must be readable by
the scorer too), else ``system + "\\n\\n" + user``. The generator returns only the sampled tokens' log-probs, so
yes/no verdicts need the openai backend.

gRPC status -> error: UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNKNOWN ->
:class:`~services.scorer.outbound.guard.SourceUnavailable` (retried, counted by the breaker); others (a bad request)
-> :class:`~services.scorer.outbound.guard.SourceRejected`. Cancelling a call cancels the ``Generate`` RPC, which
aborts the generator's engine requests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import grpc

from fastexp.security import ClientTLS, read_file
from fastexp.v1 import generation_pb2, generation_pb2_grpc
from services.common.channels import open_channel
from services.scorer.judges.backends import Chat, JudgeReply
from services.scorer.judges.config import JudgeConfig
from services.scorer.outbound.guard import SourceRejected, SourceUnavailable

_RETRIED = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
}
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class GeneratorBackend:
    """A fastexp ``GenerationService`` as a judge (module docs)."""

    def __init__(self, config: JudgeConfig) -> None:
        self._config = config
        self.where = f"generator {config.address}"
        self.prompts_per_call = config.batch_size
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationServiceStub | None = None
        self._tokenizer = None
        self._tokenizer_lock = asyncio.Lock()

    async def start(self) -> None:
        config = self._config
        token = None if config.token_file is None else read_file(config.token_file, "token_file").decode().strip()
        tls = None if config.tls_ca_file is None else ClientTLS(config.tls_ca_file)
        # the services' one channel: token and request id on every call, round-robin over a fleet's replicas
        self._channel = open_channel(config.address, _MAX_MESSAGE_BYTES, tls=tls, token=token)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)

    async def complete(self, chats: Sequence[Chat], timeout_s: float) -> list[JudgeReply]:
        assert self._stub is not None, "start() first"
        config = self._config
        prompts = await self._prompts(chats, timeout_s)
        request = generation_pb2.GenerateRequest(
            request_id=f"judge-{config.name}-{uuid.uuid4().hex[:12]}",
            prompts=[generation_pb2.GenerationPrompt(text=prompt) for prompt in prompts],
            sampling=generation_pb2.SamplingParams(
                temperature=config.temperature, max_new_tokens=config.answer_tokens, skip_special_tokens=True,
                seed=0,
            ),
            n_samples_per_prompt=1,
        )
        replies: list[JudgeReply | None] = [None] * len(prompts)
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            async for response in call:
                for completion in response.completions:
                    replies[completion.prompt_index] = _reply(completion)
        except grpc.aio.AioRpcError as error:
            raise _translated(error) from None
        finally:
            call.cancel()  # a no-op once the call ended; else (cancelled, failed) the generator aborts its requests
        if any(reply is None for reply in replies):
            raise SourceUnavailable(f"Generate ended with {replies.count(None)} of {len(replies)} answers missing")
        return replies  # type: ignore[return-value]

    async def _prompts(self, chats: Sequence[Chat], timeout_s: float) -> list[str]:
        if not self._config.apply_chat_template:
            return [f"{chat.system}\n\n{chat.user}" if chat.system else chat.user for chat in chats]
        tokenizer = await self._chat_tokenizer(timeout_s)
        return [tokenizer.apply_chat_template(chat.messages(), tokenize=False, add_generation_prompt=True)
                for chat in chats]

    async def _chat_tokenizer(self, timeout_s: float):
        """The judge model's tokenizer, read once (the folder ``GetModelInfo`` names).

        Raises:
            SourceUnavailable: the generator did not answer. SourceRejected: the folder is not readable here.
        """
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    info = await self._stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout_s)
                except grpc.aio.AioRpcError as error:
                    raise _translated(error) from None
                try:
                    self._tokenizer = await asyncio.to_thread(_load_tokenizer, info.tokenizer)
                except (OSError, ValueError) as error:
                    raise SourceRejected(f"apply_chat_template: cannot read the judge's tokenizer "
                                         f"{info.tokenizer!r} here ({error})") from None
            return self._tokenizer

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _reply(completion: generation_pb2.Completion) -> JudgeReply:
    """One completion as a reply (no candidates' log-probs: the generator has only the sampled tokens')."""
    return JudgeReply(completion.text, len(completion.prompt_token_ids), len(completion.output_token_ids))


def _translated(error: grpc.aio.AioRpcError) -> Exception:
    message = f"{error.code().name}: {error.details()}"
    if error.code() in _RETRIED:
        return SourceUnavailable(message, timeout=error.code() is grpc.StatusCode.DEADLINE_EXCEEDED)
    return SourceRejected(message)
