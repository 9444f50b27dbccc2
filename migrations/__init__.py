"""The broker's Alembic revisions, a package so that they install with the wheel (see broker/migrate.py)."""
