"""Whatever a client sends, it gets an answer of the 4xx class with a detail, never a 500, and nothing
half-applied: numbers past their limits or not written as numbers, text that UTF-8 cannot hold."""
import json

import httpx
import pytest
from sqlalchemy import text

import broker
from tests.factories import WAREHOUSE_QUEUE, begin
from tests.rest import ApiServer, new_key


@pytest.fixture
def api(database_url, engine, orders):
    with ApiServer(database_url) as server:
        with engine.begin() as c:
            server.handle = begin(c)
        server.key = new_key(engine, "admin")
        yield server


def _post(api, path: str, content: str) -> httpx.Response:
    with api.client(api.key) as client:
        return client.post(path, content=content.encode("utf-8", "surrogatepass"),
                           headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("body", ['{"message_type": "order.note", "sequence_number": 9223372036854775808}',
                                  '{"message_type": "order.note", "body": "\\ud800"}',
                                  '{"message_type": "order.note", "body": {"\\udfff": 1}}'])
def test_a_send_that_cannot_be_stored_is_refused_and_stores_nothing(api, engine, body):
    answer = _post(api, f"/v1/conversations/{api.handle}/messages", body)
    assert answer.status_code == 422 and answer.json()["detail"]
    with engine.connect() as c:
        assert broker.receive(c, WAREHOUSE_QUEUE, 10) == []


def test_an_end_with_text_that_cannot_be_stored_is_refused(api, engine):
    answer = _post(api, f"/v1/conversations/{api.handle}/end",
                   '{"error_code": 7, "error_description": "\\ud800"}')
    assert answer.status_code == 422 and answer.json()["detail"]
    with api.client(api.key) as client:
        assert client.get(f"/v1/conversations/{api.handle}").json()["state"] == "conversing"


@pytest.mark.parametrize("options", [{"wait_ms": False}, {"max_messages": 2.5}, {"lock_s": "5"},
                                     {"max_bytes": True}, {"max_messages": "10"}, {"lock_s": None}])
def test_a_number_is_taken_only_as_a_number(api, engine, options):
    """2.0 is the integer 2 to JSON Schema, and so to the OpenAPI document; 2.5, true and "2" are not."""
    with engine.begin() as c:
        broker.send(c, api.handle, "order.note", b"{}")
    answer = _post(api, f"/v1/queues/{WAREHOUSE_QUEUE}/receive", json.dumps(options))
    assert answer.status_code == 422 and next(iter(options)) in answer.json()["detail"]
    with engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM broker.leases")).scalar() == 0


def test_every_refusal_says_what_happened(api):
    with api.client(api.key) as client:
        answers = [client.get("/v1/nowhere"), client.get("/nowhere"), client.delete("/v1/queues"),
                   client.post(f"/v1/conversations/{api.handle}/messages",
                               json={"message_type": "order.note", "body": 1, "body_base64": "AA=="}),
                   client.post("/transport/v1/batches", content=b"x")]
    with api.client() as client:
        answers.append(client.get("/v1/queues"))
    assert [a.status_code for a in answers] == [404, 404, 405, 422, 401, 401]
    for answer in answers:
        problem = answer.json()
        assert answer.headers["content-type"] == "application/problem+json"
        assert problem["detail"] and problem["title"] and problem["status"] == answer.status_code, problem


@pytest.mark.parametrize("path", ["/v1/transmission-queue?limt=5", "/v1/queues?x=1", "/v1/status?verbose=true",
                                  "/v1/transmission-queue?limit=5&limit=6&offset=0&%00=1"])
def test_a_query_parameter_the_route_does_not_take_is_refused(api, path):
    with api.client(api.key) as client:
        answer = client.get(path)
        taken = client.get("/v1/transmission-queue?limit=5&offset=0")
    assert answer.status_code == 422 and answer.json()["type"] == "/problems/invalid-request", answer.text
    assert "takes no such parameter" in answer.json()["detail"]
    assert taken.status_code == 200
