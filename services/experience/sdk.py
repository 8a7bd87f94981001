"""Trainer SDK: stream Experiences (torch tensors, the seed's field names) from the experience service.

Example::

    from services.experience.sdk import ExperienceClient

    with ExperienceClient("127.0.0.1:50053") as client:
        for exp in client.make_experiences(
            [[{"role": "user", "content": "What is 2 + 3?"}]], references=["5"], n_samples_per_prompt=4
        ):
            loss = -(exp.advantages * ratio(exp)).sum() / exp.action_mask.sum()  # exp.action_log_probs, ...

Errors arrive as ``grpc.RpcError`` with the service's status code (INVALID_ARGUMENT names the field).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from fastexp.v1 import experience_pb2, experience_pb2_grpc
from services.common.sampling import SamplingOptions
from services.experience.types import Experience
from services.experience.wire import experience_from_pb

#: A prompt: raw text, or chat messages ``[{"role": ..., "content": ...}, ...]`` rendered with the chat template.
PromptLike = str | Sequence[dict[str, str]]


#: Sampling parameters for a request (the validated record the services use; see ``fastexp.v1.SamplingParams``).
Sampling = SamplingOptions
DEFAULT_SAMPLING = Sampling()


def build_request(
    prompts: Sequence[PromptLike],
    *,
    n_samples_per_prompt: int,
    references: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    sampling: Sampling = DEFAULT_SAMPLING,
    micro_rollout_batch_size: int = 0,
    advantage_estimator: str = "group_norm",
    kl_coef: float = 0.01,
    kl_estimator: str = "k1",
    use_kl_loss: bool = False,
    gamma: float = 1.0,
    request_id: str = "",
) -> experience_pb2.MakeExperiencesRequest:
    """A ``MakeExperiencesRequest`` from Python values.

    Raises:
        ValueError: ``references``/``labels`` given with a length other than ``len(prompts)``.
    """
    for name, column in (("references", references), ("labels", labels)):
        if column is not None and len(column) != len(prompts):
            raise ValueError(f"{len(column)} {name} for {len(prompts)} prompts")
    inputs = []
    for i, prompt in enumerate(prompts):
        item = experience_pb2.PromptInput()
        if isinstance(prompt, str):
            item.text = prompt
        else:
            item.chat.messages.extend(experience_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
        if references is not None:
            item.reference = references[i]
        if labels is not None:
            item.label = labels[i]
        inputs.append(item)
    return experience_pb2.MakeExperiencesRequest(
        request_id=request_id,
        prompts=inputs,
        sampling=sampling.to_pb(),
        n_samples_per_prompt=n_samples_per_prompt,
        micro_rollout_batch_size=micro_rollout_batch_size,
        advantage_estimator=advantage_estimator,
        kl=experience_pb2.KLSettings(kl_coef=kl_coef, kl_estimator=kl_estimator, use_kl_loss=use_kl_loss),
        gamma=gamma,
    )


class ExperienceClient:
    """A blocking client of ``fastexp.v1.ExperienceService``; use as a context manager or call :meth:`close`."""

    def __init__(self, address: str, *, timeout_s: float = 3600.0, max_message_bytes: int = 256 * 1024 * 1024):
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self._stub = experience_pb2_grpc.ExperienceServiceStub(self._channel)
        self._timeout_s = timeout_s

    def make_experiences(self, prompts: Sequence[PromptLike], **options) -> Iterator[Experience]:
        """Stream Experiences for ``prompts``; ``options`` are :func:`build_request`'s keyword arguments.

        Each yielded Experience holds whole prompt groups; every prompt's group arrives exactly once. Stopping
        the iteration (or ``close``) cancels the stream, which aborts the remaining generation.

        Raises:
            grpc.RpcError: the call failed (INVALID_ARGUMENT, UNAVAILABLE, DEADLINE_EXCEEDED, ...).
        """
        stream = self._stub.MakeExperiences(build_request(prompts, **options), timeout=self._timeout_s)
        try:
            for message in stream:
                yield experience_from_pb(message)
        finally:
            stream.cancel()

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until the service's channel is ready. Raises ``grpc.FutureTimeoutError`` after ``timeout_s``."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ExperienceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
