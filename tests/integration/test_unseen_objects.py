"""A key learns nothing of the conversation handles and locks of services and queues outside its scopes: every
REST route that takes one answers for it exactly as for a random id that names nothing."""
import uuid

import pytest
from sqlalchemy import text

import broker
from tests import factories
from tests.rest import ApiServer, new_key

LEDGER, LEDGER_QUEUE = "ledger", "ledger_queue"


@pytest.fixture
def api(database_url, orders, engine):
    with engine.begin() as connection:
        broker.create_queue(connection, LEDGER_QUEUE)
        broker.create_service(connection, LEDGER, LEDGER_QUEUE, [factories.CONTRACT])
    with ApiServer(database_url) as server:
        yield server


def _answer(response, named_id: str) -> tuple[int, str, str]:
    """The status, the content type and the body with the id the request named written as <id>."""
    return response.status_code, response.headers["content-type"], response.text.replace(named_id, "<id>")


def _own_lock(engine, client) -> tuple[str, str]:
    """A lock the stranger holds on its own queue, and the conversation side it holds."""
    with engine.begin() as connection:
        handle = broker.begin_dialog(connection, LEDGER, LEDGER, factories.CONTRACT)
        broker.send(connection, handle, "order.note", "mine")
    lock = client.post(f"/v1/queues/{LEDGER_QUEUE}/receive", json={}).json()
    return lock["lock_token"], lock["messages"][0]["conversation_handle"]


def test_another_scopes_conversations_and_locks_answer_as_ids_that_name_nothing(api, engine):
    with api.client(new_key(engine, "admin")) as admin, \
            api.client(new_key(engine, f"send:{LEDGER}", f"receive:{LEDGER_QUEUE}")) as stranger:
        shop_side = str(factories.notes_waiting(engine, "for the warehouse"))
        live = admin.post("/v1/queues/warehouse_queue/receive", json={"max_messages": 1}).json()
        warehouse_side = live["messages"][0]["conversation_handle"]
        factories.notes_waiting(engine, "another")
        ended = admin.post("/v1/queues/warehouse_queue/receive", json={"max_messages": 1}).json()["lock_token"]
        assert admin.post(f"/v1/locks/{ended}/complete").status_code == 200
        own_lock, own_side = _own_lock(engine, stranger)
        conversation_routes = [
            ("get", "/v1/conversations/{id}", None),
            ("get", "/v1/conversations/{id}/messages", None),
            ("post", "/v1/conversations/{id}/messages", {"message_type": "order.note", "body": "x"}),
            ("post", "/v1/conversations/{id}/end", {}),
            ("post", "/v1/conversations/{id}/move", {"conversation_group": str(uuid.uuid4())}),
            ("post", "/v1/messages", {"messages": [{"conversation_handle": "{id}", "sequence_number": 1,
                                                    "message_type": "order.note", "body": "x"}]}),
            ("post", "/v1/conversations", {"from_service": LEDGER, "to_service": factories.WAREHOUSE,
                                           "contract": factories.CONTRACT, "related_conversation": "{id}"}),
            ("post", f"/v1/locks/{own_lock}/dead-letter", {"conversation_handle": "{id}", "reason": "x"}),
        ]
        lock_routes = [
            ("post", "/v1/locks/{id}/complete", None), ("post", "/v1/locks/{id}/abandon", None),
            ("post", "/v1/locks/{id}/renew", {"lock_s": 60}), ("get", "/v1/locks/{id}/state", None),
            ("put", "/v1/locks/{id}/state", {"state": 1}),
            ("post", "/v1/locks/{id}/dead-letter", {"conversation_handle": own_side, "reason": "x"}),
        ]
        cases = [(route, foreign) for route in conversation_routes for foreign in (shop_side, warehouse_side)]
        cases += [(route, foreign) for route in lock_routes for foreign in (live["lock_token"], ended)]
        for (method, path, body), foreign in cases:
            answers = []
            for named in (foreign, str(uuid.uuid4())):
                response = stranger.request(method, _with_id(path, named), json=_with_id(body, named))
                answers.append(_answer(response, named))
            assert answers[0] == answers[1], f"{method.upper()} {path} tells a foreign id from an unknown one"
            assert answers[0][0] in (404, 409), answers[0]
    with engine.connect() as connection:  # nothing was applied: the live lock holds, every conversation goes on
        assert connection.execute(text("SELECT count(*) FROM broker.leases")).scalar() == 2
        assert connection.execute(text("SELECT count(*) FROM broker.conversation_endpoints WHERE state <> 'conversing'"
                                        )).scalar() == 0


def _with_id(template, named: str):
    """A path or a request body with {id} written as the id named."""
    if isinstance(template, dict):
        return {name: _with_id(value, named) for name, value in template.items()}
    if isinstance(template, list):
        return [_with_id(value, named) for value in template]
    return template.replace("{id}", named) if isinstance(template, str) else template


def test_a_key_that_sees_a_conversation_is_told_which_scope_it_lacks(api, engine):
    """A reader of the warehouse's queue sees its conversations, and may not send on them without send:warehouse."""
    factories.notes_waiting(engine, "one")
    with api.client(new_key(engine, "receive:warehouse_queue")) as reader:
        lock = reader.post("/v1/queues/warehouse_queue/receive", json={}).json()
        side = lock["messages"][0]["conversation_handle"]
        assert reader.get(f"/v1/conversations/{side}").status_code == 200
        refused = reader.post(f"/v1/conversations/{side}/messages", json={"message_type": "order.note"})
        assert refused.status_code == 403 and "send:warehouse" in refused.json()["detail"]
