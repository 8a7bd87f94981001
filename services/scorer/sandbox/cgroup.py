"""A memory cgroup per tool run, below the scorer's own, where the host lets the scorer write one.

Sampling a run's memory (:mod:`.usage`, :func:`.gvisor.sandbox_usage`) stops it at the next sample: between two, a
run's processes can each reach their own address-space limit at once (the eighth review held 6.8 GB for 1.7 s
against 512 MiB with 15 processes pre-faulting 450 MB each). In a memory cgroup the kernel refuses the memory as it
is asked for: past the group's limit it reclaims, then kills a process of the group (the run ends; the scorer reads
``oom_kill`` and reports the memory limit).

Where: cgroup v1's memory controller (``/sys/fs/cgroup/memory`` mounted writable, the scorer's own group there
writable: a host's root, a privileged container), one child group of the scorer's own per run, so the runs stay
inside whatever bounds the scorer (its container's group). cgroup v2 is not used: its groups with controllers enabled
for children may hold no process, so the scorer would first have to move itself into a leaf; hosts with v2 alone
keep the sampled limits (docs/operations/security.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: Where cgroup v1's memory controller is mounted.
MEMORY_CONTROLLER = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class MemoryGroups:
    """The scorer's own memory group (``parent``), below which each run gets one (:meth:`create`)."""

    parent: Path

    @classmethod
    def find(cls, proc_cgroup: Path = Path("/proc/self/cgroup"),
             controller: Path = MEMORY_CONTROLLER) -> MemoryGroups | None:
        """The scorer's memory group where it may create groups below it (None: cgroup v1's memory controller is
        not mounted, or its group is not writable)."""
        try:
            lines = proc_cgroup.read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                parent = controller / path.lstrip("/")
                if (parent / "memory.limit_in_bytes").is_file() and os.access(parent, os.W_OK):
                    return cls(parent)
        return None

    def create(self, limit_bytes: int) -> MemoryGroup:
        """A new group of ``limit_bytes`` (memory, kernel memory included) for one run.

        Raises:
            OSError: the group could not be made or limited (none is left).
        """
        path = self.parent / f"fastexp-run-{uuid.uuid4().hex}"
        path.mkdir()
        group = MemoryGroup(path)
        try:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        except OSError:
            group.remove()
            raise
        return group


@dataclass(frozen=True)
class MemoryGroup:
    """One run's memory group (a cgroup v1 folder)."""

    path: Path

    @property
    def procs(self) -> str:
        """The file a process writes its pid into to join the group (its children are born in it)."""
        return str(self.path / "cgroup.procs")

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed at its limit (0 where it cannot be read)."""
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def peak_bytes(self) -> int:
        """The most the group held at once (0 where it cannot be read)."""
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / "memory.max_usage_in_bytes").read_text())
        return 0

    def remove(self) -> None:
        """Remove the group (once its processes are gone; a group still busy is logged and left)."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as error:
            logger.warning("a run's memory group could not be removed: %s (%s)", self.path, error)
