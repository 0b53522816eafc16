"""The test helpers' port choice (``brokerha.testing.free_base_port``)."""

from __future__ import annotations

import socket

import pytest

from brokerha import testing
from brokerha.cluster.ports import ADMIN_OFFSET, CLUSTER_OFFSET, TXLOG_OFFSET

ALL = (0, ADMIN_OFFSET, CLUSTER_OFFSET, TXLOG_OFFSET)


def test_every_port_of_a_txlog_cluster_is_free_and_below_the_ephemeral_range() -> None:
    """A TxLog master listens on AMQP + 30000: that port must not be an outgoing one's."""
    low = testing._ephemeral_low()
    for _ in range(20):
        base = testing.free_base_port(3, ALL)
        for port in (base + i + off for i in range(3) for off in ALL):
            assert 2000 <= port < low
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        candidates = iter([port - TXLOG_OFFSET, port - TXLOG_OFFSET, 2500])

        class Fixed:
            def randrange(self, lo: int, hi: int) -> int:
                return next(candidates)

        monkeypatch.delenv(testing.STRIPE_ENV, raising=False)
        monkeypatch.setattr("random.Random", Fixed)
        monkeypatch.setattr(testing, "_ephemeral_low", lambda: port + 1 + 3)
        assert testing.free_base_port(1, ALL) == 2500
    finally:
        taken.close()


def test_offsets_that_reach_the_ephemeral_range_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testing, "_ephemeral_low", lambda: 32000)
    with pytest.raises(ValueError, match="ephemeral"):
        testing.free_base_port(3, ALL)


def test_two_stripes_never_share_a_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scripts/pytest_jobs.py``'s two sessions: whatever each picks, with every offset,
    no port of one is a port of the other (a CI run started two nodes on one port)."""
    taken: list[set[int]] = []
    for k in (0, 1):
        monkeypatch.setenv(testing.STRIPE_ENV, f"{k}/2")
        ports: set[int] = set()
        for count, offsets in ((6, ALL[:3]), (3, ALL), (1, (0,)), (10, (0,))):
            for _ in range(50):
                base = testing.free_base_port(count, offsets)
                ports.update(base + i + off for i in range(count) for off in offsets)
        taken.append(ports)
    assert taken[0] and taken[1] and not taken[0] & taken[1]
    monkeypatch.setenv(testing.STRIPE_ENV, "2/2")
    with pytest.raises(ValueError, match="k must be"):
        testing.free_base_port(1)
    monkeypatch.setenv(testing.STRIPE_ENV, "0/3")  # 10000 is no multiple of 300
    with pytest.raises(ValueError, match="do not fit"):
        testing.free_base_port(1)

