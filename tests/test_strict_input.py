"""Whatever a client sends, it gets an answer of the 4xx class with a detail, never a 500, and nothing
half-applied: numbers past their limits, text that UTF-8 cannot hold."""
import httpx
import pytest

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
