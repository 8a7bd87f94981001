"""What a gVisor run uses, read from its host processes (:mod:`.gvisor`'s per-run limits between two samples).

A gVisor run's host tree is ``runsc run``, its gofer, the Sentry (the run's kernel) and, under the ptrace platform,
one host process standing for each of the tool's. The tool's memory lives in the Sentry's memory file (a memfd),
not in any of their resident sets as their own: that file's allocated blocks are read instead.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from services.scorer.sandbox.usage import (
    MAX_SAMPLE_S,
    SampleOverBudget,
    TreeUsage,
    mapping_count,
    process_stats,
    tree_of,
    tree_usage_of,
)

#: What the Sentry's memory file (every page the run's kernel gives its processes and its tmpfs) is named as.
MEMORY_FILE = "/memfd:runsc-memory"
#: Samples in a row a Sentry may show no memory file (it makes one as it boots) before the run is stopped as
#: unmeasurable (``"usage"``): a runsc naming it otherwise, or a Sentry whose descriptors the scorer cannot read.
MEMORY_FILE_GRACE_SAMPLES = 20


class SentryUsage:
    """:func:`sandbox_usage` for one run, remembering where the Sentry's memory file is once found (a run's
    host processes can hold thousands of descriptors: the gofer one per file the run opened)."""

    def __init__(self) -> None:
        self._memory_file: str | None = None  # /proc/<sentry>/fd/<n>
        self._unseen = 0  # samples in a row with a Sentry but no memory file found

    def __call__(self, root: int) -> tuple[TreeUsage, None]:
        return sandbox_usage(root, self)

    def memory_file_bytes(self, pids: list[int]) -> int:
        """Bytes allocated in the Sentry's memory file (0 before the Sentry has it)."""
        if self._memory_file is None:
            sentries = [pid for pid in pids if _command_line(pid).startswith(b"runsc-sandbox")]
            self._memory_file = next(filter(None, map(_memory_file, sentries)), None)
            self._unseen = self._unseen + 1 if sentries and self._memory_file is None else 0
            if self._unseen > MEMORY_FILE_GRACE_SAMPLES:  # fail closed: its memory cannot be read
                raise SampleOverBudget("the Sentry's memory file was not found (another runsc, or no access)")
        if self._memory_file is None:
            return 0
        try:
            return os.stat(self._memory_file).st_blocks * 512
        except OSError:  # the Sentry has ended: the run is ending
            self._memory_file = None
            return 0


def sandbox_usage(root: int, sentry: SentryUsage | None = None) -> tuple[TreeUsage, None]:
    """A gVisor run's use (module docs) from ``root``, the ``runsc run`` process: CPU seconds of its host tree,
    ``rss_bytes`` the tree's anonymous resident bytes, ``shared_bytes`` the bytes allocated in the Sentry's
    memory file (the run's processes' pages and its tmpfs, counted once however many of them map a page) and
    ``mappings`` of the host processes (under the ptrace platform each of the tool's mappings is one of the host
    process standing for it: host kernel memory, :data:`~services.scorer.sandbox.usage.MAPPING_BYTES` each). Files
    are not counted apart (gVisor's inodes are the Sentry's memory). The scorer's CPU reading them is
    ``read_cpu_s`` (past its allowance, the run's: :mod:`.supervise`).

    Raises:
        SampleOverBudget: the reading took longer than :data:`~services.scorer.sandbox.usage.MAX_SAMPLE_S`.
    """
    deadline = time.monotonic() + MAX_SAMPLE_S
    stats = process_stats()
    usage = tree_usage_of(stats, root)
    pids = [stat.pid for stat in tree_of(stats, root)]
    reading = time.thread_time()
    anonymous = sum(_anonymous_bytes(pid) for pid in pids)
    guest = (sentry or SentryUsage()).memory_file_bytes(pids)
    mappings = sum(mapping_count(Path(f"/proc/{pid}"), deadline) for pid in pids)
    if time.monotonic() > deadline:
        raise SampleOverBudget(f"sampling the run took more than {MAX_SAMPLE_S} s")
    return TreeUsage(usage.cpu_s, anonymous, usage.processes, usage.inner, guest, mappings,
                     read_cpu_s=time.thread_time() - reading), None


def _anonymous_bytes(pid: int) -> int:
    """``RssAnon`` of ``pid`` (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _command_line(pid: int) -> bytes:
    """``/proc/<pid>/cmdline`` (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _memory_file(sentry: int) -> str | None:
    """``/proc/<sentry>/fd/<n>`` of the Sentry's memory file (None where it has none yet)."""
    try:
        for entry in os.scandir(f"/proc/{sentry}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(entry.path).startswith(MEMORY_FILE):
                    return entry.path
    except OSError:
        pass
    return None
