"""A trainer's side of ``UpdateWeights``: named tensors as a stream of ``WeightsChunk`` messages."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch

from fastexp.types import FLOAT_DTYPES, Target
from fastexp.v1 import experience_pb2, experience_pb2_grpc, generation_pb2, tensor_pb2

_WIRE_DTYPES = {torch_dtype: getattr(tensor_pb2, f"DTYPE_{name.upper()}") for name, torch_dtype in FLOAT_DTYPES.items()}
#: The feature a receiver lists (``ModelInfo.features``, ``ServerInfo.features``) when it takes ``TensorBatch``
#: messages (:func:`weight_chunks` with ``batch``).
TENSOR_BATCHES = "tensor-batches"
#: The messages :func:`tensor_messages` builds.
_M = TypeVar("_M", generation_pb2.WeightsChunk, generation_pb2.AdapterChunk)
#: ``WeightsTarget`` enum value -> target.
TARGETS: dict[int, Target] = {
    generation_pb2.WEIGHTS_TARGET_POLICY: "policy", generation_pb2.WEIGHTS_TARGET_CRITIC: "critic",
}


def weight_chunks(
    tensors: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int = 4 * 1024 * 1024,
    checkpoint_dir: str | None = None, target: Target = "policy", num_tensors: int | None = None,
    policy_version: int | None = None, batch: bool = False, wire_dtype: str = "",
) -> Iterator[generation_pb2.WeightsChunk]:
    """The ``UpdateWeights`` messages for named tensors (checkpoint/HF names), ``chunk_bytes`` of data each.

    Tensors are sent in their own floating dtype (the receiver casts to the model's), or in ``wire_dtype`` (a
    :data:`~fastexp.types.FLOAT_DTYPES` name; "": their own) where theirs is wider and ``wire_dtype`` is bfloat16 or
    float32 (:func:`narrowed`), one at a time, so the
    sender holds one CPU copy of one tensor; each tensor's first chunk carries the CRC-32 (``zlib.crc32``) of its
    bytes, which the receiver checks before applying anything. With ``checkpoint_dir`` only the header is sent.
    ``num_tensors`` (when ``tensors`` is a lazy iterator) is announced in the header; otherwise ``tensors`` is
    listed first. ``policy_version``: the version the update makes live (``None``: the receiver's previous + 1;
    an experience service sets it to keep a fleet of generators in step). ``batch``: tensors smaller than
    ``chunk_bytes`` travel whole, several per message (``TensorBatch``, up to ``chunk_bytes`` each), larger ones
    in chunks as before; only for a receiver that lists the feature ``"tensor-batches"``.

    Raises:
        ValueError: a tensor is not floating point; ``chunk_bytes`` < 1; an unknown ``wire_dtype``.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if wire_dtype and wire_dtype not in FLOAT_DTYPES:
        raise ValueError(f"wire_dtype must be one of {sorted(FLOAT_DTYPES)} or empty, got {wire_dtype!r}")
    narrow = FLOAT_DTYPES[wire_dtype] if wire_dtype else None
    if checkpoint_dir:
        tensors, num_tensors = (), 0
    elif num_tensors is None:
        tensors = list(tensors)
        num_tensors = len(tensors)
    wire_target = {name: number for number, name in TARGETS.items()}[target]
    yield generation_pb2.WeightsChunk(
        header=generation_pb2.WeightsHeader(
            checkpoint_dir=checkpoint_dir or "", num_tensors=num_tensors, target=wire_target,
            policy_version=policy_version,
        )
    )
    tensors = ((name, narrowed(tensor, narrow)) for name, tensor in tensors) if narrow is not None else tensors
    yield from tensor_messages(generation_pb2.WeightsChunk, tensors, chunk_bytes=chunk_bytes, batch=batch)


def narrowed(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` cast to ``dtype`` where that has fewer bits and float32's range, bfloat16 or float32 (float32 ->
    bfloat16: rounded to nearest, ties to even, as the receiver's own cast of a full update), else ``tensor`` itself:
    never to float16, whose range would turn a trainer's finite values into infinities (nor where ``dtype`` is None).
    """
    wide = tensor.is_floating_point() and dtype is not None and dtype.itemsize < tensor.element_size()
    if wide and dtype in (torch.bfloat16, torch.float32):
        return tensor.detach().to(dtype)
    return tensor


def tensor_messages(
    message_type: type[_M], tensors: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int = 4 * 1024 * 1024,
    batch: bool = False,
) -> Iterator[_M]:
    """The data messages of :func:`weight_chunks` (no header) as ``message_type``, ``WeightsChunk`` or
    ``AdapterChunk`` (both have the fields ``tensor``, a ``TensorChunk``, and ``tensors``, a ``TensorBatch``).
    Each chunk is built inside its message: a tensor's bytes are copied once on the way (a rank-16 adapter's
    messages built 3x faster than from separate ``TensorChunk`` messages, which each enclosing message copies).

    Raises:
        ValueError: a tensor is not floating point.
    """
    pending: _M | None = None  # whole small tensors waiting for their batch
    pending_bytes = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if batch and size < chunk_bytes:
            if pending is not None and pending_bytes + size > chunk_bytes:
                yield pending
                pending, pending_bytes = None, 0
            if pending is None:
                pending = message_type()
            for fields in _tensor_chunks(name, tensor, chunk_bytes):  # its one chunk
                pending.tensors.tensors.add(**fields)
            pending_bytes += size
            continue
        if pending is not None:  # tensors go in order
            yield pending
            pending, pending_bytes = None, 0
        yield from (message_type(tensor=fields) for fields in _tensor_chunks(name, tensor, chunk_bytes))
    if pending is not None:
        yield pending


def _tensor_chunks(name: str, tensor: torch.Tensor, chunk_bytes: int) -> Iterator[dict]:
    """One tensor's chunks as ``TensorChunk`` fields, ``chunk_bytes`` of data each, the first with the CRC-32 of all
    its bytes."""
    if tensor.dtype not in _WIRE_DTYPES:
        raise ValueError(f"{name}: dtype {tensor.dtype} is not a floating-point weight dtype")
    data = tensor.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()
    shape = list(tensor.shape)
    crc32 = zlib.crc32(data)
    for start in range(0, max(len(data), 1), chunk_bytes):
        yield {"name": name, "dtype": _WIRE_DTYPES[tensor.dtype], "shape": shape,
               "data": data[start : start + chunk_bytes].tobytes(), "crc32": crc32 if start == 0 else None}


@dataclass(frozen=True)
class ServerInfo:
    """What an experience server said of itself (``GetServerInfo``): ``features`` it takes beyond the contract's
    first version (e.g. :data:`TENSOR_BATCHES`); ``policy_dtype``: the type its policy is served in ("bfloat16",
    ...; "" unknown)."""

    features: frozenset[str] = frozenset()
    policy_dtype: str = ""


def server_info(stub: experience_pb2_grpc.ExperienceServiceStub, timeout_s: float) -> ServerInfo:
    """The experience server's :class:`ServerInfo`; an empty one from a server older than that call
    (UNIMPLEMENTED). A ``policy_dtype`` outside :data:`~fastexp.types.FLOAT_DTYPES` is read as unknown.

    Raises:
        grpc.RpcError: any other failure (UNAVAILABLE, UNAUTHENTICATED, DEADLINE_EXCEEDED).
    """
    try:
        info = stub.GetServerInfo(experience_pb2.GetServerInfoRequest(), timeout=timeout_s)
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            return ServerInfo()
        raise
    return ServerInfo(frozenset(info.features), info.policy_dtype if info.policy_dtype in FLOAT_DTYPES else "")
