"""REST: concurrent clients send over HTTP (a message a request, then 100 numbered messages a request), then
receive with peek-lock and complete, on a `broker serve`; and, as the baseline of a message a request, the same
clients on a bare FastAPI endpoint that only inserts and commits (bench.bare_api)."""
import base64
from collections.abc import Callable
from pathlib import Path

import httpx
from sqlalchemy import create_engine

from bench import workload
from bench.databases import BenchServer
from bench.nodes import serve_api, start_bare_api
from bench.results import Measurement, ScenarioResult
from broker import api_keys
from broker.cli.processes import stop


def _clients(count: int, work: Callable[[httpx.Client], int], errors: list[str]) -> float:
    """Runs work(client) in `count` threads at once; returns the messages handled per second."""
    handled = []

    def client() -> None:
        try:
            with httpx.Client(timeout=30) as http:
                handled.append(work(http))
        except Exception as error:  # counted and reported, not raised: the scenario reports errors
            errors.append(f"{type(error).__name__}: {error}")

    seconds = workload.run_at_once(client, count)
    return sum(handled) / seconds


BATCH = 100
BATCH_CONVERSATIONS = 10
BATCHED_TARGET = 5_000


def run(server: BenchServer, log: Path, clients: int, messages_per_client: int,
        report: Callable[[str], None]) -> ScenarioResult:
    batched_per_client = 10 * messages_per_client // BATCH * BATCH
    url = server.database("rest")
    workload.define(url, sender=True, receiver=True)
    engine = create_engine(url)
    with engine.begin() as connection:
        key = api_keys.create(connection, "bench", ["admin"])
    engine.dispose()
    api, address = serve_api(url, log)
    headers = {"Authorization": f"Bearer {key}"}
    body = base64.b64encode(bytes(workload.MESSAGE_BYTES)).decode()
    errors: list[str] = []

    def begin(http: httpx.Client) -> str:
        conversation = http.post(f"{address}/v1/conversations", headers=headers, json={
            "from_service": "bench_sender", "to_service": "bench_receiver", "contract": "bench"})
        conversation.raise_for_status()
        return conversation.json()["conversation_handle"]

    def send_batches(http: httpx.Client) -> int:
        """BATCHED_PER_CLIENT messages, BATCH a request, over BATCH_CONVERSATIONS conversations in turn."""
        handles = [begin(http) for _ in range(BATCH_CONVERSATIONS)]
        for first in range(0, batched_per_client, BATCH):
            numbers = range(first, first + BATCH)
            http.post(f"{address}/v1/messages", headers=headers, json={"messages": [
                {"conversation_handle": handles[n % BATCH_CONVERSATIONS], "sequence_number": n // BATCH_CONVERSATIONS + 1,
                 "message_type": "bench.record", "body_base64": body} for n in numbers]}).raise_for_status()
        return batched_per_client

    def send(http: httpx.Client) -> int:
        handle = begin(http)
        for _ in range(messages_per_client):
            http.post(f"{address}/v1/conversations/{handle}/messages", headers=headers,
                      json={"message_type": "bench.record", "body_base64": body}).raise_for_status()
        return messages_per_client

    def receive(http: httpx.Client) -> int:
        taken = 0
        while True:
            batch = http.post(f"{address}/v1/queues/bench_dst/receive", headers=headers,
                              json={"max_messages": 100, "wait_ms": 0, "lock_s": 60})
            batch.raise_for_status()
            if batch.status_code == 204:  # nothing left
                return taken
            received = batch.json()
            http.post(f"{address}/v1/locks/{received['lock_token']}/complete", headers=headers).raise_for_status()
            taken += len(received["messages"])

    def send_bare(http: httpx.Client) -> int:
        for _ in range(messages_per_client):
            http.post(f"{bare_address}/messages", json={"body_base64": body}).raise_for_status()
        return messages_per_client

    bare, bare_address = start_bare_api(server.database("rest_bare"), log)
    try:
        bare_sent = _clients(clients, send_bare, errors)
    finally:
        stop(bare)
    try:
        sent = _clients(clients, send, errors)
        report(f"REST: {clients} clients sent {clients * messages_per_client:,} messages at {sent:,.0f} msgs/s, "
               f"a message a request ({sent / bare_sent:.2f}x a bare FastAPI INSERT and commit: {bare_sent:,.0f})")
        batched = _clients(clients, send_batches, errors)
        report(f"REST: {clients} clients sent {clients * batched_per_client:,} messages at {batched:,.0f} msgs/s, "
               f"{BATCH} a request")
        received = _clients(clients, receive, errors)
        report(f"REST: {clients} clients received and completed at {received:,.0f} msgs/s; {len(errors)} errors")
    finally:
        stop(api)
    return ScenarioResult(
        "REST send, then receive + complete", Measurement(f"send: POST /v1/messages, {BATCH} a request", "msgs/s",
                                                          [batched]),
        target=f"≥ {BATCHED_TARGET:,} msgs/s sent; no errors", met=not errors and batched >= BATCHED_TARGET,
        details={"clients": clients, "messages": clients * (messages_per_client + batched_per_client),
                 "send_one_a_request_msgs_per_s": sent, "bare_fastapi_insert_msgs_per_s": bare_sent,
                 "send_one_a_request_vs_bare": sent / bare_sent, "send_batched_msgs_per_s": batched,
                 "receive_complete_msgs_per_s": received, "receive_batch": 100, "errors": errors[:5],
                 "error_count": len(errors)})
