"""Run untrusted Python (a policy's tool call) in its own process, with limits, and return what it printed.

Each call runs ``python -I`` (isolated: no ``PYTHON*`` variables, no user site) in a fresh process with:

- a private temporary directory as its working directory, removed afterwards;
- an empty environment (nothing inherited from the service: no tokens, no paths but the interpreter's);
- ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space: a memory bomb gets ``MemoryError``),
  ``RLIMIT_FSIZE`` (bytes any file may reach), ``RLIMIT_NOFILE`` and ``RLIMIT_CORE`` = 0, in its own session;
- a wall-clock timeout (the process group is killed: a ``sleep`` or a blocked read is stopped too);
- stdout and stderr cut to ``max_output_bytes``;
- a prelude installing a PEP 578 audit hook before the code runs: sockets, new processes (``subprocess``,
  ``os.system``, ``os.exec*``, ``os.fork``), ``ctypes`` and writes or removals outside the directory raise
  ``PermissionError``. Audit hooks cannot be removed from Python code.

Where the kernel allows unprivileged user namespaces, the process also gets its own empty network namespace
(``unshare(CLONE_NEWUSER | CLONE_NEWNET)``: no interface but a down loopback). This is defence in depth for a
policy's arithmetic, not a boundary for hostile code: run the scorer under gVisor, nsjail or a locked-down
container for that.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000

# Runs before the user's code, inside the sandbox (the code itself is read from code.py in the directory).
_PRELUDE = r'''
import os, sys
_HOME = os.path.realpath(os.getcwd())
_DENIED = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
           "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.kill", "os.killpg"}
_PATHS = {"os.remove": 0, "os.rename": 0, "os.replace": 0, "os.rmdir": 0, "os.mkdir": 0, "os.chmod": 0,
          "os.chown": 0, "os.symlink": 1, "os.link": 1, "os.truncate": 0, "shutil.rmtree": 0, "os.utime": 0}

def _inside(path):
    try:
        real = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else ".")
    except Exception:
        return False
    return real == _HOME or real.startswith(_HOME + os.sep)

def _hook(event, args):
    if event in _DENIED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args and args[0] is not None:
        mode, flags = args[1] or "", args[2] if len(args) > 2 and args[2] and args[2] > 0 else 0
        writing = any(c in str(mode) for c in "wax+") or bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writing and not _inside(args[0]):
            raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {args[0]}")
    if event in _PATHS and args and not _inside(args[_PATHS[event]]):
        raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

sys.addaudithook(_hook)
del _hook
_source = open("code.py").read()
exec(compile(_source, "<tool>", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run: ``timeout_s`` wall clock, ``cpu_s`` CPU seconds, ``memory_bytes`` address space,
    ``max_output_bytes`` of stdout and of stderr kept, ``max_file_bytes`` any file it writes may reach."""

    timeout_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 1024 * 1024
    max_output_bytes: int = 8192
    max_file_bytes: int = 1024 * 1024


@dataclass(frozen=True)
class SandboxResult:
    """What a run printed (cut to the limit), its exit code (negative: the signal that ended it), and why it was
    stopped (``timeout``, ``cpu``, ``""`` when it ended by itself)."""

    stdout: str
    stderr: str
    exit_code: int
    stopped: str = ""

    def as_observation(self) -> str:
        """The tool message a policy sees: stdout, then stderr, then how it ended when not cleanly."""
        parts = [self.stdout.rstrip()] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(self.stderr.rstrip())
        if self.stopped == "timeout":
            parts.append("(stopped: wall-clock time limit)")
        elif self.stopped == "cpu":
            parts.append("(stopped: CPU time limit)")
        elif self.exit_code != 0 and not self.stderr.strip():
            parts.append(f"(exit code {self.exit_code})")
        return "\n".join(parts) if parts else "(no output)"


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` in a sandboxed process (module docs) and return its output. Blocking; call it off the event
    loop. Never raises for what the code does: errors come back in ``stderr`` and ``exit_code``.

    Raises:
        OSError: the interpreter could not be started at all.
    """
    folder = Path(tempfile.mkdtemp(prefix="fastexp-sandbox-"))
    try:
        (folder / "code.py").write_text(code)
        with open(folder / ".stdout", "wb") as out, open(folder / ".stderr", "wb") as err:
            process = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _PRELUDE], cwd=folder, env={}, stdin=subprocess.DEVNULL,
                stdout=out, stderr=err, close_fds=True, start_new_session=True,
                preexec_fn=lambda: _confine(limits),  # noqa: PLW1509 - the limits must be set in the child
            )
            stopped = ""
            try:
                process.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                stopped = "timeout"
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if process.returncode == -signal.SIGXCPU or (process.returncode == -signal.SIGKILL and not stopped):
            stopped = "cpu"
        return SandboxResult(
            stdout=_read(folder / ".stdout", limits.max_output_bytes),
            stderr=_read(folder / ".stderr", limits.max_output_bytes),
            exit_code=process.returncode, stopped=stopped,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _confine(limits: SandboxLimits) -> None:
    """In the child, before exec: resource limits, then (where permitted) an empty network namespace."""
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET)  # fails quietly without user namespaces: the audit hook remains


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as file:
        data = file.read(limit + 1)
    text = data[:limit].decode(errors="replace")
    return text + "\n(output truncated)" if len(data) > limit else text
