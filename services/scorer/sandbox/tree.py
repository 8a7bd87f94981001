"""A tool run's process tree, ended as one unit: bwrap's monitor (the process the scorer started), the sandbox's init
below it and the init's descendants.

Every signal goes through a pidfd (``pidfd_open``): the kernel reuses a pid once its process is reaped (this host's
``pid_max`` is 32,768, and asyncio reaps a child the moment it exits), and a signal sent by number then lands on
whatever process took it. The monitor is held by a pidfd from its start; a process below it is signalled through a
pidfd opened after the walk that found it, once its parent is checked again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable
from pathlib import Path

from services.common.tasks import run_to_end
from services.scorer.sandbox.usage import parse_stat, process_stats, tree_of

#: Seconds bwrap's monitor has, once the run's processes were killed, to reap the sandbox's init and exit, before it
#: is killed too (a process stuck in the kernel can hold an init's exit up).
END_GRACE_S = 10.0

#: Seconds between two looks for the sandbox's init while bwrap's monitor sets it up (:meth:`RunTree.end`).
SET_UP_POLL_S = 0.005


async def start_run(spawn: Awaitable[asyncio.subprocess.Process]) -> asyncio.subprocess.Process:
    """The run's first process once ``spawn`` (``asyncio.create_subprocess_exec``) has started it, even when the
    caller is cancelled meanwhile: then the start is waited for, the run's whole tree ended
    (:meth:`RunTree.end`), and ``CancelledError`` raised.

    Cancelled inside its own start, asyncio kills only the process it was starting (bwrap's monitor, ``runsc``): an
    init the monitor had already forked would be left running with nothing to reap or kill it, as when
    :meth:`RunTree.end` killed a monitor first (seen: ``--die-with-parent`` did not end that init).

    Raises:
        OSError: the program could not be started.
        asyncio.CancelledError: the caller was cancelled (once the run's tree is gone).
    """
    task = asyncio.ensure_future(spawn)
    try:
        return await run_to_end(task, "a tool run's start")
    except asyncio.CancelledError:  # the caller has gone (raised whatever the start's outcome)
        if not task.cancelled() and task.exception() is None:
            with RunTree(task.result()) as tree:
                await tree.end()
        raise


class RunTree:
    """One run's tree, held from its start (use it as a context manager: the pidfd is closed at the end).

    ``process``: bwrap's monitor as asyncio started it (``setpriv`` execs ``bwrap``: the same process).
    """

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        try:
            self._fd: int | None = os.pidfd_open(process.pid)
        except ProcessLookupError:  # gone already: nothing of the run is left to signal
            self._fd = None

    def __enter__(self) -> RunTree:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def end(self) -> None:
        """Kill the run's whole tree and reap it, even while the caller is being cancelled.

        SIGKILL goes to every process below the monitor (from ``/proc``: the sandbox's init among them; the kernel
        kills every process of a pid namespace whose init died, and that init reaps them before it is gone); the
        monitor then reaps the init and exits, so once it is reaped nothing of the run is left, not even a zombie
        for the host's init (or a scorer that is PID 1 of its container) to collect. A monitor with nothing started
        yet is watched until it has (then that is killed) or has exited; one that does neither, or is still there
        after :data:`END_GRACE_S`, is killed (with the tree again). The wait is shielded and taken up again after
        each cancel.
        """
        loop = asyncio.get_running_loop()
        grace, cancelled = loop.time() + END_GRACE_S, False
        # a monitor still setting up has not forked the sandbox's init yet, or has just done so: killed now, it would
        # leave that init orphaned and running, its namespace and the run's output pipes with it (--die-with-parent
        # did not end it: seen when a call was cancelled as its sandbox started). So its init is waited for, and
        # killed, or the monitor's own exit; a monitor that does neither within the grace is killed
        while not self._kill_inner() and self._monitor_alive():
            if loop.time() >= grace:
                self._kill_monitor()
                break
            try:
                await asyncio.sleep(SET_UP_POLL_S)  # polling the process table for the init, not a delay
            except asyncio.CancelledError:
                cancelled = True
        reaped = asyncio.ensure_future(self._process.wait())
        while not reaped.done():
            try:
                left = grace - loop.time()
                if left > 0:
                    await asyncio.wait({reaped}, timeout=left)  # not cancelled with the caller: the wait resumes
                else:
                    self._kill_inner()
                    self._kill_monitor()
                    await asyncio.shield(reaped)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    def _kill_inner(self) -> bool:
        """SIGKILL every process below the monitor while it lives; whether there was any (the walk takes ~1 ms)."""
        if not self._monitor_alive():
            return False
        monitor = self._process.pid
        inner = [stat for stat in tree_of(process_stats(), monitor) if stat.pid != monitor]
        for stat in inner:
            _kill_child(stat.pid, stat.ppid)
        return bool(inner)

    def _kill_monitor(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._fd, signal.SIGKILL)

    def _monitor_alive(self) -> bool:
        if self._fd is None:
            return False
        try:
            signal.pidfd_send_signal(self._fd, 0)
        except ProcessLookupError:
            return False
        return True


def _kill_child(pid: int, ppid: int) -> None:
    """SIGKILL process ``pid`` if it is still the child of ``ppid`` the walk found (not a process that took its pid
    since)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if parse_stat((Path("/proc") / str(pid) / "stat").read_text()).ppid == ppid:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (OSError, ValueError):  # ended meanwhile
        pass
    finally:
        os.close(fd)
