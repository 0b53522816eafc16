"""Authentication, vhost access and per-vhost permissions (users from conftest.ACCESS)."""

from __future__ import annotations

import pika
import pytest

from .support import channel_error, get_bodies

pytestmark = pytest.mark.timeout(30)


def connect_as(broker, user: str, password: str, vhost: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(broker.params(user, password, vhost))


@pytest.fixture
def alice(broker_with_users):
    conn = connect_as(broker_with_users, "alice", "secret", "vh1")
    yield conn
    if conn.is_open:
        conn.close()


@pytest.mark.parametrize("user,password", [("guest", "wrong"), ("nobody", "secret")])
def test_bad_credentials_are_403_access_refused(broker_with_users, user, password):
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as info:
        connect_as(broker_with_users, user, password, "/")
    # pika folds the broker's connection.close into the message
    assert "(403) 'ACCESS_REFUSED - Login was refused using authentication mechanism " \
           "PLAIN" in str(info.value.args[0])


def test_unknown_vhost_is_530_not_allowed(broker_with_users):
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as info:
        connect_as(broker_with_users, "guest", "guest", "no-such-vhost")
    assert "(530) 'NOT_ALLOWED - vhost no-such-vhost not found'" in str(info.value.args[0])


@pytest.mark.parametrize("user,password,vhost", [
    ("bob", "hunter2", "vh1"),     # a user without any permissions
    ("alice", "secret", "/"),      # permissions on vh1 only
    ("guest", "guest", "vh1"),     # guest only has "/"
])
def test_vhost_without_permissions_is_530(broker_with_users, user, password, vhost):
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as info:
        connect_as(broker_with_users, user, password, vhost)
    assert f"NOT_ALLOWED - access to vhost '{vhost}' refused for user '{user}'" in \
        str(info.value.args[0])


def test_url_with_vhost_works(broker_with_users, names):
    conn = pika.BlockingConnection(pika.URLParameters(
        broker_with_users.url_for("alice", "secret", "vh1")))
    conn.channel().queue_declare(names(prefix="alice-"), exclusive=True)
    conn.close()


def test_permitted_operations_succeed(alice, names):
    ch = alice.channel()
    q, x = names(prefix="alice-"), names("x", prefix="alice-")
    ch.queue_declare(q)
    ch.exchange_declare(x, "fanout")
    ch.queue_bind(q, x)                        # write on queue, read on exchange
    ch.queue_bind(q, "amq.direct", "k")        # reading amq.direct is allowed
    ch.basic_publish(x, "", b"m")              # write on alice-x
    assert get_bodies(ch, q) == [b"m"]         # read on queue
    ch.queue_delete(q)
    ch.exchange_delete(x)


def test_declare_outside_configure_pattern_is_403(alice, names):
    q = names()
    with channel_error(403, f"ACCESS_REFUSED - access to queue '{q}' in vhost 'vh1' "
                            "refused for user 'alice'"):
        alice.channel().queue_declare(q)
    assert alice.is_open  # a channel error, not a connection error


def test_server_named_queue_needs_configure_on_amq_gen_name(alice):
    with channel_error(403, "ACCESS_REFUSED - access to queue 'amq.gen-"):
        alice.channel().queue_declare("", exclusive=True)


@pytest.mark.parametrize("exchange", ["amq.fanout", ""], ids=["amq.fanout", "default"])
def test_publish_outside_write_pattern_is_403(alice, names, exchange):
    ch = alice.channel()
    q = names(prefix="alice-")
    ch.queue_declare(q)
    ch.basic_publish(exchange, q, b"x")
    # the default exchange is checked as 'amq.default'
    shown = exchange or "amq.default"
    with channel_error(403, f"ACCESS_REFUSED - access to exchange '{shown}' in vhost 'vh1' "
                            "refused for user 'alice'"):
        ch.queue_declare(q, passive=True)
