"""The tool sandbox's settings (the scorer's ``sandbox:`` block) and the backend they build."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fastexp.security import read_file
from services.scorer.outbound.tls import client_tls
from services.scorer.sandbox.base import MIB, Sandbox
from services.scorer.sandbox.bubblewrap import BubblewrapOptions, BubblewrapSandbox
from services.scorer.sandbox.gvisor import GvisorOptions, GvisorSandbox
from services.scorer.sandbox.remote import RemoteSandbox
from services.scorer.sandbox.run_groups import CgroupVersion


class SandboxSettings(BaseModel):
    """Where tool code runs: ``bwrap`` (each run isolated by bubblewrap in the scorer's container; the default),
    ``gvisor`` (each run under a kernel of its own, gVisor's ``runsc``: nothing of the host kernel's global state is
    shared between runs) or ``remote`` (a SandboxFusion-compatible endpoint, e.g. ``fastexp serve sandbox`` in a
    container of its own).
    Tool code never runs without one: where the backend's probe fails at start, tool environments are not offered.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["bwrap", "gvisor", "remote"] = Field(
        "bwrap", description="bwrap: local bubblewrap; gvisor: a gVisor kernel per run; remote: HTTP sandbox")
    bwrap: str = Field("bwrap", description="the bubblewrap program (name on PATH or path)")
    runsc: str = Field("runsc", description="gvisor: gVisor's runsc program (name on PATH or path)")
    runsc_platform: Literal["ptrace", "kvm"] = Field(
        "ptrace", description="gvisor: how the run's kernel traps its system calls (kvm needs /dev/kvm)")
    python: str | None = Field(
        None, description="interpreter inside the sandbox (default: the scorer's if under /usr, else /usr/bin/python3)"
    )
    uid: int | None = Field(None, ge=1, description="host uid runs use (default: 65534 when the scorer is root)")
    gid: int | None = Field(None, ge=1, description="host gid runs use (default: as uid)")
    max_processes: int = Field(16, ge=1, le=4096, description="processes one run may have, itself included")
    tmpfs_bytes: int = Field(64 * MIB, ge=MIB, description="size of the run's only writable place, /tmp")
    mount_proc: bool = Field(True, description="a private /proc (turn off where the runtime masks /proc)")
    max_concurrent: int = Field(4, ge=1, description="runs at once; more wait, each tenant (experience run) in a "
                                "queue of its own, a freed slot going to the tenant with the fewest runs in progress")
    max_concurrent_per_tenant: int | None = Field(
        None, ge=1, description="most runs one tenant holds at once (default: max_concurrent); below "
        "max_concurrent it keeps slots free for other tenants: one then waits for no other's runs to end while the "
        "others, each at most at this cap, hold fewer than max_concurrent")
    usage_poll_s: float = Field(0.1, ge=0.01, le=5.0, description="seconds between two samples of a run's whole "
                                "tree (CPU seconds, resident memory) against its per-run limits")
    max_files: int = Field(10_000, ge=16, description="files (inodes) a run's /tmp may hold; each costs the kernel "
                           "about 1 KiB that tmpfs_bytes does not count")
    cgroups: CgroupVersion = Field(
        "auto", description="bwrap, gvisor (a root scorer's): the cgroup hierarchy each run gets a group in (memory, "
        "tasks and CPU per run; the whole tree killed as one): auto (v1 where its memory controller is writable, else "
        "v2 where the scorer's group is delegated to it), v1, v2 (any writable group) or off (sampled limits only); "
        "docs/operations/security.md")
    remote_url: str | None = Field(None, description="remote: the endpoint's base URL (POST {url}/run_code)")
    remote_token_file: Path | None = Field(None, description="remote: bearer token file (first line)")
    remote_ca_file: Path | None = Field(None, description="remote: CA bundle verifying an https endpoint")
    remote_cert_file: Path | None = Field(None, description="remote: the scorer's certificate (PEM) for an endpoint "
                                          "with mutual TLS (its tls_client_ca_file); with remote_key_file")
    remote_key_file: Path | None = Field(None, description="remote: the key of remote_cert_file (PEM)")
    remote_margin_s: float = Field(5.0, gt=0, description="remote: deadline beyond the run's own timeout")

    @model_validator(mode="after")
    def _remote_has_url(self) -> Self:
        if self.backend == "remote" and not self.remote_url:
            raise ValueError("sandbox.remote_url is required with sandbox.backend: remote")
        return self


def build_sandbox(settings: SandboxSettings) -> Sandbox:
    """The configured backend (not yet probed: call its ``check``).

    Raises:
        SecurityConfigError: ``remote_token_file`` or a TLS file is unreadable, or a certificate lacks its key.
    """
    if settings.backend == "remote":
        assert settings.remote_url is not None  # validated
        token = read_file(settings.remote_token_file, "sandbox.remote_token_file").strip().splitlines()[0] \
            if settings.remote_token_file else None
        verify = client_tls(settings.remote_ca_file, settings.remote_cert_file, settings.remote_key_file,
                            "sandbox.remote_")
        return RemoteSandbox(settings.remote_url, token, settings.remote_margin_s, verify=verify)
    if settings.backend == "gvisor":
        return GvisorSandbox(GvisorOptions(
            runsc=settings.runsc, platform=settings.runsc_platform, python=settings.python,
            max_processes=settings.max_processes, tmpfs_bytes=settings.tmpfs_bytes,
            max_concurrent=settings.max_concurrent, usage_poll_s=settings.usage_poll_s,
            max_concurrent_per_tenant=settings.max_concurrent_per_tenant, cgroups=settings.cgroups,
        ))
    return BubblewrapSandbox(BubblewrapOptions(
        bwrap=settings.bwrap, python=settings.python, uid=settings.uid, gid=settings.gid,
        max_processes=settings.max_processes, tmpfs_bytes=settings.tmpfs_bytes, mount_proc=settings.mount_proc,
        max_concurrent=settings.max_concurrent, usage_poll_s=settings.usage_poll_s, max_files=settings.max_files,
        max_concurrent_per_tenant=settings.max_concurrent_per_tenant, cgroups=settings.cgroups,
    ))
