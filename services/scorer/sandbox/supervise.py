"""How a local backend watches one run: both output streams read and bounded, the wall clock, and the run's whole
tree sampled against its per-run limits until it ends or is stopped.

Shared by :mod:`.bubblewrap` and :mod:`.gvisor`; each brings its own :class:`Watch` (how its tree's use is read:
from the host's ``/proc`` for a bubblewrap run, from the sandbox's own kernel's memory for a gVisor one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from services.scorer.sandbox.base import SandboxLimits
from services.scorer.sandbox.tree import RunTree
from services.scorer.sandbox.usage import READ_ALLOWANCE_S, SampleOverBudget, TreeUsage

#: A run's tree's use now and the files in its writable folder (None: not known), from the pid of the process the
#: scorer started. Runs off the event loop; raises :class:`~services.scorer.sandbox.usage.SampleOverBudget` where
#: the reading would take too long.
Sampler = Callable[[int], tuple[TreeUsage, int | None]]


@dataclass(frozen=True)
class Watch:
    """How a run is watched: ``sample`` every ``poll_s`` seconds, its files held against ``max_files`` (None: its
    sampler counts no files apart);
    ``stderr_prefix`` bytes the backend writes first on stderr (its start marker), kept beyond the output limit;
    ``oom_kills``: the processes the kernel killed at the run's memory group's limit (None: no group), read each
    sample: one is the run over its memory; ``group_cpu_s``: the CPU seconds its ``cpuacct`` group counted (None: no
    group), read each sample: the run's CPU is the larger of it and the sampled figure (:mod:`.cgroup`)."""

    sample: Sampler
    poll_s: float
    max_files: int | None = None
    stderr_prefix: int = 0
    oom_kills: Callable[[], int] | None = None
    group_cpu_s: Callable[[], float | None] | None = None


async def collect(process: asyncio.subprocess.Process, tree: RunTree, limits: SandboxLimits,
                  watch: Watch) -> tuple[str, bytes, bytes]:
    """Wait for ``process`` while reading both streams, each kept up to one byte past ``max_output_bytes``, and
    kill its whole tree at ``timeout_s``, once it passes a per-run limit (:func:`_watch`) or once a stream passes
    ``max_output_bytes``; returns why it was stopped (``""``: it ended by itself) and both streams.

    However the call ends (its result, the timeout, the caller's cancellation), the tree is killed and reaped
    before it returns or its cancellation completes (:meth:`RunTree.end`).
    """
    keep = limits.max_output_bytes + 1
    overflow = asyncio.Event()
    reads = asyncio.gather(_drain(process.stdout, keep, overflow),
                           _drain(process.stderr, keep + watch.stderr_prefix, overflow))
    try:
        async with asyncio.timeout(limits.timeout_s):  # not wait_for: see tests/unit/test_architecture.py
            stopped = await _watch(process, limits, watch, overflow)
    except TimeoutError:
        stopped = "timeout"
    except BaseException:  # the caller gave up (cancelled, its deadline): the run ends here, before its slot is free
        await tree.end()
        reads.cancel()
        raise
    if stopped:
        await tree.end()
    stdout, stderr = await reads
    return stopped, stdout, stderr


async def _watch(process: asyncio.subprocess.Process, limits: SandboxLimits, watch: Watch,
                 overflow: asyncio.Event) -> str:
    """Wait for ``process`` to end (``""``), sampling its tree's use every ``poll_s``: ``"cpu"`` once it passed
    ``cpu_s`` CPU seconds, ``"memory"`` once it holds more than ``memory_bytes``
    (:attr:`~services.scorer.sandbox.usage.TreeUsage.memory_bytes`), ``"files"`` once its writable folder holds
    more than ``max_files``, ``"output"`` once ``overflow`` is set, ``"usage"`` once a sample takes longer than
    :data:`~services.scorer.sandbox.usage.MAX_SAMPLE_S` (the caller kills it)."""
    ended = asyncio.ensure_future(process.wait())
    overflowed = asyncio.ensure_future(overflow.wait())
    try:
        return await _sample_until(process.pid, ended, overflowed, limits, watch)
    finally:
        overflowed.cancel()


async def _sample_until(root: int, ended: asyncio.Future, overflowed: asyncio.Future, limits: SandboxLimits,
                        watch: Watch) -> str:
    """:func:`_watch`'s loop: why the run is to be stopped, or ``""`` once ``ended``. The scorer's CPU reading the
    run's mappings and sockets past :data:`~services.scorer.sandbox.usage.READ_ALLOWANCE_S` a sample counts toward
    ``cpu_s`` (:mod:`services.scorer.sandbox.usage`)."""
    charged_s = 0.0
    while not ended.done():
        await asyncio.wait({ended, overflowed}, timeout=watch.poll_s, return_when=asyncio.FIRST_COMPLETED)
        if ended.done():
            break
        if overflowed.done():
            return "output"
        try:
            usage, files = await asyncio.to_thread(watch.sample, root)
        except SampleOverBudget:  # its use cannot be measured in time: fail closed
            return "usage"
        charged_s += max(0.0, usage.read_cpu_s - READ_ALLOWANCE_S)
        counted_s = (watch.group_cpu_s() or 0.0) if watch.group_cpu_s is not None else 0.0
        if max(usage.cpu_s, counted_s) + charged_s > limits.cpu_s:
            return "cpu"
        if usage.memory_bytes > limits.memory_bytes or (watch.oom_kills is not None and watch.oom_kills()):
            return "memory"
        if files is not None and watch.max_files is not None and files > watch.max_files:
            return "files"
    return ""


async def _drain(stream: asyncio.StreamReader | None, keep: int, overflow: asyncio.Event) -> bytes:
    """Read ``stream`` to its end, keeping its first ``keep`` bytes; ``overflow`` is set once it has more (the run
    is then stopped, and what comes before its end is dropped)."""
    kept = bytearray()
    while stream is not None and (chunk := await stream.read(65536)):
        if len(kept) < keep:
            kept += chunk[: keep - len(kept)]
        if len(kept) >= keep:
            overflow.set()
    return bytes(kept)
