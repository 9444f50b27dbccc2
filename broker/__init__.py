"""Exactly-once-in-order messaging between PostgreSQL databases, in the style of Service Broker."""
from broker.core import (
    ReceivedMessage,
    alter_queue,
    begin_conversation_timer,
    begin_dialog,
    create_contract,
    create_message_type,
    create_queue,
    create_route,
    create_service,
    drop_contract,
    drop_message_type,
    drop_queue,
    drop_route,
    drop_service,
    end_conversation,
    get_conversation_group,
    receive,
    report_processing_failure,
    send,
)
from broker.errors import (
    AlreadyExists,
    BrokerError,
    ConversationClosed,
    InUse,
    InvalidArgument,
    NotAllowed,
    QueueDisabled,
    UnknownObject,
    ValidationFailed,
)

__all__ = [
    "AlreadyExists", "BrokerError", "ConversationClosed", "InUse", "InvalidArgument", "NotAllowed",
    "QueueDisabled", "ReceivedMessage", "UnknownObject", "ValidationFailed", "alter_queue",
    "begin_conversation_timer", "begin_dialog", "create_contract", "create_message_type", "create_queue",
    "create_route", "create_service", "drop_contract", "drop_message_type", "drop_queue", "drop_route",
    "drop_service", "end_conversation", "get_conversation_group", "receive", "report_processing_failure", "send",
]
