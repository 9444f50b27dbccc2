"""Field types shared by the request models: names as the broker accepts them, text PostgreSQL can store, and
numbers as numbers (an integer field takes 5, not true or "5"); and no query parameter a route does not take."""
from typing import Annotated

from fastapi import Path, Request
from fastapi.dependencies.utils import get_flat_dependant
from fastapi.exceptions import RequestValidationError
from pydantic import BeforeValidator, Field, Strict

from broker.names import NAME_PATTERN

Name = Annotated[str, Field(pattern=f"^{NAME_PATTERN}$", examples=["warehouse"])]
NamePath = Annotated[str, Path(pattern=f"^{NAME_PATTERN}$", examples=["warehouse_queue"])]
Text = Annotated[str, Field(pattern=r"^[^\x00]*$", description="any text without NUL characters")]
Number = Annotated[float, Strict()]


def integer(**bounds):
    """An integer field with its bounds (Field's ge, le, gt): 5, and 5.0, which JSON Schema counts as the same
    integer; not true, "5" or 5.5.  The bounds come before the validator, or the schema loses them."""
    return Annotated[int, Strict(), Field(**bounds), BeforeValidator(_integral)]


def _integral(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def known_query_parameters(request: Request) -> None:
    """Refuses a query parameter the route does not take, as a body member it does not take is refused:
    a misspelt `limt=5` is an error, not silently the default."""
    route = request.scope.get("route")
    taken = {parameter.alias for parameter in get_flat_dependant(route.dependant).query_params} if route else set()
    unknown = [name for name in request.query_params if name not in taken]
    if unknown:
        raise RequestValidationError([{"loc": ("query", unknown[0][:100]), "type": "extra_forbidden",
                                       "msg": f"this route takes no such parameter (it takes {sorted(taken) or 'none'})"}])
