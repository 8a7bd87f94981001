"""fastexp's vLLM plugin, through vLLM's own plugin loader in a fresh interpreter (as vLLM's engine core and workers
load it): with FASTEXP_VLLM_BUSY_LOOP_S set, every message-queue reader made afterwards spins that long; unset,
vLLM's own 1 s stays (another vLLM user of the environment is untouched)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("vllm")

READER = """
import tempfile, zmq
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators import shm_broadcast
load_general_plugins()
address = "ipc://" + tempfile.mktemp(prefix="fastexp-spin-")
reader = shm_broadcast.SpinCondition(is_reader=True, context=zmq.Context(), notify_address=address)
print(reader.busy_loop_s, shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
"""


def _reader_spin(env_value: str | None) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k != "FASTEXP_VLLM_BUSY_LOOP_S"}
    if env_value is not None:
        env["FASTEXP_VLLM_BUSY_LOOP_S"] = env_value
    done = subprocess.run([sys.executable, "-c", READER], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    spin, recheck_ms = done.stdout.strip().splitlines()[-1].split()
    return float(spin), int(recheck_ms)


def test_the_plugin_is_registered_where_vllm_looks():
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("fastexp_busy_loop") == "services.generator.vllm_plugin:register"


def test_a_reader_spins_what_the_setting_says_and_vllms_own_without_it():
    """With the setting, a parked reader also re-checks its queue every 10 ms (a lost notification cost 5 s)."""
    assert _reader_spin("0.0") == (0.0, 10)
    assert _reader_spin("0.002") == (0.002, 10)
    assert _reader_spin(None) == (1.0, 5000)  # vLLM 0.32's own
