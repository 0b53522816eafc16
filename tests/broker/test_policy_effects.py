"""Policies acting on queues and exchanges (broker/policy_effects.py), with a virtual clock."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from brokerha.backup.timers import hold_all_timers, resume_timers
from brokerha.broker.broker import Broker
from brokerha.broker.policies import OPERATOR_POLICY, POLICY, Policy
from brokerha.broker.policy_effects import PolicyEffects
from tests.broker.test_queues import Clock, drain, msg


def setup() -> tuple[Broker, Clock, PolicyEffects]:
    clock = Clock()
    broker = Broker("t", clock=clock)
    broker.add_vhost("v")
    return broker, clock, PolicyEffects(broker)


def pol(name: str, pattern: str, priority: int = 0, apply_to: str = "all",
        **definition: object) -> Policy:
    return Policy("v", name, pattern, {k.replace("_", "-"): v for k, v in definition.items()},
                  priority, apply_to)


def test_a_queue_declared_without_arguments_obeys_message_ttl_and_max_length() -> None:
    broker, clock, effects = setup()
    effects.set_policy(POLICY, pol("p", "^pol\\.", message_ttl=1000, max_length=2))
    vh = broker.vhosts["v"]
    q = vh.declare_queue("pol.q", owner=None)
    other = vh.declare_queue("other", owner=None)
    for body in (b"1", b"2", b"3"):
        q.enqueue(msg(body))
        other.enqueue(msg(body))
    assert q.message_count == 2 and other.message_count == 3
    clock.now += 1.1
    broker.tick()
    assert q.message_count == 0 and other.message_count == 3
    assert effects.applied(q).policy_name == "p"
    assert effects.applied(other).policy is None


def test_lowering_max_length_trims_an_existing_queue_at_once_into_its_dlx() -> None:
    broker, _, effects = setup()
    vh = broker.vhosts["v"]
    dlq = vh.declare_queue("dlq", owner=None)
    vh.bind("amq.fanout", dlq, "")
    q = vh.declare_queue("pol.q", owner=None, arguments={"x-dead-letter-exchange": "amq.fanout"})
    for i in range(10):
        q.enqueue(msg(str(i).encode()))
    effects.set_policy(POLICY, pol("p", "^pol\\.", max_length=3))
    assert drain(q) == [b"7", b"8", b"9"]
    assert dlq.message_count == 7
    assert dlq.get().message.headers["x-death"][0]["reason"] == "maxlen"  # type: ignore[union-attr]


def test_clearing_a_policy_lifts_its_limit() -> None:
    broker, _, effects = setup()
    effects.set_policy(POLICY, pol("p", "^pol\\.", max_length=1))
    q = broker.vhosts["v"].declare_queue("pol.q", owner=None)
    q.enqueue(msg(b"1"))
    q.enqueue(msg(b"2"))
    assert q.message_count == 1
    effects.clear_policy(POLICY, "v", "p")
    q.enqueue(msg(b"3"))
    assert drain(q) == [b"2", b"3"]
    assert effects.applied(q).policy is None


def test_a_big_trim_runs_in_slices_and_a_publish_meanwhile_drops_one() -> None:
    broker, _, effects = setup()
    pending: list[Callable[[], None]] = []
    broker.background.schedule = pending.append
    broker.background.entries = 100
    broker.background.seconds = 0.0  # one step of 100 per loop turn
    q = broker.vhosts["v"].declare_queue("pol.q", owner=None)
    for i in range(1000):
        q.enqueue(msg(str(i).encode()))
    effects.set_policy(POLICY, pol("p", "^pol\\.", max_length=10))
    assert q.message_count == 900  # one slice in the caller's turn
    pending.pop(0)()  # one loop turn: one more
    assert q.message_count == 800
    before = q.message_count
    q.enqueue(msg(b"new"))
    assert q.message_count == before  # the publish dropped one, not the rest of the trim
    while pending:
        pending.pop(0)()
    assert q.message_count == 10 and q.max_length == 10
    assert drain(q)[-1] == b"new"


def test_reject_publish_is_not_trimmed_and_refuses() -> None:
    broker, _, effects = setup()
    q = broker.vhosts["v"].declare_queue("pol.q", owner=None)
    for i in range(5):
        q.enqueue(msg(str(i).encode()))
    effects.set_policy(POLICY, pol("p", "^pol\\.", max_length=2, overflow="reject-publish"))
    assert q.message_count == 5
    assert not q.enqueue(msg(b"refused"))


def test_arguments_win_or_the_smaller_value_wins_as_rabbitmqs() -> None:
    broker, _, effects = setup()
    effects.set_policy(POLICY, pol("p", ".", max_length=5, message_ttl=100,
                                   dead_letter_exchange="theirs", overflow="reject-publish"))
    q = broker.vhosts["v"].declare_queue("q", owner=None, arguments={
        "x-max-length": 10, "x-message-ttl": 50, "x-dead-letter-exchange": "mine",
        "x-overflow": "drop-head"})
    assert (q.max_length, q.message_ttl, q.dead_letter_exchange, q.overflow) == (
        5, 50, "mine", "drop-head")


def test_the_operator_policy_caps_the_users() -> None:
    broker, _, effects = setup()
    effects.set_policy(POLICY, pol("p", ".", max_length=100, message_ttl=60000))
    effects.set_policy(OPERATOR_POLICY, pol("o", ".", max_length=3))
    q = broker.vhosts["v"].declare_queue("q", owner=None)
    assert (q.max_length, q.message_ttl) == (3, 60000)
    applied = effects.applied(q)
    assert (applied.policy_name, applied.operator_policy_name) == ("p", "o")
    assert applied.definition == {"max-length": 3, "message-ttl": 60000}


def test_a_new_expires_counts_from_now() -> None:
    broker, clock, effects = setup()
    vh = broker.vhosts["v"]
    vh.declare_queue("q", owner=None)
    clock.now += 100
    effects.set_policy(POLICY, pol("p", ".", apply_to="queues", expires=2000))
    broker.tick()
    assert "q" in vh.queues
    clock.now += 2.1
    broker.tick()
    assert "q" not in vh.queues


def test_an_exchange_takes_the_policys_alternate_exchange_its_argument_wins() -> None:
    broker, _, effects = setup()
    vh = broker.vhosts["v"]
    plain = vh.declare_exchange("plain", "direct")
    own = vh.declare_exchange("own", "direct", arguments={"alternate-exchange": "mine"})
    effects.set_policy(POLICY, pol("ae", ".", apply_to="exchanges", alternate_exchange="ae"))
    assert plain.alternate == "ae" and own.alternate == "mine"
    ae_q = vh.declare_queue("caught", owner=None)
    vh.bind("amq.fanout", ae_q, "")
    effects.set_policy(POLICY, pol("ae", ".", apply_to="exchanges",
                                   alternate_exchange="amq.fanout"))
    assert vh.route(plain, msg(rk="nowhere")) == [ae_q]
    effects.clear_policy(POLICY, "v", "ae")
    assert plain.alternate is None


def test_a_backups_queues_take_the_settings_but_keep_no_time_and_trim_nothing() -> None:
    broker, clock, effects = setup()
    vh = broker.vhosts["v"]
    q = vh.declare_queue("pol.q", owner=None)
    for i in range(5):
        q.enqueue(msg(str(i).encode()))
    hold_all_timers(broker)
    effects.set_policy(POLICY, pol("p", "^pol\\.", max_length=2, message_ttl=10))
    assert q.max_length == 2 and q.message_ttl == 10
    assert q.message_count == 5 and q not in vh.timed_queues  # the primary's dequeues decide
    resume_timers(broker, clock())  # promoted
    assert q in vh.timed_queues


def test_a_global_queue_takes_no_local_only_keys() -> None:
    broker, _, effects = setup()
    effects.set_policy(POLICY, pol("p", ".", max_length=1, message_ttl=10,
                                   dead_letter_exchange="dlx"))
    q = broker.vhosts["v"].declare_queue("g", owner=None, arguments={"x-global": True})
    assert (q.max_length, q.message_ttl, q.dead_letter_exchange) == (None, None, "dlx")


def test_recovered_queues_get_their_policies_from_apply_all() -> None:
    broker, _, effects = setup()
    effects.book.set(POLICY, pol("p", ".", max_length=4))
    q = broker.vhosts["v"].declare_queue("q", owner=None)
    q.max_length = None  # as recovery leaves it (restore_queue calls no observer)
    effects.apply_all()
    assert q.max_length == 4


def test_ha_replicate_resolves_with_the_argument_winning() -> None:
    broker, _, effects = setup()
    effects.set_policy(POLICY, pol("r", "^tmp\\.", ha_replicate="none"))
    vh = broker.vhosts["v"]
    assert effects.replicate(vh.declare_queue("tmp.a", owner=None)) == "none"
    assert effects.replicate(vh.declare_queue("tmp.b", owner=None,
                                              arguments={"x-ha-replicate": "all"})) == "all"
    assert effects.replicate(vh.declare_queue("keep", owner=None)) is None


def test_definition_changes_set_and_clear_policies() -> None:
    """A listener of broker/definitions.py: the primary's API, a backup's replication and
    recovery all come as these changes, so every node derives the same effective policy."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Change:
        kind: str
        key: tuple[str, ...]
        value: dict[str, object] | None

    broker, _, effects = setup()
    q = broker.vhosts["v"].declare_queue("pol.q", owner=None)
    value = {"pattern": "^pol\\.", "apply-to": "queues", "definition": {"max-length": 2},
             "priority": 0}
    effects.definition_changed(Change("vhost", ("v",), {"description": ""}))  # not a policy
    effects.definition_changed(Change(POLICY, ("v", "p"), value))
    effects.definition_changed(Change(OPERATOR_POLICY, ("v", "o"), {**value, "definition": {
        "max-length": 1}}))
    assert q.max_length == 1 and effects.applied(q).policy_name == "p"
    effects.definition_changed(Change(OPERATOR_POLICY, ("v", "o"), None))
    assert q.max_length == 2
    effects.definition_changed(Change(POLICY, ("v", "p"), None))
    assert q.max_length is None and effects.book.list(POLICY) == []


@given(st.lists(st.one_of(st.tuples(st.just("publish"), st.integers(1, 30)),
                          st.tuples(st.just("policy"), st.integers(0, 20)),
                          st.tuples(st.just("operator"), st.integers(0, 20)),
                          st.tuples(st.just("clear"), st.integers(0, 1))), max_size=25),
       st.one_of(st.none(), st.integers(0, 20)))
def test_a_drop_head_queue_never_holds_more_than_its_effective_limit(
        steps: list[tuple[str, int]], argument: int | None) -> None:
    broker, _, effects = setup()
    broker.background.entries = 7  # trims of more than 7 go on in slices (no loop: at once)
    args = {} if argument is None else {"x-max-length": argument}
    q = broker.vhosts["v"].declare_queue("pol.q", owner=None, arguments=args)
    sent = 0
    for action, n in steps:
        if action == "publish":
            for _ in range(n):
                sent += 1
                q.enqueue(msg(str(sent).encode()))
        elif action == "policy":
            effects.set_policy(POLICY, pol("p", "^pol", max_length=n))
        elif action == "operator":
            effects.set_policy(OPERATOR_POLICY, pol("o", ".", max_length=n))
        else:
            effects.clear_policy(OPERATOR_POLICY if n else POLICY, "v", "o" if n else "p")
        limits = [v for v in (argument, effects.applied(q).definition.get("max-length"))
                  if v is not None]
        expected = min(limits) if limits else None
        assert q.max_length == expected
        if expected is not None:
            assert q.message_count <= expected
    kept = [int(body) for body in drain(q)]
    assert kept == list(range(sent - len(kept) + 1, sent + 1))  # the newest, in order
