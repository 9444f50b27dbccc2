"""The relay connects to a route's host only at addresses that are not link-local or a cloud metadata service's,
unless the operator allows them (broker.allow_metadata_addresses): broker.create_route refuses such a host when a
route is made, and this refuses a name that resolves to one when a batch is sent, however the name resolves by
then.  The host is resolved once, here, every address checked, and the connection made to a checked address, so
that a name cannot resolve to another address between the check and the connection.  The networks are those of
broker._metadata_address (broker/sql/functions/01_catalog.sql)."""
import ipaddress
import socket

import httpcore
import httpx
from sqlalchemy import Connection

from broker import queries

METADATA_NETWORKS = tuple(ipaddress.ip_network(network) for network in (
    "169.254.0.0/16", "100.100.100.200/32", "fe80::/10", "fd00:ec2::254/128",
    "::ffff:169.254.0.0/112", "::ffff:100.100.100.200/128", "64:ff9b::169.254.0.0/112",
    "64:ff9b::100.100.100.200/128"))


def is_metadata_address(address: str) -> bool:
    """Whether an IP address (an IPv6 one may carry a %zone) is link-local or a cloud metadata service's."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    return any(ip.version == network.version and ip in network for network in METADATA_NETWORKS)


class CheckedConnections(httpcore.SyncBackend):
    """httpcore's network backend, connecting only to addresses that are not metadata ones unless
    allow_metadata_addresses (the relay sets it from the database's setting)."""

    def __init__(self):
        self.allow_metadata_addresses = False

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        if self.allow_metadata_addresses:
            return super().connect_tcp(host, port, timeout, local_address, socket_options)
        try:
            addresses = list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, port,
                                                                                   type=socket.SOCK_STREAM)))
        except OSError as error:
            raise httpcore.ConnectError(f"cannot resolve {host}: {error}") from error
        refused = next((address for address in addresses if is_metadata_address(address)), None)
        if refused is not None:
            raise httpcore.ConnectError(
                f"{host} resolves to {refused}, a link-local or cloud metadata address: not connected to (an "
                "operator allows it with the database setting broker.allow_metadata_addresses); the messages wait")
        failure = httpcore.ConnectError(f"{host} resolves to no address")
        for address in addresses:
            try:
                return super().connect_tcp(address, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as error:
                failure = error
        raise failure


def checked_client(connections: CheckedConnections, timeout_s: float, verify) -> httpx.Client:
    """An httpx client whose connections go through the checks.  It connects directly: a proxy from the
    environment would resolve the host itself, out of the checks' reach."""
    transport = httpx.HTTPTransport(verify=verify)
    transport._pool._network_backend = connections  # httpx names no network backend of its own
    return httpx.Client(timeout=timeout_s, transport=transport)


def client_for_peers(connection: Connection, timeout_s: float, verify) -> httpx.Client:
    """A checked client for a one-off look at the peers (broker diagnose, GET /v1/diagnose), allowing metadata
    addresses as the database's setting does now."""
    connections = CheckedConnections()
    allowed = connection.execute(queries.QUERIES["metadata_addresses_allowed"]).scalar_one()
    connections.allow_metadata_addresses = allowed
    return checked_client(connections, timeout_s, verify)
