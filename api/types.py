"""Field types shared by the request models: names as the broker accepts them, and text PostgreSQL can store."""
from typing import Annotated

from fastapi import Path
from pydantic import Field

from broker.names import NAME_PATTERN

Name = Annotated[str, Field(pattern=f"^{NAME_PATTERN}$", examples=["warehouse"])]
NamePath = Annotated[str, Path(pattern=f"^{NAME_PATTERN}$", examples=["warehouse_queue"])]
Text = Annotated[str, Field(pattern=r"^[^\x00]*$", description="any text without NUL characters")]
