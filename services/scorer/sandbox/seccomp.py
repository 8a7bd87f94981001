"""The system-call filter every tool run gets (``bwrap --seccomp``): a deny list in the spirit of Docker's default
profile and Kubernetes' ``RuntimeDefault``, built with libseccomp (``pyseccomp``, its ctypes bindings) as the
classic-BPF program bwrap loads just before it executes the run's first process.

Denied with EPERM: the kernel keyring (``keyctl``, ``add_key``, ``request_key``: the scorer's session keyring is
neither readable nor writable, and nothing left there by one call reaches the next), ``bpf``,
``perf_event_open``, ``userfaultfd``, ``ptrace`` and reading or writing other processes' memory, mounts and
namespaces (``mount``, ``umount2``, ``pivot_root``, ``chroot``, ``unshare``, ``setns``, and ``clone`` with any
namespace flag), kernel modules and ``kexec``, clocks, swap, reboot, ``syslog``, ``acct``, quotas, handles
(``open_by_handle_at``), ``fanotify``, ``io_uring``, port I/O. ``clone3`` answers ENOSYS, as under Docker: its
flags cannot be filtered (they are behind a pointer), and the C library falls back to ``clone``. Everything else
is allowed: the run's other limits (namespaces, rlimits, the read-only root) do the rest.
"""

from __future__ import annotations

import errno
import functools
import tempfile

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
)
#: ``clone`` flags that make a namespace (any of them: EPERM).
NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}


#: What bubblewrap itself needs to build a run's namespaces and root: the one difference between the container's
#: profile (:func:`container_profile`: the sandbox container's seccomp profile, under which bwrap starts) and the
#: filter of every run (:func:`filter_program`).
BWRAP_NEEDS = ("mount", "umount2", "pivot_root", "chroot", "unshare")
#: The architectures the container profile names (the runtime picks the node's).
PROFILE_ARCHITECTURES = ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM")


def container_profile() -> dict:
    """The sandbox container's seccomp profile (Docker's and Kubernetes' JSON format, ``deploy/seccomp/
    fastexp-sandbox.json``): the runs' deny list, less what bubblewrap needs to build their namespaces
    (:data:`BWRAP_NEEDS`, and ``clone`` with namespace flags); every run then gets the whole filter inside."""
    denied = [name for name in DENIED_SYSCALLS if name not in BWRAP_NEEDS]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": list(PROFILE_ARCHITECTURES),
        "syscalls": [
            {"names": denied, "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
        ],
    }


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
    for name in DENIED_SYSCALLS:
        try:
            rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError, OSError):
            continue  # not a system call of this kernel or architecture
    for flag in NAMESPACE_FLAGS.values():
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as program:
        rules.export_bpf(program)
        program.seek(0)
        return program.read()
