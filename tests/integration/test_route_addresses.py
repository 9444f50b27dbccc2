"""A route names a plain http(s) URL: anything else is refused with what an address may hold."""
from uuid import uuid4

import pytest
from sqlalchemy import text

import broker
from broker.errors import InvalidArgument

SECRET = "a-secret-of-16-chars"


@pytest.mark.parametrize("address", [
    "http://user:password@peer.example:8080", "https://token@peer.example", "peer.example:8080", "ftp://peer.example",
    "http://", "http://:8080", "http://peer.example:0", "http://peer.example:99999", "http://peer.example?x=1",
    "http://peer.example/#top", "http://peer example", "http://peer.example/\n", "javascript://peer.example",
    "http://-peer.example", "http://peer.example:80:80",
])
def test_an_address_that_is_not_a_plain_http_url_is_refused(rolled_back, address):
    with pytest.raises(InvalidArgument, match="without credentials"):
        broker.create_route(rolled_back, "far", address, uuid4(), SECRET)


@pytest.mark.parametrize("address", [
    "http://127.0.0.1:8080", "https://peer.example", "https://peer.example:8443/broker/", "http://[::1]:8080",
    "http://node-b.internal.example/path_with~tilde",
])
def test_a_plain_http_url_is_taken(rolled_back, address):
    broker.create_route(rolled_back, "far", address, uuid4(), SECRET)
    assert rolled_back.execute(text("SELECT address FROM broker.routes")).scalar_one() == address.rstrip("/")
