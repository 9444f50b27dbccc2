"""How the Spark ingest finds its JDBC driver and reaches the database (no Spark needed)."""
import pytest

from broker.spark_ingest import jdbc
from broker.spark_ingest.errors import IngestError


def test_a_database_url_becomes_a_jdbc_url_and_properties():
    url, properties = jdbc.jdbc_connection(
        "postgresql+psycopg2://ingest:s3cret@db.example:5433/orders?sslmode=require&application_name=lake", 500)
    assert url == "jdbc:postgresql://db.example:5433/orders?sslmode=require&ApplicationName=lake"
    assert properties == {"user": "ingest", "password": "s3cret", "driver": "org.postgresql.Driver",
                          "fetchsize": "500"}
    assert jdbc.jdbc_connection("postgresql://postgres@127.0.0.1/broker", 10)[0] == \
        "jdbc:postgresql://127.0.0.1:5432/broker"


@pytest.mark.parametrize("url", ["postgresql:///broker", "postgresql://u@/broker?host=/var/run/postgresql"])
def test_a_unix_socket_url_is_refused_with_what_to_do(url):
    with pytest.raises(IngestError, match="connects over TCP"):
        jdbc.jdbc_connection(url, 10)


def test_an_explicit_driver_jar_comes_first_and_must_exist(tmp_path):
    jar = tmp_path / "postgresql-42.7.4.jar"
    with pytest.raises(IngestError, match="does not exist"):
        jdbc.find_driver_jar(jar)
    jar.write_bytes(b"")
    assert jdbc.find_driver_jar(jar) == jar


def test_without_debians_jar_the_newest_cached_one_is_taken(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(jdbc, "DEBIAN_DRIVER_JAR", tmp_path / "absent.jar")
    assert jdbc.find_driver_jar(None) is None
    maven = tmp_path / ".m2/repository/org/postgresql/postgresql"
    for version in ("42.7.4", "42.10.1"):
        (maven / version).mkdir(parents=True)
        (maven / version / f"postgresql-{version}.jar").write_bytes(b"")
        (maven / version / f"postgresql-{version}-sources.jar").write_bytes(b"")
    ivy = tmp_path / ".ivy2.5.2/jars"
    ivy.mkdir(parents=True)
    (ivy / "org.postgresql_postgresql-42.9.0.jar").write_bytes(b"")
    assert jdbc.find_driver_jar(None) == maven / "42.10.1/postgresql-42.10.1.jar"
