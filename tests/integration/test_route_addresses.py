"""A route names a plain http(s) URL: anything else is refused with what an address may hold."""
from urllib.parse import urlsplit
from uuid import uuid4

import pytest
from sqlalchemy import text

import broker
from broker import queries
from broker.errors import InvalidArgument
from broker.transport import addresses
from tests.integration.test_diagnose import _diagnose, _diagnose_over_rest
from tests.nodes import wait_for

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


METADATA_HOSTS = ["http://169.254.169.254/latest/meta-data", "http://[::ffff:169.254.169.254]/",
                  "http://[::ffff:a9fe:a9fe]", "http://metadata.google.internal/computeMetadata/v1",
                  "http://METADATA.Google.Internal", "http://metadata", "http://[fe80::1]:8080", "http://[FEBF::1]",
                  "http://169.254.170.2/v2/credentials", "http://100.100.100.200/latest/meta-data",
                  "http://[fd00:ec2::254]", "http://[64:ff9b::169.254.169.254]", "http://metadata.tencentyun.com"]


@pytest.mark.parametrize("address", METADATA_HOSTS)
def test_a_link_local_or_metadata_address_is_refused_unless_the_operator_allows_it(rolled_back, address):
    with pytest.raises(InvalidArgument, match="link-local or cloud metadata") as refused, rolled_back.begin_nested():
        broker.create_route(rolled_back, "far", address, uuid4(), SECRET)
    assert "broker.allow_metadata_addresses = on" in refused.value.hint
    rolled_back.execute(text("SET LOCAL broker.allow_metadata_addresses = on"))
    broker.create_route(rolled_back, "far", address, uuid4(), SECRET)


@pytest.mark.parametrize("address", ["http://2852039166", "http://0xa9fea9fe", "http://0251.0376.0251.0376",
                                     "http://169.254.43518", "http://010.0.0.1:8080", "http://1.2.3.4.5",
                                     "http://peer.0x10"])
def test_an_ipv4_address_written_otherwise_than_in_four_decimals_is_refused_whatever_is_allowed(rolled_back,
                                                                                               address):
    rolled_back.execute(text("SET LOCAL broker.allow_metadata_addresses = on"))
    with pytest.raises(InvalidArgument, match="four decimal numbers"):
        broker.create_route(rolled_back, "far", address, uuid4(), SECRET)


def test_the_operator_allows_metadata_addresses_for_a_database(engine):
    with engine.connect() as connection:
        assert connection.execute(queries.QUERIES["metadata_addresses_allowed"]).scalar_one() is False
        connection.execute(text("SELECT set_config('broker.allow_metadata_addresses', 'maybe', false)"))
        with pytest.raises(InvalidArgument, match="must be on or off"):
            broker.create_route(connection, "far", "http://peer.example", uuid4(), SECRET)
        connection.rollback()
        database = connection.execute(text("SELECT current_database()")).scalar_one()
        connection.execute(text(f'ALTER DATABASE "{database}" SET broker.allow_metadata_addresses = on'))
        connection.commit()
    engine.dispose()
    with engine.begin() as connection:  # a new session
        broker.create_route(connection, "far", "http://169.254.169.254", uuid4(), SECRET)


@pytest.mark.parametrize("address", ["169.254.169.254", "169.254.0.1", "169.253.255.255", "169.255.0.0",
                                     "100.100.100.200", "100.100.100.201", "fe80::1", "fec0::1", "fd00:ec2::254",
                                     "fd00:ec2::253", "::ffff:169.254.169.254", "::ffff:10.0.0.1", "::1",
                                     "64:ff9b::a9fe:a9fe", "64:ff9b::a00:1", "10.0.0.1", "127.0.0.1"])
def test_the_relay_and_create_route_refuse_the_same_addresses(rolled_back, address):
    in_sql = rolled_back.execute(text("SELECT broker._metadata_address(CAST(:a AS inet))"), {"a": address}).scalar()
    assert addresses.is_metadata_address(address) is in_sql


def test_a_route_whose_name_resolves_to_a_metadata_address_is_not_connected_to_and_its_messages_wait(nodes):
    """A route taken before hosts were checked, or a name that resolves otherwise since: the relay resolves it
    when it sends (2852039166 is 169.254.169.254 to the resolver), refuses the address, and says so."""
    a, b = nodes
    port = urlsplit(b.address).port
    with a.engine.begin() as c:
        c.execute(text("UPDATE broker.routes SET address = :address WHERE service_name = 'warehouse'"),
                  {"address": f"http://2852039166:{port}"})
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.submit", '{"sku": "A-1"}')
    status = wait_for(lambda: a.scalar("SELECT max(transmission_status) FROM broker.transmission_queue_status"
                                       " WHERE transmission_status LIKE '%metadata%'"), 30, "the refusal to show")
    assert "2852039166 resolves to 169.254.169.254, a link-local or cloud metadata address" in status
    assert "broker.allow_metadata_addresses" in status
    # broker diagnose, in the CLI and over REST, looks at the peer through the same checks.
    _, findings = _diagnose(a)
    for shown in (findings, _diagnose_over_rest(a)):
        [node] = [finding for finding in shown if finding["check"] == f"node http://2852039166:{port}"]
        assert node["finding"].startswith("does not answer: 2852039166 resolves to 169.254.169.254, a link-local "
                                          "or cloud metadata address"), node
    with a.engine.begin() as c:
        c.execute(text("UPDATE broker.routes SET address = :address WHERE service_name = 'warehouse'"),
                  {"address": b.address})
    wait_for(lambda: b.scalar("SELECT depth FROM broker.queue_status WHERE queue_name = 'warehouse_queue'") == 1,
             60, "the message to arrive once the route is put right")


def test_a_path_prefix_that_reaches_the_node_itself_is_not_found_and_diagnose_says_so(nodes):
    """No proxy in front of b takes the route's path prefix away: b answers a batch to /broker/transport/v1/batches
    with 404 before it reads the body (not 413, which would have the relay shrink its batches), the messages wait,
    and diagnose names the address as the thing to fix."""
    a, b = nodes
    with a.engine.begin() as c:
        c.execute(text("UPDATE broker.routes SET address = :address WHERE service_name = 'warehouse'"),
                  {"address": f"{b.address}/broker"})
        handle = broker.begin_dialog(c, "shop", "warehouse", "orders")
        broker.send(c, handle, "order.submit", '{"sku": "A-1"}')
    status = wait_for(lambda: a.scalar("SELECT max(transmission_status) FROM broker.transmission_queue_status"
                                       " WHERE attempts > 0"), 30, "the refusal to show")
    assert "answered HTTP 404" in status and "this node serves no POST '/broker/transport/v1/batches'" in status
    _, findings = _diagnose(a)
    [transmission] = [f for f in findings if f["check"] == f"transmission to {b.address}/broker"]
    assert "fix the routes' address" in transmission["advice"]
    with a.engine.begin() as c:
        c.execute(text("UPDATE broker.routes SET address = :address WHERE service_name = 'warehouse'"),
                  {"address": b.address})
    wait_for(lambda: b.scalar("SELECT depth FROM broker.queue_status WHERE queue_name = 'warehouse_queue'") == 1,
             60, "the message to arrive once the route is put right")
