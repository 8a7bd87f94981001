"""The pieces of a tool run's ``bwrap`` command line and of what it reports (:mod:`services.scorer.sandbox.bubblewrap`
puts them together): the launcher that sets the limits inside, the read-only root's links and binds, the private
``/proc`` with its host-wide files masked, the memory files that carry the code and the filter, and bwrap's
``--json-status-fd`` records."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

#: Runs inside the sandbox first: sets the limits (argv: cpu_s, memory_bytes, max_file_bytes, max_processes), then
#: replaces itself with the tool's program so that the tool runs as a clean ``__main__``.
LAUNCHER = (
    "import os, resource as r, sys\n"
    "cpu, memory, fsize, nproc = map(int, sys.argv[1:5])\n"
    "for which, value in ((r.RLIMIT_CPU, (cpu, cpu + 1)), (r.RLIMIT_AS, (memory, memory)),\n"
    "                     (r.RLIMIT_FSIZE, (fsize, fsize)), (r.RLIMIT_NPROC, (nproc, nproc)),\n"
    "                     (r.RLIMIT_NOFILE, (64, 64)), (r.RLIMIT_CORE, (0, 0))):\n"
    "    r.setrlimit(which, value)\n"
    "os.execv(sys.executable, [sys.executable, '-I', '-B', 'main.py'])\n"
)
WORKDIR = "/tmp"
#: Files of the private ``/proc`` whose figures count for the whole host, not the run's pid namespace: forks since
#: boot (``stat``), threads and load (``loadavg``), memory, interrupts, locks, open files, keys. A run could move one
#: (fork 42 times) and a later call read it (the fourth review carried 6 bits a call this way; the fifth, 2 bits through
#: ``uptime``'s host-wide idle time); each reads empty. ``keys`` lists the keys the reader may view, those of the
#: scorer's session keyring included (their descriptions, where the scorer is not root): it reads empty too.
#: ``cgroups`` counts the groups of each hierarchy, the runs' own among them: a run read how many others were in
#: flight, and when one started or ended (the held-out review of the cgroup v2 groups, 2026-11-27).
HOST_WIDE_PROC = (
    "stat", "loadavg", "meminfo", "vmstat", "zoneinfo", "buddyinfo", "pagetypeinfo", "slabinfo", "interrupts",
    "softirqs", "schedstat", "diskstats", "locks", "keys", "key-users", "cmdline", "swaps", "sys/fs/file-nr",
    "sys/fs/inode-nr", "sys/fs/inode-state", "sys/fs/dentry-state", "sys/fs/aio-nr", "sys/kernel/pty/nr",
    "sys/kernel/random/entropy_avail", "uptime", "cgroups",
)
#: Folders of ``/proc`` likewise (pressure stall figures): each an empty read-only tmpfs.
HOST_WIDE_PROC_FOLDERS = ("pressure",)


def root_links() -> list[str]:
    """``/bin``, ``/lib``, ``/lib64``, ``/sbin`` as the host has them: links into ``/usr`` (merged /usr) or
    read-only binds."""
    arguments = []
    for name in ("bin", "lib", "lib64", "sbin"):
        path = Path("/") / name
        if path.is_symlink():
            arguments += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            arguments += ["--ro-bind", str(path), str(path)]
    return arguments


def prefix_bind(python: str) -> list[str]:
    """A read-only bind of the interpreter's installation when it is not under ``/usr`` (e.g. pyenv's)."""
    prefix = Path(os.path.realpath(python)).parent.parent
    if prefix == Path("/usr") or Path("/usr") in prefix.parents:
        return []
    return ["--ro-bind", str(prefix), str(prefix)]


@functools.cache
def host_wide_proc_files() -> tuple[str, ...]:
    """The files of :data:`HOST_WIDE_PROC` this kernel has (a bind over a missing one would fail the run)."""
    return tuple(name for name in HOST_WIDE_PROC if (Path("/proc") / name).exists())


def private_proc(empties: list[int]) -> list[str]:
    """bwrap's arguments for the run's own ``/proc``: its host-wide files (:func:`host_wide_proc_files`) bound
    read-only over with an empty file each (``empties``: one fd per file, read to its end by bwrap, e.g.
    ``/dev/null`` opened that many times) and its host-wide folders with an empty read-only tmpfs.

    Raises:
        ValueError: not one fd per file.
    """
    names = host_wide_proc_files()
    if len(empties) != len(names):
        raise ValueError(f"{len(names)} host-wide /proc files, {len(empties)} empty files")
    arguments = ["--proc", "/proc"]
    for name, fd in zip(names, empties, strict=True):
        arguments += ["--ro-bind-data", str(fd), f"/proc/{name}"]
    for name in HOST_WIDE_PROC_FOLDERS:
        if (Path("/proc") / name).is_dir():
            arguments += ["--size", "4096", "--tmpfs", f"/proc/{name}", "--remount-ro", f"/proc/{name}"]
    return arguments


def memory_file(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def parse_status(data: bytes) -> tuple[bool, int | None]:
    """``bwrap --json-status-fd``'s records: whether the tool's process started, and its exit code if reported."""
    started, exit_code = False, None
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            started = started or "child-pid" in record
            exit_code = record.get("exit-code", exit_code)
    return started, exit_code
