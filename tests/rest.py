"""The REST API for tests: a real uvicorn server in a thread, on a test database."""
import threading

import httpx
import uvicorn
from sqlalchemy import Engine

from broker.api.main import create_app
from broker.settings import Settings
from broker import api_keys
from tests.nodes import free_port, wait_for


class ApiServer:
    """create_app on the database, served by uvicorn on a free port of 127.0.0.1 until the block ends."""

    def __init__(self, database_url: str, **app_options):
        self.app = create_app(database_url, Settings(**app_options))
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> "ApiServer":
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "uvicorn to start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, key: str | None = None, **options) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, **{"timeout": 30, **options})


def new_key(engine: Engine, *scopes: str, name: str = "test") -> str:
    with engine.begin() as connection:
        return api_keys.create(connection, name, list(scopes))
