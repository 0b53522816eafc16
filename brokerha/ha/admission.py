"""Which client connections a node serves: the seam between its HA role and its listeners.

Sans-I/O. The node's asyncio shell (``node/server.py``, ``node/transport.py``)
and the HA simulation (``ha/simulation/world.py``) drive the same object, so
the rule that broke once (issue 32: a node that had just lost its lease
accepted a connection and answered ``tx.commit-ok`` on its local fsync) is
simulated where it lives. The rules:

- **The role is read, never copied.** Whether this node serves clients is
  ``serving_term()`` -- the HA member's answer at that instant (the serving
  primary of its epoch, verified, within its lease) -- and the shell's own
  readiness for *that* term (``open``: listeners and the TxLog master are up).
  No flag a task sets later stands in for it.
- **A connection is served only if it is admitted** (``admit``) when the
  transport hands it over (``connection_made``, after a TLS handshake or a
  relay's preamble too), with the term it was admitted in. A connection the
  node cannot serve at that instant is relayed to the primary or refused
  (``decide``), never served.
- **The role change and the closing of every client connection are one step**
  (``close``): called from the member's ``demoted`` effect, synchronously,
  before anything else can run on the node; from then until the next
  ``open`` nothing is admitted.

Confirms are gated the same way in the broker (``Broker.durability_gate``, the
member's ``term``): a connection that somehow outlived its term still gets no
answer that claims durability.

``Unsafe.lagging_role`` reintroduces the race on purpose (simulations only):
the role is read from a flag that a task clears ``LAGGING_TURN`` later (a
loaded loop's turn: 45 ms in the partition test of issue 32), and
connections admitted meanwhile are never closed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from brokerha.seed_runner import UnsafeRules

LAGGING_TURN = 0.05  # Unsafe.lagging_role: how late the old shell's task ran


class ClientLink(Protocol):
    """One client connection as the admission sees it."""

    def force_close(self) -> None:
        """Tell the client 320 CONNECTION_FORCED and drop the connection now."""


class NodeAdmission(Protocol):
    """What the node's shell asks of the object deciding which connections it serves:
    ``ClientAdmission`` of its one member, or a partitioned node's over its groups
    (``partition/clients.py``, ``GroupClients``)."""

    @property
    def opened(self) -> int | None: ...

    @property
    def serving(self) -> bool: ...

    @property
    def connections(self) -> Mapping[ClientLink, int]: ...

    refused: int

    def decide(self, can_relay: bool) -> Admission: ...

    def admit(self, link: ClientLink) -> bool: ...

    def gone(self, link: ClientLink) -> None: ...

    def open(self, term: int) -> bool: ...


class Admission(enum.Enum):
    SERVE = "serve"    # a client of this node
    RELAY = "relay"    # forwarded to the primary (node/relay.py)
    REFUSE = "refuse"  # closed at once: the client tries its next URL


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of the admission to break on purpose (simulations only): each must be caught."""

    lagging_role: bool = False  # the role read from a flag cleared a loop turn late (issue 32)


class ClientAdmission:
    def __init__(self, serving_term: Callable[[], int | None], *,
                 later: Callable[[float, Callable[[], None]], object] | None = None,
                 unsafe: Unsafe | None = None,
                 role_term: Callable[[], int | None] | None = None) -> None:
        self._serving_term = serving_term
        # the term whose role the node holds, its lease valid or lapsed (HAMember.role_term):
        # the shell opens for it; clients are served only while ``serving_term`` says so
        self._role_term = role_term or serving_term
        self._later = later
        self.unsafe = unsafe or Unsafe()
        self.opened: int | None = None  # the term the shell is open for (listeners, TxLog)
        self._lagging: int | None = None  # Unsafe.lagging_role's copied flag
        self.connections: dict[ClientLink, int] = {}  # served connection -> its term
        self.refused = 0  # connections handed over when this node could not serve them

    def term(self) -> int | None:
        """The term this node serves clients in at this instant, or None."""
        if self.unsafe.lagging_role:
            return self._lagging
        term = self._serving_term()
        return term if term is not None and term == self.opened else None

    @property
    def serving(self) -> bool:
        return self.term() is not None

    def decide(self, can_relay: bool) -> Admission:
        """What to do with a connection being accepted now."""
        if self.term() is not None:
            return Admission.SERVE
        return Admission.RELAY if can_relay else Admission.REFUSE

    def admit(self, link: ClientLink) -> bool:
        """The transport hands ``link`` over: serve it (True) only if this node serves now."""
        term = self.term()
        if term is None:
            self.refused += 1
            return False
        self.connections[link] = term
        return True

    def gone(self, link: ClientLink) -> None:
        self.connections.pop(link, None)

    def open(self, term: int) -> bool:
        """The shell is ready to serve ``term``; False if the node no longer holds its role
        (a lease that lapsed meanwhile does not count: it may be renewed)."""
        if self._role_term() != term:
            return False
        self.opened = self._lagging = term
        return True

    def close(self) -> list[ClientLink]:
        """The role changed: every client connection is forced closed, in this same step."""
        self.opened = None
        if self.unsafe.lagging_role and self._later is not None:
            # the old shell: a spawned task closed, a turn later, the connections it
            # knew of now; one admitted in between was never closed
            known = set(self.connections)
            self._later(LAGGING_TURN, lambda: self._close_late(known))
            return []
        self._lagging = None
        return self._close_all()

    def _close_late(self, known: set[ClientLink]) -> None:
        self._lagging = None
        self._close_all(only=known)

    def _close_all(self, only: set[ClientLink] | None = None) -> list[ClientLink]:
        closed = [link for link in self.connections if only is None or link in only]
        for link in closed:
            del self.connections[link]
            link.force_close()
        return closed
