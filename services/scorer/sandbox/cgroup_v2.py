"""A cgroup v2 group per tool run, below the scorer's own in the unified hierarchy, where the host delegates that group
to the scorer (:func:`delegated`: a systemd unit with ``Delegate=yes``, a group the scorer's non-root user owns, a
container with a cgroup namespace of its own mounted writable), or anywhere the scorer may write with
``sandbox.cgroups: v2``.

**What every such group gives**, whatever controllers the scorer may hand on: the run's whole tree ends as one unit
(``cgroup.kill``, Linux 5.14 and later: every process of the group at once, forks in flight included; before, each
listed process is killed until none is), its end is read from ``cgroup.events`` (``populated 0``), and its CPU is
counted whole, processes the kernel reaped included (``cpu.stat``'s ``usage_usec``, kept by the kernel for every
group with or without the ``cpu`` controller).

**Limits, for each controller the scorer's group may hand to its children** (``cgroup.controllers``):

- ``memory``: ``memory.max`` (the run's memory, page cache and kernel memory included, refused past it as it is asked
  for), ``memory.swap.max`` 0 (as cgroup v1's ``memory.memsw.limit_in_bytes`` at the same limit: nothing beyond it
  swapped out), ``memory.oom.group`` 1 (at the limit the kernel kills the whole run, not one process of it);
  ``memory.events``' ``oom_kill`` says so;
- ``pids``: ``pids.max`` (the run's tasks, processes and threads, whatever its uid; ``pids.events``' ``max`` counts
  the forks refused);
- ``hugetlb``: each ``hugetlb.<size>.max`` 0: huge pages are not charged to ``memory.max`` (unless the hierarchy
  is mounted with ``memory_hugetlb_accounting``), and a run needs none.

Before a group is removed, what is still charged to it (the page cache of files its run read first) is reclaimed
(``memory.reclaim``, Linux 5.19 and later), as cgroup v1's ``memory.force_empty`` does (:mod:`.cgroup`): a group
removed with pages charged stays alive in the kernel, out of sight, holding one of the host's memory-group ids.

**No internal processes.** cgroup v2 lets a group hand controllers to its children only while it holds no process
itself (the root excepted). Where the scorer's group holds processes (the scorer, a container's init), they move into
a leaf below it, :data:`LEAF`, before the controllers are enabled, as systemd and container runtimes do with a
delegated group; each run's group is then a sibling of that leaf. A controller that cannot be enabled is logged and
left out: its limit stays the sampled one (:mod:`.usage`). A scorer in the hierarchy's root group (a root scorer of
the host with ``sandbox.cgroups: v2``: ``auto`` does not take the root) enables the controllers there, for the
whole host, moves nothing (the root may hold processes) and leaves them enabled when it stops.

Where nothing is delegated (the container's cgroup mounted read-only, as Kubernetes and Docker mount it unless told
otherwise; a group that is systemd's or another's, even where a root scorer could write it), the runs get no group
(:meth:`UnifiedRunGroups.find` returns None) and keep the sampled limits (docs/operations/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.scorer.sandbox.cgroup import END_TIMEOUT_S, PREFIX, SWEEP_AGE_S, end_group, kill_in

logger = logging.getLogger(__name__)

#: The leaf below the scorer's group that the group's own processes move into (module docs).
LEAF = "fastexp-scorer"
#: The controllers a run's group is limited by where the scorer's group may hand them on (module docs).
CONTROLLERS = ("memory", "pids", "hugetlb")
#: Tries at enabling a controller while the group still holds a process (the kernel answers EBUSY), and seconds
#: between two, growing by this much each time.
ENABLE_TRIES = 5
ENABLE_PAUSE_S = 0.05


@dataclass(frozen=True)
class UnifiedRunGroups:
    """The scorer's group in the unified hierarchy (``parent``), below which each run gets a group (:meth:`create`),
    limited by the ``controllers`` that ``parent`` hands to its children."""

    parent: Path
    controllers: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def find(cls, proc_cgroup: Path = Path("/proc/self/cgroup"), mountinfo: Path = Path("/proc/self/mountinfo"),
             delegated_only: bool = False) -> UnifiedRunGroups | None:
        """The scorer's group where the scorer may create groups below it, with :data:`CONTROLLERS` enabled for its
        children where its group has them (moving its processes into :data:`LEAF` where they must make room: module
        docs). None: no unified hierarchy is mounted, the scorer's group there is not writable, or, with
        ``delegated_only``, not delegated to it (:func:`delegated`)."""
        try:
            text = proc_cgroup.read_text()
            group = own_group(text, mountinfo.read_text())
        except OSError:
            return None
        if group is not None and group.name == LEAF and _writable(group.parent):
            group = group.parent  # already in its leaf: moved there by an earlier find (another backend, a reload)
        if group is None or not _writable(group):
            return None
        if delegated_only and not delegated(group, _unified_path(text) in ("/", f"/{LEAF}")):
            logger.info("cgroup v2: %s is writable but not delegated to the scorer (no delegate mark, not its "
                        "container's own): tool runs get no group in it; sandbox.cgroups: v2 uses it anyway", group)
            return None
        return cls(group, frozenset(_enable(group)))

    def sweep(self, older_than_s: float = SWEEP_AGE_S) -> int:
        """Remove this scorer's kind of group left empty below ``parent`` for longer than ``older_than_s`` (a scorer
        that crashed, a group :meth:`UnifiedRunGroup.end` gave up on); returns how many."""
        removed, now = 0, time.time()
        for path in self.parent.glob(f"{PREFIX}*"):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > older_than_s and not (group := UnifiedRunGroup(path)).populated():
                    group.reclaim_and_remove()
                    removed += 1
        return removed

    def create(self, limit_bytes: int, max_tasks: int | None = None) -> UnifiedRunGroup:
        """A new group for one run, limited (module docs) to ``limit_bytes`` of memory where ``memory`` is handed on,
        ``max_tasks`` tasks where ``pids`` is (None: no task limit), and no huge pages where ``hugetlb`` is.

        Raises:
            OSError: the group could not be made, or a limit of a controller it has could not be written (none is
                left).
        """
        path = self.parent / f"{PREFIX}{uuid.uuid4().hex}"
        path.mkdir()
        try:
            for name, value in self._settings(path, limit_bytes, max_tasks):
                (path / name).write_text(value)
        except OSError:
            UnifiedRunGroup(path).remove()
            raise
        return UnifiedRunGroup(path)

    def _settings(self, path: Path, limit_bytes: int, max_tasks: int | None) -> list[tuple[str, str]]:
        settings = []
        if "memory" in self.controllers:
            settings.append(("memory.max", str(limit_bytes)))
            settings += [(name, value) for name, value in (("memory.oom.group", "1"), ("memory.swap.max", "0"))
                         if (path / name).exists()]  # Linux 4.19 and later; where the kernel accounts swap
        if "pids" in self.controllers and max_tasks is not None:
            settings.append(("pids.max", str(max_tasks)))
        if "hugetlb" in self.controllers:
            settings += [(limit.name, "0") for limit in sorted(path.glob("hugetlb.*.max"))]
        return settings


def own_group(proc_cgroup: str, mountinfo: str) -> Path | None:
    """This process's group's folder in the unified hierarchy: its ``0::`` line of ``/proc/self/cgroup``
    (``proc_cgroup``) below a ``cgroup2`` mount of ``/proc/self/mountinfo`` (``mountinfo``) whose root holds it (a
    container's mount is rooted at its own group). None: no such line or mount, or a path with white space (the run's
    shell joins the group by its path, split on it)."""
    path = _unified_path(proc_cgroup)
    if path is None or ".." in path.split("/"):  # (a process outside its cgroup namespace's root sees /../…)
        return None
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        if rest.split()[:1] != ["cgroup2"]:
            continue
        root, point = fields.split()[3:5]
        if path == root or path.startswith(root.rstrip("/") + "/"):
            group = Path(point) / path[len(root.rstrip("/")):].lstrip("/")
            return None if any(c.isspace() for c in str(group)) else group
    return None


def _unified_path(proc_cgroup: str) -> str | None:
    """The path of ``/proc/self/cgroup``'s ``0::`` line (the unified hierarchy's), as the process's cgroup namespace
    shows it."""
    return next((line[3:] for line in proc_cgroup.splitlines() if line.startswith("0::")), None)


def delegated(group: Path, namespace_root: bool) -> bool:
    """Whether ``group`` is the scorer's to divide: marked delegated by systemd (``Delegate=yes`` sets the
    ``trusted.delegate`` extended attribute on the unit's group, ``user.delegate`` for a user's service), owned by the
    scorer's non-root user (a delegation to a user hands it the group's folder), or the root of a container's own
    cgroup namespace (``namespace_root``: the scorer sees its group as ``/``, and the group is not the hierarchy's
    real root, which has no ``cgroup.type``: the container's runtime gave it the subtree, writable where it mounted it
    so). A root scorer can write every group, so writing alone does not tell."""
    for name in ("trusted.delegate", "user.delegate"):
        with contextlib.suppress(OSError):
            if os.getxattr(group, name) == b"1":
                return True
    with contextlib.suppress(OSError):
        if os.geteuid() != 0 and group.stat().st_uid == os.geteuid():
            return True
    return namespace_root and (group / "cgroup.type").is_file()


def _writable(group: Path) -> bool:
    return (group / "cgroup.subtree_control").is_file() and os.access(group, os.W_OK) \
        and os.access(group / "cgroup.procs", os.W_OK)


def _enable(group: Path) -> set[str]:
    """Enable each of :data:`CONTROLLERS` that ``group`` has for its children, moving its processes into
    :data:`LEAF` first where it holds some (module docs); those enabled."""
    enabled = set((group / "cgroup.subtree_control").read_text().split())
    wanted = [c for c in CONTROLLERS if c in (group / "cgroup.controllers").read_text().split() and c not in enabled]
    moved = False
    for controller in wanted:
        for attempt in range(ENABLE_TRIES):
            try:
                (group / "cgroup.subtree_control").write_text(f"+{controller}")
                enabled.add(controller)
                break
            except OSError as error:
                if error.errno != errno.EBUSY or attempt == ENABLE_TRIES - 1:
                    logger.warning("cgroup v2: %s cannot be enabled for tool runs' groups in %s (%s): its limit is "
                                   "sampled only", controller, group, error)
                    break
                if not moved:  # no internal processes: the group's own make room, once
                    _into_leaf(group)
                    moved = True
                else:  # a process forked meanwhile, or the kernel's moves not yet settled: moved again after a pause
                    time.sleep(ENABLE_PAUSE_S * (attempt + 1))
                    _into_leaf(group)
    return enabled & set(CONTROLLERS)


def _into_leaf(group: Path) -> None:
    """Move the processes of ``group`` into its :data:`LEAF` (made where missing), again while new ones appear (a
    fork during the move), up to :data:`ENABLE_TRIES` rounds; one that exits or cannot be moved is skipped (the
    controllers' writes then fail, logged)."""
    leaf = group / LEAF
    leaf.mkdir(exist_ok=True)
    tried: set[str] = set()
    moved = 0
    for _ in range(ENABLE_TRIES):
        left = [pid for pid in (group / "cgroup.procs").read_text().split() if pid not in tried]
        if not left:
            break
        for pid in left:
            tried.add(pid)
            try:
                (leaf / "cgroup.procs").write_text(pid)
                moved += 1
            except OSError as error:
                logger.debug("cgroup v2: process %s stays in %s (%s)", pid, group, error)
    logger.info("cgroup v2: %d process(es) of %s moved into %s, so that tool runs' groups can be limited",
                moved, group, LEAF)


@dataclass(frozen=True)
class UnifiedRunGroup:
    """One run's group in the unified hierarchy (``path``), with the same reading interface as cgroup v1's
    :class:`.cgroup.RunGroup`."""

    path: Path

    @property
    def folders(self) -> list[Path]:
        """The run's group folder (one: the unified hierarchy holds every controller)."""
        return [self.path]

    @property
    def procs(self) -> str:
        """The file a process writes its pid into to join the group (its children are born in it)."""
        return str(self.path / "cgroup.procs")

    def cpu_s(self) -> float | None:
        """CPU seconds, user and system, the run's processes spent while in the group, exited ones included
        (``cpu.stat``'s ``usage_usec``; None where it cannot be read)."""
        return _field(self.path / "cpu.stat", "usage_usec", lambda usec: usec / 1e6)

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed at its ``memory.max`` (0: none, or no ``memory`` controller)."""
        return _field(self.path / "memory.events", "oom_kill") or 0

    def tasks_refused(self) -> int:
        """The forks and clones refused at the group's ``pids.max`` (0: none, or no ``pids`` controller)."""
        return _field(self.path / "pids.events", "max") or 0

    def pids(self) -> list[int]:
        """The processes in the group now."""
        try:
            return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def populated(self) -> bool:
        """Whether a process is in the group (``cgroup.events``; True where it cannot be read)."""
        return _field(self.path / "cgroup.events", "populated") != 0

    async def end(self, timeout_s: float = END_TIMEOUT_S) -> None:
        """Kill the run's whole tree and remove its group, even while the caller is cancelled; a group still busy
        after ``timeout_s`` is logged and left for :meth:`UnifiedRunGroups.sweep` (as :meth:`.cgroup.RunGroup.end`)."""
        await end_group(self._removed, timeout_s)

    def _removed(self, last_try: bool) -> bool:
        """Kill the group's processes while it has any; once it has none, remove it; whether it is gone (or left,
        on the ``last_try``)."""
        if not self.path.exists():
            return True
        if self.populated():
            kill = self.path / "cgroup.kill"
            if kill.exists():
                with contextlib.suppress(OSError):  # removed meanwhile: the next try reads it again
                    kill.write_text("1")
            else:  # before Linux 5.14: each listed process, until none is
                for pid in self.pids():
                    kill_in(pid, self.path, unified=True)
            return self._give_up("its processes are still exiting") if last_try else False
        if refused := self.tasks_refused():
            logger.debug("a run's group refused %d forks or clones at its pids.max: %s", refused, self.path.name)
        try:
            self.reclaim_and_remove()
        except FileNotFoundError:
            pass
        except OSError as error:
            return self._give_up(str(error)) if last_try else False
        return True

    def reclaim_and_remove(self) -> None:
        """Reclaim what is still charged to the empty group (``memory.reclaim``, where it has the ``memory``
        controller: module docs), then remove it.

        Raises:
            OSError: it could not be removed (a process is in it; it is gone already: FileNotFoundError).
        """
        reclaim = self.path / "memory.reclaim"
        if reclaim.exists():
            with contextlib.suppress(OSError, ValueError):  # EAGAIN: less reclaimed than asked; removed even so
                reclaim.write_text((self.path / "memory.current").read_text().strip())
        self.path.rmdir()

    def _give_up(self, why: str) -> bool:
        logger.warning("a run's cgroup v2 group could not be removed: %s (%s)", self.path.name, why)
        return True

    def remove(self) -> None:
        """Remove the group if it is empty."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _field(path: Path, key: str, convert: Callable[[int], Any] = int) -> Any:
    """The integer after ``key`` in a flat-keyed cgroup file (``key value`` lines), converted; None where the file
    or the key cannot be read."""
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return convert(int(value))
    return None
