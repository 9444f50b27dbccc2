"""What the routes depend on, declared once: the caller's API key (one with the admin scope where a route needs
it), the node's database and its settings.

AdminKey checks the admin scope as the route's dependencies are solved, which is before FastAPI validates the
route's path, query and body: so only routes that take nothing else to validate use it, and a route that does
checks the scope itself after validation (api.auth.require), as it checks a scope named by a path parameter
(receive:<queue>, send:<service>): a bad argument is answered 422 whatever the key.

The dependencies here do no I/O, so they are coroutines: they take no worker thread.  Transactions are opened in
the routes, not by a dependency: the cleanup of a dependency with yield runs after the response is sent, so a
commit there could fail after the client was told it succeeded."""
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine

from broker.api.auth import api_key, require
from broker.api_keys import ApiKey
from broker.settings import Settings

Key = Annotated[ApiKey, Depends(api_key)]


async def _admin_key(key: Key) -> ApiKey:
    require(key, "admin")
    return key


AdminKey = Annotated[ApiKey, Depends(_admin_key)]


async def _database(request: Request) -> Engine:
    return request.app.state.engine


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


# The node's database (a route opens its own transactions, where it needs them) and its settings.
Database = Annotated[Engine, Depends(_database)]
NodeSettings = Annotated[Settings, Depends(_settings)]
