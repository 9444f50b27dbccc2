"""The JDBC side: where the PostgreSQL driver jar is, how to reach the database, and the SparkSession."""
import getpass
import os
import re
from importlib import resources
from pathlib import Path

from sqlalchemy.engine import make_url

from broker.spark_ingest.errors import IngestError

DEBIAN_DRIVER_JAR = Path("/usr/share/java/postgresql.jar")
# What Spark downloads when no jar is found (needs Maven Central).
DRIVER_PACKAGE = "org.postgresql:postgresql:42.7.4"
DRIVER_CLASS = "org.postgresql.Driver"
# Quiet driver logging (warnings only) for runs this module starts.
LOG_CONFIGURATION = resources.files("broker.spark_ingest").joinpath("log4j2.properties")

# libpq's URL parameters that pgjdbc knows under another name.
_JDBC_PARAMETER_NAMES = {"application_name": "ApplicationName", "connect_timeout": "connectTimeout"}


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.name))


def _cached_driver_jars() -> list[Path]:
    """Driver jars in the local Maven repository and Ivy caches, newest version last."""
    home = Path.home()
    found = list((home / ".m2/repository/org/postgresql/postgresql").glob("*/postgresql-*.jar"))
    for ivy in home.glob(".ivy2*"):
        found += ivy.glob("jars/org.postgresql_postgresql-*.jar")
    return sorted((path for path in found if "sources" not in path.name), key=_version_key)


def find_driver_jar(explicit: Path | None) -> Path | None:
    """The driver jar: the explicit one, Debian's libpostgresql-jdbc-java, or the newest cached one."""
    if explicit is not None:
        if not explicit.is_file():
            raise IngestError(f"the JDBC driver jar {explicit} does not exist")
        return explicit
    if DEBIAN_DRIVER_JAR.is_file():
        return DEBIAN_DRIVER_JAR
    cached = _cached_driver_jars()
    return cached[-1] if cached else None


def jdbc_connection(database_url: str, fetch_size: int) -> tuple[str, dict[str, str]]:
    """The JDBC URL and connection properties for a PostgreSQL URL (libpq or SQLAlchemy style)."""
    url = make_url(database_url)
    query = dict(url.query)
    if url.host is None or "host" in query:
        raise IngestError("the JDBC driver connects over TCP: give the database URL a host name or address, "
                          "not a Unix socket")
    parameters = "&".join(f"{_JDBC_PARAMETER_NAMES.get(name, name)}={value}" for name, value in query.items())
    jdbc_url = f"jdbc:postgresql://{url.host}:{url.port or 5432}/{url.database or ''}"
    properties = {"user": url.username or getpass.getuser(), "driver": DRIVER_CLASS, "fetchsize": str(fetch_size)}
    if url.password is not None:
        properties["password"] = url.password
    return (f"{jdbc_url}?{parameters}" if parameters else jdbc_url), properties


def launched_by_spark_submit() -> bool:
    """spark-submit starts the JVM first: its --master, --jars and --packages are already in force."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def spark_session(master: str | None = None, driver_jar: Path | None = None):
    """A SparkSession for the ingest; local[*] unless a master is given here or by spark-submit."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("broker-ingest").config("spark.ui.showConsoleProgress", "false")
    if master:
        builder = builder.master(master)
    if not launched_by_spark_submit():
        builder = builder.config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={LOG_CONFIGURATION}")
        jar = find_driver_jar(driver_jar)
        builder = (builder.config("spark.jars", str(jar)) if jar
                   else builder.config("spark.jars.packages", DRIVER_PACKAGE))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark
