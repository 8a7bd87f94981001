"""``UpdateWeights`` streams on the receiving side: read into staged tensors, and re-sent to a generator; and the
``LoadAdapter`` messages that carry a LoRA adapter to a generator (:func:`adapter_chunks`).

The wire half of :mod:`services.common.weights` (whose other modules hold the records, checks, staging and blobs,
free of protobuf): servicers and the fleet's clients use these; the pipeline sees only :class:`ReceivedUpdate`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping

import torch

from fastexp.v1 import generation_pb2, tensor_pb2
from fastexp.weights import TARGETS, tensor_messages, weight_chunks
from services.common.errors import InvalidRequest
from services.common.lora import AdapterConfig
from services.common.weights.checks import allowed_checkpoint_dir
from services.common.weights.records import ReceivedUpdate, UpdateBounds
from services.common.weights.staging import WeightStager, checkpoint_entries

#: Chunks up to this size are staged on the event loop; larger ones in a worker thread. Writing and CRC-ing 256 KiB
#: takes about as long as one thread hop (~0.1 ms), hashing it too (an adapter's: ``hash_data``) about twice that: a
#: LoRA adapter's hundreds of small tensors are not worth it.
INLINE_CHUNK_BYTES = 256 * 1024
#: ``DType`` values → fastexp's dtype names (``DTYPE_BFLOAT16`` → ``"bfloat16"``), built once: the enum's
#: ``values()`` and ``items()`` build a list on every call, once per chunk otherwise (both receivers: weights and
#: adapters).
DTYPE_NAMES = {int(v): n.removeprefix("DTYPE_").lower() for n, v in tensor_pb2.DType.items()}


@contextlib.asynccontextmanager
async def staged_update(
    messages: AsyncIterator[generation_pb2.WeightsChunk], staging_dir: str | None, *, bounds: UpdateBounds,
    hash_data: bool = False, in_memory: bool = False,
) -> AsyncIterator[ReceivedUpdate]:
    """Receive an ``UpdateWeights`` stream into a fresh staging folder under ``staging_dir`` (None: the system temp
    folder), checked against ``bounds`` as it arrives; the folder is removed when the block exits, applied or not.
    ``hash_data``: its bytes hashed as they arrive (``ReceivedUpdate.data_sha256``: a blob's digest without a second
    read). ``in_memory``: held in memory, not staged (kind ``"memory"``; :class:`WeightStager`).

    Raises:
        InvalidRequest: as :func:`receive_update`.
    """
    stager = WeightStager(staging_dir, hash_data, in_memory)
    try:
        yield await receive_update(messages, stager, bounds)
    finally:
        await asyncio.to_thread(stager.discard)


async def receive_update(
    messages: AsyncIterator[generation_pb2.WeightsChunk], stager: WeightStager, bounds: UpdateBounds
) -> ReceivedUpdate:
    """Read an ``UpdateWeights`` stream: the header, then tensor chunks staged on disk by ``stager``, each tensor
    checked against the target's model on its first chunk (:meth:`WeightStager.add`).

    Tensors come one chunk per message (``tensor``) or several whole ones per message (``tensors``: the feature
    ``"tensor-batches"``).

    Raises:
        InvalidRequest: no header first, a second header, chunks after a ``checkpoint_dir`` header, an empty
            message or one of a kind this server does not know (``kind``), an unknown
            target or one the service does not serve, a bad chunk (see :meth:`WeightStager.add`), a
            ``checkpoint_dir`` outside ``bounds.checkpoint_roots`` or missing, or a count mismatch.
    """
    headers: list[generation_pb2.WeightsHeader] = []

    def take(header: generation_pb2.WeightsHeader) -> None:
        if header.target not in TARGETS:
            raise InvalidRequest("header.target", f"unknown target {header.target}")
        stager.expect(bounds.spec_for(TARGETS[header.target]))
        headers.append(header)

    async for chunk in header_then_chunks(messages, take):
        if headers[0].checkpoint_dir:
            raise InvalidRequest("tensor", "no tensor chunks may follow a checkpoint_dir header")
        await _stage_chunk(chunk, stager)
    header = headers[0]
    target = TARGETS[header.target]
    version = header.policy_version if header.HasField("policy_version") else None
    if header.checkpoint_dir:
        folder = allowed_checkpoint_dir(header.checkpoint_dir, bounds.checkpoint_roots)
        entries = await asyncio.to_thread(checkpoint_entries, folder)
        return ReceivedUpdate(target, "checkpoint", folder, entries, version)
    entries = await asyncio.to_thread(stager.finish, header.num_tensors or None)
    return ReceivedUpdate(target, stager.kind, str(stager.folder or ""), entries, version, stager.data_sha256,
                          stager.values_checked)


async def header_then_chunks(
    messages: AsyncIterator[generation_pb2.WeightsChunk | generation_pb2.AdapterChunk],
    take_header: Callable[[generation_pb2.WeightsHeader | generation_pb2.AdapterHeader], None],
) -> AsyncIterator[generation_pb2.TensorChunk]:
    """The tensor chunks of an ``UpdateWeights`` or ``LoadAdapter`` stream, in order, after ``take_header`` was
    given its first message's header (it raises to refuse it): one chunk per ``tensor`` message, each of a
    ``tensors`` batch in turn.

    Raises:
        InvalidRequest: no header first (``header``), a second header, an empty stream, an empty message or one of a
            kind this server does not know (``kind``); whatever ``take_header`` raises.
    """
    seen = False
    async for message in messages:
        part = message.WhichOneof("kind")
        if not seen:
            if part != "header":
                raise InvalidRequest("header", "the first message must carry the header")
            seen = True
            take_header(message.header)
        elif part == "header":
            raise InvalidRequest("header", "sent twice")
        elif part == "tensor":
            yield message.tensor
        elif part == "tensors":  # several whole tensors, in order (the feature "tensor-batches")
            for chunk in message.tensors.tensors:
                yield chunk
        else:
            raise InvalidRequest("kind", "an empty message, or a kind this server does not take")
    if not seen:
        raise InvalidRequest("header", "the stream was empty")


async def _stage_chunk(chunk: generation_pb2.TensorChunk, stager: WeightStager) -> None:
    dtype = DTYPE_NAMES.get(chunk.dtype)  # e.g. "bfloat16"
    if dtype is None:
        raise InvalidRequest(f"tensor {chunk.name!r}: dtype", f"unknown DType value {chunk.dtype}")
    crc32 = chunk.crc32 if chunk.HasField("crc32") else None
    data = chunk.data  # upb hands out a new bytes object per access: read it once
    if len(data) <= INLINE_CHUNK_BYTES:  # a LoRA tensor: the thread hop would cost more than the write
        stager.add(chunk.name, dtype, tuple(chunk.shape), data, crc32)
    else:
        await asyncio.to_thread(stager.add, chunk.name, dtype, tuple(chunk.shape), data, crc32)


def entry_chunks(
    update: ReceivedUpdate, *, chunk_bytes: int = 4 * 1024 * 1024, policy_version: int | None = None,
    batch: bool = False,
) -> Iterator[generation_pb2.WeightsChunk]:
    """Re-send a received update (e.g. to a generator): the folder's name for a checkpoint, else its staged
    tensors read one at a time from disk (each with its CRC-32); ``policy_version``: the version it makes live
    there (``None``: the receiver's previous + 1); ``batch``: small tensors several per message (a receiver listing
    the feature ``"tensor-batches"``)."""
    if update.kind == "checkpoint":
        return weight_chunks((), checkpoint_dir=update.folder, target=update.target, policy_version=policy_version)
    return weight_chunks(
        ((e.name, e.load()) for e in update.entries), chunk_bytes=chunk_bytes, target=update.target,
        num_tensors=len(update.entries), policy_version=policy_version, batch=batch,
    )


def adapter_chunks(
    name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], *, version: int | None = None,
    weights_digest: str = "", chunk_bytes: int = 4 * 1024 * 1024, batch: bool = False,
) -> Iterator[generation_pb2.AdapterChunk]:
    """The ``LoadAdapter`` messages for adapter ``name``: the header, then each peft-named tensor in its own
    floating dtype, ``chunk_bytes`` per chunk, its first chunk with its CRC-32 (as :func:`fastexp.weights.weight_chunks`
    sends weights). ``version``: the version the load makes live (None: the receiver's previous + 1);
    ``weights_digest``: what the tensors are (the blob's digest), which the generator reports back in ``ModelInfo``;
    ``batch``: small tensors several per message (a generator listing the feature ``"tensor-batches"``).

    Raises:
        ValueError: a tensor is not floating point; ``chunk_bytes`` < 1.
    """
    yield generation_pb2.AdapterChunk(header=generation_pb2.AdapterHeader(
        name=name, rank=config.rank, alpha=config.alpha, target_modules=list(config.target_modules),
        use_rslora=config.use_rslora, num_tensors=len(tensors), version=version, weights_digest=weights_digest,
    ))
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    yield from tensor_messages(generation_pb2.AdapterChunk, tensors.items(), chunk_bytes=chunk_bytes, batch=batch)
