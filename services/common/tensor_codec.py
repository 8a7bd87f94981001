"""``fastexp.v1.Tensor`` <-> numpy / torch.

Tensors travel as raw little-endian, C-order bytes with dtype and shape: never as repeated floats, never pickled.
bfloat16 has no numpy dtype; it is carried as the upper 16 bits of float32 and decoded through torch.
"""

from __future__ import annotations

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
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        bits = tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
        return tensor_pb2.Tensor(
            dtype=DType.DTYPE_BFLOAT16, shape=list(tensor.shape), data=bits.astype("<u2").tobytes()
        )
    return from_numpy(tensor.numpy())


def to_torch(message: tensor_pb2.Tensor) -> torch.Tensor:
    """Decode a ``Tensor`` into a CPU torch tensor that owns its memory.

    Raises:
        TensorDecodeError: the message is malformed.
    """
    import torch

    raw = _raw_array(message)
    if message.dtype == DType.DTYPE_BFLOAT16:
        return torch.from_numpy(raw.astype(np.int16, copy=True)).view(torch.bfloat16)
    return torch.from_numpy(raw.astype(_NUMPY_DTYPES[message.dtype].newbyteorder("="), copy=True))


def _raw_array(message: tensor_pb2.Tensor) -> np.ndarray:
    if message.dtype not in _NUMPY_DTYPES:
        raise TensorDecodeError(f"unknown dtype {message.dtype}")
    shape = tuple(message.shape)
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"negative dimension in shape {shape}")
    dtype = _NUMPY_DTYPES[message.dtype]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(message.data) != expected:
        raise TensorDecodeError(
            f"shape {shape} of {DType.Name(message.dtype)} needs {expected} bytes, got {len(message.data)}"
        )
    return np.frombuffer(message.data, dtype=dtype).reshape(shape)
