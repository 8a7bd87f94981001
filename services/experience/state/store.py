"""The experience tier's durable state: one SQL database behind one interface, SQLite or PostgreSQL.

``state_url`` names it: ``sqlite:///path/state.db`` (the embedded default: one node, a file that survives
restarts) or ``postgresql://user:password@host:port/db`` (several experience replicas share it). Both run the same
schema (:mod:`services.experience.state.schema`, created and upgraded by alembic migrations at start) through the
same SQLAlchemy Core code, the way Airflow and MLflow take one SQLAlchemy URL.

Every change is one transaction (:meth:`StateStore.transact`). Updates of one row are serialized across replicas:
PostgreSQL takes the row's lock (``SELECT ... FOR UPDATE``); SQLite takes the database's write lock when the
transaction begins (``BEGIN IMMEDIATE``). Calls run on a small thread pool whose size is the connection pool's, so
any number of concurrent streams queue for a connection instead of exhausting the database's (SkyRL's Tinker server
ran out of its pool with one write per sample: here the store is written per run, per update and per delivered
batch, never per sample or token).

Every call has a deadline (``timeout_s``: PostgreSQL's ``connect_timeout``, ``statement_timeout`` and
``lock_timeout``, SQLite's busy timeout, and the wait for the thread pool). A database that cannot be reached or
answer in time raises :class:`~fastexp.errors.NotReady` (gRPC UNAVAILABLE) naming the store: the service never
answers from a copy in memory instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import URL, Connection, Engine, make_url

from services.common import metrics
from services.common.errors import NotReady

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: PostgreSQL advisory lock key held while migrations run (replicas starting together migrate one at a time).
MIGRATION_LOCK_KEY = 0x66657870  # "fexp"
MIGRATIONS = Path(__file__).parent / "migrations"


class StoreConfigError(ValueError):
    """``state_url`` names no database the store supports (the message says which are)."""


def engine_url(url: str) -> URL:
    """The SQLAlchemy URL for ``url``: ``sqlite:///<path>`` as is, ``postgresql://`` with the psycopg (3) driver.

    Raises:
        StoreConfigError: neither SQLite nor PostgreSQL, or not a URL.
    """
    try:
        parsed = make_url(url)
    except exc.ArgumentError as error:
        raise StoreConfigError(f"state_url: {error}") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise StoreConfigError("state_url: an SQLite store is a file (sqlite:///path/state.db), not in memory")
        return parsed.set(drivername="sqlite+pysqlite")
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+psycopg")
    raise StoreConfigError(f"state_url: {backend!r} is not supported; use sqlite:///path or postgresql://...")


class StateStore:
    """One SQL database (module docs), reached through ``pool_size`` connections, each call within ``timeout_s``.

    Raises:
        StoreConfigError: ``url`` is not a supported database URL.
    """

    def __init__(self, url: str, *, timeout_s: float = 10.0, pool_size: int = 4) -> None:
        self._url = engine_url(url)
        self.name = self._url.set(drivername=self._url.get_backend_name()).render_as_string(hide_password=True)
        self.backend = self._url.get_backend_name()
        self.timeout_s = timeout_s
        self._engine = self._create_engine(pool_size)
        self._executor = concurrent.futures.ThreadPoolExecutor(pool_size, thread_name_prefix="state-store")

    def _create_engine(self, pool_size: int) -> Engine:
        if self.backend == "sqlite":
            Path(self._url.database).parent.mkdir(parents=True, exist_ok=True)
            engine = sa.create_engine(self._url, connect_args={"timeout": self.timeout_s, "check_same_thread": False},
                                      pool_size=pool_size, max_overflow=0, pool_timeout=self.timeout_s)

            @sa.event.listens_for(engine, "connect")
            def _connect(dbapi_connection, _record) -> None:  # pysqlite's own BEGIN off: ours is IMMEDIATE
                dbapi_connection.isolation_level = None
                dbapi_connection.execute("PRAGMA journal_mode=WAL")
                dbapi_connection.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")

            @sa.event.listens_for(engine, "begin")
            def _begin(connection) -> None:  # the write lock at once: no two writers read the same old row
                connection.exec_driver_sql("BEGIN IMMEDIATE")

            return engine
        ms = int(self.timeout_s * 1000)
        return sa.create_engine(
            self._url, pool_size=pool_size, max_overflow=0, pool_timeout=self.timeout_s, pool_pre_ping=True,
            connect_args={"connect_timeout": max(1, int(self.timeout_s)),
                          "options": f"-c statement_timeout={ms} -c lock_timeout={ms}"},
        )

    def migrate(self) -> str:
        """Create or upgrade the schema to the newest migration (alembic ``upgrade head``); returns its revision.
        Replicas starting together on PostgreSQL migrate one at a time (an advisory lock).

        Raises:
            NotReady: the database cannot be reached.
        """
        from alembic import command
        from alembic.config import Config
        from alembic.runtime.migration import MigrationContext

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        try:
            with self._engine.begin() as connection:
                if self.backend == "postgresql":
                    connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
                config.attributes["connection"] = connection
                command.upgrade(config, "head")
                revision = MigrationContext.configure(connection).get_current_revision()
        except (exc.OperationalError, exc.InterfaceError, exc.TimeoutError) as error:
            raise self._unavailable("migrating the schema", error) from None
        logger.info("state store %s at schema revision %s", self.name, revision)
        return revision

    async def transact(self, what: str, work: Callable[[Connection], T]) -> T:
        """``work(connection)`` in one transaction on a store thread: committed when it returns, rolled back when
        it raises (its exception propagates: domain errors such as NotFound pass through unchanged).

        Raises:
            NotReady: naming the store and ``what``: the database cannot be reached or did not answer within
                ``timeout_s`` (nothing was committed, or the commit's outcome is unknown and the caller must read
                the row again).
        """
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._run, what, work)
        try:
            # the statement and lock timeouts end the thread's work; this bounds the wait for a thread as well
            async with asyncio.timeout(self.timeout_s * 3):  # cancellable: wait_for may swallow a cancel
                return await asyncio.shield(future)
        except TimeoutError:
            raise NotReady(f"state store {self.name}: {what} did not finish within {self.timeout_s * 3:.0f} s") from None

    def transact_sync(self, what: str, work: Callable[[Connection], T]) -> T:
        """:meth:`transact` on the calling thread (start-up, tests, benchmarks; never on the event loop)."""
        return self._run(what, work)

    def _run(self, what: str, work: Callable[[Connection], T]) -> T:
        try:
            with metrics.STATE_STORE_SECONDS.labels(what).time(), self._engine.begin() as connection:
                return work(connection)
        except (exc.OperationalError, exc.InterfaceError, exc.TimeoutError) as error:
            raise self._unavailable(what, error) from None
        except exc.DBAPIError as error:
            if error.connection_invalidated:
                raise self._unavailable(what, error) from None
            raise

    def _unavailable(self, what: str, error: Exception) -> NotReady:
        metrics.STATE_STORE_FAILURES.labels(what).inc()
        cause = getattr(error, "orig", None) or error
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        logger.warning("state store %s: %s failed: %s", self.name, what, detail)
        return NotReady(f"state store {self.name} unavailable ({what}): {detail}")

    def close(self) -> None:
        """Close the connections (calls after this fail)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._engine.dispose()
