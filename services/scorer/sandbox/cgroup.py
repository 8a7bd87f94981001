"""A cgroup per tool run, below the scorer's own, where the host lets the scorer write one: memory, CPU accounting
and, for a bubblewrap run, its tasks.

**Memory.** Sampling a run's memory (:mod:`.usage`, :func:`.gvisor_usage.sandbox_usage`) stops it at the next sample:
between two, a run's processes can each reach their own address-space limit at once (the eighth review held 6.8 GB
for 1.7 s against 512 MiB with 15 processes pre-faulting 450 MB each). In a memory cgroup the kernel refuses the
memory as it is asked for: past the group's limit it reclaims, then kills a process of the group (the run ends; the
scorer reads ``oom_kill`` and reports the memory limit).

**CPU.** Sampling ``/proc`` counts the CPU of the run's live processes and of the children they reaped; a child the
kernel reaps by itself (its parent ignores ``SIGCHLD``) takes its CPU with it, so a run forking short-lived workers
spent up to ``timeout_s`` x cores against ``cpu_s``. A ``cpuacct`` group counts the CPU every process spends
while in it, exited ones included (``cpuacct.usage``, nanoseconds), so the run's CPU is read whole at each sample.

**Tasks.** ``RLIMIT_NPROC`` (``max_processes``) is counted by the kernel per uid in each user namespace (Linux 5.14
and later; before, per uid on the whole host, shared by concurrent runs of one uid) and not at all for a process
that is root on the host. A ``pids`` group bounds the tasks, processes and threads alike, of everything in it
(``pids.max``): the run's whole tree, whatever its uid and the kernel's version; past it ``fork`` and ``clone`` fail
with ``EAGAIN``, as at ``RLIMIT_NPROC``. Only a bubblewrap run gets one (its ``max_processes`` + the fixed tasks of its
tree outside the sandbox, :data:`.bubblewrap.TASK_HEADROOM`): a gVisor run's host threads are its Sentry's and
gofer's, not the tool's, whose processes the Sentry bounds in its own kernel.

Where: cgroup v1's ``memory`` (and ``cpuacct`` and ``pids``, where they are mounted too) controllers mounted
writable under ``/sys/fs/cgroup``, the scorer's own group in each writable (a host's root, a privileged container);
each run gets a child group of the scorer's own in each, so the runs stay inside whatever bounds the scorer (its
container's group). A host whose v1 memory controller is not writable (cgroup v2 alone) gets a group per run in the
unified hierarchy instead, where the scorer's group there is delegated (:mod:`.cgroup_v2`; the choice:
:mod:`.run_groups`); elsewhere the sampled limits hold alone (docs/operations/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: Where cgroup v1's controllers are mounted, each hierarchy in a folder named as ``/proc/self/cgroup`` lists its
#: controllers (``memory``, ``cpuacct`` or ``cpu,cpuacct``, ``pids``).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: A run's group's name: this prefix and a random suffix.
PREFIX = "fastexp-run-"
#: Seconds :meth:`RunGroup.end` waits for a run's last processes to be gone before it leaves its groups.
END_TIMEOUT_S = 10.0
#: Seconds between two tries.
END_POLL_S = 0.02
#: Age past which an empty group is a leftover (:meth:`RunGroups.sweep`): a live run's is empty only between
#: its creation and ``runsc`` joining it, well under a second.
SWEEP_AGE_S = 60.0


@dataclass(frozen=True)
class RunGroups:
    """The scorer's own memory group (``parent``), ``cpuacct`` group (``cpu_parent``) and ``pids`` group
    (``pids_parent``; None: not available), below which each run gets one of each (:meth:`create`)."""

    parent: Path
    cpu_parent: Path | None = None
    pids_parent: Path | None = None

    @classmethod
    def find(cls, proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> RunGroups | None:
        """The scorer's groups where it may create groups below them (None: cgroup v1's memory controller is not
        mounted, or its group is not writable; ``cpu_parent``, ``pids_parent`` None: the same for ``cpuacct``,
        ``pids``)."""
        try:
            lines = proc_cgroup.read_text().splitlines()
        except OSError:
            return None
        parent = _writable(lines, "memory", "memory.limit_in_bytes", root)
        if parent is None:
            return None
        # pids.max is in every group of the hierarchy but its root (where a scorer of a host's root is): any group's
        # cgroup.procs is probed instead
        return cls(parent, _writable(lines, "cpuacct", "cpuacct.usage", root),
                   _writable(lines, "pids", "cgroup.procs", root))

    def sweep(self, older_than_s: float = SWEEP_AGE_S) -> int:
        """Remove this scorer's kind of group left empty below the parents for longer than ``older_than_s`` (a
        scorer that crashed, a group :meth:`RunGroup.end` gave up on); returns how many."""
        removed, now = 0, time.time()
        for parent in dict.fromkeys((self.parent, self.cpu_parent, self.pids_parent)):
            for path in parent.glob(f"{PREFIX}*") if parent is not None else ():
                with contextlib.suppress(OSError):
                    if now - path.stat().st_mtime > older_than_s and not (path / "cgroup.procs").read_text().strip():
                        if parent == self.parent:  # else it stays alive in the kernel (RunGroup._removed)
                            (path / "memory.force_empty").write_text("0")
                        path.rmdir()
                        removed += 1
        return removed

    def create(self, limit_bytes: int, max_tasks: int | None = None) -> RunGroup:
        """New groups for one run: memory of ``limit_bytes`` (kernel memory included) and, where the scorer has
        one, ``cpuacct``, and ``pids`` of ``max_tasks`` (None: no ``pids`` group). Either of the last two that
        cannot be made is logged and left out: the run has the others.

        Raises:
            OSError: the memory group could not be made or limited (none is left).
        """
        name = f"{PREFIX}{uuid.uuid4().hex}"
        path = self.parent / name
        path.mkdir()
        try:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            swap = path / "memory.memsw.limit_in_bytes"  # where swap is accounted: memory and swap together
            if swap.exists():
                swap.write_text(str(limit_bytes))
        except OSError:
            RunGroup(path).remove()
            raise
        made = {self.parent}  # one hierarchy holding several controllers: the run's group there is made once
        cpu_path = _beside(self.cpu_parent, name, made, "cpuacct", "its CPU is sampled only")
        pids_path = None if max_tasks is None else _beside(
            self.pids_parent, name, made, "pids", "its processes are bounded by RLIMIT_NPROC alone",
            ("pids.max", max_tasks))
        return RunGroup(path, cpu_path, pids_path)


def _beside(parent: Path | None, name: str, made: set[Path], controller: str, otherwise: str,
            setting: tuple[str, int] | None = None) -> Path | None:
    """The run's group ``name`` below ``parent`` in ``controller``'s hierarchy, with its ``setting`` (a file and its
    value) written; the run's group there already where ``made`` holds ``parent`` (a hierarchy of several
    controllers). None where there is no ``parent``, or the group cannot be made or set (logged: the run goes on
    without it, ``otherwise``)."""
    if parent is None:
        return None
    path, new = parent / name, parent not in made
    try:
        if new:
            path.mkdir()
            made.add(parent)
        if setting is not None:
            (path / setting[0]).write_text(str(setting[1]))
    except OSError as error:
        if new:
            with contextlib.suppress(OSError):
                path.rmdir()
            made.discard(parent)
        logger.warning("no %s group for a tool run (%s): %s", controller, error, otherwise)
        return None
    return path


def _writable(lines: list[str], controller: str, probe: str, root: Path) -> Path | None:
    """The scorer's group in ``controller``'s v1 hierarchy (``lines``: ``/proc/self/cgroup``'s) if it is a folder
    holding ``probe`` that the scorer may write, and its path has no white space (the run's shell joins the groups
    by their paths, split on it; such a scorer's runs get no groups)."""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            group = root / controllers / path.lstrip("/")
            if (group / probe).is_file() and os.access(group, os.W_OK) and not any(c.isspace() for c in str(group)):
                return group
    return None


@dataclass(frozen=True)
class RunGroup:
    """One run's groups: memory (``path``, a cgroup v1 folder), ``cpuacct`` (``cpu_path``) and ``pids``
    (``pids_path``; None: none). Two of them are one folder where their controllers share a hierarchy."""

    path: Path
    cpu_path: Path | None = None
    pids_path: Path | None = None

    @property
    def folders(self) -> list[Path]:
        """The run's group folders, each once, memory first."""
        return [p for p in dict.fromkeys((self.path, self.cpu_path, self.pids_path)) if p is not None]

    @property
    def procs(self) -> str:
        """The files a process writes its pid into to join the groups (its children are born in them), separated by
        spaces, memory first."""
        return " ".join(str(p / "cgroup.procs") for p in self.folders)

    def cpu_s(self) -> float | None:
        """CPU seconds, user and system, the run's processes spent while in its ``cpuacct`` group, exited ones
        included (None: no group, or it cannot be read)."""
        if self.cpu_path is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            return int((self.cpu_path / "cpuacct.usage").read_text()) / 1e9
        return None

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed at its limit (0 where it cannot be read)."""
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def tasks_refused(self) -> int:
        """The forks and clones the ``pids`` group refused at its ``pids.max`` (0: none, or no group)."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            if self.pids_path is not None:
                return int((self.pids_path / "pids.events").read_text().split()[1])  # "max N"
        return 0

    def pids(self) -> list[int]:
        """The processes in the group now (exiting ones and zombies until they are reaped)."""
        try:
            return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    async def end(self, timeout_s: float = END_TIMEOUT_S) -> None:
        """Kill what is left in the groups and remove them, even while the caller is cancelled. A run's ``runsc`` is
        reaped before its Sentry, gofer and the processes standing for the tool's are: they may still be exiting,
        and a group is removable only once they are gone (the ninth review left groups so). Each is killed again
        until none is listed, then the group is removed; one still busy after ``timeout_s`` is logged and left for
        :meth:`RunGroups.sweep`."""
        await end_group(self._removed, timeout_s)

    def _removed(self, last_try: bool) -> bool:
        """Kill what is listed, then, once nothing is, reclaim what is still charged to the group and remove it;
        whether it is gone (or left, on the ``last_try``). A group removed with pages still charged to it (the
        page cache of files its run read first) stays alive in the kernel, out of sight, holding one of the host's
        65,535 memory-group ids (the tenth review left one a call so); ``memory.force_empty`` reclaims them first
        (cgroup v1's step before removal), which also drops from the cache what the run alone brought into it."""
        pids = self.pids()
        for pid in pids:
            kill_in(pid, self.path)
        if pids:
            return False if not last_try else self._give_up("its processes are still exiting")
        if refused := self.tasks_refused():
            logger.debug("a run's pids group refused %d forks or clones at its limit: %s", refused, self.path.name)
        with contextlib.suppress(OSError):
            (self.path / "memory.force_empty").write_text("0")
        for path in self.folders:
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as error:
                return False if not last_try else self._give_up(f"{path}: {error}")
        return True

    def _give_up(self, why: str) -> bool:
        logger.warning("a run's groups could not be removed: %s (%s)", self.path.name, why)
        return True

    def remove(self) -> None:
        """Remove the groups that are empty (nothing where they are not)."""
        for path in self.folders:
            with contextlib.suppress(OSError):
                path.rmdir()


async def end_group(removed: Callable[[bool], bool], timeout_s: float = END_TIMEOUT_S) -> None:
    """Call ``removed`` (in a thread: it writes and reads cgroup files) every :data:`END_POLL_S` until it returns
    True, passing whether this is the last try (``timeout_s`` past), even while the caller is cancelled: the cancel
    then holds (re-raised once it is done). A try under way is awaited again, not started twice."""
    loop = asyncio.get_running_loop()
    deadline, cancelled = loop.time() + timeout_s, False
    attempt: asyncio.Future[bool] | None = None
    while True:
        try:
            if attempt is None:
                attempt = asyncio.ensure_future(asyncio.to_thread(removed, loop.time() > deadline))
            if await asyncio.shield(attempt):
                break
            attempt = None
            await asyncio.sleep(END_POLL_S)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def kill_in(pid: int, group: Path, unified: bool = False) -> None:
    """SIGKILL ``pid`` if it is still in ``group`` (through a pidfd: not a process that took its pid since): its
    memory group in cgroup v1, its group in the unified hierarchy (cgroup v2) where ``unified``."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        line = next(line for line in lines if (line.startswith("0::") if unified else ":memory:" in line))
        if line.split(":", 2)[2].rstrip("/").endswith(group.name):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (OSError, StopIteration):
        pass
    finally:
        os.close(fd)
