"""Malformed client input as octets, with RabbitMQ 3.10's answer to each.

The shapes a wire fuzzer found (5,000 mutated client streams, issue 32: four
ended in 541 INTERNAL_ERROR) and their neighbours. tests/amqp/test_fuzz.py
feeds them to a ServerConnection in process; tests/differential/ sends them to
a private RabbitMQ node and a brokerha node and compares the answers.

An answer is ``close CODE TEXT CLASS,METHOD`` (the connection.close), ``tune``
(the login went through) or ``eof`` (the socket closed without a word).

RabbitMQ's sources for them (rabbitmq-server v3.10.8):

- deps/rabbit/src/rabbit_auth_mechanism_plain.erl: the response must be
  NUL user NUL password (no authorisation identity, nothing after); else
  ``{protocol_error, "response ~p invalid"}``.
- deps/rabbit/src/rabbit_auth_mechanism_amqplain.erl: a field table as
  rabbit_binary_parser:parse_table reads it (a crash if it does not parse),
  LOGIN and PASSWORD long strings.
- deps/rabbit/src/rabbit_reader.erl, auth_phase/2: a refused login is
  access_refused; auth_fail/5 sends connection.close 403 "Login was refused
  using authentication mechanism PLAIN. For details see the broker logfile."
  (class and method 0) if the client has ``authentication_failure_close``; a
  protocol_error becomes syntax_error. handle_exception/3 in state 'starting'
  answers access_refused only: anything else (syntax_error, command_invalid
  for an unknown mechanism, frame_error, a crash) waits 3 s and closes the
  socket without a connection.close (a handshake_error).
- codegen.py (rabbit_framing_amqp_0_9_1:decode_method_fields): arguments that
  do not match the method's binary pattern exactly are 501 FRAME_ERROR
  "cannot decode <<...>>" (rabbit_misc:frame_error/2) naming the method; a
  short string that is not UTF-8 is 501 "Malformed UTF-8 in shortstr"
  (rabbit_binary_parser:assert_utf8/1; the method named on channel 0 only).
"""

from __future__ import annotations

import struct
from typing import Any

from pamqp import commands, encode, frame

from brokerha.amqp.frames import encode_frame

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
CAPABILITIES: dict[str, Any] = {"authentication_failure_close": True}


def refused(mechanism: str) -> str:
    return (f"close 403 ACCESS_REFUSED - Login was refused using authentication mechanism "
            f"{mechanism}. For details see the broker logfile. 0,0")


def table(entries: dict[str, Any]) -> bytes:
    """A field table's entries without its length (as an AMQPLAIN response carries them)."""
    return encode.field_table(entries)[4:]


def longstr_entry(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + b"S" + struct.pack(">I", len(value)) + value


def start_ok(response: bytes, mechanism: bytes = b"PLAIN",
             client_properties: bytes | None = None) -> bytes:
    """A connection.start-ok frame with these octets exactly (pamqp would encode a str)."""
    props = client_properties if client_properties is not None else encode.field_table(
        {"capabilities": CAPABILITIES})
    payload = b"".join((struct.pack(">HH", 10, 11), props, bytes([len(mechanism)]), mechanism,
                        struct.pack(">I", len(response)), response, b"\x05en_US"))
    return encode_frame(1, 0, payload)


GOOD_PLAIN = b"\x00guest\x00guest"
GOOD_AMQPLAIN = longstr_entry(b"LOGIN", b"guest") + longstr_entry(b"PASSWORD", b"guest")

#: name -> (the start-ok frame, the answer)
START_OK: dict[str, tuple[bytes, str]] = {
    # the fuzzer's shapes: a response that is not UTF-8 (pamqp hands over bytes)
    "PLAIN, a user name that is not UTF-8": (start_ok(b"\x00gu\xffst\x00guest"), refused("PLAIN")),
    "PLAIN, a password that is not UTF-8": (start_ok(b"\x00guest\x00gu\xfe\xffst"),
                                            refused("PLAIN")),
    "PLAIN, no separators and not UTF-8": (start_ok(b"guest-without-separators-\xff"), "eof"),
    "AMQPLAIN, a LOGIN that is not UTF-8": (
        start_ok(longstr_entry(b"LOGIN", b"g\xffe") + longstr_entry(b"PASSWORD", b"guest"),
                 b"AMQPLAIN"), refused("AMQPLAIN")),
    # their neighbours
    "PLAIN, the right password": (start_ok(GOOD_PLAIN), "tune"),
    "PLAIN, an authorisation identity": (start_ok(b"guest\x00guest\x00guest"), "eof"),
    "PLAIN, three separators": (start_ok(b"\x00a\x00b\x00c"), "eof"),
    "PLAIN, no password": (start_ok(b"\x00guest"), "eof"),
    "PLAIN, an empty password": (start_ok(b"\x00guest\x00"), refused("PLAIN")),
    "PLAIN, empty": (start_ok(b""), "eof"),
    "PLAIN, not UTF-8 and no authentication_failure_close": (
        start_ok(b"\x00gu\xffst\x00guest", client_properties=encode.field_table({})), "eof"),
    "AMQPLAIN, the right password": (start_ok(GOOD_AMQPLAIN, b"AMQPLAIN"), "tune"),
    "AMQPLAIN, a field name that is not UTF-8 besides": (
        start_ok(GOOD_AMQPLAIN + b"\x02\xff\xfeI\x00\x00\x00\x01", b"AMQPLAIN"), "tune"),
    "AMQPLAIN, cut short": (start_ok(GOOD_AMQPLAIN[:-3], b"AMQPLAIN"), "eof"),
    "AMQPLAIN, no PASSWORD": (start_ok(longstr_entry(b"LOGIN", b"guest"), b"AMQPLAIN"), "eof"),
    "AMQPLAIN, a LOGIN that is a number": (
        start_ok(table({"LOGIN": 5}) + longstr_entry(b"PASSWORD", b"guest"), b"AMQPLAIN"), "eof"),
    "AMQPLAIN, an unknown field type": (start_ok(b"\x05LOGIN\x01", b"AMQPLAIN"), "eof"),
    "AMQPLAIN, octets that are no table and not UTF-8": (start_ok(b"\xff\xfe\xfd", b"AMQPLAIN"),
                                                         "eof"),
    "a mechanism not offered": (start_ok(GOOD_PLAIN, b"NOPE"), "eof"),
    "a mechanism that is not UTF-8": (start_ok(GOOD_PLAIN, b"PL\xffIN"), "eof"),
    "start-ok cut short": (encode_frame(1, 0, start_ok(GOOD_PLAIN)[7:-5]), "eof"),
    "start-ok with octets left over": (encode_frame(1, 0, start_ok(GOOD_PLAIN)[7:-1] + b"x"),
                                       "eof"),
    "client properties that do not parse": (
        start_ok(GOOD_PLAIN, client_properties=struct.pack(">I", 3) + b"\x01a\x01"), "eof"),
    "tune-ok instead of start-ok": (frame.marshal(commands.Connection.TuneOk(
        channel_max=0, frame_max=131072, heartbeat=0), 0), "eof"),
    "a frame end that is not 0xce": (start_ok(GOOD_PLAIN)[:-1] + b"\x00", "eof"),
}


def method(class_id: int, method_id: int, arguments: bytes, channel: int = 1) -> bytes:
    return encode_frame(1, channel, struct.pack(">HH", class_id, method_id) + arguments)


def _queue_declare(name: bytes, bits: int, table_octets: bytes) -> bytes:
    return method(50, 10, b"\x00\x00" + bytes([len(name)]) + name + bytes([bits]) + table_octets)


def cannot_decode(frame_octets: bytes) -> str:
    """RabbitMQ's answer to a method frame whose arguments do not decode."""
    class_id, method_id = struct.unpack_from(">HH", frame_octets, 7)
    arguments = ",".join(map(str, frame_octets[11:-1]))
    return f"close 501 FRAME_ERROR - cannot decode <<{arguments}>> {class_id},{method_id}"


_DECLARE = _queue_declare(b"pq", 0, struct.pack(">I", 6) + b"\x03x-ab\x01")
_CUT = encode_frame(1, 1, _DECLARE[7:-4])
_LEFT_OVER = encode_frame(1, 1, _DECLARE[7:-1] + b"abc")
_PAST_TABLE = _queue_declare(b"pq", 0, struct.pack(">I", 50) + b"\x03x-aI")
_PUBLISH_CUT = method(60, 40, b"\x00\x00\x00\x07nowher")
_LONG = "é" * 120
_NOT_FOUND = f"NOT_FOUND - no queue '{_LONG}' in vhost '/'".encode()[:252].decode("utf-8", "ignore")

#: name -> (frames after connection.open and channel.open on channel 1, the answer)
ON_A_CHANNEL: dict[str, tuple[list[bytes], str]] = {
    "queue.declare cut short": ([_CUT], cannot_decode(_CUT)),
    "queue.declare with octets left over": ([_LEFT_OVER], cannot_decode(_LEFT_OVER)),
    "queue.declare whose arguments run past their table": ([_PAST_TABLE],
                                                           cannot_decode(_PAST_TABLE)),
    "queue.declare named in octets that are not UTF-8": (
        [_queue_declare(b"q-\xff\xfe", 0, struct.pack(">I", 0))],
        "close 501 FRAME_ERROR - Malformed UTF-8 in shortstr 0,0"),
    "tx.select with an octet left over": ([method(90, 10, b"\x00")],
                                          "close 501 FRAME_ERROR - cannot decode <<0>> 90,10"),
    "basic.publish cut short": ([_PUBLISH_CUT], cannot_decode(_PUBLISH_CUT)),
    "basic.ack cut short": ([method(60, 80, b"\x00\x00")],
                            "close 501 FRAME_ERROR - cannot decode <<0,0>> 60,80"),
    "a content header for class 61": (
        [method(60, 40, b"\x00\x00\x00\x00\x00"),
         encode_frame(2, 1, struct.pack(">HHQ", 61, 0, 5) + b"\x00\x00")],
        "close 505 UNEXPECTED_FRAME - expected content header for class 60, got one for "
        "class 61 instead 60,40"),
    "a missing queue whose name is long beyond ASCII": (  # passive: 404, the text cut at 255
        [_queue_declare(_LONG.encode(), 1, struct.pack(">I", 0))],
        f"channel-close 404 {_NOT_FOUND}... 50,10"),
}
