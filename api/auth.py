"""Every /v1 route takes an API key as a bearer token: 401 without a valid key, 403 without the scope."""
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.problems import Problem
from broker import api_keys
from broker.api_keys import ApiKey

bearer = HTTPBearer(auto_error=False, description="An API key from `broker keys create`")


def api_key(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> ApiKey:
    if credentials is not None:
        with request.app.state.engine.connect() as connection:
            key = api_keys.verify(connection, credentials.credentials)
        if key is not None:
            return key
    raise Problem(401, "unauthorized", "A valid API key is required",
                  "send it as 'Authorization: Bearer <key>'; create one with 'broker keys create'",
                  headers={"WWW-Authenticate": "Bearer"})


def require(key: ApiKey, *scopes: str) -> None:
    """Passes when the key holds one of the scopes (or admin)."""
    if not any(key.allows(scope) for scope in scopes):
        raise Problem(403, "forbidden", "The API key lacks the scope for this",
                      f"needs {' or '.join(scopes)}; the key '{key.name}' has {', '.join(key.scopes)}")
