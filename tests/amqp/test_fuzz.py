"""Malformed and truncated input never crashes the connection state machine.

Whatever arrives, the server either keeps going or closes with a reply code
from the spec, and other connections on the same broker are unaffected.
"""

from __future__ import annotations

import os
import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands, frame

from brokerha.amqp import constants as C
from brokerha.amqp.frames import encode_frame
from tests.amqp.wire import Wire, make_broker

# a protocol error for malformed input, never 541 INTERNAL_ERROR (an exception inside)
VALID_CODES = set(C.REPLY_NAMES) - {C.REPLY_SUCCESS, C.INTERNAL_ERROR}


def _method_payloads() -> list[bytes]:
    methods = [
        commands.Queue.Declare(queue="fz"), commands.Basic.Publish(exchange="", routing_key="fz"),
        commands.Basic.Consume(queue="fz"), commands.Exchange.Declare(exchange="fx"),
        commands.Basic.Ack(delivery_tag=1), commands.Tx.Select(), commands.Confirm.Select(),
        commands.Basic.Qos(prefetch_count=3), commands.Channel.Close(reply_code=200,
                                                                     reply_text="", class_id=0,
                                                                     method_id=0),
    ]
    return [frame.marshal(m, 1)[7:-1] for m in methods]


PAYLOADS = _method_payloads()


@st.composite
def frame_bytes(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["valid", "mutated", "truncated", "random"]))
    base = draw(st.sampled_from(PAYLOADS))
    ftype = draw(st.sampled_from([1, 1, 1, 2, 3, 8, draw(st.integers(0, 255))]))
    channel = draw(st.sampled_from([0, 1, 1, 2, draw(st.integers(0, 65535))]))
    if kind == "valid":
        return encode_frame(ftype, channel, base)
    if kind == "mutated":
        data = bytearray(encode_frame(ftype, channel, base))
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if kind == "truncated":
        payload = base[: draw(st.integers(0, len(base)))]
        return encode_frame(ftype, channel, payload)
    return draw(st.binary(max_size=64))


def check_outcome(w: Wire) -> None:
    for m in w.methods():
        if isinstance(m, commands.Connection.Close | commands.Channel.Close):
            assert m.reply_code in VALID_CODES, m


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frame_bytes(), min_size=1, max_size=12))
def test_random_frames_never_crash(frames: list[bytes]) -> None:
    broker = make_broker()
    victim = Wire(broker).connected()
    bystander = Wire(broker).connected()
    for data in frames:
        victim.raw(data)
        check_outcome(victim)
    bystander.method(1, commands.Queue.Declare(queue="still-fine"))
    bystander.expect(commands.Queue.DeclareOk)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=200))
def test_random_bytes_before_handshake(data: bytes) -> None:
    w = Wire()
    w.raw(data)
    out = w.frames()
    if len(data) >= 8 and not data.startswith(C.PROTOCOL_HEADER):
        assert out == [(0, C.PROTOCOL_HEADER)]


@pytest.mark.slow
def test_bounded_random_frame_run() -> None:
    """A longer seeded run: BROKERHA_FUZZ_SECONDS (default 60) of random frames."""
    import time

    seed = int(os.environ.get("BROKERHA_FUZZ_SEED", "1"))
    rng = random.Random(seed)
    deadline = time.monotonic() + float(os.environ.get("BROKERHA_FUZZ_SECONDS", "60"))
    broker = make_broker()
    bystander = Wire(broker).connected()
    runs = 0
    while time.monotonic() < deadline:
        w = Wire(broker).connected()
        for _ in range(rng.randint(1, 30)):
            payload = rng.choice(PAYLOADS)
            data = bytearray(encode_frame(rng.choice([1, 2, 3, 8]), rng.choice([0, 1, 2]), payload))
            for _ in range(rng.randint(0, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            w.raw(bytes(data[: rng.randint(1, len(data))] if rng.random() < 0.2 else data))
            check_outcome(w)
        w.conn.connection_lost()
        runs += 1
    bystander.method(1, commands.Queue.Declare(queue="still-fine"))
    bystander.expect(commands.Queue.DeclareOk)
    assert runs > 0
    assert struct  # keep import for payload building in future cases


# -- the handshake: what a wire fuzzer found (5,000 mutated client streams, 4 ended in 541) --

CAPS = {"authentication_failure_close": True}


def start_ok(response: bytes, mechanism: str = "PLAIN") -> bytes:
    """A start-ok frame whose SASL response is exactly ``response`` (pamqp would encode a str)."""
    method = commands.Connection.StartOk(
        client_properties={"capabilities": CAPS}, mechanism=mechanism, response="R" * 7,
        locale="en_US")
    payload = frame.marshal(method, 0)[7:-1]
    marker = struct.pack(">I", 7) + b"R" * 7
    assert payload.count(marker) == 1
    return encode_frame(1, 0, payload.replace(marker, struct.pack(">I", len(response)) + response))


def started() -> Wire:
    w = Wire()
    w.raw(C.PROTOCOL_HEADER)
    w.expect(commands.Connection.Start)
    return w


def refused_login(w: Wire) -> bool:
    return any(isinstance(m, commands.Connection.Close) and m.reply_code == C.ACCESS_REFUSED
               and m.reply_text.startswith("ACCESS_REFUSED - Login was refused")
               for m in w.methods())


@pytest.mark.parametrize("response", [
    b"\x00gu\xffst\x00guest",      # a user name that is not UTF-8: pamqp hands over bytes
    b"\x00guest\x00gu\xfe\xffst",  # a password that is not UTF-8
])
def test_a_sasl_response_that_is_not_utf8_is_a_refused_login_not_an_internal_error(
        response: bytes) -> None:
    """RabbitMQ compares the bytes: no such user, or a wrong password (403)."""
    w = started()
    w.raw(start_ok(response))
    assert refused_login(w)


@pytest.mark.parametrize("response", [b"guest-without-separators-\xff", b"\x00a\x00b\x00c"])
def test_a_malformed_plain_response_closes_the_connection_without_an_answer(
        response: bytes) -> None:
    """As RabbitMQ 3.10 does (tests/differential): a handshake error, the socket closed."""
    w = started()
    w.raw(start_ok(response))
    assert w.methods() == [] and w.conn.wants_close


def test_a_password_in_utf8_beyond_ascii_logs_in() -> None:
    broker = make_broker()
    broker.users.add_user("zoë", "pässwörd")
    broker.users.set_permissions("zoë", "/")
    w = Wire(broker)
    w.handshake("zoë", "pässwörd")
    assert any(isinstance(m, commands.Connection.OpenOk) for m in w.last), w.last


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["PLAIN", "AMQPLAIN"]), st.binary(max_size=40),
       st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4))
def test_mutated_handshakes_get_a_protocol_answer(mechanism: str, response: bytes,
                                                 flips: list[tuple[int, int]]) -> None:
    """The handshake's frames, mutated: start-ok, tune-ok, open."""
    w = started()
    data = bytearray(start_ok(response, mechanism)
                     + frame.marshal(commands.Connection.TuneOk(channel_max=10, frame_max=131072,
                                                                heartbeat=0), 0)
                     + frame.marshal(commands.Connection.Open(virtual_host="/"), 0))
    for at, value in flips:
        data[at % len(data)] = value
    w.raw(bytes(data))
    check_outcome(w)

