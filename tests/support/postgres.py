"""A real PostgreSQL server for tests: Debian's ``postgresql`` binaries (``initdb``, ``pg_ctl``), a fresh cluster in
a temporary folder, on a free loopback port, stopped and started again by the tests that need an outage.

PostgreSQL refuses to run as root: as root the cluster's folder belongs to the ``postgres`` user and the binaries
run as it, through ``runuser`` (exec'ed: the test process, with its gRPC and proxy threads, only forks and execs;
``subprocess``'s own ``user=`` changes ids in the forked child, which crashed there now and then). ``pg_ctl -w``
returns once the server accepts connections (an event, not a sleep).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import sqlalchemy as sa


def postgres_bin() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: on PATH, else the newest ``/usr/lib/postgresql/*/bin`` (None: not
    installed)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(candidates[-1]).parent if candidates else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PostgresServer:
    """One PostgreSQL cluster (module docs): :meth:`start`, :meth:`stop`, :meth:`url` of a database,
    :meth:`create_database`, :meth:`remove`."""

    def __init__(self) -> None:
        bin_dir = postgres_bin()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql; make tools does)")
        self._bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="fastexp-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self._user = "postgres" if os.geteuid() == 0 else None
        if self._user is not None:
            entry = pwd.getpwnam(self._user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "fastexp", "--auth=trust", "-E", "UTF8", "--no-sync")

    def _as_owner(self, *command: str) -> list[str]:
        """``command`` run as the cluster's owner (``runuser`` as root)."""
        return ["runuser", "-u", self._user, "--", *command] if self._user is not None else list(command)

    def _run(self, tool: str, *args: str) -> None:
        result = subprocess.run(self._as_owner(str(self._bin / tool), *args), capture_output=True, text=True,
                                timeout=120, cwd=self.root)
        if result.returncode != 0:
            raise RuntimeError(f"{tool} failed ({result.returncode}): {result.stderr or result.stdout}")

    def start(self) -> None:
        """Start the server; returns once it accepts connections (``pg_ctl -w``)."""
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=100")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", options, "-w", "-t",
                  "120", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: open connections are ended; ``immediate``: as if killed)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "120", "stop")

    def running(self) -> bool:
        """Whether the server runs (``pg_ctl status``)."""
        result = subprocess.run(self._as_owner(str(self._bin / "pg_ctl"), "-D", str(self.data), "status"),
                                capture_output=True, text=True, timeout=60, cwd=self.root)
        return result.returncode == 0

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://fastexp@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its URL."""
        name = f"fastexp_{uuid.uuid4().hex[:12]}"
        engine = sa.create_engine(self.url().replace("postgresql://", "postgresql+psycopg://"),
                                  isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
        engine.dispose()
        return self.url(name)

    def remove(self) -> None:
        """Stop the server if it runs, and remove its folder."""
        with contextlib.suppress(RuntimeError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
