"""``LoadAdapter`` streams on the generator: their receiver, which assembles the tensors in memory (an adapter is
MBs: no staging on disk) and checks them as they arrive (the sender's side:
:func:`services.common.weights.wire.adapter_chunks`).

The receiver checks the header's name and config first, each tensor's name, dtype and shape on its first chunk
(before its bytes are held), and each tensor's CRC-32 and values (no NaN, no infinity) once its last byte arrived,
while the next ones are still on their way; the engine then checks the whole adapter again
(:func:`services.common.lora.check_adapter`: nothing missing; its values not scanned twice) before applying it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import torch

from fastexp.types import FLOAT_DTYPES
from fastexp.v1 import generation_pb2
from services.common.errors import InvalidRequest
from services.common.lora import AdapterConfig, check_config, check_tensor
from services.common.weights.checks import all_finite
from services.common.weights.wire import DTYPE_NAMES, header_then_chunks

#: The longest ``AdapterHeader.weights_digest`` taken (``sha256:`` and 64 hex digits fit with room).
MAX_DIGEST_CHARS = 128


@dataclass(frozen=True)
class ReceivedAdapter:
    """A ``LoadAdapter`` stream, read: the adapter's name, config, tensors (peft names, CPU) and version."""

    name: str
    config: AdapterConfig
    tensors: dict[str, torch.Tensor]
    version: int | None  # None: the previous + 1
    num_bytes: int
    weights_digest: str = ""  # what the sender says these tensors are ("": not said)


async def receive_adapter(
    messages: AsyncIterator[generation_pb2.AdapterChunk], modules: Mapping[str, tuple[int, int]], max_rank: int
) -> ReceivedAdapter:
    """Read a ``LoadAdapter`` stream into memory, checked as it arrives against the base's linear ``modules``.

    Raises:
        InvalidRequest: no header first or a second one, an empty message or an unknown kind; a bad name or config (``adapter``, ``config.rank``, ...)
            or a ``header.weights_digest`` over 128 characters;
            a tensor that is not one the config produces, or of the wrong dtype or shape, sent twice, split over
            non-consecutive chunks, short or long, failing its CRC-32 or holding NaN or infinite values
            (``tensors[<name>]``); a count other than ``header.num_tensors``.
    """
    taken: list[tuple[generation_pb2.AdapterHeader, AdapterConfig, _Assembler]] = []

    def take(header: generation_pb2.AdapterHeader) -> None:
        if len(header.weights_digest) > MAX_DIGEST_CHARS:
            raise InvalidRequest("header.weights_digest", f"over {MAX_DIGEST_CHARS} characters")
        config = AdapterConfig(header.rank, header.alpha, tuple(header.target_modules), header.use_rslora)
        taken.append((header, config, _Assembler(check_config(header.name, config, modules, max_rank))))

    async for chunk in header_then_chunks(messages, take):
        taken[0][2].add(chunk)
    header, config, assembler = taken[0]
    tensors = assembler.finish()
    if header.num_tensors != len(tensors):
        raise InvalidRequest("header.num_tensors", f"{header.num_tensors} announced, {len(tensors)} arrived")
    version = header.version if header.HasField("version") else None
    return ReceivedAdapter(header.name, config, tensors, version, assembler.num_bytes, header.weights_digest)


@dataclass
class _Assembler:
    """Joins tensor chunks in memory: one tensor at a time, its bytes checked against its shape and CRC-32."""

    expected: Mapping[str, tuple[int, int]]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    num_bytes: int = 0
    _name: str | None = None  # the tensor being received
    _wire_dtype: int = 0
    _dtype: str = ""
    _shape: tuple[int, ...] = ()
    _parts: list[bytes] = field(default_factory=list)
    _held: int = 0  # its bytes so far
    _crc32: int = 0  # the sender's

    def add(self, chunk: generation_pb2.TensorChunk) -> None:
        if chunk.name != self._name:
            self._close()
            self._open(chunk)
        elif chunk.dtype != self._wire_dtype or tuple(chunk.shape) != self._shape:
            raise InvalidRequest(f"tensors[{chunk.name}]", "dtype and shape must be the same on every chunk")
        data = chunk.data  # upb hands out a new bytes object per access: read it once
        self._held += len(data)
        if self._held > math.prod(self._shape) * FLOAT_DTYPES[self._dtype].itemsize:
            raise InvalidRequest(f"tensors[{chunk.name}]", f"more bytes than its shape {list(self._shape)} holds")
        self._parts.append(data)

    def _open(self, chunk: generation_pb2.TensorChunk) -> None:
        field_name = f"tensors[{chunk.name}]"
        if chunk.name in self.tensors:
            raise InvalidRequest(field_name, "sent twice (chunks of a tensor must be consecutive)")
        dtype = DTYPE_NAMES.get(chunk.dtype, f"DType value {chunk.dtype}")
        if dtype not in FLOAT_DTYPES:
            raise InvalidRequest(field_name, f"dtype {dtype} is not a floating-point type")
        check_tensor(chunk.name, FLOAT_DTYPES[dtype], tuple(chunk.shape), self.expected)
        if not chunk.HasField("crc32"):
            raise InvalidRequest(field_name, "the first chunk must carry crc32, the CRC-32 (zlib.crc32) of its bytes")
        self._name, self._wire_dtype, self._dtype, self._shape = chunk.name, chunk.dtype, dtype, tuple(chunk.shape)
        self._parts, self._held, self._crc32 = [], 0, chunk.crc32

    def _close(self) -> None:
        if self._name is None:
            return
        data = bytearray().join(self._parts)  # the tensor's own memory, writable: the one copy of its bytes
        field_name = f"tensors[{self._name}]"
        expected = math.prod(self._shape) * FLOAT_DTYPES[self._dtype].itemsize
        if len(data) != expected:
            raise InvalidRequest(field_name, f"{len(data)} of {expected} bytes arrived")
        if zlib.crc32(data) != self._crc32:
            raise InvalidRequest(field_name, f"CRC-32 {zlib.crc32(data):#010x} of the received bytes != the "
                                 f"sender's {self._crc32:#010x} (corrupted in transit); nothing was applied")
        # little-endian on the wire; fastexp's hosts are too (never empty: check_tensor took a shape of rank >= 1)
        raw = torch.frombuffer(data, dtype=torch.uint8)  # a view of ``data``, which it keeps alive
        tensor = raw.view(FLOAT_DTYPES[self._dtype]).reshape(self._shape)
        if not all_finite(tensor):
            raise InvalidRequest(field_name, "holds NaN or infinite values")
        self.tensors[self._name] = tensor
        self.num_bytes += len(data)
        self._name, self._parts = None, []

    def finish(self) -> dict[str, torch.Tensor]:
        """The tensors received, once the last one is complete."""
        self._close()
        return self.tensors
