"""The OpenAPI document makes a good client: openapi-python-client generates one from a live node without a
warning, and a conversation goes round through it, a sequence conflict included, with typed answers."""
import os
import subprocess
import sys
from pathlib import Path

from tests import factories
from tests.rest import ApiServer, new_key

VENV_BIN = Path(sys.executable).parent


def _generate(url: str, output: Path) -> str:
    """Generates the client package under output from the document at url; what the generator printed."""
    generated = subprocess.run(
        [VENV_BIN / "openapi-python-client", "generate", "--url", url, "--output-path", output],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"})  # its post hooks run ruff
    assert generated.returncode == 0, generated.stdout + generated.stderr
    return generated.stdout + generated.stderr


def test_a_generated_client_converses_and_reads_a_sequence_conflict(database_url, engine, orders, tmp_path,
                                                                    monkeypatch):
    with ApiServer(database_url) as server:
        printed = _generate(f"{server.url}/openapi.json", tmp_path / "client")
        assert "warning" not in printed.lower(), printed
        monkeypatch.syspath_prepend(tmp_path / "client")
        from pg_broker_node_client import AuthenticatedClient
        from pg_broker_node_client.api.conversations import begin_conversation, end_conversation, send_message
        from pg_broker_node_client.api.operations import healthz
        from pg_broker_node_client.api.queues import complete_lock, receive
        from pg_broker_node_client.models import (BeginConversation, Completed, Conversation, EndConversation,
                                                  Health, ProblemDetails, ReceiveRequest, Received, SendMessage,
                                                  Sent)

        with AuthenticatedClient(base_url=server.url, token=new_key(engine, "admin")) as client:
            assert isinstance(healthz.sync(client=client), Health)
            begun = begin_conversation.sync(client=client, body=BeginConversation(
                from_service=factories.SHOP, to_service=factories.WAREHOUSE, contract=factories.CONTRACT))
            assert isinstance(begun, Conversation) and begun.state == "conversing", begun
            handle = begun.conversation_handle

            def send(number: int, body) -> Sent | ProblemDetails:
                return send_message.sync(handle, client=client, body=SendMessage(
                    message_type="order.submit", body=body, sequence_number=number))

            assert send(1, {"sku": "A-1"}) == Sent(sequence_number=1, duplicate=False)
            assert send(1, {"sku": "A-1"}) == Sent(sequence_number=1, duplicate=True)
            conflict = send(5, {"sku": "B-2"})
            assert isinstance(conflict, ProblemDetails), conflict
            assert (conflict.status, conflict.type_, conflict.expected_sequence_number) == (
                409, "/problems/sequence-conflict", 2)

            received = receive.sync(factories.WAREHOUSE_QUEUE, client=client,
                                    body=ReceiveRequest(max_messages=10, wait_ms=5000, lock_s=60))
            assert isinstance(received, Received), received
            assert [(m.sequence_number, m.body) for m in received.messages] == [(1, {"sku": "A-1"})]
            assert complete_lock.sync(received.lock_token, client=client) == Completed(completed=1)

            ended = end_conversation.sync(handle, client=client, body=EndConversation())
            assert isinstance(ended, Conversation) and ended.state != "conversing", ended
