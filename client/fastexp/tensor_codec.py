"""``fastexp.v1.Tensor`` <-> numpy / torch.

Tensors travel as raw little-endian, C-order bytes with dtype and shape: never as repeated floats, never pickled.
bfloat16 has no numpy dtype; it is carried as the upper 16 bits of float32 and decoded through torch.

The torch paths copy each tensor's bytes once each way (``write_torch`` fills a message field in place;
``to_torch`` wraps one owned copy of the bytes): experience batches are many small tensors, so per-tensor
overhead, not bandwidth, is what the stream pays (``benchmarks/``, ratio ``stream_vs_raw_bytes``).
"""

from __future__ import annotations

import math
import sys
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from fastexp.v1 import tensor_pb2

if TYPE_CHECKING:
    import torch

DType = tensor_pb2.DType

_NUMPY_DTYPES: dict[int, np.dtype] = {
    DType.DTYPE_FLOAT32: np.dtype("<f4"),
    DType.DTYPE_FLOAT16: np.dtype("<f2"),
    DType.DTYPE_BFLOAT16: np.dtype("<u2"),  # raw bits; see to_torch
    DType.DTYPE_FLOAT64: np.dtype("<f8"),
    DType.DTYPE_INT64: np.dtype("<i8"),
    DType.DTYPE_INT32: np.dtype("<i4"),
    DType.DTYPE_INT16: np.dtype("<i2"),
    DType.DTYPE_INT8: np.dtype("i1"),
    DType.DTYPE_UINT8: np.dtype("u1"),
    DType.DTYPE_BOOL: np.dtype("?"),
}
_FROM_NUMPY: dict[np.dtype, int] = {
    np.dtype(v).newbyteorder("="): k for k, v in _NUMPY_DTYPES.items() if k != DType.DTYPE_BFLOAT16
}


class TensorDecodeError(ValueError):
    """A ``Tensor`` message is malformed: unknown dtype, negative dimension, or a byte count that disagrees
    with its shape."""


def from_numpy(array: np.ndarray) -> tensor_pb2.Tensor:
    """Encode a numpy array (any byte order or layout) as a ``Tensor``.

    Raises:
        TypeError: the dtype has no ``DType`` (e.g. complex, object, unicode).
    """
    native = np.dtype(array.dtype).newbyteorder("=")
    try:
        dtype = _FROM_NUMPY[native]
    except KeyError:
        raise TypeError(f"no fastexp.v1.DType for numpy dtype {array.dtype}") from None
    data = np.ascontiguousarray(array, dtype=_NUMPY_DTYPES[dtype]).tobytes()
    return tensor_pb2.Tensor(dtype=dtype, shape=list(array.shape), data=data)


def to_numpy(message: tensor_pb2.Tensor) -> np.ndarray:
    """Decode a ``Tensor`` into a read-only numpy array in native byte order.

    Raises:
        TensorDecodeError: the message is malformed, or it is bfloat16 (use :func:`to_torch`).
    """
    if message.dtype == DType.DTYPE_BFLOAT16:
        raise TensorDecodeError("bfloat16 has no numpy dtype; decode it with to_torch")
    return _raw_array(message).astype(_NUMPY_DTYPES[message.dtype].newbyteorder("="), copy=False)


def from_torch(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    """Encode a torch tensor (any device, contiguous or not) as a ``Tensor``; bfloat16 is kept as bfloat16.

    Raises:
        TypeError: the dtype has no ``DType``.
    """
    message = tensor_pb2.Tensor()
    write_torch(tensor, message)
    return message


def write_torch(tensor: torch.Tensor, target: tensor_pb2.Tensor) -> None:
    """Encode ``tensor`` into ``target`` (e.g. a message's tensor field) in place, replacing what it held;
    one copy of the bytes, none of the message.

    Raises:
        TypeError: the dtype has no ``DType``.
    """
    try:
        dtype = _torch_to_dtype()[tensor.dtype]
    except KeyError:
        raise TypeError(f"no fastexp.v1.DType for torch dtype {tensor.dtype}") from None
    if tensor.requires_grad or tensor.device.type != "cpu":
        tensor = tensor.detach().cpu()
    array = tensor.contiguous()
    if dtype == _BFLOAT16:
        array = array.view(_torch_dtypes()[_INT16])
    host = array.numpy()
    if _BIG_ENDIAN_HOST:
        host = host.astype(host.dtype.newbyteorder("<"))
    target.dtype = dtype
    target.shape[:] = tensor.shape
    target.data = host.tobytes()


def to_torch(message: tensor_pb2.Tensor) -> torch.Tensor:
    """Decode a ``Tensor`` into a CPU torch tensor that owns its memory (the bytes copied once, by us).

    Raises:
        TensorDecodeError: the message is malformed.
    """
    import torch

    data = message.data  # upb hands out a new bytes object per access: read it once
    shape = _checked_shape(message, data)
    raw = np.frombuffer(data, dtype=_NUMPY_DTYPES[message.dtype]).reshape(shape)
    native = raw.astype(raw.dtype.newbyteorder("=")) if _BIG_ENDIAN_HOST else raw.copy()
    if message.dtype == _BFLOAT16:
        return torch.from_numpy(native.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(native)


_BIG_ENDIAN_HOST = sys.byteorder == "big"
_BFLOAT16 = int(DType.DTYPE_BFLOAT16)
_INT16 = int(DType.DTYPE_INT16)
_ITEMSIZE: dict[int, int] = {dtype: numpy_dtype.itemsize for dtype, numpy_dtype in _NUMPY_DTYPES.items()}


@cache
def _torch_dtypes() -> dict[int, torch.dtype]:
    import torch

    return {
        DType.DTYPE_FLOAT32: torch.float32, DType.DTYPE_FLOAT16: torch.float16, DType.DTYPE_BFLOAT16: torch.bfloat16,
        DType.DTYPE_FLOAT64: torch.float64, DType.DTYPE_INT64: torch.int64, DType.DTYPE_INT32: torch.int32,
        DType.DTYPE_INT16: torch.int16, DType.DTYPE_INT8: torch.int8, DType.DTYPE_UINT8: torch.uint8,
        DType.DTYPE_BOOL: torch.bool,
    }


@cache
def _torch_to_dtype() -> dict[torch.dtype, int]:
    return {v: k for k, v in _torch_dtypes().items()}


def _checked_shape(message: tensor_pb2.Tensor, data: bytes) -> tuple[int, ...]:
    """The message's shape, after checking its dtype, dimensions and byte count."""
    itemsize = _ITEMSIZE.get(message.dtype)
    if itemsize is None:
        raise TensorDecodeError(f"unknown dtype {message.dtype}")
    shape = tuple(message.shape)
    if shape and min(shape) < 0:
        raise TensorDecodeError(f"negative dimension in shape {shape}")
    expected = math.prod(shape) * itemsize
    if len(data) != expected:
        raise TensorDecodeError(
            f"shape {shape} of {DType.Name(message.dtype)} needs {expected} bytes, got {len(data)}"
        )
    return shape


def _raw_array(message: tensor_pb2.Tensor) -> np.ndarray:
    data = message.data
    shape = _checked_shape(message, data)
    return np.frombuffer(data, dtype=_NUMPY_DTYPES[message.dtype]).reshape(shape)
