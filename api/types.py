"""Field types shared by the request models: names as the broker accepts them, text PostgreSQL can store, and
numbers as numbers (an integer field takes 5, not true or "5")."""
from typing import Annotated

from fastapi import Path
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
