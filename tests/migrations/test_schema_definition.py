"""broker/sql/ is the SQL API's one definition: a database built from it equals one built by the
migration chain (the baseline, the revisions after it, and the function files applied at the head), and every
revision's downgrade gives back the tables, types and views it started from."""
import pytest
from alembic import command
from alembic.script import ScriptDirectory

from broker import migrate
from tests.migrations import catalog
from tests.conftest import _fresh_database


def _revisions() -> list[str]:
    """The revisions, oldest first."""
    script = ScriptDirectory.from_config(migrate.alembic_config(""))
    return [revision.revision for revision in reversed(list(script.walk_revisions()))]


@pytest.fixture
def by_chain(admin_url):
    """Another database with no broker schema."""
    yield from _fresh_database(admin_url)


def test_the_definition_files_build_what_the_migrations_build(empty_database_url, by_chain):
    """migrate.upgrade builds a new database from broker/sql/; the chain, revision by revision, must
    build the same."""
    migrate.upgrade(empty_database_url)
    command.upgrade(migrate.alembic_config(by_chain), "head")

    built = catalog.snapshot(empty_database_url)
    migrated = catalog.snapshot(by_chain)
    assert len(built["functions"]) > 60 and len(built["relations"]) > 20 and built["rows"]
    difference = catalog.diff(migrated, built, ("migrations", "broker/sql"))
    assert not difference, "broker/sql/ differs from the migration chain:\n" + difference


def test_each_revision_goes_down_to_the_catalog_it_came_from(empty_database_url):
    """base, 0028, ...: at each, upgrade one step and downgrade back; the catalog, less the functions (which only
    the head applies, from broker/sql/functions/), must be as it was."""
    url = empty_database_url
    revisions = ["base"] + _revisions()
    # Alembic keeps its version table, empty, at base: made once here, so that base compares equal.
    migrate.upgrade(url, revisions[1])
    migrate.downgrade(url, "base")
    failures = []
    for revision, following in zip(revisions, revisions[1:]):
        before = catalog.without_functions(catalog.snapshot(url))
        migrate.upgrade(url, following)
        assert catalog.without_functions(catalog.snapshot(url)) != before, f"{following} changes no table"
        migrate.downgrade(url, revision)
        difference = catalog.diff(before, catalog.without_functions(catalog.snapshot(url)),
                                  (f"at {revision}", f"{following} and back"))
        if difference:
            failures.append(f"--- downgrade of {following} to {revision}:\n{difference}")
        migrate.upgrade(url, following)
    assert "alembic version | " + migrate.head_revision() in catalog.snapshot(url)["rows"]
    assert not failures, "\n\n".join(failures)
