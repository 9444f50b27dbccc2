"""The schema exists only through Alembic: upgrade, downgrade and upgrade again on one database; the function files
that changed are applied at the head; a database older than the baseline is told what to do."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text

from broker import migrate, schema

ROOT = Path(__file__).resolve().parents[2]
HEAD = migrate.head_revision()


def _schema_state(url):
    engine = create_engine(url)
    with engine.connect() as c:
        has_schema = c.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname = 'broker'")).scalar_one() == 1
        version = c.execute(text(
            "SELECT CASE WHEN to_regclass('public.broker_alembic_version') IS NULL THEN NULL"
            " ELSE (SELECT string_agg(version_num, ',') FROM public.broker_alembic_version) END")).scalar_one()
    engine.dispose()
    return has_schema, version


def test_the_head_a_node_needs_is_alembics_head():
    assert HEAD == ScriptDirectory.from_config(migrate.alembic_config("")).get_current_head()


def test_upgrade_downgrade_upgrade(empty_database_url):
    migrate.upgrade(empty_database_url)
    assert _schema_state(empty_database_url) == (True, HEAD)
    migrate.downgrade(empty_database_url)
    assert _schema_state(empty_database_url) == (False, None)
    migrate.upgrade(empty_database_url)
    assert _schema_state(empty_database_url) == (True, HEAD)


def test_an_applications_own_alembic_history_is_left_alone(empty_database_url):
    engine = create_engine(empty_database_url)
    with engine.begin() as c:
        c.execute(text("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)"))
        c.execute(text("INSERT INTO alembic_version VALUES ('app_head')"))
    migrate.upgrade(empty_database_url)
    migrate.downgrade(empty_database_url)
    with engine.begin() as c:
        assert c.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == "app_head"
    engine.dispose()


def test_plain_alembic_command_takes_the_url_from_the_environment(empty_database_url):
    assert "postgresql" not in (ROOT / "alembic.ini").read_text()
    env = {**os.environ, "BROKER_DATABASE_URL": empty_database_url}
    subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=120)
    assert _schema_state(empty_database_url) == (True, HEAD)


def _function_files(url):
    engine = create_engine(url)
    with engine.connect() as c:
        applied = {name: bytes(sha256) for name, sha256 in c.execute(text("SELECT file_name, sha256 FROM broker.function_files"))}
    engine.dispose()
    return applied


def test_only_the_function_files_that_changed_are_applied_again(database_url):
    applied = _function_files(database_url)
    assert set(applied) == {file.name for file in schema.function_files()}
    engine = create_engine(database_url)
    with engine.begin() as c:
        assert schema.apply_functions(c) == []
        c.execute(text("UPDATE broker.function_files SET sha256 = '\\x00' WHERE file_name = '05_send.sql'"))
        c.execute(text("DROP FUNCTION broker.send_batch(uuid[], text, bytea[])"))
    migrate.upgrade(database_url)
    with engine.begin() as c:
        assert c.execute(text("SELECT to_regprocedure('broker.send_batch(uuid[], text, bytea[])') IS NOT NULL")).scalar()
        assert schema.apply_functions(c) == []
    engine.dispose()
    assert _function_files(database_url) == applied


def test_a_database_older_than_the_baseline_is_told_which_release_to_upgrade_through(database_url):
    engine = create_engine(database_url)
    with engine.begin() as c:
        c.execute(text("UPDATE public.broker_alembic_version SET version_num = '0027'"))
    with pytest.raises(migrate.OlderThanBaseline, match=f"revision 0027.*commit {migrate.LAST_RELEASE_BEFORE_BASELINE}"):
        migrate.upgrade(database_url)
    env = {**os.environ, "BROKER_DATABASE_URL": database_url}
    refused = subprocess.run([sys.executable, "-m", "broker.cli", "migrate"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("broker: the database's broker schema is at revision 0027, older than this")
    with engine.begin() as c:
        assert c.execute(text("SELECT version_num FROM public.broker_alembic_version")).scalar_one() == "0027"
    engine.dispose()
