import numpy as np
import pytest
import torch

from fastexp.tensor_codec import TensorDecodeError, from_numpy, from_torch, to_numpy, to_torch, write_torch
from fastexp.v1 import tensor_pb2


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool],
)
def test_torch_round_trip_keeps_values_dtype_and_shape(dtype):
    source = (torch.arange(24).reshape(2, 3, 4) - 7).to(dtype)
    decoded = to_torch(tensor_pb2.Tensor.FromString(from_torch(source).SerializeToString()))
    assert decoded.dtype == dtype and decoded.shape == (2, 3, 4)
    assert torch.equal(decoded, source)


def test_bytes_are_little_endian_c_order():
    message = from_numpy(np.array([[1, 2], [3, 256]], dtype=">i4").T)  # big-endian, Fortran-ordered view
    assert message.shape == [2, 2]
    assert message.data == np.array([[1, 3], [2, 256]], dtype="<i4").tobytes()
    assert to_numpy(message).tolist() == [[1, 3], [2, 256]]


def test_bfloat16_is_upper_half_of_float32():
    message = from_torch(torch.tensor([1.0, -2.5], dtype=torch.bfloat16))
    expected = (np.array([1.0, -2.5], dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()
    assert message.data == expected


def test_scalar_and_empty():
    assert to_torch(from_torch(torch.tensor(3.5))).item() == 3.5
    assert to_torch(from_torch(torch.zeros(0, 5))).shape == (0, 5)


def test_malformed_messages_are_rejected():
    with pytest.raises(TensorDecodeError, match="needs 16 bytes"):
        to_numpy(tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4], data=b"\0" * 15))
    with pytest.raises(TensorDecodeError, match="unknown dtype"):
        to_numpy(tensor_pb2.Tensor(dtype=0, shape=[1], data=b"\0"))
    with pytest.raises(TensorDecodeError, match="negative"):
        to_numpy(tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, shape=[-1], data=b""))
    with pytest.raises(TypeError):
        from_numpy(np.array(["a"]))


def test_write_torch_replaces_a_field_in_place_and_takes_any_layout():
    holder = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[7, 7], data=b"\0" * 392)
    source = torch.arange(12, dtype=torch.float32).reshape(3, 4).T.requires_grad_()  # strided, needs grad
    write_torch(source, holder)
    assert holder.shape == [4, 3] and holder.dtype == tensor_pb2.DTYPE_FLOAT32
    assert torch.equal(to_torch(holder), source.detach())


def test_decoded_tensor_owns_writable_memory():
    message = from_torch(torch.ones(3))
    decoded = to_torch(message)
    decoded += 1  # would fail on a read-only view of the message's bytes
    assert torch.equal(to_torch(message), torch.ones(3))
