"""`free_port`: a port that nothing else takes unasked between the pick and its owner's bind."""

import socket
from pathlib import Path

from refit.sharding.process_group import free_port


def test_free_port_is_bindable_and_below_the_ephemeral_range_that_outgoing_connections_draw_from():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn at random, so two tests' servers do not race for one port
    for port in ports:
        assert 20000 <= port < low or low <= 21000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
