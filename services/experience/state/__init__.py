"""The experience tier's durable, shared state (issue 42): every piece of state a trainer depends on that must
survive a restart and be the same on every experience replica.

- :mod:`~services.experience.state.store`: one SQL database (SQLite embedded, PostgreSQL shared) behind one
  interface; transactions, deadlines, UNAVAILABLE naming the store.
- :mod:`~services.experience.state.schema` and ``migrations/``: the tables and their alembic migrations.
- :mod:`~services.experience.state.rows`: the runs' and models' rows as records, and the transactions over them
  (the one writer of each row: a run, its versions, its statistics, its stream slots).
- :mod:`~services.experience.state.ledger`: versions issued once by the store, their weights kept by reference in
  :mod:`~services.common.weights.blobs` (a content-addressed folder of checksummed blobs).
"""
