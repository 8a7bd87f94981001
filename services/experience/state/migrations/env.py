"""Alembic's environment for the experience tier's state store: migrations run on the connection
:meth:`services.experience.state.store.StateStore.migrate` passes in (never a URL of their own)."""

from alembic import context

from services.experience.state.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
