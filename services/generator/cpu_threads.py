"""The threads of a CPU engine's model, set at run time (``SetCpuThreads``).

vLLM on CPU binds its worker's OpenMP threads one per core at start (``VLLM_CPU_OMP_THREADS_BIND``). A host that
also runs the experience service's forward passes lends the engine every bound core while the forwards have
nothing to do and takes some back while they run (:mod:`services.experience.fleet.cores`). The team size is set
in the worker between engine steps (``collective_rpc``, :meth:`~services.generator.vllm_worker.WeightLoaderExtension.fastexp_cpu_threads`);
its threads keep their cores, so a smaller team runs on the first ones.

Measured on 2 cores (SmolLM2, 32 sequences of 128 tokens): 414 tokens/s on 2 threads, 261 after setting 1, 413
after setting 2 again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from services.common import metrics
from services.common.errors import InvalidRequest

logger = logging.getLogger(__name__)

#: How long the workers may take to answer a change: one engine step (a long prefill on a CPU: seconds) and the call.
RPC_TIMEOUT_S = 60.0


def bind_model_threads() -> None:
    """Give the calling thread (the engine's: it runs the model) the cores of ``VLLM_CPU_OMP_THREADS_BIND`` that
    this process may use, and an OpenMP team of one thread per core, as vLLM's multiprocessing executor gives its
    worker process (through ``OMP_NUM_THREADS``, read once when a process starts: too late here, so torch's setter
    instead). The team's threads, created by this thread at its first parallel region, inherit its cores; unlike
    vLLM's worker they are not pinned one per core (a smaller team from ``SetCpuThreads`` may run on any of them).
    ``auto``: every logical CPU this process may use (vLLM's own ``auto`` takes one per physical core and keeps one
    for its engine-core process, which this engine does not have); ``nobind``: the team ``OMP_NUM_THREADS`` gives.

    Raises:
        ValueError: the bind list names no CPU this process may use.
    """
    import torch
    from vllm import envs
    from vllm.utils.cpu_resource_utils import parse_id_list

    bind = envs.VLLM_CPU_OMP_THREADS_BIND
    if bind == "nobind":
        return
    allowed = os.sched_getaffinity(0)
    asked = allowed if bind == "auto" else set(parse_id_list(bind))
    cores = asked & allowed
    if not cores:
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={bind} names no CPU this process may use ({sorted(allowed)})")
    if cores != asked:
        logger.warning("VLLM_CPU_OMP_THREADS_BIND=%s: only %s are this process's", bind, sorted(cores))
    if bind != "auto":
        os.sched_setaffinity(0, cores)  # 0: this thread only
    torch.set_num_threads(len(cores))
    logger.info("vLLM's model runs on %d threads (cores %s)", len(cores), sorted(cores))


class CpuThreads:
    """Owner of one vLLM CPU engine's model threads (all its workers alike). ``max_threads``: the threads it
    started with (its bound cores), read by :meth:`start`."""

    def __init__(self, engine: Any) -> None:
        """``engine``: vLLM's ``AsyncLLM``."""
        self._engine = engine
        self.max_threads = 0
        self.threads = 0
        self._setting = asyncio.Lock()  # one change at a time: the reply's count is the one applied

    async def start(self) -> None:
        """Prepare the CPU workers (:meth:`~services.generator.vllm_worker.WeightLoaderExtension.fastexp_setup_cpu`)
        and read the threads they started with (the most :meth:`set` allows)."""
        self.max_threads = self.threads = min(await self._engine.collective_rpc("fastexp_setup_cpu", timeout=RPC_TIMEOUT_S))
        metrics.GENERATOR_CPU_THREADS.set(self.threads)

    async def set(self, threads: int) -> int:
        """Run the model on ``threads`` of its bound cores from the next engine step (0: all of them); returns the
        threads now.

        Raises:
            InvalidRequest: ``threads`` beyond :attr:`max_threads`. What vLLM raises when its workers do not answer
                within :data:`RPC_TIMEOUT_S` (the change may still apply; the count reported stays the last known).
        """
        if threads > self.max_threads:
            raise InvalidRequest("threads", f"{threads} is more than the engine's {self.max_threads} bound cores")
        # a caller that gives up does not stop a change the workers may already apply: what is reported stays true
        return await asyncio.shield(self._apply(threads or self.max_threads))

    async def _apply(self, threads: int) -> int:
        async with self._setting:
            applied = await self._engine.collective_rpc("fastexp_cpu_threads", timeout=RPC_TIMEOUT_S,
                                                          args=(threads,))
            self.threads = min(applied)
            metrics.GENERATOR_CPU_THREADS.set(self.threads)
            return self.threads
