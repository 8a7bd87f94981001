"""Run the three services as local processes on loopback (``fastexp up``, ``fastexp demo``, CLI tests)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

SERVICES = ("generator", "scorer", "experience")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_serving(address: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Block until ``address`` reports SERVING over the gRPC health protocol.

    Raises:
        TimeoutError: not SERVING within ``timeout_s``.
        RuntimeError: ``process`` exited first.
    """
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the service at {address} exited with code {process.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{address} was not SERVING after {timeout_s:.0f} s")


@dataclass
class LocalCluster:
    """Generator, scorer and experience processes on loopback ports; a context manager.

    ``services`` picks which of the three to run (a benchmark may want the generator alone).
    ``overrides`` maps a service name to settings fields (``{"generator": {"backend": "hf"}}``), passed to each
    process as ``FASTEXP_<SERVICE>_<FIELD>`` environment variables; ``config_file`` is passed as ``--config``.
    """

    host: str = "127.0.0.1"
    ports: Mapping[str, int] | None = None
    services: tuple[str, ...] = SERVICES
    config_file: Path | None = None
    overrides: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    start_timeout_s: float = 600.0
    log_dir: Path | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ports = dict(self.ports or {name: free_port(self.host) for name in SERVICES})

    def address(self, service: str) -> str:
        return f"{self.host}:{self.ports[service]}"

    def start(self) -> LocalCluster:
        """Start the services and wait until each is SERVING (the experience service waits for the generator)."""
        try:
            for name in self.services:
                self._spawn(name)
            for name in self.services:
                wait_serving(self.address(name), self.start_timeout_s, self.processes[name])
        except BaseException:
            self.stop()
            raise
        return self

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
        self._spawn(service)
        wait_serving(self.address(service), self.start_timeout_s, self.processes[service])

    def _spawn(self, name: str) -> None:
        extra = {"experience": {"generator_address": self.address("generator"),
                                "scorer_address": self.address("scorer")}}
        env = dict(os.environ)
        for key, value in {**self.overrides.get(name, {}), **extra.get(name, {})}.items():
            env[f"FASTEXP_{name.upper()}_{key.upper()}"] = str(value)
        command = [sys.executable, "-m", "fastexp.cli", "serve", name,
                   "--host", self.host, "--port", str(self.ports[name])]
        if self.config_file is not None:
            command += ["--config", str(self.config_file)]
        stdout = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stdout = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        self.processes[name] = subprocess.Popen(
            command, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
            start_new_session=True,
        )
        logger.info("started %s on %s (pid %d)", name, self.address(name), self.processes[name].pid)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process (experience first), then SIGKILL what is left after ``grace_s``."""
        for name in reversed(SERVICES):
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
