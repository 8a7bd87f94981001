"""``dtype: auto``: bfloat16 where the device multiplies it natively, float32 where it does not; a named dtype is
kept as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.dtypes import native_bfloat16, resolve_dtype


@pytest.mark.parametrize("named", ["bfloat16", "float16", "float32"])
def test_a_named_dtype_is_kept(named):
    assert resolve_dtype(named, "cpu") == named


def test_auto_on_this_cpu_follows_its_instruction_set():
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(value.split())
            break
    native = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    assert native_bfloat16("cpu") is native
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")


def test_auto_on_a_cuda_device_follows_the_gpu():
    expected = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    assert resolve_dtype("auto", "cuda") == ("bfloat16" if expected else "float32")
