"""What the routes depend on, declared once: the caller's API key (one with the admin scope where a route needs
it), the node's database and its settings.

The admin scope is checked as the route's dependencies are solved, before its body and query are validated: a key
without it learns nothing of what the route would take (403 before 422).  A scope named by a path parameter
(receive:<queue>, send:<service>) is checked in the route, with api.auth.require."""
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine

from api.auth import api_key, require
from broker.api_keys import ApiKey
from broker.cli.settings import Settings

Key = Annotated[ApiKey, Depends(api_key)]


def _admin_key(key: Key) -> ApiKey:
    require(key, "admin")
    return key


AdminKey = Annotated[ApiKey, Depends(_admin_key)]


def _database(request: Request) -> Engine:
    return request.app.state.engine


def _settings(request: Request) -> Settings:
    return request.app.state.settings


# The node's database (a route opens its own transactions, where it needs them) and its settings.
Database = Annotated[Engine, Depends(_database)]
NodeSettings = Annotated[Settings, Depends(_settings)]
