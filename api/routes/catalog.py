"""Read-only catalog routes (admin scope): message types, contracts, services, routes, and the
transmission queue.  The catalog is changed in SQL or by migrations, where it is versioned."""
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field
from sqlalchemy import TextClause

from broker.api.auth import require
from broker.api.deps import AdminKey, Database, Key
from broker.api.problems import KEYED, error_responses
from broker.api.types import known_query_parameters
from broker import queries

router = APIRouter(prefix="/v1", tags=["catalog"], responses=error_responses(*KEYED),
                   dependencies=[Depends(known_query_parameters)])


class MessageType(BaseModel):
    name: str = Field(examples=["order.submit"])
    validation: Literal["none", "empty", "json"]


class Contract(BaseModel):
    name: str = Field(examples=["orders"])
    message_types: dict[str, Literal["initiator", "target", "any"]] = Field(
        examples=[{"order.submit": "initiator", "order.ack": "target"}])


class Service(BaseModel):
    name: str = Field(examples=["warehouse"])
    queue: str
    contracts: list[str] = Field(description="contracts it accepts as a target")


class Route(BaseModel):
    """Where a remote service lives; the peer's secret is never shown."""

    service_name: str
    address: str = Field(examples=["https://node-b.example.com"])
    broker_instance: UUID
    created_at: datetime


class BrokerPriority(BaseModel):
    """Conversation sides created for this contract between these services (null: any) get this priority."""

    name: str
    priority: int = Field(ge=1, le=10, examples=[8])
    contract_name: str | None
    local_service_name: str | None
    remote_service_name: str | None


class WaitingMessage(BaseModel):
    conversation_handle: UUID
    conversation_id: UUID
    to_service: str
    message_sequence_number: int
    message_type: str
    body_bytes: int | None
    enqueued_at: datetime
    attempts: int
    next_attempt_at: datetime
    transmission_status: str = Field(description="why it is still waiting, in words")


def _read(db: Database, query: TextClause, **params) -> list[dict[str, Any]]:
    with db.connect() as connection:
        return queries.as_dicts(connection.execute(query, params))


@router.get("/message-types", response_model=list[MessageType], summary="Message types")
def list_message_types(key: AdminKey, db: Database) -> Any:
    return _read(db, queries.QUERIES["message_types"])


@router.get("/contracts", response_model=list[Contract], summary="Contracts")
def list_contracts(key: AdminKey, db: Database) -> Any:
    with db.connect() as connection:
        described = queries.contracts(connection)
    return [{"name": name, "message_types": {message_type: sides["sent_by"] for message_type, sides in types.items()}}
            for name, types in described.items()]


@router.get("/services", response_model=list[Service], summary="Services")
def list_services(key: AdminKey, db: Database) -> Any:
    return _read(db, queries.QUERIES["services"], names=None)


@router.get("/routes", response_model=list[Route], summary="Routes to remote services")
def list_routes(key: AdminKey, db: Database) -> Any:
    return _read(db, queries.QUERIES["routes"])


@router.get("/broker-priorities", response_model=list[BrokerPriority], summary="Conversation priorities")
def list_broker_priorities(key: AdminKey, db: Database) -> Any:
    return _read(db, queries.QUERIES["broker_priorities"])


@router.get("/transmission-queue", response_model=list[WaitingMessage], tags=["queues"],
            summary="Messages waiting for a remote node's acknowledgement", responses=error_responses(422))
def list_transmission_queue(key: Key, db: Database,
                            limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=2**62)) -> Any:
    require(key, "admin")
    return _read(db, queries.QUERIES["transmission_queue"], limit=limit, offset=offset)
