"""Ports for servers started later by other processes: free, distinct, and out of the kernel's ephemeral range."""

import socket
from types import SimpleNamespace

from bench import ports
from bench.ports import FIRST_PORT, _ephemeral_start, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = free_ports(32)
    assert len(set(ports)) == 32 and all(FIRST_PORT <= port < _ephemeral_start() for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    """The held port is drawn first (and again), and each time passed over for the next free one."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_ports(1)[0]))
        held.listen()
        taken = held.getsockname()[1]
        spare = next(port for port in free_ports(2) if port != taken)
        draws = iter([taken, taken, spare])
        monkeypatch.setattr(ports.random, "SystemRandom", lambda: SimpleNamespace(randrange=lambda lo, hi: next(draws)))
        assert free_ports(1) == [spare]
