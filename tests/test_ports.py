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
    tmp_path.chmod(0o700)
    monkeypatch.setattr(ports, "reservations_dir", lambda: tmp_path)
    return tmp_path


def reserved(folder) -> list[int]:
    return sorted(int(f.name) for f in folder.iterdir() if f.name != ports.LOCK_FILE)


def needs_free(*wanted: int) -> None:
    """Skip when a port this test names is in use on the host (another process holds it)."""
    for port in wanted:
        with socket.socket() as s:
            try:
                s.bind((ports.LOOPBACK, port))
            except OSError:
                pytest.skip(f"port {port} is in use on this host")


def test_ports_come_from_below_the_ephemeral_range_and_are_free(folder):
    high = min(ports.PORT_CEILING, ports.ephemeral_low())
    if high <= ports.PORT_FLOOR:
        pytest.skip("this host's ephemeral range leaves no room below it")
    drawn = [ports.free_port() for _ in range(40)]
    assert all(ports.PORT_FLOOR <= p < high for p in drawn)
    assert len(set(drawn)) == len(drawn)                 # each one reserved for its launch
    assert reserved(folder) == sorted(drawn)             # ports found in use keep no reservation
    with socket.socket() as s:
        s.bind((ports.LOOPBACK, drawn[-1]))              # really free


def test_a_port_another_process_reserved_or_listens_on_is_skipped(folder, monkeypatch):
    taken, listened, free = 23456, 23457, 23458
    needs_free(taken, listened, free)
    (folder / str(taken)).write_text("")                 # a fresh reservation of another process
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((ports.LOOPBACK, listened))
        server.listen(1)
        monkeypatch.setattr(ports.random, "SystemRandom", Draws([taken, listened, free]))
        assert ports.free_port() == free
    assert reserved(folder) == [taken, free]             # the listened one is not held


def test_a_stale_reservation_is_taken_over_and_old_ones_are_swept(folder, monkeypatch):
    stale, old = 24001, 24002
    needs_free(stale)
    for port in (stale, old):
        (folder / str(port)).write_text("")
        past = time.time() - ports.RESERVATION_S - 1
        os.utime(folder / str(port), (past, past))
    monkeypatch.setattr(ports.random, "SystemRandom", Draws([stale]))
    assert ports.free_port() == stale
    assert reserved(folder) == [stale]


def test_a_folder_others_can_write_is_not_used(folder):
    folder.chmod(0o777)                                  # as if another user had planted it
    port = ports.free_port()
    assert port > 0 and list(folder.iterdir()) == []


def test_without_room_below_the_ephemeral_range_the_kernel_chooses(folder, monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.PORT_FLOOR)
    port = ports.free_port()
    assert port > 0 and list(folder.iterdir()) == []
