"""What a node tells a peer about itself, for `broker diagnose` on the peer: both ends.

The peer asks, signed, for the services it routes to this node and the contracts it uses; this node
answers with those of its services it has (their queues and contracts), how it defines those
contracts, and which of its own services it routes back to the peer.
"""
import json
from collections.abc import Mapping
from typing import Annotated

import httpx
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import Engine

from broker import queries
from broker.transport import signing, wire
from broker.transport.receiving import Malformed, secret_of_signer


# A name as PostgreSQL's text holds it: without a NUL character.
Name = Annotated[str, Field(pattern=r"^[^\x00]*$")]


class DescribeRequest(BaseModel):
    services: list[Name]
    contracts: list[Name]


class OfferedService(BaseModel):
    queue: str
    queue_enabled: bool
    contracts: list[str]


class Description(BaseModel):
    """What a peer's describe endpoint answers: checked before any of it is used."""
    services: dict[str, OfferedService]
    contracts: dict[str, dict]
    routes_to_you: list[str]


def ask(client: httpx.Client, address: str, our_instance: str, their_instance: str, secret: str,
        services: list[str], contracts: list[str]) -> httpx.Response:
    """Asks the node at address to describe the services and contracts, signed for that node."""
    body = json.dumps({"services": services, "contracts": contracts}).encode()
    purpose = signing.request_purpose("POST", signing.DESCRIBE_PATH, wire.JSON_MEDIA_TYPE, their_instance)
    return client.post(f"{address}{signing.DESCRIBE_PATH}", content=body,
                       headers={"Content-Type": wire.JSON_MEDIA_TYPE,
                                **signing.signed_headers(secret, our_instance, purpose, body)})


def answer(engine: Engine, our_instance: str, peer_instance: str, headers: Mapping[str, str],
           body: bytes) -> tuple[str, bytes]:
    """The secret the request is signed under and the description it asks for (JSON).  Raises
    signing.BadSignature, or Malformed for a signed request that is not a describe request."""
    purpose = signing.request_purpose("POST", signing.DESCRIBE_PATH, wire.JSON_MEDIA_TYPE, our_instance)
    with engine.connect() as connection:
        secret = secret_of_signer(connection, peer_instance, purpose, headers, body)
        try:
            asked = DescribeRequest.model_validate_json(body)
        except ValidationError as error:
            raise Malformed(str(error.errors()[:3])) from error
        services = {row.name: {"queue": row.queue, "queue_enabled": row.queue_enabled,
                               "contracts": list(row.contracts)}
                    for row in queries.services(connection, asked.services)}
        contracts = queries.contracts(connection, asked.contracts)
        routes = connection.execute(queries.QUERIES["services_routed_to"], {"instance": peer_instance}).scalars().all()
    return secret, json.dumps({"broker_instance": our_instance, "services": services, "contracts": contracts,
                               "routes_to_you": routes}).encode()
