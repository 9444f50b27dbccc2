"""free_port hands out ports that an outgoing connection cannot take before a server binds them."""
import socket

from broker.cli.processes import EPHEMERAL_PORTS, PORTS_FROM, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_ones():
    first_ephemeral = int(EPHEMERAL_PORTS.read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(PORTS_FROM <= port < first_ephemeral for port in ports)
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports[-1]))  # free when handed out
