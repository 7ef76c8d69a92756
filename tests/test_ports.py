"""Rendezvous ports: drawn below the kernel's ephemeral range (where no ``bind(0)`` listener or
outgoing connection can take them between the choice and the launcher's bind) and reserved
against other Frenzy processes on the host."""
from __future__ import annotations

import os
import socket
import time

import pytest

from trainer import ports


class Draws:
    """Stands in for ``random.SystemRandom``: hands out the given ports in order."""

    def __init__(self, sequence):
        self.sequence = list(sequence)

    def __call__(self):
        return self

    def randint(self, low, high):
        port = self.sequence.pop(0)
        assert low <= port <= high
        return port


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "reservations_dir", lambda: tmp_path)
    return tmp_path


def test_ports_come_from_below_the_ephemeral_range_and_are_free(folder):
    low = ports.ephemeral_low()
    assert low > ports.PORT_FLOOR        # Linux's default 32768 here
    drawn = [ports.free_port() for _ in range(40)]
    assert all(ports.PORT_FLOOR <= p < low for p in drawn)
    assert len(set(drawn)) == len(drawn)                 # each one reserved for its launch
    assert sorted(int(f.name) for f in folder.iterdir()) == sorted(drawn)
    with socket.socket() as s:
        s.bind((ports.LOOPBACK, drawn[-1]))              # really free


def test_a_port_another_process_reserved_or_listens_on_is_skipped(folder, monkeypatch):
    taken, listened, free = 23456, 23457, 23458
    (folder / str(taken)).write_text("")                 # a fresh reservation of another process
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((ports.LOOPBACK, listened))
        except OSError:
            pytest.skip(f"port {listened} is in use on this host")
        server.listen(1)
        monkeypatch.setattr(ports.random, "SystemRandom", Draws([taken, listened, free]))
        assert ports.free_port() == free


def test_a_stale_reservation_is_taken_over_and_old_ones_are_swept(folder, monkeypatch):
    stale, old = 24001, 24002
    for port in (stale, old):
        (folder / str(port)).write_text("")
        past = time.time() - ports.RESERVATION_S - 1
        os.utime(folder / str(port), (past, past))
    monkeypatch.setattr(ports.random, "SystemRandom", Draws([stale]))
    assert ports.free_port() == stale
    assert sorted(f.name for f in folder.iterdir()) == [str(stale)]


def test_without_room_below_the_ephemeral_range_the_kernel_chooses(folder, monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.PORT_FLOOR)
    port = ports.free_port()
    assert port > 0 and list(folder.iterdir()) == []
