"""fastexp's vLLM plugin: how long vLLM's message-queue readers spin before they sleep.

vLLM's shared-memory message queue (``vllm.distributed.device_communicators.shm_broadcast``), between its engine
core and its workers, lets a reader spin (``sched_yield`` in a loop) for ``busy_loop_s`` seconds after every read
before it sleeps on a socket notification; vLLM 0.32 fixes that at 1 s, with no setting. On a GPU host the spinning
core is otherwise idle and the spin saves microseconds per step. On a CPU host those are the cores the model runs
on: the engine core spins while its worker computes each step, and the worker spins for a second after each step
(16 of vLLM's 92 CPU seconds in a ``make demo`` profile, benchmarks/README.md).

vLLM loads ``vllm.general_plugins`` entry points (``pyproject.toml`` names :func:`register`) in each of its
processes, the engine core's and every worker's, before their queues exist. With :data:`BUSY_LOOP_ENV` set (the
generator sets it from its ``vllm_busy_loop_s`` setting before it starts the engine: the processes inherit it),
every queue reader made afterwards in that process spins that long; unset, the plugin changes nothing (another
vLLM user of the same environment: TRL's). A vLLM whose ``SpinCondition`` has no ``busy_loop_s`` parameter any more
is left as it is, with a warning.

A reader that does not spin parks on its socket after every read, and a notification can be lost there: vLLM then
finds the message only at its next re-check of the queue, 5 s later ("bounds lost-notify recovery latency to ~5s",
its comment says). Measured here with the spin off: every second ``collective_rpc`` took 5.0 s instead of 2 ms,
and a generation of 32 x 128 tokens with four of them took 20.7 s instead of 10.5 s. Where it applies the plugin
also re-checks every :data:`RECHECK_S` (10 ms: each parked reader wakes 100 times a second to read one flag), which
brought those calls to 1-120 ms.
"""

from __future__ import annotations

import inspect
import logging
import os

logger = logging.getLogger(__name__)

BUSY_LOOP_ENV = "FASTEXP_VLLM_BUSY_LOOP_S"
#: How often a parked reader re-reads the queue's written-flag (vLLM 0.32: every 5 s), where the plugin applies.
RECHECK_S = 0.01


def register() -> None:
    """The entry point: apply :data:`BUSY_LOOP_ENV`'s seconds to vLLM's queue readers (module docs)."""
    value = os.environ.get(BUSY_LOOP_ENV)
    if not value:
        return
    seconds = float(value)
    if seconds < 0:
        raise ValueError(f"{BUSY_LOOP_ENV} must be >= 0 seconds, got {value!r}")
    from vllm.distributed.device_communicators import shm_broadcast

    condition = getattr(shm_broadcast, "SpinCondition", None)
    init = getattr(condition, "__init__", None)
    parameters = list(inspect.signature(init).parameters) if init is not None else []
    if not parameters or parameters[-1] != "busy_loop_s" or len(init.__defaults__ or ()) != 1:
        logger.warning("%s=%s ignored: this vLLM's shm_broadcast.SpinCondition takes no trailing busy_loop_s",
                       BUSY_LOOP_ENV, value)
        return
    init.__defaults__ = (seconds,)
    if hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):  # read by each wait, from the module
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = int(RECHECK_S * 1000)


def set_busy_loop(seconds: float | None) -> None:
    """For the vLLM processes started after this call: their queue readers spin ``seconds`` (None: vLLM's own).

    Raises:
        ValueError: ``seconds`` < 0.
    """
    if seconds is None:
        os.environ.pop(BUSY_LOOP_ENV, None)
        return
    if seconds < 0:
        raise ValueError(f"vllm_busy_loop_s must be >= 0 seconds, got {seconds}")
    os.environ[BUSY_LOOP_ENV] = repr(float(seconds))
