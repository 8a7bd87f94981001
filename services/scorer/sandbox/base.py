"""What every tool sandbox shares: a run's limits and result, the backend protocol, and its two errors.

Tool code is written by a policy under RL training and is treated as hostile. A backend isolates each run at the
operating-system level (:mod:`.bubblewrap`) or runs it on another machine (:mod:`.remote`); nothing in fastexp
runs tool code without one (:class:`SandboxUnavailable` is raised instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

MIB = 1024 * 1024


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be set up here (no ``bwrap``, user namespaces refused, remote sandbox unreachable). The
    message names the cause and the fix; tool environments are then not offered."""


class SandboxError(RuntimeError):
    """One run could not be carried out by the backend (not: the code failed). Fails that episode only."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run: ``timeout_s`` wall-clock seconds; ``cpu_s`` CPU seconds and ``memory_bytes`` (of each
    process's address space, and resident plus shared in the run's whole tree) where the backend enforces them per run
    (bubblewrap: module :mod:`services.scorer.sandbox.bubblewrap`); ``max_output_bytes`` of stdout and of stderr
    kept, ``max_file_bytes`` any one file may reach."""

    timeout_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 * MIB
    max_output_bytes: int = 8192
    max_file_bytes: int = 1 * MIB

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_bytes", "max_output_bytes", "max_file_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    """What a run printed (each stream cut to ``max_output_bytes``), its exit code (non-zero: it failed or was
    stopped), and why it was stopped: ``"timeout"`` (wall clock), ``"cpu"`` (CPU time), ``"memory"`` (the run's
    resident memory), ``"files"`` (files in its writable folder), ``"output"`` (stdout or stderr past
    ``max_output_bytes``), ``"usage"`` (its use could not be measured in time), ``""`` otherwise."""

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
        elif self.stopped == "memory":
            parts.append("(stopped: memory limit)")
        elif self.stopped == "files":
            parts.append("(stopped: file count limit)")
        elif self.stopped == "output":
            parts.append("(stopped: output limit)")
        elif self.stopped == "usage":
            parts.append("(stopped: its memory use could not be measured in time)")
        elif self.exit_code != 0 and not self.stderr.strip():
            parts.append(f"(exit code {self.exit_code})")
        return "\n".join(parts) if parts else "(no output)"


class Sandbox(Protocol):
    """A backend that runs one Python program per call, isolated, and returns its output."""

    #: What it is, for logs and health (e.g. ``"bubblewrap 0.8.0, uid 65534"``).
    description: str

    async def run(self, code: str, limits: SandboxLimits, tenant: str = "") -> SandboxResult:
        """Run ``code`` as a Python program under ``limits``, for ``tenant`` (whose runs share the backend's slots
        fairly with other tenants': :mod:`.slots`; ``""``: the shared default). Never raises for what the code does.

        Raises:
            SandboxError: the backend could not carry the run out (named).
        """
        ...

    async def check(self) -> None:
        """Run a probe program end to end; return when isolation works.

        Raises:
            SandboxUnavailable: it does not (the cause and the fix named).
        """
        ...

    async def close(self) -> None:
        """Release connections (idempotent)."""
        ...


def cut(data: bytes, limit: int) -> str:
    """``data`` decoded, cut to ``limit`` bytes with a note when it was longer."""
    text = data[:limit].decode(errors="replace")
    return text + "\n(output truncated)" if len(data) > limit else text


#: The probe every backend runs at start (its output must be exactly ``PROBE_OUTPUT``).
PROBE_CODE = "print(6 * 7)"
PROBE_OUTPUT = "42"


async def probe(sandbox: Sandbox, timeout_s: float, python: str, cannot: str) -> None:
    """Run :data:`PROBE_CODE` through ``sandbox`` (its ``check``'s last step).

    Raises:
        SandboxUnavailable: the run could not be carried out (``cannot``, where ``{error}`` is the backend's
            message: what fails here and the fix), or the probe printed something else (``python`` named).
    """
    try:
        result = await sandbox.run(PROBE_CODE, SandboxLimits(timeout_s=timeout_s))
    except SandboxError as error:
        raise SandboxUnavailable(cannot.format(error=error)) from error
    if result.stdout.strip() != PROBE_OUTPUT:
        raise SandboxUnavailable(
            f"the sandbox's probe printed {result.stdout.strip()!r} (exit {result.exit_code}; stderr "
            f"{result.stderr.strip()[:300]!r}): check sandbox.python ({python}) can run with only /usr"
        )
