"""Multi-GPU generator settings: parallelism the backend or the machine cannot run is a clear start-up error,
raised before any model is loaded (the real ``fastexp serve generator`` exits 2 naming the settings)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.generator.server import ParallelismError, check_parallelism
from services.generator.vllm_engine import engine_options


@pytest.mark.parametrize(("tp", "dp", "backend", "gpus"), [(1, 1, "hf", 0), (1, 1, "vllm", 0), (2, 1, "vllm", 2),
                                                           (2, 2, "vllm", 8)])
def test_parallelism_that_fits_is_accepted(tp, dp, backend, gpus):
    check_parallelism(tp, dp, backend, gpus)


@pytest.mark.parametrize(
    ("tp", "dp", "backend", "gpus", "message"),
    [(2, 1, "vllm", 1, "= 2 GPUs, but this machine has 1 visible"),
     (4, 2, "vllm", 4, "tensor_parallel_size=4 x data_parallel_size=2 = 8 GPUs"),
     (2, 1, "hf", 8, "the hf backend runs one device")],
)
def test_parallelism_that_does_not_fit_names_the_settings(tp, dp, backend, gpus, message):
    with pytest.raises(ParallelismError, match=message.replace("(", r"\(")):
        check_parallelism(tp, dp, backend, gpus)


def test_engine_options_carry_the_parallel_sizes_only_when_set():
    pytest.importorskip("vllm")
    assert "tensor_parallel_size" not in engine_options("m")
    options = engine_options("m", tensor_parallel_size=2, data_parallel_size=2)
    assert (options["tensor_parallel_size"], options["data_parallel_size"]) == (2, 2)


def test_the_generator_refuses_to_start_with_more_gpus_than_the_machine_has():
    env = dict(os.environ, FASTEXP_GENERATOR_TENSOR_PARALLEL_SIZE="2", FASTEXP_GENERATOR_BACKEND="vllm",
               CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", "generator", "--port", "0"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "generator refuses to start" in done.stderr
    assert "tensor_parallel_size=2 x data_parallel_size=1 = 2 GPUs, but this machine has 0 visible" in done.stderr

