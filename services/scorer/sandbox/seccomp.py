"""The system-call filter every tool run gets (``bwrap --seccomp``): a deny list in the spirit of Docker's default
profile and Kubernetes' ``RuntimeDefault``, built with libseccomp (``pyseccomp``, its ctypes bindings) as the
classic-BPF program bwrap loads just before it executes the run's first process.

Denied with EPERM: the kernel keyring (``keyctl``, ``add_key``, ``request_key``: the scorer's session keyring is
neither readable nor writable, and nothing left there by one call reaches the next), ``bpf``,
``perf_event_open``, ``userfaultfd``, ``ptrace`` and reading or writing other processes' memory, mounts and
namespaces (``mount``, ``umount2``, ``pivot_root``, ``chroot``, ``unshare``, ``setns``, and ``clone`` with any
namespace flag), kernel modules and ``kexec``, clocks, swap, reboot, ``syslog``, ``acct``, quotas, handles
(``open_by_handle_at``), ``fanotify``, ``io_uring``, port I/O; and the kernel memory no per-run limit sees
(System V shared memory, message queues and semaphores, ``shmget``, ``msgget``, ``semget``: they outlive every
process that used them, and a fresh IPC namespace allows 32,000 semaphore sets of ~2 MiB; ``memfd_create``: its
pages count in no process's resident set until mapped), and ``io_setup`` (Linux AIO's event quota, ``fs.aio-nr``,
is one counter for the whole host). Arguments are compared as the kernel reads them: ``int`` arguments on their
low 32 bits (``prctl(0x100000001)`` is ``prctl(1)`` to the kernel). ``clone3`` answers
ENOSYS, as under Docker: its flags cannot be filtered (they are behind a pointer), and the C library falls back to
``clone``. Growing a socket's buffers (``setsockopt`` ``SO_SNDBUF``/``SO_RCVBUF``) is EPERM: queued socket data is
kernel memory no resident set shows. ``prctl(PR_SET_PDEATHSIG)`` is EPERM: a run's first process is its pid namespace's init and dies with
bwrap's monitor (``--die-with-parent``), which it must not undo; ``prctl(PR_SET_DUMPABLE)`` likewise (a
non-dumpable process hides the ``/proc`` entries the per-run limits read from a scorer of the same uid).
Sockets of any address family but ``AF_UNIX``, ``AF_INET`` and ``AF_INET6`` answer EAFNOSUPPORT: ``AF_VSOCK`` is
not confined by the network namespace (a run would share the virtual machine's vsock ports with its host),
``AF_NETLINK`` queues kernel memory no count sees, and the others are kernel attack surface no tool needs
(``AF_PACKET``, ``AF_ALG``, ``AF_XDP``, ...); multipath TCP (``IPPROTO_MPTCP``) answers EPROTONOSUPPORT. The page cache of the files every run shares (the read-only ``/usr``) must not carry bits from one
call to the next: probing whether a page is cached (``preadv2``/``pwritev2`` with ``RWF_NOWAIT``, ``cachestat``)
and evicting a file's pages (``posix_fadvise(POSIX_FADV_DONTNEED)``, ``madvise(MADV_COLD | MADV_PAGEOUT)``) are
EPERM (``mincore`` reports nothing of files a run cannot write). System calls newer than these lists (from ``memfd_secret``, 447, on) answer ENOSYS, as on a kernel without them
(:data:`FIRST_UNREVIEWED_SYSCALL`); ``memfd_secret``'s memory shows in no resident set, ``process_madvise`` would
advise another process's pages, ``quotactl_fd`` and ``modify_ldt`` are kernel surface no tool needs (EPERM).
Writing extended attributes answers EOPNOTSUPP (:data:`XATTR_WRITES`: kernel memory on the run's tmpfs).
``inotify_init``/``inotify_init1`` are EPERM: inotify instances are counted per host uid, which every run shares, so
one run holding 128 left a concurrent one none. ``socketpair`` is held to the same families as ``socket``.
Everything else is allowed: the run's other limits (namespaces, rlimits, the read-only root, the per-run use) do the
rest.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import tempfile

from services.scorer.sandbox.runtime_default import ARCHITECTURE_ALLOWED, RUNTIME_DEFAULT_ALLOWED

#: Denied with EPERM (names the running kernel does not know are skipped).
DENIED_SYSCALLS = (
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount", "fsopen", "fsmount",
    "fsconfig", "fspick", "mount_setattr",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "lookup_dcookie",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "iopl", "ioperm", "vhangup",
    "shmget", "msgget", "semget", "memfd_create", "memfd_secret", "io_setup",
    "cachestat", "process_madvise", "quotactl_fd", "modify_ldt",
    "inotify_init", "inotify_init1",
)
#: Writing extended attributes answers EOPNOTSUPP, as on a filesystem without them: on the run's tmpfs each
#: ``user.*`` attribute is kernel memory no resident set shows and no byte limit counts (a run of the fourth review
#: wrote 423 MiB of them within one 0.1 s sample interval). Reading and listing stay allowed.
XATTR_WRITES = ("setxattr", "lsetxattr", "fsetxattr")
#: Every system call from this number up to :data:`SYSCALL_NUMBERS_END` answers ENOSYS, as on a kernel without it,
#: unless a rule above names it: 447 is ``memfd_secret`` (Linux 5.14: memory no resident set shows), and the lists
#: above were reviewed against the calls before it. A call newer than this filter (``open_tree_attr``,
#: ``statmount``, ``listmount``, ``file_getattr``, ...: Linux 6.8 to 6.17 added a dozen the deny list missed) is
#: refused rather than allowed; the C library treats ENOSYS as "not on this kernel" and falls back. Since Linux 5.1 a
#: new call has the same number on every architecture, so one range covers them all.
FIRST_UNREVIEWED_SYSCALL = 447
SYSCALL_NUMBERS_END = 1024
#: Socket address families a run may use (unix, IPv4, IPv6); any other is EAFNOSUPPORT. Netlink too: the data
#: queued on netlink sockets is kernel memory no count sees (the sixth review held 316 MiB so), and no tool needs it
#: (the C library's address lookup falls back without it).
ALLOWED_SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
#: The families bubblewrap itself needs under the container's profile: netlink, to bring the run's loopback up.
BWRAP_SOCKET_FAMILIES = {"AF_NETLINK": 16}
#: ``socket``'s protocol ``IPPROTO_MPTCP``: EPROTONOSUPPORT, as on a kernel without multipath TCP. Its queued data
#: shows in no ``/proc/net/tcp`` row (the sixth review queued 1.5 GB so, unseen).
IPPROTO_MPTCP = 262
#: ``prctl``'s option that sets (or clears) the signal a process gets when its parent dies, and the one that makes a
#: process non-dumpable (its ``/proc/<pid>/maps`` and ``root`` then closed to a scorer of the same uid, whose per-run
#: limits read them): both EPERM.
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
#: ``setsockopt(SOL_SOCKET, ...)`` options that grow a socket's buffers (``SO_SNDBUF``, ``SO_RCVBUF`` and their
#: ``FORCE`` forms): EPERM, so each socket keeps the host's default (``net.core.wmem_default``) and the kernel memory
#: a run's sockets can queue stays bounded by its descriptors × that default.
SOL_SOCKET = 1
BUFFER_OPTIONS = (7, 8, 32, 33)
#: The page-cache probe (``RWF_NOWAIT`` in ``preadv2``/``pwritev2``'s flags, argument 5 after the two halves of the
#: offset) and evictions (``fadvise64``'s advice, argument 3; ``madvise``'s, argument 2): EPERM.
RWF_NOWAIT = 0x8
POSIX_FADV_DONTNEED = 4
MADV_COLD, MADV_PAGEOUT = 20, 21
#: ``clone`` flags that make a namespace (any of them: EPERM).
NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}


#: What bubblewrap itself needs to build a run's namespaces and root beyond what the runtimes' default allows a
#: container: the runs' deny list and the container's profile (:func:`container_profile`, under which bwrap
#: starts) differ by these, and the runtimes' default lacks them (it grants them with CAP_SYS_ADMIN only).
BWRAP_NEEDS = ("mount", "umount2", "pivot_root", "chroot", "unshare", "sethostname")
#: What the sandbox server itself needs: the run's code reaches bwrap through a memory file.
SERVER_NEEDS = ("memfd_create",)
#: ``personality`` values the runtimes' default allows (Linux's, ``PER_LINUX32``, ``UNAME26`` and both, and the
#: query): any other is EPERM in the container.
PERSONALITIES = (0, 8, 0x20000, 0x20008, 0xFFFFFFFF)
#: The architectures the container profile names (the runtime picks the node's).
PROFILE_ARCHITECTURES = ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM")


def container_profile() -> dict:
    """The sandbox container's seccomp profile (Docker's and Kubernetes' JSON format, ``deploy/seccomp/
    fastexp-sandbox.json``), an allow list as the runtimes' default is: the calls that default allows every container
    (:mod:`services.scorer.sandbox.runtime_default`) less the runs' deny list, plus what bubblewrap needs to build the
    runs' namespaces (:data:`BWRAP_NEEDS`, and ``clone`` with namespace flags) and what the server needs
    (:data:`SERVER_NEEDS`); ``socket`` and ``socketpair`` for the runs' families and netlink (bubblewrap brings the
    loopback up with it; any other family EAFNOSUPPORT), ``personality`` as the default allows it
    (:data:`PERSONALITIES`), not ``socketcall``; anything else EPERM, ``clone3`` ENOSYS. Every run then gets
    the whole filter inside (:func:`filter_program`)."""
    needed = set(BWRAP_NEEDS + SERVER_NEEDS)
    denied = set(DENIED_SYSCALLS) - needed
    allowed = (set(RUNTIME_DEFAULT_ALLOWED + ARCHITECTURE_ALLOWED) | needed | {"clone"}) - denied
    # below, with their conditions; socketcall (32-bit x86's multiplexer) would reach every family past them
    allowed -= {"socket", "socketpair", "clone3", "personality", "socketcall"}
    families = {**ALLOWED_SOCKET_FAMILIES, **BWRAP_SOCKET_FAMILIES}
    sockets = [{"names": ["socket", "socketpair"], "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": INT_MASK, "valueTwo": family, "op": "SCMP_CMP_MASKED_EQ"}]}
               for family in sorted(families.values())]
    refused = [{"names": ["socket", "socketpair"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EAFNOSUPPORT,
                "args": args} for args in _family_conditions(families)]
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": errno.EPERM,
        "architectures": list(PROFILE_ARCHITECTURES),
        "syscalls": [
            {"names": sorted(allowed), "action": "SCMP_ACT_ALLOW"},
            *sockets,
            *refused,
            *({"names": ["personality"], "action": "SCMP_ACT_ALLOW",
               "args": [{"index": 0, "value": persona, "op": "SCMP_CMP_EQ"}]} for persona in PERSONALITIES),
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
        ],
    }


#: ``int`` arguments are compared on the 32 bits the kernel reads (a 64-bit register's high bits are ignored there).
INT_MASK = 0xFFFFFFFF


def _family_conditions(allowed: dict[str, int]) -> list[list[dict]]:
    """One rule's conditions on ``socket``'s family per denied value, and one for every family above the highest
    allowed (Docker's JSON format; a masked comparison's ``value`` is the mask, ``valueTwo`` the datum). Denied:
    every family from 3 (AF_AX25) on but ``allowed``'s (0 and 1, 2 are AF_UNSPEC, which the kernel refuses, and
    AF_UNIX, AF_INET). The open range compares all 64 bits: a family with high bits set is above it too."""
    top = max(allowed.values())
    rules = [[{"index": 0, "value": INT_MASK, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}]
             for value in range(3, top) if value not in allowed.values()]
    return [*rules, [{"index": 0, "value": top + 1, "op": "SCMP_CMP_GE"}]]


def _arg(seccomp, condition: dict):
    """A libseccomp argument comparison from one condition of the JSON format."""
    if condition["op"] == "SCMP_CMP_MASKED_EQ":
        return seccomp.Arg(condition["index"], seccomp.MASKED_EQ, condition["value"], condition["valueTwo"])
    return seccomp.Arg(condition["index"], seccomp.GE, condition["value"])


def _page_cache_rules(seccomp, rules) -> None:
    """EPERM for probing or evicting shared files' cached pages (module docs)."""
    for name in ("preadv2", "pwritev2"):
        rules.add_rule(seccomp.ERRNO(errno.EPERM), name, seccomp.Arg(5, seccomp.MASKED_EQ, RWF_NOWAIT, RWF_NOWAIT))
    rules.add_rule(seccomp.ERRNO(errno.EPERM), "fadvise64",
                   seccomp.Arg(3, seccomp.MASKED_EQ, INT_MASK, POSIX_FADV_DONTNEED))
    for advice in (MADV_COLD, MADV_PAGEOUT):
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "madvise", seccomp.Arg(2, seccomp.MASKED_EQ, INT_MASK, advice))


class SeccompUnavailable(RuntimeError):
    """The filter cannot be built here (libseccomp or its bindings are missing)."""


@functools.cache
def filter_program() -> bytes:
    """The filter as a classic-BPF program for ``bwrap --seccomp`` (built once).

    Raises:
        SeccompUnavailable: naming what is missing.
    """
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as error:  # the bindings, or libseccomp.so under them
        raise SeccompUnavailable(f"libseccomp is not available ({error}): install libseccomp2 and pyseccomp") from None
    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    with contextlib.suppress(RuntimeError, OSError):  # a binary search over the calls, not a chain (libseccomp 2.5+)
        rules.set_attr(seccomp.Attr.CTL_OPTIMIZE, 2)
    named = set()
    for name in DENIED_SYSCALLS:
        try:
            rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
            named.add(seccomp.resolve_syscall(seccomp.Arch.NATIVE, name))
        except (RuntimeError, ValueError, OSError):
            continue  # not a system call libseccomp knows on this architecture (the range below may hold it)
    for name in XATTR_WRITES:
        rules.add_rule(seccomp.ERRNO(errno.EOPNOTSUPP), name)
        named.add(seccomp.resolve_syscall(seccomp.Arch.NATIVE, name))
    for number in range(FIRST_UNREVIEWED_SYSCALL, SYSCALL_NUMBERS_END):
        if number not in named:
            rules.add_rule(seccomp.ERRNO(errno.ENOSYS), number)
    for flag in NAMESPACE_FLAGS.values():
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for option in (PR_SET_PDEATHSIG, PR_SET_DUMPABLE):
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "prctl", seccomp.Arg(0, seccomp.MASKED_EQ, INT_MASK, option))
    for conditions in _family_conditions(ALLOWED_SOCKET_FAMILIES):
        for call in ("socket", "socketpair"):
            rules.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, *(_arg(seccomp, c) for c in conditions))
    rules.add_rule(seccomp.ERRNO(errno.EPROTONOSUPPORT), "socket",
                   seccomp.Arg(2, seccomp.MASKED_EQ, INT_MASK, IPPROTO_MPTCP))
    for option in BUFFER_OPTIONS:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "setsockopt", seccomp.Arg(1, seccomp.MASKED_EQ, INT_MASK, SOL_SOCKET),
                       seccomp.Arg(2, seccomp.MASKED_EQ, INT_MASK, option))
    _page_cache_rules(seccomp, rules)
    with tempfile.TemporaryFile() as program:
        rules.export_bpf(program)
        program.seek(0)
        return program.read()
