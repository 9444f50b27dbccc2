"""The revisions, each with its frozen SQL beside it (package data); Alembic skips this file."""
