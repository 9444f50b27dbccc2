"""Read-only catalog routes (admin scope): message types, contracts, services, routes, and the
transmission queue.  The catalog is changed in SQL or by migrations, where it is versioned."""
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field
from sqlalchemy import text

from api.auth import api_key, require
from api.problems import KEYED, error_responses
from broker.api_keys import ApiKey

router = APIRouter(prefix="/v1", tags=["catalog"], responses=error_responses(*KEYED))

MESSAGE_TYPES = text("SELECT name, validation FROM broker.message_types ORDER BY name")
CONTRACTS = text(
    "SELECT c.name, coalesce(jsonb_object_agg(mt.name, cmt.sent_by) FILTER (WHERE mt.name IS NOT NULL), '{}')"
    " AS message_types"
    " FROM broker.contracts c"
    " LEFT JOIN broker.contract_message_types cmt USING (contract_id)"
    " LEFT JOIN broker.message_types mt USING (message_type_id)"
    " GROUP BY c.name ORDER BY c.name")
SERVICES = text(
    "SELECT s.name, q.name AS queue, coalesce(array_agg(c.name ORDER BY c.name) FILTER (WHERE c.name IS NOT NULL),"
    " '{}') AS contracts"
    " FROM broker.services s JOIN broker.queues q USING (queue_id)"
    " LEFT JOIN broker.service_contracts sc USING (service_id)"
    " LEFT JOIN broker.contracts c ON c.contract_id = sc.contract_id"
    " GROUP BY s.name, q.name ORDER BY s.name")
ROUTES = text("SELECT service_name, address, broker_instance, created_at FROM broker.routes ORDER BY service_name")
TRANSMISSION_QUEUE = text(
    "SELECT * FROM broker.transmission_queue_status ORDER BY enqueued_at, conversation_handle, message_sequence_number"
    " LIMIT :limit OFFSET :offset")


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


def _rows(request: Request, key: ApiKey, query, **params) -> list[dict[str, Any]]:
    require(key, "admin")
    with request.app.state.engine.connect() as connection:
        return [row._asdict() for row in connection.execute(query, params)]


@router.get("/message-types", response_model=list[MessageType], summary="Message types")
def list_message_types(request: Request, key: ApiKey = Depends(api_key)) -> Any:
    return _rows(request, key, MESSAGE_TYPES)


@router.get("/contracts", response_model=list[Contract], summary="Contracts")
def list_contracts(request: Request, key: ApiKey = Depends(api_key)) -> Any:
    return _rows(request, key, CONTRACTS)


@router.get("/services", response_model=list[Service], summary="Services")
def list_services(request: Request, key: ApiKey = Depends(api_key)) -> Any:
    return _rows(request, key, SERVICES)


@router.get("/routes", response_model=list[Route], summary="Routes to remote services")
def list_routes(request: Request, key: ApiKey = Depends(api_key)) -> Any:
    return _rows(request, key, ROUTES)


@router.get("/transmission-queue", response_model=list[WaitingMessage], tags=["queues"],
            summary="Messages waiting for a remote node's acknowledgement", responses=error_responses(422))
def list_transmission_queue(request: Request, key: ApiKey = Depends(api_key),
                            limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=2**62)) -> Any:
    return _rows(request, key, TRANSMISSION_QUEUE, limit=limit, offset=offset)
