"""Every /v1 route takes an API key as a bearer token: 401 without a valid key, 403 without the scope.

The key is verified by api.admission before the request's body is read; the dependency here hands it to
the route and names the scheme in the OpenAPI document."""
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from broker.api.problems import Problem
from broker.api_keys import ApiKey

bearer = HTTPBearer(auto_error=False, description="An API key from `broker keys create`")


def api_key(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> ApiKey:
    key = getattr(request.state, "api_key", None)
    if key is None:  # a keyed route outside api.admission.needs_key: refuse rather than serve it unkeyed
        raise Problem(401, "unauthorized", "A valid API key is required",
                      "this route is not admitted with a key; it is not served", headers={"WWW-Authenticate": "Bearer"})
    return key


def require(key: ApiKey, *scopes: str) -> None:
    """Passes when the key holds one of the scopes (or admin)."""
    if not any(key.allows(scope) for scope in scopes):
        raise Problem(403, "forbidden", "The API key lacks the scope for this",
                      f"needs {' or '.join(scopes)}; the key '{key.name}' has {', '.join(key.scopes)}")
