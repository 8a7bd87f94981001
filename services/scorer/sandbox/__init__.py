"""The tool sandbox: policy-written code runs isolated by the operating system or on another machine, never bare.

- :mod:`.base`: a run's limits and result, the backend protocol, :class:`SandboxUnavailable`, :class:`SandboxError`;
- :mod:`.bubblewrap`: each run in its own bubblewrap sandbox (namespaces, read-only root, tmpfs, limits);
- :mod:`.gvisor`: each run under a kernel of its own (gVisor's ``runsc``), nothing of the host kernel shared;
- :mod:`.supervise`: how a local backend watches a run (streams, wall clock, per-run limits);
- :mod:`.gvisor_usage`: what a gVisor run uses, from its host processes and its kernel's memory file;
- :mod:`.cgroup`: a memory and a cpuacct cgroup per run where the host lets the scorer make them (both local backends'),
  and a pids one (bubblewrap's);
- :mod:`.slots`: the run slots a local backend shares fairly between tenants (experience runs);
- :mod:`.remote`: a SandboxFusion-compatible HTTP endpoint;
- :mod:`.settings`: the scorer's ``sandbox:`` block and the backend it builds;
- :mod:`.server`: ``fastexp serve sandbox``, that endpoint over the bubblewrap backend.
"""

from services.scorer.sandbox.base import Sandbox, SandboxError, SandboxLimits, SandboxResult, SandboxUnavailable
from services.scorer.sandbox.bubblewrap import BubblewrapOptions, BubblewrapSandbox
from services.scorer.sandbox.gvisor import GvisorOptions, GvisorSandbox
from services.scorer.sandbox.remote import RemoteSandbox
from services.scorer.sandbox.settings import SandboxSettings, build_sandbox

__all__ = [
    "BubblewrapOptions", "BubblewrapSandbox", "GvisorOptions", "GvisorSandbox", "RemoteSandbox", "Sandbox", "SandboxError", "SandboxLimits",
    "SandboxResult", "SandboxSettings", "SandboxUnavailable", "build_sandbox",
]
