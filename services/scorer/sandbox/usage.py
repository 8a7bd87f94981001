"""What a run's whole process tree uses, read from ``/proc``: the per-run limits of a tool run on hosts that
delegate no cgroup to the scorer (most containers: Kubernetes and Docker mount the container's cgroup read-only).

A run's tree is the bubblewrap process the scorer started and every process below it: bwrap's init is the reaper of
the run's pid namespace, so an orphan (a daemon, a double fork) is re-parented to it and stays in the tree. Its use:

- **CPU seconds**: user + system time of each live process and of the children each has reaped (``utime + stime +
  cutime + cstime`` in ``/proc/<pid>/stat``), so the work of processes that already ended still counts;
- **resident bytes**: the sum of each live process's resident set (``/proc/<pid>/stat`` ``rss``): pages shared
  between processes (the interpreter's, a fork's copy-on-write pages) count once per process, so the figure is an
  upper bound and a run is stopped no later than its true use passes the limit;
- **shared bytes**: the size of every writable shared mapping of its processes (``rw?s`` in ``/proc/<pid>/maps``),
  each object once: shared memory stays allocated while no resident set shows it (a page dropped with
  ``MADV_DONTNEED``, a forked child that never touched it), so the whole mapping counts, touched or not;
- **mappings**: every mapping (``/proc/<pid>/maps`` line) of its processes costs the kernel a ``vm_area_struct``
  and its links (slab no resident set shows: 64,000 mappings of untouched pages in one process held ~14 MiB of
  unreclaimable slab, ~230 B each, measured 2026-11-25), charged at :data:`MAPPING_BYTES` each;
- **sockets**: the bytes waiting on its network namespace's TCP and UDP sockets (:func:`socket_use`), times
  :data:`QUEUE_OVERHEAD` (the kernel grows TCP buffers by itself, so no per-socket bound holds), and
  :data:`SOCKET_BYTES` per socket: a connection waiting in a listener's queue has no descriptor that an rlimit
  bounds; and :data:`UNIX_SOCKET_BYTES` per unix socket (``net/unix``, which shows no queue: data sent into a
  connection nobody accepted stays queued after its sender closed, up to the sender's send buffer);
- **files** in its writable tmpfs (:func:`files_used`: the inodes in use, seen through ``/proc/<pid>/root``): the
  tmpfs is bounded in bytes, but each empty file still costs the kernel about 1 KiB that no byte limit counts.

A process whose main thread has exited while its other threads run (``SYS_exit`` on the main thread: the process
shows state ``Z``) keeps its memory, mappings and root, but the kernel no longer shows them at ``/proc/<pid>``
(resident set 0, no mappings, no root); they are read from one of its live threads (``/proc/<pid>/task/<tid>``),
which share them. Memory no process's resident set shows (System V shared memory and message queues, unmapped
memory files, secret memory) is refused by the run's system-call filter instead
(:mod:`services.scorer.sandbox.seccomp`).

The supervisor (:func:`services.scorer.sandbox.supervise.collect`) samples it every ``poll_s``: between two
samples a run's total may pass its limit, by at most what its processes can each reach under their own rlimits
(``RLIMIT_AS``, ``RLIMIT_CPU``), for at most one interval; then the whole tree is killed. A sample takes at most
:data:`MAX_SAMPLE_S`; one that would take longer stops the run (:class:`SampleOverBudget`), so an interval is at most
``poll_s`` + :data:`MAX_SAMPLE_S`. What the scorer spends reading the files a run shapes (its mappings, its
sockets: :attr:`TreeUsage.read_cpu_s`) is the run's doing: past :data:`READ_ALLOWANCE_S` a sample, it counts toward
the run's CPU seconds, so a run cannot make the scorer work for it unbounded (the sixth review had the scorer spend
7 CPU-s sampling a run that spent 0.06).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

#: Kernel memory charged per mapping of a run's processes (a ``vm_area_struct`` with its anon-vma links: ~230 B
#: measured, rounded up): what mapping many small ranges costs beyond its resident pages.
MAPPING_BYTES = 256
#: Kernel memory per byte queued on a socket: each buffer's payload rides in an skb whose true size is larger
#: (headers, page rounding); 2 is an upper bound for loopback's 64 KiB segments.
QUEUE_OVERHEAD = 2


def _sysctl_int(path: str, default: int) -> int:
    """An integer sysctl of the host (``default`` where it cannot be read)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


#: Kernel memory charged per socket of a run's network namespace (a TCP socket with its buffers' minimum: the
#: sixth review held 148,000 unaccepted loopback connections in listen queues, ~600 MB, about 4 KiB each).
SOCKET_BYTES = 4096
#: Kernel memory charged per unix socket of a run's network namespace: what its send buffer may hold
#: (``net.core.wmem_default``, which a run cannot raise), times :data:`QUEUE_OVERHEAD` (the re-run of the sixth
#: review queued 1.2 GB in 19,000 unaccepted unix connections whose senders had closed).
UNIX_SOCKET_BYTES = QUEUE_OVERHEAD * _sysctl_int("/proc/sys/net/core/wmem_default", 212_992)
#: The same for a unix datagram or seqpacket socket: its receive queue holds up to ``net.unix.max_dgram_qlen`` + 1
#: datagrams of up to a send buffer each, from senders that may have closed since.
UNIX_DATAGRAM_SOCKET_BYTES = UNIX_SOCKET_BYTES * (_sysctl_int("/proc/sys/net/unix/max_dgram_qlen", 10) + 1)
#: ``net/unix``'s ``Type`` of a stream socket (any other is a datagram or seqpacket one).
_UNIX_STREAM = b"0001"
#: CPU seconds of the scorer per sample that reading a run's mappings and sockets may take before the rest counts
#: toward the run's ``cpu_s`` (a benign run's few processes take well under a millisecond).
READ_ALLOWANCE_S = 0.005
#: Most seconds one sample of a run's tree may take: past it the sample stops (:class:`SampleOverBudget`) and the
#: run with it. Reading ``/proc/<pid>/maps`` costs the kernel a rendered path per mapping, and a run chooses both
#: how many mappings it has and how long their paths are (the fifth review made one sample take 6 s, while its
#: processes used 2.7 GB against 512 MiB unseen).
MAX_SAMPLE_S = 0.5
#: Clock ticks per second of ``/proc/<pid>/stat``'s times.
_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class TreeUsage:
    """A process tree's use at one moment: ``cpu_s`` CPU seconds (user + system, reaped children included),
    ``rss_bytes`` resident bytes (summed per process: an upper bound), ``processes`` alive."""

    cpu_s: float = 0.0
    rss_bytes: int = 0
    processes: int = 0
    inner: int | None = None  # the root's first child (bubblewrap's: the sandbox's init), None: none yet
    shared_bytes: int = 0  # writable shared mappings, each object once (:func:`mappings_of`)
    mappings: int = 0  # mappings of all its processes (:func:`mappings_of`)
    socket_bytes: int = 0  # data queued on its network namespace's TCP and UDP sockets (:func:`socket_use`)
    sockets: int = 0  # its network namespace's TCP and UDP sockets (:func:`socket_use`)
    unix_sockets: int = 0  # its network namespace's unix stream sockets (:func:`socket_use`)
    unix_datagram_sockets: int = 0  # and its unix datagram and seqpacket ones
    read_cpu_s: float = 0.0  # the scorer's CPU seconds reading its mappings and sockets for this sample

    @property
    def memory_bytes(self) -> int:
        """What the run's memory limit is held against: resident bytes, writable shared mappings,
        :data:`MAPPING_BYTES` per mapping, :data:`QUEUE_OVERHEAD` times the bytes queued on its sockets,
        :data:`SOCKET_BYTES` per TCP or UDP socket, :data:`UNIX_SOCKET_BYTES` per unix stream socket and
        :data:`UNIX_DATAGRAM_SOCKET_BYTES` per other unix socket (an upper bound: a shared page resident somewhere
        counts twice)."""
        return (self.rss_bytes + self.shared_bytes + self.mappings * MAPPING_BYTES
                + self.socket_bytes * QUEUE_OVERHEAD + self.sockets * SOCKET_BYTES
                + self.unix_sockets * UNIX_SOCKET_BYTES + self.unix_datagram_sockets * UNIX_DATAGRAM_SOCKET_BYTES)


@dataclass(frozen=True)
class ProcessStat:
    """The fields of one ``/proc/<pid>/stat`` line a tree's use is summed from."""

    pid: int
    ppid: int
    cpu_ticks: int  # utime + stime + cutime + cstime (the whole thread group's)
    rss_pages: int
    state: str = "R"  # proc(5)'s state letter: Z for a zombie, or a process whose main thread has exited


def parse_stat(line: str) -> ProcessStat:
    """Parse a ``/proc/<pid>/stat`` line (proc(5)); the command name may hold spaces and parentheses, so fields
    are counted after its last ``)``.

    Raises:
        ValueError: not such a line.
    """
    head, _, tail = line.rpartition(")")
    fields = tail.split()
    if not head or len(fields) < 22:
        raise ValueError(f"not a /proc/<pid>/stat line: {line[:80]!r}")
    pid = int(head.split("(", 1)[0])
    # fields[0] is field 3 (state): ppid is field 4, utime..cstime 14..17, rss 24
    return ProcessStat(pid, int(fields[1]), sum(int(value) for value in fields[11:15]), int(fields[21]), fields[0])


def tree_of(stats: list[ProcessStat], root: int) -> list[ProcessStat]:
    """``root`` and its descendants among ``stats`` (every process's stat at one moment), parents first."""
    children: dict[int, list[ProcessStat]] = {}
    by_pid = {}
    for stat in stats:
        children.setdefault(stat.ppid, []).append(stat)
        by_pid[stat.pid] = stat
    tree, pending = [], [by_pid[root]] if root in by_pid else []
    while pending:
        stat = pending.pop(0)
        tree.append(stat)
        pending.extend(children.get(stat.pid, ()))
    return tree


def tree_usage_of(stats: list[ProcessStat], root: int) -> TreeUsage:
    """The use of ``root`` and its descendants among ``stats`` (mappings not read: ``shared_bytes`` and
    ``mappings`` 0)."""
    return _usage(tree_of(stats, root), root, Mappings())


def _usage(tree: list[ProcessStat], root: int, mappings: Mappings) -> TreeUsage:
    inner = tree[1].pid if len(tree) > 1 and tree[1].ppid == root else None
    return TreeUsage(sum(s.cpu_ticks for s in tree) / _TICKS, sum(s.rss_pages for s in tree) * _PAGE, len(tree),
                     inner, mappings.shared_bytes, mappings.count)


def process_stats(proc: Path = Path("/proc")) -> list[ProcessStat]:
    """Every process's stat now, from ``proc`` (blocking: call it off the event loop where it matters). A process
    that ends during the walk is skipped (its time is in its parent's once reaped); one whose main thread has exited
    while others run has its resident set read from a live thread (module docs)."""
    stats = []
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            try:
                stat = parse_stat((proc / entry.name / "stat").read_text())
                if stat.state == "Z" and (thread := live_thread(stat.pid, proc)) is not None:
                    stat = replace(stat, rss_pages=parse_stat((thread / "stat").read_text()).rss_pages)
                stats.append(stat)
            except (OSError, ValueError):
                continue
    return stats


def live_thread(pid: int, proc: Path = Path("/proc")) -> Path | None:
    """``/proc/<pid>/task/<tid>`` of a thread of ``pid`` other than its main one, or None where it has none (a
    process whose main thread exited shows its memory, mappings and root only there)."""
    try:
        tids = [entry.name for entry in os.scandir(proc / str(pid) / "task") if entry.name != str(pid)]
    except OSError:
        return None
    return proc / str(pid) / "task" / tids[0] if tids else None


def _process_dir(stat: ProcessStat, proc: Path) -> Path:
    """Where ``stat``'s process shows its mappings and root (module docs)."""
    thread = live_thread(stat.pid, proc) if stat.state == "Z" else None
    return thread or proc / str(stat.pid)


class SampleOverBudget(RuntimeError):
    """A sample of a run's tree took longer than :data:`MAX_SAMPLE_S` (the run is to be stopped)."""


def tree_usage(root: int, proc: Path = Path("/proc"), budget_s: float | None = MAX_SAMPLE_S) -> TreeUsage:
    """The use of process ``root``'s tree now, shared mappings and queued socket data included (blocking).

    Raises:
        SampleOverBudget: reading it took longer than ``budget_s`` seconds (None: no bound).
    """
    deadline = None if budget_s is None else time.monotonic() + budget_s
    tree = tree_of(process_stats(proc), root)
    folders = [_process_dir(s, proc) for s in tree]
    started = time.thread_time()
    usage = _usage(tree, root, mappings_of(folders, deadline))
    queued, sockets, streams, datagrams = socket_use(folders[1], deadline) if usage.inner is not None else (0,) * 4
    return replace(usage, socket_bytes=queued, sockets=sockets, unix_sockets=streams, unix_datagram_sockets=datagrams,
                   read_cpu_s=time.thread_time() - started)


def socket_use(process: Path, deadline: float | None = None) -> tuple[int, int, int, int]:
    """Bytes queued to send and to read on the TCP and UDP sockets of the network namespace of the process at
    ``process`` (its ``/proc/<pid>`` or a live thread's folder: the ``tx_queue:rx_queue`` column of
    ``net/{tcp,tcp6,udp,udp6}`` there), how many such sockets (rows) there are, and how many unix stream and other
    unix sockets (``net/unix``'s rows by ``Type``: connections not yet accepted among them). The kernel grows a TCP socket's
    buffers by itself (autotuning, up to ``net.ipv4.tcp_wmem``/``tcp_rmem``'s maximum, 4 and 32 MiB here), so the
    socket count alone bounds nothing: the fifth review queued 1.4 GiB on 406 loopback connections.

    Raises:
        SampleOverBudget: ``deadline`` (``time.monotonic()`` seconds) passed while reading.
    """
    queued = sockets = 0
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            for line in _lines(process / "net" / table, deadline):
                fields = line.split()
                if len(fields) > 4 and b":" in fields[4]:  # not the header
                    tx, rx = fields[4].split(b":")
                    queued += int(tx, 16) + int(rx, 16)
                    sockets += 1
        except OSError:
            continue
    streams = datagrams = 0
    try:
        for line in _lines(process / "net" / "unix", deadline):
            fields = line.split()
            if len(fields) > 5 and fields[0] != b"Num":  # not the header
                streams += fields[4] == _UNIX_STREAM
                datagrams += fields[4] != _UNIX_STREAM
    except OSError:
        pass
    return queued, sockets, streams, datagrams


@dataclass(frozen=True)
class Mappings:
    """The mappings of some processes: ``shared_bytes`` of their writable shared ones (each object once) and how
    many there are (``count``, every kind)."""

    shared_bytes: int = 0
    count: int = 0


def mappings_of(processes: list[Path], deadline: float | None = None) -> Mappings:
    """The mappings of ``processes`` (their ``/proc/<pid>`` or a live thread's folder, whose ``maps`` is read): all
    of them counted, and the bytes of the writable shared ones (permissions ``rw?s``), each mapped object (device,
    inode) once at its largest mapping.

    Raises:
        SampleOverBudget: ``deadline`` (``time.monotonic()`` seconds) passed while reading.
    """
    objects: dict[tuple[bytes, bytes], int] = {}
    count = 0
    for folder in processes:
        try:
            for line in _lines(folder / "maps", deadline):
                count += 1
                fields = line.split(maxsplit=5)
                if len(fields) < 5 or fields[1][1:2] != b"w" or fields[1][3:4] != b"s":
                    continue
                start, end = (int(value, 16) for value in fields[0].split(b"-"))
                key = (fields[3], fields[4])
                objects[key] = max(objects.get(key, 0), end - start)
        except OSError:
            continue
    return Mappings(sum(objects.values()), count)


def mapping_count(folder: Path, deadline: float | None = None) -> int:
    """How many mappings the process at ``folder`` (its ``/proc/<pid>``) has (0 where it is gone).

    Raises:
        SampleOverBudget: ``deadline`` passed while reading.
    """
    try:
        return sum(1 for _ in _lines(folder / "maps", deadline))
    except OSError:
        return 0


def _lines(path: Path, deadline: float | None, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The lines of ``path``, read ``chunk`` bytes at a time, checking ``deadline`` before each read after the
    first (a file of one chunk, as every process's ``maps`` but a run's with some 10,000 mappings, is never cut: a
    scorer descheduled on a loaded host does not stop a run that way).

    Raises:
        SampleOverBudget: ``deadline`` passed. OSError: unreadable.
    """
    with open(path, "rb") as file:
        rest, first = b"", True
        while block := file.read(chunk):
            if not first and deadline is not None and time.monotonic() > deadline:
                raise SampleOverBudget(f"reading {path} passed the sample's {MAX_SAMPLE_S} s")
            first = False
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            yield from lines
        if rest:
            yield rest


def files_used(pid: int, folder: str, proc: Path = Path("/proc")) -> int | None:
    """Inodes in use in the filesystem at ``folder`` as process ``pid`` sees it (its mount namespace; through a live
    thread where its main thread has exited), or None where that cannot be read (the process ended, or no
    access)."""
    for base in (proc / str(pid), live_thread(pid, proc)):
        if base is None:
            continue
        try:
            stats = os.statvfs(base / "root" / folder.lstrip("/"))
        except OSError:
            continue
        return stats.f_files - stats.f_ffree
    return None
