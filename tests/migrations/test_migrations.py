"""The schema exists only through Alembic: upgrade, downgrade and upgrade again on one database."""
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, text

from broker import migrate

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
