"""A trainer's side of ``UpdateWeights``: named tensors as a stream of ``WeightsChunk`` messages."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

import torch

from fastexp.types import FLOAT_DTYPES, Target
from fastexp.v1 import generation_pb2, tensor_pb2

_WIRE_DTYPES = {torch_dtype: getattr(tensor_pb2, f"DTYPE_{name.upper()}") for name, torch_dtype in FLOAT_DTYPES.items()}
#: ``WeightsTarget`` enum value -> target.
TARGETS: dict[int, Target] = {
    generation_pb2.WEIGHTS_TARGET_POLICY: "policy", generation_pb2.WEIGHTS_TARGET_CRITIC: "critic",
}


def weight_chunks(
    tensors: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int = 4 * 1024 * 1024,
    checkpoint_dir: str | None = None, target: Target = "policy", num_tensors: int | None = None,
    policy_version: int | None = None,
) -> Iterator[generation_pb2.WeightsChunk]:
    """The ``UpdateWeights`` messages for named tensors (checkpoint/HF names), ``chunk_bytes`` of data each.

    Tensors are sent in their own floating dtype (the receiver casts to the model's), one at a time, so the
    sender holds one CPU copy of one tensor; each tensor's first chunk carries the CRC-32 (``zlib.crc32``) of its
    bytes, which the receiver checks before applying anything. With ``checkpoint_dir`` only the header is sent.
    ``num_tensors`` (when ``tensors`` is a lazy iterator) is announced in the header; otherwise ``tensors`` is
    listed first. ``policy_version``: the version the update makes live (``None``: the receiver's previous + 1;
    an experience service sets it to keep a fleet of generators in step).

    Raises:
        ValueError: a tensor is not floating point; ``chunk_bytes`` < 1.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
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
    for name, tensor in tensors:
        if tensor.dtype not in _WIRE_DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} is not a floating-point weight dtype")
        data = tensor.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()
        shape = list(tensor.shape)
        crc32 = zlib.crc32(data)
        for start in range(0, max(len(data), 1), chunk_bytes):
            yield generation_pb2.WeightsChunk(
                tensor=generation_pb2.TensorChunk(
                    name=name, dtype=_WIRE_DTYPES[tensor.dtype], shape=shape,
                    data=data[start : start + chunk_bytes].tobytes(), crc32=crc32 if start == 0 else None,
                )
            )
