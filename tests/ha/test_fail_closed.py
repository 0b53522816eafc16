"""Fail closed at the seam of the HA role and the clients (issue 32).

A node that had just lost its lease accepted connections and answered
``tx.commit-ok`` on its local fsync alone: the shell read its role from a
flag a spawned task cleared later, and once the primary role was gone no
barrier but the local sync stood between a commit and its answer. These
tests drive the product's objects: the broker's durability gate
(``Broker.after_durable``), the ``ClientAdmission`` and the ``HAMember``
in the simulated datacenter (virtual clock, the shell's accept path).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from brokerha.broker.broker import Broker
from brokerha.cluster import election as el
from brokerha.ha.admission import Admission, ClientAdmission, Unsafe
from brokerha.ha.simulation.disk import DiskStore
from brokerha.ha.simulation.world import Faults, SimConnection, World


class Gate:
    def __init__(self, term: int | None) -> None:
        self.now: int | None = term
        self.lapsed_term: int | None = None  # its lease lapsed, the role not ended
        self.refusals = 0
        self.deferred: list[Callable[[], None]] = []

    def term(self) -> int | None:
        return self.now

    def lapsed(self) -> int | None:
        return self.lapsed_term

    def defer(self, release: Callable[[], None]) -> None:
        self.deferred.append(release)

    def refused(self) -> None:
        self.refusals += 1


def gated_broker(term: int | None) -> tuple[Broker, DiskStore, Gate]:
    store = DiskStore()
    broker = Broker("n1", store=store)
    gate = Gate(term)
    broker.durability_gate = gate
    return broker, store, gate


# -- the broker's durability gate ------------------------------------------------------------


def test_a_member_that_does_not_serve_confirms_nothing_not_even_on_its_own_disk() -> None:
    broker, store, gate = gated_broker(None)
    answered: list[str] = []
    broker.after_durable(lambda: answered.append("commit-ok"))
    store.sync()
    assert answered == [] and gate.refusals == 1 and broker.durable_refused == 1


def test_a_confirm_whose_term_ended_before_it_was_due_is_never_answered() -> None:
    broker, store, gate = gated_broker(3)
    answered: list[str] = []
    broker.after_durable(lambda: answered.append("commit-ok"))
    gate.now = None  # the role ended while the disk synced (deposed, lease ran out)
    store.sync()
    assert answered == [] and gate.refusals == 1


def test_a_new_term_does_not_answer_what_an_old_one_was_asked() -> None:
    broker, store, gate = gated_broker(3)
    answered: list[str] = []
    broker.after_durable(lambda: answered.append("commit-ok"))
    gate.now = 5  # deposed and elected again meanwhile: that client's connection is gone
    store.sync()
    assert answered == [] and gate.refusals == 1


def test_the_serving_term_answers_once_its_barriers_passed() -> None:
    broker, store, gate = gated_broker(3)
    held: list[object] = []
    broker.replication_barriers.append(held.append)  # a backup's acknowledgement
    answered: list[str] = []
    broker.after_durable(lambda: answered.append("commit-ok"))
    store.sync()
    assert answered == []
    held.pop()()  # type: ignore[operator]
    assert answered == ["commit-ok"] and gate.refusals == 0


def test_without_any_barrier_a_gated_broker_still_asks_the_gate() -> None:
    """What broke: with the primary's barriers removed, only the local sync was left."""
    broker, store, gate = gated_broker(3)
    answered: list[str] = []
    broker.after_durable(lambda: answered.append("a"))
    gate.now = None
    broker.after_durable(lambda: answered.append("b"))
    store.sync()
    assert answered == [] and gate.refusals == 2


# -- the client admission ------------------------------------------------------------------


class Link:
    def __init__(self) -> None:
        self.closed = 0

    def force_close(self) -> None:
        self.closed += 1


def test_a_connection_is_served_only_while_the_member_serves_the_term_the_shell_opened() -> None:
    term: list[int | None] = [None]
    adm = ClientAdmission(lambda: term[0])
    assert adm.decide(can_relay=True) is Admission.RELAY
    assert adm.decide(can_relay=False) is Admission.REFUSE
    term[0] = 4
    assert adm.decide(can_relay=True) is Admission.RELAY  # elected, the shell not open yet
    assert adm.open(4) and adm.decide(can_relay=True) is Admission.SERVE
    a = Link()
    assert adm.admit(a) and adm.connections == {a: 4}
    term[0] = None  # the lease ran out: the member's answer changes at once
    b = Link()
    assert not adm.admit(b) and adm.refused == 1
    assert adm.decide(can_relay=False) is Admission.REFUSE
    assert not adm.open(4)  # the shell cannot open a term the member no longer serves


def test_closing_the_role_closes_every_connection_in_the_same_step() -> None:
    term: list[int | None] = [2]
    adm = ClientAdmission(lambda: term[0])
    adm.open(2)
    links = [Link() for _ in range(3)]
    for link in links:
        assert adm.admit(link)
    adm.gone(links[0])
    assert adm.close() == links[1:]
    assert [link.closed for link in links] == [0, 1, 1] and adm.connections == {}
    assert adm.opened is None and not adm.admit(Link())  # until the shell opens again


def test_the_lagging_role_mutant_keeps_a_connection_admitted_after_the_role_ended() -> None:
    """The race as it was: what a later turn closes is what it knew of at the role change."""
    later: list[tuple[float, object]] = []
    adm = ClientAdmission(lambda: 2, later=lambda d, cb: later.append((d, cb)),
                          unsafe=Unsafe(lagging_role=True))
    adm.open(2)
    old, late = Link(), Link()
    adm.admit(old)
    assert adm.close() == []
    assert adm.admit(late)  # accepted in the same loop turn as the lease loss
    later.pop()[1]()  # type: ignore[operator]
    assert old.closed == 1 and late.closed == 0 and late in adm.connections


# -- the member, in the simulated datacenter ------------------------------------------------


def settled_world() -> tuple[World, str]:
    faults = Faults(rate=0.0, spike_p=0.0, detect=(0.01, 0.01), redial=(0.01, 0.01))
    world = World(11, faults=faults)
    world.start()
    world.run_until(3.0)
    assert world.serving_now is not None
    return world, world.serving_now.name


def connect(world: World, name: str) -> list[SimConnection]:
    got: list[SimConnection] = []
    world.connect(name, got.append)
    world.run_until(world.now + 0.05)
    return got


def test_the_member_serves_clients_of_its_term_and_a_backup_relays_them() -> None:
    world, p = settled_world()
    primary = world.nodes[p]
    assert primary.ha.term() == primary.election.epoch
    backup = next(n for n in world.nodes.values() if n.name != p)
    assert backup.ha.term() is None and backup.ha.clients.decide(True) is Admission.RELAY
    (conn,) = connect(world, backup.name)  # relayed: served by the primary
    assert conn.node is primary and conn.open


def test_a_primary_whose_lease_ran_out_serves_nobody_before_its_tick_notices() -> None:
    world, p = settled_world()
    node = world.nodes[p]
    (conn,) = connect(world, p)
    world.pause(node, 1.0)  # SIGSTOP: no tick, no input
    world.run_until(world.now + 0.9)
    world.now += 0.2        # resumed at this instant, before any event ran
    assert node.election.role == "primary" and node.ha.term() is None
    assert node.ha.clients.decide(can_relay=False) is Admission.REFUSE
    answered: list[str] = []
    node.broker.after_durable(lambda: answered.append("commit-ok"))
    world.run_soon()
    assert answered == []   # waits (a lapse): answered only if renewed in this term
    world.run_until(world.now + 1.0)  # a successor was elected meanwhile: it is deposed
    assert answered == [] and node.election.role != "primary" and not conn.open


def test_an_expired_lease_is_renewed_only_within_the_lapse() -> None:
    """A late acknowledgement renews a lapsed lease (the durability gate waited, refused
    nothing); past ``lapse_timeout`` the primary steps down before reading anything."""
    timing = el.ElectionTiming()

    def primary_in_lease() -> el.Election:
        e = el.Election("n1", ["n1", "n2", "n3"], epoch=1, voted_for="n1",
                        position=el.Position(1, 0), timing=timing, rng=random.Random(1))
        e._role, e._primary, e._lease_expiry = "primary", "n1", 10.0
        e._next_heartbeat = math.inf
        return e

    e = primary_in_lease()
    assert e.lapsed(10.1) and not e.lease_valid(10.1)
    ack = el.HeartbeatAck(1, "n2", 9.9, 1, 0, True)  # stamped in time, read after the expiry
    assert e.receive(10.1, "n2", ack) == []
    assert e.role == "primary" and e.lease_valid(10.1) and not e.lapsed(10.1)
    e = primary_in_lease()
    late = 10.0 + e.lapse_timeout + 0.01
    actions = e.receive(late, "n2", el.HeartbeatAck(1, "n2", late - 0.05, 1, 0, True))
    assert any(isinstance(a, el.StopServing) for a in actions)
    assert e.role != "primary" and not e.lease_valid(late)


def test_a_confirm_due_while_the_lease_lapsed_waits_for_its_renewal() -> None:
    """A stall past the lease without a step-down (``Election.lapsed``): the answer waits,
    and goes out only if the lease is renewed in the same term."""
    broker, store, gate = gated_broker(3)
    answered: list[str] = []
    broker.after_durable(lambda: answered.append("first"))
    gate.now, gate.lapsed_term = None, 3  # the loop stalled past the lease
    broker.after_durable(lambda: answered.append("asked while lapsed"))
    store.sync()
    assert answered == [] and gate.refusals == 0 and len(gate.deferred) == 2
    gate.now, gate.lapsed_term = 3, None  # a majority acknowledged a heartbeat again
    for release in gate.deferred:
        release()
    assert answered == ["first", "asked while lapsed"]


def test_a_confirm_waiting_out_a_lapse_is_never_answered_if_the_role_ends() -> None:
    broker, store, gate = gated_broker(3)
    answered: list[str] = []
    broker.after_durable(lambda: answered.append("commit-ok"))
    gate.now, gate.lapsed_term = None, 3
    store.sync()
    gate.lapsed_term = None  # stepped down (or deposed): the term is over
    for release in gate.deferred:
        release()
    assert answered == [] and gate.refusals == 1


# -- what a client sees on the wire of a gated broker ------------------------------------------


def test_a_durable_declare_is_answered_once_durable_and_the_channel_waits_behind_it() -> None:
    from pamqp import commands

    from tests.amqp.wire import Wire, make_broker

    broker = make_broker()
    gate = Gate(1)
    broker.durability_gate = gate
    held: list[object] = []
    broker.replication_barriers.append(held.append)  # the backups' acknowledgement
    w = Wire(broker).connected()
    w.method(1, commands.Queue.Declare(queue="d", durable=True))
    w.method(1, commands.Queue.Declare(queue="t"))  # behind it on the channel
    assert w.methods() == []
    held.pop()()  # type: ignore[operator]
    assert [type(m) for m in w.methods()] == [commands.Queue.DeclareOk] * 2
    gate.now = None  # the role ended: a durable declare is never answered
    w.method(1, commands.Exchange.Declare(exchange="x", exchange_type="fanout", durable=True))
    w.method(1, commands.Tx.Select())
    assert w.methods() == [] and gate.refusals == 1
