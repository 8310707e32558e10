"""Alembic environment: the engine comes from autotile.store.migrate, never from an ini file."""
from alembic import context

from autotile.store.models import VERSION_TABLE, Base

engine = context.config.attributes["engine"]
with engine.begin() as connection:
    context.configure(connection=connection, target_metadata=Base.metadata, version_table=VERSION_TABLE,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
