"""Tool runs isolated by the operating system with bubblewrap (``bwrap``, what Flatpak uses).

Each run is ``bwrap`` with, for the tool's process tree:

- **new user, pid, network, ipc, uts and cgroup namespaces** (``--unshare-all --unshare-user``), and no further
  user namespaces inside (``--disable-userns``): it sees only its own processes, has no network interface but a
  down loopback, and holds no capability on the host;
- **a minimal read-only root**: ``/usr`` (the interpreter, its standard library, the C library) and the
  interpreter's own prefix when it lies elsewhere; nothing of ``/etc``, ``/home``, ``/root``, the project tree, the
  scorer's mounts or its secrets; a private ``/proc`` (its own processes only; the files in it that count for the
  whole host, :data:`~services.scorer.sandbox.bwrap_args.HOST_WIDE_PROC`, read empty: a counter one call moves
  and the next reads would carry bits between them) and a minimal ``/dev``;
- **one writable place**, a fresh tmpfs at ``/tmp`` of ``tmpfs_bytes``, which is also its working directory and
  vanishes with the run; the sandbox's root and its ``/dev`` are remounted read-only (bwrap makes both as tmpfs
  without a size limit: writable, they would let a run fill the host's memory), so ``/dev/shm`` is not writable;
- **an empty environment** (``--clearenv``) but ``PATH``, ``HOME`` and ``LANG``;
- **a system-call filter** (``--seccomp``: :mod:`services.scorer.sandbox.seccomp`, a Docker-default-like deny list:
  the kernel keyring, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``ptrace``, mounts and namespaces, ...); a
  host where it cannot be built runs no tool (fail closed);
- ``--as-pid-1``, ``--die-with-parent`` and ``--new-session``: the run's first process is its pid namespace's init
  (no bwrap process runs inside: its memory, outside the filter and the limits, would be writable through
  ``/proc/1/mem``), it dies with bwrap's monitor (the filter keeps it from clearing that), and when it ends the
  kernel kills every process left in the namespace, so nothing outlives the run;
- **limits per process** set by a trusted launcher inside, before the tool's code starts (the code cannot raise
  them): ``RLIMIT_NPROC`` (``max_processes``), ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``
  and ``RLIMIT_CORE`` = 0;
- **limits per run**: the whole tree's CPU seconds (``cpu_s``), memory (``memory_bytes``: resident bytes,
  writable shared mappings and the kernel's memory per mapping) and files in its
  tmpfs (``max_files``), sampled from ``/proc`` every ``usage_poll_s`` (:mod:`services.scorer.sandbox.usage`): past
  any, the whole tree is killed (``stopped``: ``"cpu"``, ``"memory"``, ``"files"``); a wall-clock timeout kills it, and
  so does stdout or stderr passing ``max_output_bytes`` (``"output"``: reading and dropping an endless stream would
  cost the scorer CPU that no limit of the run counts); where the host lets the scorer make one (a root scorer,
  cgroup v1's memory controller writable: :mod:`services.scorer.sandbox.cgroup`; on a host of cgroup v2, a group
  delegated to the scorer gives the same per run: :mod:`services.scorer.sandbox.cgroup_v2`), the run's tree is in a
  **memory cgroup** of its own besides (``memory_bytes`` + ``tmpfs_bytes`` + :data:`GROUP_HEADROOM_BYTES`, kernel memory
  included): the kernel refuses the memory past it as it is asked for, so what the tree reaches between two
  samples is bounded too (a run it ends there reports ``"memory"``), and, where ``cpuacct`` is writable too, in a
  ``cpuacct`` group whose count of the tree's CPU, children the kernel reaped by itself included, is held against
  ``cpu_s`` at each sample, and, where ``pids`` is writable too, in a ``pids`` group of ``max_processes`` +
  :data:`TASK_HEADROOM` tasks: the tool's processes and threads together are bounded by ``max_processes`` per run,
  whatever the uid and the kernel's version (``RLIMIT_NPROC`` is counted per uid in each user namespace since Linux
  5.14, per uid on the whole host before; :mod:`services.scorer.sandbox.cgroup`);
- **one unit that ends once**: however the call ends (its result, the timeout, the caller's cancellation: a
  cancelled Step or stream, a step timeout, the scorer stopping), the run's whole tree is killed and reaped before
  the call returns or its cancellation completes, and only then is its ``max_concurrent`` slot free: bwrap's
  monitor reaps the sandbox's init, which reaps the rest, so no zombie is left for the host's init (or a scorer
  that is PID 1 of its container) to collect.

A scorer running as root starts ``bwrap`` as an unprivileged uid (``uid``, default 65534) through util-linux's
``setpriv``: the kernel does not enforce ``RLIMIT_NPROC`` for processes that are root on the host, and a kernel
escape then lands as nobody. (Not with ``Popen(user=...)``: that forks without vfork, and gRPC's fork handlers
crash the child of a process serving gRPC.) The tool's code reaches ``bwrap`` through a memory file descriptor:
no host file or directory is made for a run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from services.scorer.sandbox.base import (
    MIB,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    cut,
    probe,
)
from services.scorer.sandbox.bwrap_args import (
    LAUNCHER,
    WORKDIR,
    host_wide_proc_files,
    memory_file,
    parse_status,
    prefix_bind,
    private_proc,
    root_links,
)
from services.scorer.sandbox.run_groups import AnyRunGroup, CgroupVersion, describe, find_run_groups
from services.scorer.sandbox.seccomp import SeccompUnavailable, filter_program
from services.scorer.sandbox.slots import FairSlots
from services.scorer.sandbox.supervise import Watch, collect
from services.scorer.sandbox.tree import RunTree, start_run
from services.scorer.sandbox.usage import TreeUsage, files_used, tree_usage

logger = logging.getLogger(__name__)

_NOBODY = 65534

#: Exit statuses ``bwrap`` passes on for a child ended by a signal (128 + signal number).
_CPU_SIGNALS = {128 + signal.SIGXCPU, 128 + signal.SIGKILL, -signal.SIGXCPU, -signal.SIGKILL}


@dataclass(frozen=True)
class BubblewrapOptions:
    """How runs are isolated: the ``bwrap`` program, the interpreter inside (``None``: this process's interpreter
    when it lies under ``/usr``, else ``/usr/bin/python3``), the host ``uid``/``gid`` runs use (``None``: 65534 when
    the scorer is root, else the scorer's own), ``max_processes`` the tool may have (itself included),
    ``tmpfs_bytes`` of its writable ``/tmp``, ``mount_proc`` (a private ``/proc``; off where the container
    runtime masks ``/proc``), ``max_concurrent`` runs at once (more wait, each tenant in a queue of its own:
    :mod:`.slots`; ``max_concurrent_per_tenant`` of them for one tenant, ``None``: all), and ``usage_poll_s``, the seconds
    between two samples of a run's tree's CPU time, memory and files (its per-run limits); ``max_files`` the
    files (inodes) a run's tmpfs may hold; ``cgroups`` which cgroup hierarchy a run's group is made in
    (:data:`.run_groups.CgroupVersion`)."""

    bwrap: str = "bwrap"
    python: str | None = None
    uid: int | None = None
    gid: int | None = None
    max_processes: int = 16
    tmpfs_bytes: int = 64 * MIB
    mount_proc: bool = True
    max_concurrent: int = 4
    usage_poll_s: float = 0.1
    max_files: int = 10_000
    max_concurrent_per_tenant: int | None = None
    cgroups: CgroupVersion = "auto"


#: What a run's memory group holds beyond ``memory_bytes`` and its tmpfs: bwrap's monitor, page tables, kernel
#: stacks and the other kernel memory the sampled limit does not see.
GROUP_HEADROOM_BYTES = 64 * MIB
#: The tasks of a run's ``pids`` group that are not the tool's (its ``pids.max`` is ``max_processes`` + these): bwrap's
#: monitor, the one process of the tree outside the sandbox, single-threaded. The join script and ``setpriv`` exec into
#: it rather than fork, bwrap's child is the tool's first process (``--as-pid-1``: no init of bwrap's inside), and an
#: unprivileged bwrap forks no helper (tests/integration/test_tool_sandbox_run_groups.py counts them during a run). A
#: setuid bwrap (not this project's: it needs unprivileged user namespaces) forks a privileged helper while it sets
#: up, one task more for that while: with ``max_processes`` 1 it could not start.
TASK_HEADROOM = 1
#: Joins the run's groups, whose ``cgroup.procs`` files ``$1`` lists (space-separated, split without globbing; none
#: where empty), then execs the rest of its arguments; exits 125 where one cannot be joined (the run fails: closed).
_JOIN_GROUP = 'set -f && for procs in $1; do echo $$ > "$procs" || exit 125; done && shift && exec "$@"'


class BubblewrapSandbox:
    """Runs each tool program in its own bubblewrap sandbox (module docs)."""

    def __init__(self, options: BubblewrapOptions = BubblewrapOptions()) -> None:
        self._options = options
        self._python = options.python or default_python()
        running_as_root = os.geteuid() == 0
        self._uid = options.uid if options.uid is not None else (_NOBODY if running_as_root else None)
        self._gid = options.gid if options.gid is not None else (_NOBODY if running_as_root else None)
        self._slots = FairSlots(options.max_concurrent, options.max_concurrent_per_tenant)
        # resolved once, on this process's PATH: runs start with an empty environment, where a bare name that is
        # not in the default path (/bin, /usr/bin) would not be found; start-up and runs use the same program
        self._bwrap = shutil.which(options.bwrap)
        self._groups = find_run_groups(options.cgroups)  # cgroups per run where the host lets it make them
        if self._groups is not None:
            self._groups.sweep()  # groups a scorer that crashed left
        self.description = f"bubblewrap ({self._bwrap or options.bwrap}; {self._python}; host uid {self._uid or os.geteuid()})"

    async def check(self) -> None:
        """Run the probe in a real sandbox (see :meth:`run`).

        Raises:
            SandboxUnavailable: ``bwrap`` or the interpreter is missing, or the kernel refuses the namespaces.
        """
        bwrap = self._bwrap
        if bwrap is None:
            raise SandboxUnavailable(
                f"{self._options.bwrap!r} is not installed: install bubblewrap (Debian: apt-get install bubblewrap), "
                "or set the scorer's sandbox.backend to 'remote' and run `fastexp serve sandbox` elsewhere"
            )
        if not os.access(self._python, os.X_OK):
            raise SandboxUnavailable(f"sandbox.python {self._python!r} is not an executable interpreter")
        version = await _bwrap_version(bwrap)
        self.description = (f"bubblewrap {version} ({self._python}; host uid {self._uid or os.geteuid()}; "
                            f"{describe(self._groups)})")
        await probe(self, 30.0, self._python,
                    "bubblewrap cannot isolate a run here: {error}. Fix: allow unprivileged user namespaces "
                    "(sysctl user.max_user_namespaces > 0 and kernel.unprivileged_userns_clone = 1); in a container, "
                    "give the sandbox the security options of deploy/ (its `sandbox` service), or set sandbox.backend "
                    "to 'remote'")

    async def run(self, code: str, limits: SandboxLimits, tenant: str = "") -> SandboxResult:
        """Run ``code`` in a fresh sandbox (module docs) under ``limits``, in one of ``tenant``'s slots.

        Raises:
            SandboxError: ``bwrap`` could not set the sandbox up (its message).
        """
        async with self._slots.hold(tenant):
            group = self._group(limits)
            try:
                return await self._run(code, limits, group)
            finally:  # the run's tree is reaped by now (collect); what it left exiting goes with its group
                if group is not None:
                    await group.end()

    def _group(self, limits: SandboxLimits) -> AnyRunGroup | None:
        if self._groups is None:
            return None
        try:
            return self._groups.create(limits.memory_bytes + self._options.tmpfs_bytes + GROUP_HEADROOM_BYTES,
                                       max_tasks=self._options.max_processes + TASK_HEADROOM)
        except OSError as error:  # the sampled limits still hold
            logger.warning("no cgroups for a tool run (%s): its memory and CPU are sampled only", error)
            return None

    async def close(self) -> None:
        return None

    async def _run(self, code: str, limits: SandboxLimits, group: AnyRunGroup | None) -> SandboxResult:
        try:
            program = filter_program()
        except SeccompUnavailable as error:  # fail closed: no run without its system-call filter
            raise SandboxError(str(error)) from None
        source = memory_file("tool-code", code.encode())
        rules = memory_file("tool-seccomp", program)
        masked = host_wide_proc_files() if self._options.mount_proc else ()
        empties = [os.open(os.devnull, os.O_RDONLY) for _ in masked]  # what the host-wide /proc files read as
        status_read, status_write = os.pipe()
        try:
            process = await start_run(asyncio.create_subprocess_exec(
                *self._command(limits, source, status_write, rules, empties, group),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(source, status_write, rules, *empties), start_new_session=True, env={},
            ))
        except BaseException as error:  # bwrap missing, the uid/gid cannot be taken, or the caller gave up
            os.close(status_read)
            if isinstance(error, OSError):
                raise SandboxError(f"cannot start {self._bwrap or self._options.bwrap}: {error}") from error
            raise
        finally:
            for fd in (source, rules, status_write, *empties):
                os.close(fd)
        with open(status_read, "rb") as status, RunTree(process) as tree:
            watch = Watch(_sample, self._options.usage_poll_s, self._options.max_files,
                          oom_kills=group.oom_kills if group is not None else None,
                          group_cpu_s=group.cpu_s if group is not None else None)
            stopped, stdout, stderr = await collect(process, tree, limits, watch)
            started, exit_code = parse_status(status.read())
        if not started:
            raise SandboxError(stderr.decode(errors="replace").strip() or f"bwrap exited {process.returncode}")
        exit_code = process.returncode if exit_code is None else exit_code
        if not stopped and group is not None and group.oom_kills():
            stopped = "memory"  # the kernel ended it at its group's limit
        if not stopped and exit_code in _CPU_SIGNALS:
            stopped = "cpu"
        return SandboxResult(cut(stdout, limits.max_output_bytes), cut(stderr, limits.max_output_bytes),
                             exit_code, stopped)

    def _command(self, limits: SandboxLimits, source: int, status: int, rules: int, empties: list[int],
                 group: AnyRunGroup | None = None) -> list[str]:
        o = self._options
        command = [
            self._bwrap or o.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1",
            "--clearenv", "--hostname", "sandbox", "--json-status-fd", str(status),
            "--ro-bind", "/usr", "/usr", *root_links(), *prefix_bind(self._python),
            "--dev", "/dev", "--remount-ro", "/dev", *(private_proc(empties) if o.mount_proc else []),
            "--size", str(o.tmpfs_bytes), "--tmpfs", WORKDIR,
            "--ro-bind-data", str(source), f"{WORKDIR}/main.py", "--remount-ro", "/", "--chdir", WORKDIR,
            "--seccomp", str(rules),
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", WORKDIR,
            "--setenv", "LANG", "C.UTF-8",
        ]
        # The tool's processes: the launcher is the pid namespace's init (--as-pid-1: no bwrap process of the host's
        # runs in the sandbox, whose memory a run could write through /proc/1/mem, outside every limit)
        nproc = o.max_processes
        # the run's groups are joined first, as root: its children, bwrap and the whole tree, are born in them
        join = ["/bin/sh", "-c", _JOIN_GROUP, "join-group", group.procs] if group is not None else []
        return [*join, *self._drop_privileges(), *command, self._python, "-I", "-B", "-c", LAUNCHER,
                str(limits.cpu_s), str(limits.memory_bytes), str(limits.max_file_bytes), str(nproc)]

    def _drop_privileges(self) -> list[str]:
        if self._uid is None:
            return []
        return ["setpriv", f"--reuid={self._uid}", f"--regid={self._gid}", "--clear-groups", "--"]


def default_python() -> str:
    """This process's interpreter when it lies under ``/usr`` (same version as the scorer), else the system's."""
    own = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return own if own.startswith("/usr/") else "/usr/bin/python3"


def _sample(root: int) -> tuple[TreeUsage, int | None]:
    """The run's tree's use (from the host's ``/proc``) and the files in its tmpfs (None: not readable yet)."""
    usage = tree_usage(root)
    return usage, files_used(usage.inner, WORKDIR) if usage.inner is not None else None


async def _bwrap_version(bwrap: str, timeout_s: float = 10.0) -> str:
    """``bwrap --version``'s number (for logs), or ``"(unknown version)"``."""
    process = await asyncio.create_subprocess_exec(bwrap, "--version", stdout=subprocess.PIPE,
                                                   stderr=subprocess.DEVNULL)
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        return "(unknown version)"
    return out.decode().strip().removeprefix("bubblewrap ") or "(unknown version)"
