"""Tool runs each under a kernel of its own: gVisor (``runsc``, Google's user-space kernel; what GKE Sandbox runs).

A bubblewrap run (:mod:`.bubblewrap`) shares the host's kernel with every other run, and with it state no namespace,
mount or filter separates: the pipe and socket inode counter, negative dentries, ``/proc/net/sockstat``, the socket
cookie counter. One run can move such a counter and a later or concurrent one read it (the held-out reviews carried
bits between calls this way). Under ``sandbox.backend: gvisor`` each run is its own gVisor sandbox: its system calls
are served by a Sentry process started for that run alone, so every such counter, table and cache is the run's own
and starts fresh; the host kernel sees only the Sentry's few system calls (filtered by gVisor itself).

Each run is ``runsc run`` on an OCI bundle written for it (:func:`oci_spec`):

- a read-only root with ``/usr`` bound read-only (the interpreter, its standard library, the C library) and links
  into it; nothing of ``/etc``, ``/home``, the project or the scorer's mounts and secrets;
- one writable place, a fresh tmpfs at ``/tmp`` of ``tmpfs_bytes`` (gVisor's, in the run's own memory), also its
  working directory; the tool's code is written there as ``main.py`` from the run's standard input;
- no network (``--network=none``: a loopback of the run's own), no capability, ``no_new_privs``, uid 65534, an empty
  environment but ``PATH``, ``HOME`` and ``LANG``;
- limits per process as rlimits (``RLIMIT_NPROC`` = ``max_processes``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``,
  ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` 0; gVisor does not enforce ``RLIMIT_CPU``), and limits per run sampled every
  ``usage_poll_s`` (:func:`.gvisor_usage.sandbox_usage`): CPU seconds of the run's whole host tree (the Sentry, its gofer and the
  processes that stand for the tool's), and memory as the run's kernel holds it: the bytes allocated in the
  Sentry's memory file (every page of the tool's processes and of its tmpfs) and the anonymous memory of the host
  processes (the Sentry's own objects: sockets, files, inodes the run made; and runsc's, the gofer's and the
  Sentry's own Go heaps, a few MiB each); and for a root scorer where the host
  lets it, a memory cgroup per run (:mod:`.cgroup`, or :mod:`.cgroup_v2` on a host of cgroup v2 that delegates the
  scorer's group; ``memory_bytes`` + :data:`GROUP_HEADROOM_BYTES`) that the
  kernel enforces between two samples, and a ``cpuacct`` group whose count of the tree's CPU is held against
  ``cpu_s`` at each sample; no ``pids`` group (a bubblewrap run's): the run's host tasks are the Sentry's, its
  gofer's and runsc's threads, not the tool's, whose processes and threads the Sentry bounds by ``RLIMIT_NPROC`` in
  the run's own kernel (``max_processes``, per run);
- one unit that ends once, as under bubblewrap (:class:`~services.scorer.sandbox.tree.RunTree`): however the call
  ends, the whole tree is killed and reaped before it returns, then the run's bundle and runsc's state are removed.

A scorer running as root starts ``runsc`` in its default mode (the Sentry and gofer in namespaces of their own,
chrooted, under gVisor's own system-call filter, the Sentry as nobody); otherwise ``--rootless``. ``runsc`` needs
no daemon; it needs ``ptrace`` (the default platform) or ``/dev/kvm`` (``runsc_platform: kvm``). A run costs about
0.2–0.35 s more than under bubblewrap to start its kernel (measured 2026-11-26 on this project's 2-core host).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.scorer.sandbox.base import (
    MIB,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    cut,
    probe,
)
from services.scorer.sandbox.bubblewrap import default_python
from services.scorer.sandbox.gvisor_usage import SentryUsage
from services.scorer.sandbox.run_groups import AnyRunGroup, CgroupVersion, describe, find_run_groups
from services.scorer.sandbox.slots import FairSlots
from services.scorer.sandbox.supervise import Watch, collect
from services.scorer.sandbox.tree import RunTree, start_run

logger = logging.getLogger(__name__)

#: Written by the launcher before the tool's code runs: a run whose stderr does not start with it never started.
STARTED = b"\x00fastexp-run-started\n"
#: The run's first program (inside the sandbox): writes the marker, then the tool's code (its standard input) to
#: ``/tmp/main.py``, and becomes ``python -I -B main.py`` (as a bubblewrap run's).
LAUNCHER = (
    "import os, sys\n"
    f"os.write(2, {STARTED!r})\n"
    "code = sys.stdin.buffer.read()\n"
    "with open('main.py', 'wb') as out:\n"
    "    out.write(code)\n"
    "os.execv(sys.executable, [sys.executable, '-I', '-B', 'main.py'])\n"
)
#: Run in a mount namespace of its own before it execs the rest of its arguments: ``$1`` the /usr view's mount
#: point, ``$2`` the run's groups' ``cgroup.procs`` files (space-separated, or empty), ``$3`` the root's mount
#: point, ``$4`` its skeleton.
_USR_VIEW = ('mount --bind /usr "$1" && mount -o remount,bind,ro,nosuid,nodev,noatime "$1" && '
             'mount -t tmpfs -o size=1m,nr_inodes=64,mode=755 fastexp-root "$3" && cp -a "$4/." "$3" && '
             'set -f && for procs in $2; do echo $$ > "$procs" || exit 125; done && shift 4 && exec "$@"')
#: What a run's memory group holds beyond ``memory_bytes``: the Sentry's, its gofer's and runsc's own memory (the
#: sampled limit stops the run at ``memory_bytes``; the group bounds what it can reach between two samples).
GROUP_HEADROOM_BYTES = 256 * MIB
#: The uid and gid of the run's processes inside its kernel.
_NOBODY = 65534
#: Descriptors each of the run's processes may hold.
_MAX_FILES_OPEN = 64


@dataclass(frozen=True)
class GvisorOptions:
    """How runs are isolated: the ``runsc`` program (name on PATH or path), its ``platform`` (``ptrace`` or
    ``kvm``), the interpreter inside (``None``: as :mod:`.bubblewrap`; it must lie under ``/usr``),
    ``max_processes`` the tool may have (itself included), ``tmpfs_bytes`` of its ``/tmp``, ``max_concurrent``
    runs at once (more wait, each tenant in a queue of its own: :mod:`.slots`; ``max_concurrent_per_tenant`` of
    them for one tenant, ``None``: all), ``usage_poll_s`` between two samples of a run's use, ``cgroups`` which cgroup
    hierarchy a run's group is made in (:data:`.run_groups.CgroupVersion`)."""

    runsc: str = "runsc"
    platform: str = "ptrace"
    python: str | None = None
    max_processes: int = 16
    tmpfs_bytes: int = 64 * MIB
    max_concurrent: int = 4
    usage_poll_s: float = 0.1
    max_concurrent_per_tenant: int | None = None
    cgroups: CgroupVersion = "auto"


def oci_spec(python: str, rootfs: str, limits: SandboxLimits, options: GvisorOptions,
             usr: str = "/usr") -> dict[str, Any]:
    """The OCI runtime spec of one run (module docs): ``rootfs`` is the read-only skeleton (:func:`make_rootfs`),
    ``usr`` the host folder the run sees as ``/usr``."""
    nothing: list[str] = []
    rlimits = [("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1), ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
               ("RLIMIT_FSIZE", limits.max_file_bytes, limits.max_file_bytes),
               ("RLIMIT_NPROC", options.max_processes, options.max_processes),
               ("RLIMIT_NOFILE", _MAX_FILES_OPEN, _MAX_FILES_OPEN), ("RLIMIT_CORE", 0, 0)]
    return {
        "ociVersion": "1.0.0",
        "process": {
            "user": {"uid": _NOBODY, "gid": _NOBODY},
            "args": [python, "-I", "-B", "-c", LAUNCHER],
            "env": ["PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/tmp", "LANG=C.UTF-8"],
            "cwd": "/tmp",
            "capabilities": {kind: nothing for kind in ("bounding", "effective", "inheritable", "permitted", "ambient")},
            "noNewPrivileges": True,
            "rlimits": [{"type": kind, "soft": soft, "hard": hard} for kind, soft, hard in rlimits],
        },
        "root": {"path": rootfs, "readonly": True},
        "hostname": "sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["size=65536", "mode=755"]},
            {"destination": "/usr", "type": "bind", "source": usr, "options": ["rbind", "ro", "nosuid", "nodev"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": [f"size={options.tmpfs_bytes}", "mode=1777", "nosuid", "nodev"]},
        ],
        "linux": {"namespaces": [{"type": kind} for kind in ("pid", "network", "ipc", "uts", "mount")]},
    }


def make_rootfs(folder: Path) -> str:
    """A read-only root's skeleton in ``folder``: mount points and ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` as the
    host has them (links into ``/usr`` on a merged-/usr host; absent otherwise). Returns its path."""
    for name in ("usr", "tmp", "proc", "dev"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    for name in ("bin", "lib", "lib64", "sbin"):
        host = Path("/") / name
        if host.is_symlink() and not (folder / name).is_symlink():
            (folder / name).symlink_to(os.readlink(host))
    folder.chmod(0o755)
    return str(folder)


def usr_view_prefix(view: str, root: str, skeleton: str, procs: str = "") -> list[str]:
    """A command prefix (util-linux ``unshare`` and ``mount``, root only) that runs what follows in a mount
    namespace of its own in which the empty folder ``view`` is ``/usr`` bound read-only and without access times,
    for the run to bind as its ``/usr``; the empty folder ``root`` a tmpfs of its own holding a copy of
    ``skeleton`` (:func:`make_rootfs`), for the run's root: gVisor answers ``statfs('/')`` with the figures of the
    host filesystem its root lies on, and on one other runs' bundles are written to they move with every run (the
    ninth review read how many ran at once); and in the run's groups, whose ``cgroup.procs`` files ``procs`` lists
    (space-separated; ``""``: none, :mod:`.cgroup`). gVisor's ``ro`` is its own kernel's: its gofer reads the host's files
    through the mount it is given, and on a writable one every read stamps a file's access time, which a later run
    reads back (the eighth review carried 64 bits between calls so; a bubblewrap run reads through a read-only
    bind, which the kernel never stamps). The namespace, and the bind with it, end with the process; nothing is
    mounted where the scorer runs."""
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _USR_VIEW, "sh", view, procs,
            root, skeleton]


class GvisorSandbox:
    """Runs each tool program in a gVisor sandbox of its own (module docs)."""

    def __init__(self, options: GvisorOptions = GvisorOptions()) -> None:
        self._options = options
        self._python = options.python or default_python()
        self._runsc = shutil.which(options.runsc)  # resolved once: start-up and runs use the same program
        self._slots = FairSlots(options.max_concurrent, options.max_concurrent_per_tenant)
        self._home: Path | None = None  # this backend's folder: the root's skeleton and each run's bundle and state
        self._rootless = os.geteuid() != 0
        self._groups = None if self._rootless else find_run_groups(options.cgroups)  # where it may
        if self._groups is not None:
            self._groups.sweep()  # groups a scorer that crashed left
        self.description = (f"gVisor ({self._runsc or options.runsc}, {options.platform}; {self._python}; "
                            f"{describe(self._groups)})")

    async def check(self) -> None:
        """Run the probe in a real gVisor sandbox (see :meth:`run`).

        Raises:
            SandboxUnavailable: ``runsc`` or the interpreter is missing, or ``runsc`` cannot start a sandbox here.
        """
        if self._runsc is None:
            raise SandboxUnavailable(
                f"{self._options.runsc!r} is not installed: install gVisor (Debian: apt-get install runsc), or set "
                "the scorer's sandbox.backend to 'bwrap'"
            )
        if not self._python.startswith("/usr/") or not os.access(self._python, os.X_OK):
            raise SandboxUnavailable(f"sandbox.python {self._python!r} must be an interpreter under /usr")
        await probe(self, 60.0, self._python,
                    "gVisor cannot start a sandbox here: {error}. Fix: the ptrace platform needs ptrace (a container "
                    "runtime's default seccomp profile refuses it: see docs/operations/security.md), kvm needs "
                    "/dev/kvm; a root scorer also needs CAP_SYS_ADMIN for the run's mount namespace (unshare, mount)")

    async def run(self, code: str, limits: SandboxLimits, tenant: str = "") -> SandboxResult:
        """Run ``code`` in a fresh gVisor sandbox (module docs) under ``limits``, in one of ``tenant``'s slots.

        Raises:
            SandboxError: ``runsc`` could not set the sandbox up (its message).
        """
        async with self._slots.hold(tenant):
            try:
                run = Path(tempfile.mkdtemp(prefix="run-", dir=self._folder()))
            except OSError as error:  # e.g. /dev/shm full: this run fails, not the scorer
                raise SandboxError(f"cannot make the run's folder: {error}") from error
            group = self._group(limits)
            try:
                return await self._run(code, limits, run, group)
            finally:  # the run's tree is reaped by now (collect); what it left exiting goes with its group
                try:
                    if group is not None:
                        await group.end()
                finally:  # even when a cancel lands while the group ends
                    shutil.rmtree(run, ignore_errors=True)

    def _group(self, limits: SandboxLimits) -> AnyRunGroup | None:
        if self._groups is None:
            return None
        try:
            return self._groups.create(limits.memory_bytes + GROUP_HEADROOM_BYTES)  # no pids group (module docs)
        except OSError as error:  # the sampled limits still hold
            logger.warning("no cgroups for a tool run (%s): its memory and CPU are sampled only", error)
            return None

    async def close(self) -> None:
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None

    def _folder(self) -> Path:
        if self._home is None:
            # on a tmpfs where the host has one: a run's bundle and runsc's state written to the disk /usr lies on
            # would move the free blocks and inodes every run reads from statvfs('/usr') (the eighth review)
            memory = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            self._home = Path(tempfile.mkdtemp(prefix="fastexp-gvisor-", dir=memory))
            self._home.chmod(0o711)  # runsc's gofer reads the root's skeleton below it
            make_rootfs(self._home / "rootfs")
            (self._home / "usr").mkdir()  # where a root scorer's runs see /usr without access times (_command)
            (self._home / "root").mkdir()  # and their root, a tmpfs of its own (_command)
        return self._home

    async def _run(self, code: str, limits: SandboxLimits, run: Path, group: AnyRunGroup | None) -> SandboxResult:
        assert self._home is not None
        source = code.encode(errors="surrogatepass")  # a lone surrogate: invalid UTF-8, which Python reports
        usr = "/usr" if self._rootless else str(self._home / "usr")
        root = str(self._home / ("rootfs" if self._rootless else "root"))
        spec = oci_spec(self._python, root, limits, self._options, usr=usr)
        (run / "config.json").write_text(json.dumps(spec))
        try:
            process = await start_run(asyncio.create_subprocess_exec(
                *self._command(run, group), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            ))
        except OSError as error:
            raise SandboxError(f"cannot start {self._runsc or self._options.runsc}: {error}") from error
        with RunTree(process) as tree:
            feeding = asyncio.ensure_future(_feed(process, source))
            try:
                watch = Watch(SentryUsage(), self._options.usage_poll_s, stderr_prefix=len(STARTED),
                              oom_kills=group.oom_kills if group is not None else None,
                              group_cpu_s=group.cpu_s if group is not None else None)
                stopped, stdout, stderr = await collect(process, tree, limits, watch)  # ends the tree on its errors
            finally:
                feeding.cancel()
        if not stderr.startswith(STARTED):
            raise SandboxError(stderr.decode(errors="replace").strip() or f"runsc exited {process.returncode}")
        exit_code = process.returncode if process.returncode is not None else -1
        if not stopped and group is not None and group.oom_kills():
            stopped = "memory"  # the kernel ended it at its group's limit
        return SandboxResult(cut(stdout, limits.max_output_bytes), cut(stderr[len(STARTED):], limits.max_output_bytes),
                             exit_code, stopped)

    def _command(self, run: Path, group: AnyRunGroup | None) -> list[str]:
        runsc = [self._runsc or self._options.runsc, *(["--rootless"] if self._rootless else []), "--network=none",
                 "--ignore-cgroups", f"--platform={self._options.platform}", "--root", str(run / "state"),
                 "run", "--bundle", str(run), f"fastexp-{uuid.uuid4().hex}"]
        # killed with the scorer, however it ends (a SIGKILL, the OOM killer): the limits were the scorer's to keep
        # (a bubblewrap run has --die-with-parent); runsc ends its sandbox with it
        with_scorer = ["setpriv", "--pdeathsig", "KILL", "--"]
        if self._rootless:
            return [*with_scorer, *runsc]
        assert self._home is not None
        # the gofer's reads would otherwise stamp the host's files' access times (usr_view_prefix)
        procs = group.procs if group is not None else ""
        home = self._home
        return [*with_scorer, *usr_view_prefix(str(home / "usr"), str(home / "root"), str(home / "rootfs"), procs),
                *runsc]


async def _feed(process: asyncio.subprocess.Process, code: bytes) -> None:
    """Write the tool's code to the run's standard input and close it (the launcher reads it to its end)."""
    assert process.stdin is not None
    with contextlib.suppress(ConnectionError):
        process.stdin.write(code)
        await process.stdin.drain()
    process.stdin.close()
