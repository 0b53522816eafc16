"""The connection state machine, driven frame by frame without a socket."""

from __future__ import annotations

import struct

import pytest
from pamqp import commands

from brokerha.amqp import constants as C
from brokerha.amqp.frames import encode_frame
from tests.amqp.wire import Wire, make_broker


def closed_with(w: Wire, code: int) -> commands.Connection.Close:
    close = w.expect(commands.Connection.Close)
    assert close.reply_code == code, close
    return close


def test_handshake_advertises_capabilities_and_opens() -> None:
    w = Wire()
    w.raw(b"AMQP\x00\x00\x09\x01")
    start = w.expect(commands.Connection.Start)
    caps = start.server_properties["capabilities"]
    for cap in ("publisher_confirms", "exchange_exchange_bindings", "basic.nack",
                "consumer_cancel_notify", "connection.blocked",
                "authentication_failure_close", "per_consumer_qos"):
        assert caps[cap] is True
    assert set(start.mechanisms.split()) == {"PLAIN", "AMQPLAIN"}


def test_wrong_protocol_header_gets_ours_back_and_close() -> None:
    w = Wire()
    w.raw(b"AMQP\x00\x00\x08\x00")
    frames = w.frames()
    assert frames == [(0, C.PROTOCOL_HEADER)]
    assert w.conn.wants_close


def test_http_request_is_refused_like_a_bad_header() -> None:
    w = Wire()
    w.raw(b"GET / HTTP/1.1\r\n\r\n")
    assert w.frames() == [(0, C.PROTOCOL_HEADER)]
    assert w.conn.wants_close


def test_amqplain_login_works() -> None:
    w = Wire()
    w.raw(C.PROTOCOL_HEADER)
    w.frames()
    table = (b"\x05LOGINS\x00\x00\x00\x05guest" + b"\x08PASSWORDS\x00\x00\x00\x05guest")
    w.method(0, commands.Connection.StartOk(client_properties={}, mechanism="AMQPLAIN",
                                            response=table.decode("latin-1"), locale="en_US"))
    w.expect(commands.Connection.Tune)


def test_wrong_password_closes_with_403() -> None:
    w = Wire()
    w.handshake(password="nope")
    close = [m for m in w.last if isinstance(m, commands.Connection.Close)][0]
    assert close.reply_code == C.ACCESS_REFUSED
    assert "Login was refused" in close.reply_text
    assert w.conn.wants_close


def test_guest_refused_from_a_remote_address() -> None:
    w = Wire(peer="10.1.2.3")
    w.handshake()
    close = [m for m in w.last if isinstance(m, commands.Connection.Close)][0]
    assert close.reply_code == C.ACCESS_REFUSED


def test_unknown_vhost_is_530() -> None:
    w = Wire()
    w.handshake(vhost="nowhere")
    close = [m for m in w.last if isinstance(m, commands.Connection.Close)][0]
    assert close.reply_code == C.NOT_ALLOWED
    assert "vhost nowhere not found" in close.reply_text


def test_vhost_without_permission_is_530() -> None:
    broker = make_broker()
    broker.add_vhost("other")
    w = Wire(broker)
    w.handshake(vhost="other")
    close = [m for m in w.last if isinstance(m, commands.Connection.Close)][0]
    assert close.reply_code == C.NOT_ALLOWED
    assert "refused for user 'guest'" in close.reply_text


def test_frame_larger_than_frame_max_is_501() -> None:
    w = Wire().connected()
    w.raw(encode_frame(C.FRAME_BODY, 1, b"x" * 200_000))
    closed_with(w, C.FRAME_ERROR)
    assert w.conn.wants_close


def test_negotiated_frame_max_is_enforced() -> None:
    w = Wire()
    w.handshake(frame_max=8192)
    w.open_channel()
    w.raw(encode_frame(C.FRAME_BODY, 1, b"x" * 9000))
    closed_with(w, C.FRAME_ERROR)


def test_bad_frame_end_octet_is_501() -> None:
    w = Wire().connected()
    w.raw(struct.pack(">BHI", 1, 1, 4) + b"\x00\x14\x00\x28" + b"\x00")
    closed_with(w, C.FRAME_ERROR)


def test_unknown_frame_type_is_501() -> None:
    w = Wire().connected()
    w.raw(struct.pack(">BHI", 9, 1, 0) + b"\xce")
    closed_with(w, C.FRAME_ERROR)


def test_partial_frames_are_reassembled() -> None:
    w = Wire().connected()
    data = encode_frame(C.FRAME_METHOD, 1, struct.pack(">I", commands.Basic.Qos.index)
                        + commands.Basic.Qos(prefetch_count=5).marshal())
    for i in range(len(data)):
        w.raw(data[i : i + 1])
    w.expect(commands.Basic.QosOk)


def test_method_on_unopened_channel_is_504() -> None:
    w = Wire().connected()
    w.method(7, commands.Queue.Declare(queue="q"))
    closed_with(w, C.CHANNEL_ERROR)


def test_unknown_method_is_540() -> None:
    w = Wire().connected()
    w.raw(encode_frame(C.FRAME_METHOD, 1, struct.pack(">HH", 77, 5)))
    closed_with(w, C.NOT_IMPLEMENTED)


def test_server_only_method_from_client_is_503() -> None:
    w = Wire().connected()
    w.method(1, commands.Basic.Deliver(consumer_tag="x", delivery_tag=1, exchange="", routing_key="q"))
    closed_with(w, C.COMMAND_INVALID)


def test_truncated_method_arguments_are_501_cannot_decode() -> None:
    """RabbitMQ's words (rabbit_misc:frame_error): the arguments as Erlang prints them."""
    w = Wire().connected()
    w.raw(encode_frame(C.FRAME_METHOD, 1, struct.pack(">HH", 50, 10) + b"\x00"))
    close = closed_with(w, C.FRAME_ERROR)
    assert (close.reply_text, close.class_id, close.method_id) == (
        "FRAME_ERROR - cannot decode <<0>>", 50, 10)


def test_content_header_without_publish_is_505() -> None:
    w = Wire().connected()
    w.content(1, b"body")
    closed_with(w, C.UNEXPECTED_FRAME)


def test_method_in_the_middle_of_content_is_505() -> None:
    w = Wire().connected()
    w.method(1, commands.Basic.Publish(exchange="", routing_key="q"))
    w.method(1, commands.Basic.Qos(prefetch_count=1))
    closed_with(w, C.UNEXPECTED_FRAME)


def test_channel_error_closes_only_that_channel() -> None:
    w = Wire().connected()
    w.open_channel(2)
    w.method(1, commands.Queue.Declare(queue="missing", passive=True))
    close = w.expect(commands.Channel.Close)
    assert close.reply_code == C.NOT_FOUND
    assert close.class_id == 50 and close.method_id == 10
    w.method(2, commands.Queue.Declare(queue="q2"))
    w.expect(commands.Queue.DeclareOk)
    # frames on the closing channel are ignored until close-ok
    w.method(1, commands.Queue.Declare(queue="q3"))
    assert w.methods() == []
    w.method(1, commands.Channel.CloseOk())
    w.open_channel(1)


def test_client_close_gets_close_ok() -> None:
    w = Wire().connected()
    w.method(0, commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
    w.expect(commands.Connection.CloseOk)
    assert w.conn.wants_close


def test_server_shutdown_sends_320_and_waits_for_close_ok() -> None:
    w = Wire().connected()
    w.conn.shutdown()
    close = closed_with(w, C.CONNECTION_FORCED)
    assert "shutdown" in close.reply_text
    assert not w.conn.wants_close
    w.method(0, commands.Connection.CloseOk())
    assert w.conn.wants_close


def test_heartbeats_are_sent_and_a_silent_peer_is_dropped() -> None:
    w = Wire()
    w.handshake(heartbeat_s=2)
    w.frames()
    w.conn.tick(1.5)
    raw = w.conn.data_to_send()
    assert raw == b"\x08\x00\x00\x00\x00\x00\x00\xce"
    w.conn.sent(1.5)
    w.conn.tick(3.9)
    assert not w.conn.wants_close
    w.conn.tick(4.1)
    assert w.conn.wants_close
    assert w.conn.close_reason == "missed heartbeats"


def test_handshake_timeout_closes() -> None:
    w = Wire()
    w.raw(C.PROTOCOL_HEADER)
    w.conn.tick(11.0)
    assert w.conn.wants_close


def test_channel_numbers_are_free_but_open_channels_are_limited_by_channel_max() -> None:
    """As RabbitMQ: aiormq opens channel 65535 after a tune-ok of 2047, and that works."""
    w = Wire(make_broker(channel_max=2)).connected()
    w.method(65535, commands.Channel.Open())
    w.expect(commands.Channel.OpenOk)
    w.method(3000, commands.Channel.Open())
    w.method(7, commands.Channel.Open())
    close = closed_with(w, C.NOT_ALLOWED)
    assert close.reply_text == ("NOT_ALLOWED - number of channels opened (2) has reached the "
                                "negotiated channel_max (2)")


def test_oversized_message_is_406_on_the_channel() -> None:
    w = Wire(make_broker(max_message_size=10)).connected()
    w.publish(1, "", "q", b"x" * 11)
    close = w.expect(commands.Channel.Close)
    assert close.reply_code == C.PRECONDITION_FAILED
    assert "larger than configured max size 10" in close.reply_text


@pytest.mark.parametrize("garbage", [b"\x00" * 3, b"\xff" * 64, b"\x01\x00"])
def test_garbage_after_handshake_closes_cleanly(garbage: bytes) -> None:
    w = Wire().connected()
    w.raw(garbage + b"\xce" * 10)
    if w.conn.wants_close or w.conn.state == "closing":
        assert any(isinstance(m, commands.Connection.Close) for m in w.methods())


def test_memory_alarm_blocks_publishers_and_clears() -> None:
    broker = make_broker(memory_limit=1000)
    w = Wire(broker).connected()
    paused: list[bool] = []
    w.conn.on_read_paused = paused.append
    w.method(1, commands.Queue.Declare(queue="q"))
    w.publish(1, "", "q", b"x" * 1200)
    assert broker.memory_blocked
    w.expect(commands.Connection.Blocked)
    assert paused == [True]
    broker.vhosts["/"].queues["q"].purge()
    broker.check_memory()
    w.expect(commands.Connection.Unblocked)
    assert paused == [True, False]


def test_disk_and_memory_alarms_block_once_and_unblock_when_both_clear() -> None:
    broker = make_broker()
    w = Wire(broker).connected()
    paused: list[bool] = []
    w.conn.on_read_paused = paused.append
    w.method(1, commands.Queue.Declare(queue="q"))
    w.publish(1, "", "q", b"x")
    broker.set_alarm("disk", "free 10 MB, limit 50 MB")
    blocked = w.expect(commands.Connection.Blocked)
    assert blocked.reason == "low on disk" and paused == [True]
    broker.set_alarm("memory", "over the limit")  # already blocked: nothing new is sent
    assert broker.blocked_reason == "low on disk & memory"
    broker.set_alarm("disk", None)
    assert not any(isinstance(m, commands.Connection.Unblocked) for m in w.methods())
    broker.set_alarm("memory", None)
    w.expect(commands.Connection.Unblocked)
    assert paused == [True, False] and not broker.publishers_blocked


def test_a_peer_that_never_sends_close_ok_is_dropped() -> None:
    w = Wire().connected()
    w.conn.shutdown()
    closed_with(w, C.CONNECTION_FORCED)
    w.conn.tick(10.0)
    for t in (11.0, 12.0, 13.0):
        w.method(1, commands.Basic.Qos(prefetch_count=1))  # chatter keeps arriving
        w.conn.tick(t)
    assert not w.conn.wants_close
    w.conn.tick(13.5)
    assert w.conn.wants_close


def external_start_ok(w: Wire) -> None:
    w.raw(C.PROTOCOL_HEADER)
    w.frames()
    w.method(0, commands.Connection.StartOk(
        client_properties={"capabilities": {"authentication_failure_close": True}},
        mechanism="EXTERNAL", response="", locale="en_US"))


def test_external_is_offered_on_tls_only_and_logs_in_as_the_certificate_user() -> None:
    from brokerha.amqp.connection import ExternalIdentity

    w = Wire()
    external_start_ok(w)  # a plain connection: closed without an answer, as RabbitMQ does
    assert w.methods() == [] and w.conn.wants_close
    assert w.conn.close_reason == "COMMAND_INVALID - invalid authentication mechanism 'EXTERNAL'"
    w = Wire()
    w.conn.tls = ExternalIdentity("guest")
    w.raw(C.PROTOCOL_HEADER)
    start = w.expect(commands.Connection.Start)
    assert start.mechanisms.split() == ["PLAIN", "AMQPLAIN", "EXTERNAL"]
    w.method(0, commands.Connection.StartOk(client_properties={}, mechanism="EXTERNAL",
                                            response="", locale="en_US"))
    w.expect(commands.Connection.Tune)
    assert w.conn.user is not None and w.conn.user.name == "guest"


@pytest.mark.parametrize(("identity", "peer"), [
    (("nobody", None), "127.0.0.1"),                        # no such user
    ((None, "TLS configuration is unsafe"), "127.0.0.1"),   # nothing was verified
    (("guest", None), "10.1.2.3"),                          # the loopback rule still applies
])
def test_external_refusals_close_with_403(identity: tuple[str | None, str | None],
                                          peer: str) -> None:
    from brokerha.amqp.connection import ExternalIdentity

    w = Wire(peer=peer)
    w.conn.tls = ExternalIdentity(*identity)
    external_start_ok(w)
    close = closed_with(w, C.ACCESS_REFUSED)
    assert close.reply_text == ("ACCESS_REFUSED - Login was refused using authentication "
                                "mechanism EXTERNAL. For details see the broker logfile.")
    assert w.conn.wants_close and w.conn.user is None


def test_a_connection_held_alone_is_not_read_and_keeps_a_flow_hold_or_alarm() -> None:
    """``hold_publishing`` (a partitioned node's full forward lane): this connection's
    reading pauses, others' does not, no connection.blocked; released, it reads again
    unless the broker's flow hold or an alarm still holds publishers."""
    broker = make_broker()
    held, other = Wire(broker).connected(), Wire(broker).connected()
    paused: list[bool] = []
    others: list[bool] = []
    held.conn.on_read_paused = paused.append
    other.conn.on_read_paused = others.append
    held.conn.hold_publishing("forward", True)
    assert paused == [True] and others == []
    assert not any(isinstance(m, commands.Connection.Blocked) for m in held.methods())
    broker.flow.hold("replication", "a backup lags")
    broker.flow.release("replication")  # the broker's hold ends: still held alone
    assert paused == [True]
    broker.set_alarm("disk", "free 10 MB, limit 50 MB")
    held.conn.hold_publishing("forward", False)  # the alarm holds it still
    assert paused == [True]
    broker.set_alarm("disk", None)
    assert paused == [True, False]
