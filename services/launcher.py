"""Run the three services as local processes on loopback (``fastexp up``, ``fastexp demo``, CLI tests)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

SERVICES = ("generator", "scorer", "experience")


def fresh_state_dir(folder: Path) -> Path:
    """``folder`` emptied (created if missing): the state of a deployment that starts from nothing (no runs, policy
    version 0), for :attr:`LocalCluster.state_dir`."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``, taken below the kernel's ephemeral range: the ports it
    hands out to port-0 binds and outgoing connections (vLLM's engine opens several while it starts) come from that
    range, so none of them can take this port before the service that was given it binds it, minutes later."""
    low = _ephemeral_range_start()
    for _ in range(200):
        port = random.randint(max(1024, low - 16384), low - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded low range: any free port
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_range_start() -> int:
    """The first port of Linux's ephemeral range (``net.ipv4.ip_local_port_range``; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class ServicesNotReady(TimeoutError):
    """Services did not report SERVING in time; the message names each, with its health and its log's tail."""


def health_status(address: str, timeout_s: float = 2.0, service: str = "") -> str:
    """``SERVING``, ``NOT_SERVING`` (or another health status name), or ``unreachable (<code>)``, of ``service``
    ("": the server as a whole, its readiness; "liveness": the process runs)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError as error:
            return f"unreachable ({error.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def log_tail(path: Path | None, lines: int = 20) -> str:
    """The last ``lines`` lines of the log at ``path`` ("" when there is none)."""
    if path is None or not path.exists():
        return ""
    with path.open("rb") as log:
        log.seek(0, os.SEEK_END)
        log.seek(max(0, log.tell() - 64 * 1024))
        text = log.read().decode(errors="replace")
    # progress bars rewrite one line with carriage returns: keep what the terminal would show last
    shown = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return "\n".join(shown[-lines:])


@dataclass(frozen=True)
class CoreSplit:
    """How a host without a GPU shares its cores between the generator's CPU engine and the experience service's
    forward passes when both run on it.

    The forwards get ``forward_threads`` torch threads while generation is in flight and ``idle_forward_threads``
    (every core, from :meth:`for_host`) while none is. One generator replica's engine is bound to ``host_cores``
    (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``: one OpenMP thread per core) and runs on all of them while no forward pass
    waits, on as many threads as ``engine_cores`` while one does (the experience service sets them at run time:
    :mod:`services.experience.fleet.cores`), so neither oversubscribes the other and neither idles cores the other
    could use. Without ``host_cores``, or with several replicas, each engine is bound to its block of
    ``engine_cores`` for good. ``pin_generators``: also confine each generator's whole process tree (server,
    vLLM's scheduler and workers) to its cores with CPU affinity; otherwise only the model's threads are bound and
    vLLM's scheduler process runs on any core (what a one-replica host wants: it keeps the model's cores for the
    model). The HF backend gets ``len(engine_cores)`` OpenMP threads (its threads are not set at run time)."""

    engine_cores: tuple[int, ...]
    forward_threads: int
    pin_generators: bool = False
    idle_forward_threads: int | None = None  # the forwards' threads while no generation is in flight (None: same)
    host_cores: tuple[int, ...] = ()  # the cores one engine may run on while no forward pass waits (): engine_cores

    @classmethod
    def for_host(cls, cores: int) -> CoreSplit:
        """Half the cores (at least one) to the engine while forwards run, the rest (at least one thread) to the
        forwards; every core to the engine while no forward pass waits, and to a forward pass that starts while
        no generation is in flight."""
        engine = max(1, cores // 2)
        return cls(tuple(range(engine)), max(1, cores - engine), idle_forward_threads=max(1, cores),
                   host_cores=tuple(range(cores)) if cores > engine else ())

    def shares_cores(self, replicas: int = 1) -> bool:
        """Whether the engine's threads move with the forwards' work (one replica, ``host_cores`` given)."""
        return replicas == 1 and not self.pin_generators and len(self.host_cores) > len(self.engine_cores)

    def generator_cores(self, replica: int = 0, replicas: int = 1) -> tuple[int, ...]:
        """Generator ``replica``'s cores: the engine cores split into equal blocks, one per replica (replicas share
        blocks round-robin when there are fewer cores than replicas); ``host_cores`` when :meth:`shares_cores`."""
        if self.shares_cores(replicas):
            return self.host_cores
        size = max(1, len(self.engine_cores) // replicas)
        start = replica * size % len(self.engine_cores)
        return self.engine_cores[start : start + size]

    def environment(self, service: str, replica: int = 0, replicas: int = 1) -> dict[str, str]:
        """Variables for ``service``'s process (a variable already set, or a settings override, wins); generator
        replica ``replica`` of ``replicas`` gets :meth:`generator_cores`."""
        if service == "generator":
            mine = self.generator_cores(replica, replicas)
            # OMP_NUM_THREADS: the HF backend's torch threads (vLLM sets its own from the bind list)
            hf_threads = len(self.engine_cores) if self.shares_cores(replicas) else len(mine)
            return {"VLLM_CPU_OMP_THREADS_BIND": _cpu_list(mine), "OMP_NUM_THREADS": str(hf_threads)}
        if service == "experience":
            threads = {"FASTEXP_EXPERIENCE_TORCH_THREADS": str(self.forward_threads)}
            if self.idle_forward_threads is not None:
                threads["FASTEXP_EXPERIENCE_TORCH_THREADS_IDLE"] = str(self.idle_forward_threads)
            if self.shares_cores(replicas):
                threads["FASTEXP_EXPERIENCE_GENERATOR_CPU_THREADS_SHARING"] = str(len(self.engine_cores))
            return threads
        return {}


def _cpu_list(cores: tuple[int, ...]) -> str:
    """vLLM's bind list for ``cores``: a range when they are consecutive ("0-3"), else each one ("0,2,5")."""
    if list(cores) == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(core) for core in cores)


def child_prefix(cores: set[int] | None) -> list[str]:
    """What a service's command runs under, exec'ed before it (util-linux, where the host has it): die with the
    launching process (``setpriv --pdeathsig``: a launcher killed outright must not leave engines running), and
    keep to ``cores`` when given (``taskset``). No Python runs between fork and exec (a ``preexec_fn`` in a
    launcher with threads, as the tests' proxies and gRPC's, can crash the child before it execs)."""
    prefix = []
    if sys.platform.startswith("linux") and shutil.which("setpriv"):
        prefix += ["setpriv", "--pdeathsig", "TERM", "--"]
    if cores is not None and shutil.which("taskset"):
        prefix += ["taskset", "-c", ",".join(map(str, sorted(cores)))]
    return prefix


def default_core_split() -> CoreSplit | None:
    """The split for this host: none where an NVIDIA GPU runs the engine and the forwards."""
    if shutil.which("nvidia-smi") is not None:
        return None
    return CoreSplit.for_host(os.cpu_count() or 1)


@dataclass
class LocalCluster:
    """Generator, scorer and experience processes on loopback ports; a context manager.

    ``services`` picks which of the three to run at :meth:`start` (a benchmark may want the generator alone; a
    test may start one later with :meth:`start_service`). ``start_timeout_s`` is one overall limit for all of
    them to report SERVING, however they are ordered: the experience service waits for the generator and the
    scorer by itself, for as long as it runs. Each service's output goes to ``<log_dir>/<name>.log`` (or this
    process's stdout without ``log_dir``). ``core_split`` shares a CPU host's cores between the engine and the
    forwards (:class:`CoreSplit`; ``None`` leaves each process its defaults).
    ``overrides`` maps a service name to settings fields (``{"generator": {"backend": "hf"}}``), passed to each
    process as ``FASTEXP_<SERVICE>_<FIELD>`` environment variables; ``config_file`` is passed as ``--config``.
    ``generator_replicas`` > 1 runs a fleet: processes ``generator``, ``generator-1``, ... (each its own port and
    share of the engine cores), all given to the experience service as ``generator_addresses``.
    ``experience_replicas`` > 1 runs that many experience services, ``experience``, ``experience-1``, ... (each its
    own port; they share the state store that ``overrides`` names: ``state_url``, ``weights_dir``).
    """

    host: str = "127.0.0.1"
    ports: Mapping[str, int] | None = None
    services: tuple[str, ...] = SERVICES
    config_file: Path | None = None
    overrides: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    start_timeout_s: float = 900.0
    log_dir: Path | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    core_split: CoreSplit | None = field(default_factory=default_core_split)
    generator_replicas: int = 1
    experience_replicas: int = 1
    #: The experience replicas' state store (an SQLite file) and weights folder under this folder, unless the
    #: overrides name them; None: the settings' own (``state_url``, ``weights_dir``). A demo passes
    #: :func:`fresh_state_dir`: a deployment of its own that starts from nothing.
    state_dir: Path | None = None
    #: The interpreter that runs the services (e.g. a virtualenv with the fastexp-server wheel); this one's by default.
    python: str = sys.executable

    def __post_init__(self) -> None:
        names = (*SERVICES, *self.generator_names[1:], *self.experience_names[1:])
        self.ports = {name: free_port(self.host) for name in names} | dict(self.ports or {})
        if "generator" in self.services and not set(self.generator_names[1:]) & set(self.services):
            self.services = (*self.generator_names, *(s for s in self.services if s != "generator"))
        if "experience" in self.services and not set(self.experience_names[1:]) & set(self.services):
            self.services = (*self.services, *self.experience_names[1:])

    @property
    def generator_names(self) -> tuple[str, ...]:
        """The generator replicas' process names: ``generator``, ``generator-1``, ..."""
        return ("generator", *(f"generator-{i}" for i in range(1, self.generator_replicas)))

    @property
    def experience_names(self) -> tuple[str, ...]:
        """The experience replicas' process names: ``experience``, ``experience-1``, ..."""
        return ("experience", *(f"experience-{i}" for i in range(1, self.experience_replicas)))

    def address(self, service: str) -> str:
        return f"{self.host}:{self.ports[service]}"

    def start(self) -> LocalCluster:
        """Start the services and wait until every one is SERVING.

        Raises:
            ServicesNotReady: not all SERVING within ``start_timeout_s``; names each one that is not, with its
                health and the last lines of its log. RuntimeError: a service exited (with its log's tail).
        """
        try:
            for name in self.services:
                self._spawn(name)
            self.wait_serving(self.services)
        except BaseException:
            self.stop()
            raise
        return self

    def start_service(self, service: str, wait: bool = True) -> None:
        """Start ``service`` (one not running yet, or one that was killed) on its port; wait until SERVING."""
        self._spawn(service)
        if wait:
            self.wait_serving([service])

    def kill(self, service: str) -> None:
        """SIGKILL ``service`` and its children (no drain), as a crashed container."""
        process = self.processes[service]
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def restart(self, service: str, kill: bool = True) -> None:
        """Replace ``service`` by a fresh process on the same port, as an operator swapping a container would:
        SIGKILL (``kill``, no drain) or SIGTERM the old one, start the new one, wait until it is SERVING."""
        old = self.processes[service]
        if old.poll() is None:
            if kill:
                os.killpg(old.pid, signal.SIGKILL)
            else:
                old.send_signal(signal.SIGTERM)
            old.wait()
        self.start_service(service)

    def wait_serving(self, services: Sequence[str], timeout_s: float | None = None) -> None:
        """Block until each of ``services`` reports SERVING; one limit (``start_timeout_s``) for all of them.

        Raises:
            ServicesNotReady: some are not SERVING in time (each named, with its health and log tail).
            RuntimeError: one exited first (named, with its log tail).
        """
        deadline = time.monotonic() + (self.start_timeout_s if timeout_s is None else timeout_s)
        waiting = {name: "not checked" for name in services}
        while waiting:
            for name in list(waiting):
                process = self.processes[name]
                if process.poll() is not None:
                    raise RuntimeError(f"{name} at {self.address(name)} exited with code {process.returncode}"
                                       + self._tail(name))
                waiting[name] = health_status(self.address(name))
                if waiting[name] == "SERVING":
                    del waiting[name]
            if waiting and time.monotonic() >= deadline:
                waited = self.start_timeout_s if timeout_s is None else timeout_s
                raise ServicesNotReady(
                    f"not SERVING after {waited:.0f} s: "
                    + ", ".join(f"{name} at {self.address(name)} ({status})" for name, status in waiting.items())
                    + "".join(self._tail(name) for name in waiting)
                )
            if waiting:
                time.sleep(0.5)

    def log_path(self, service: str) -> Path | None:
        """Where ``service``'s output goes (``None``: this process's stdout)."""
        return None if self.log_dir is None else self.log_dir / f"{service}.log"

    def _tail(self, service: str) -> str:
        tail = log_tail(self.log_path(service))
        if not tail:
            return f"\n--- {service}: its output is above (no log_dir) ---" if self.log_dir is None else ""
        return f"\n--- last lines of {self.log_path(service)} ---\n{tail}"

    def _spawn(self, name: str) -> None:
        kind = "generator" if name in self.generator_names else "experience" if name in self.experience_names else name
        generators = [self.address(g) for g in self.generator_names]
        extra = {"experience": {"generator_address": generators[0], "scorer_address": self.address("scorer")}}
        if len(generators) > 1:
            extra["experience"]["generator_addresses"] = json.dumps(generators)
        env = dict(os.environ)
        replica = self.generator_names.index(name) if kind == "generator" else 0
        split = self.core_split.environment(kind, replica, self.generator_replicas) if self.core_split else {}
        for key, value in split.items():
            env.setdefault(key, value)
        state = {} if self.state_dir is None or kind != "experience" else {
            "state_url": f"sqlite:///{self.state_dir / 'state.db'}", "weights_dir": str(self.state_dir / "weights")}
        # the overrides last: a test may route the experience services through proxies (scorer_address, ...)
        for key, value in {**state, **extra.get(kind, {}), **self.overrides.get(kind, {}),
                           **self.overrides.get(name, {})}.items():
            env[f"FASTEXP_{kind.upper()}_{key.upper()}"] = str(value)
        command = [self.python, "-m", "services.cli", "serve", kind,
                   "--host", self.host, "--port", str(self.ports[name])]
        if self.config_file is not None:
            command += ["--config", str(self.config_file)]
        stdout = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stdout = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        pinned = None
        if kind == "generator" and self.core_split is not None and self.core_split.pin_generators:
            pinned = set(self.core_split.generator_cores(replica, self.generator_replicas))
        self.processes[name] = subprocess.Popen(
            [*child_prefix(pinned), *command], env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
            start_new_session=True,
        )
        if pinned is not None and not shutil.which("taskset"):  # at once, before the engine starts its threads
            os.sched_setaffinity(self.processes[name].pid, pinned)
        logger.info("started %s on %s (pid %d)", name, self.address(name), self.processes[name].pid)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process (experience first), then SIGKILL what is left after ``grace_s``."""
        for name in (*self.experience_names, "scorer", *self.generator_names):
            process = self.processes.get(name)
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
