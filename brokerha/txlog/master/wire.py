"""TxLog messages on the cluster link: one packet, ``TxLogPacket(payload)``, code 80.

The round engine's messages (:mod:`brokerha.txlog.engine.messages`) are frozen
dataclasses of strings, ints, tuples and frozensets. They travel inside one
cluster packet whose ``payload`` is the msgpack of a plain list, the message
kind first; the layout is spelled out per kind below rather than derived from
the dataclasses, so a field added to an engine message cannot silently change
the wire. Decoding checks every type: a malformed payload from an
authenticated peer is a :class:`WireError`, logged and dropped by the driver,
never an exception inside the engine.
"""

from __future__ import annotations

from typing import Any

import msgpack

from brokerha.cluster.messages import Message as ClusterMessage
from brokerha.cluster.messages import packet
from brokerha.txlog.engine.messages import Ballot, Bodies, CatchUp, FetchBodies, Message, Post, Vote
from brokerha.txlog.engine.queues import MergeBase
from brokerha.txlog.engine.records import Operation, TxBody, TxRecord

WIRE_VERSION = 1
_KINDS = ("post", "catchup", "fetch", "bodies", "vote")


@packet(80)
class TxLogPacket(ClusterMessage):
    """A TxLog message between the masters of two datacenters (msgpack payload)."""

    payload: bytes


class WireError(ValueError):
    """A TxLog payload that does not decode to a well-formed message."""


# ---- encoding ----------------------------------------------------------------------


def _record(r: TxRecord) -> list[Any]:
    return [r.tx_id, r.timestamp, r.origin, r.created_ms, r.replay_of]


def _body(b: TxBody) -> list[Any]:
    return [b.tx_id, [[op.kind, op.queue, op.message_id, op.data] if op.data
                      else [op.kind, op.queue, op.message_id] for op in b.operations]]


def _base(m: MergeBase) -> list[Any]:
    return [m.length, m.digest, m.last_id]


def _ballot(b: Ballot) -> list[Any]:
    return [b.master, b.generation, _base(b.offset), [_record(r) for r in b.records]]


def to_list(message: Message) -> list[Any]:
    if isinstance(message, Post):
        return ["post", message.sender, message.generation, sorted(message.members),
                _base(message.merge_base), message.counter,
                [_record(r) for r in message.incoming], [_body(b) for b in message.bodies]]
    if isinstance(message, CatchUp):
        return ["catchup", message.sender, message.generation, sorted(message.members),
                _base(message.base), [_record(r) for r in message.tail],
                [_body(b) for b in message.bodies]]
    if isinstance(message, FetchBodies):
        return ["fetch", message.sender, list(message.tx_ids)]
    if isinstance(message, Bodies):
        return ["bodies", message.sender, [_record(r) for r in message.records],
                [_body(b) for b in message.bodies]]
    if isinstance(message, Vote):
        return ["vote", message.sender, message.generation,
                [_ballot(b) for b in message.ballots]]
    raise TypeError(f"not a TxLog message: {message!r:.80}")


def encode(message: Message) -> TxLogPacket:
    return TxLogPacket(msgpack.packb([WIRE_VERSION, *to_list(message)], use_bin_type=True))


# ---- decoding (every field type-checked) --------------------------------------------


def _check(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise WireError(f"{what}: expected {getattr(kind, '__name__', kind)}, got {value!r:.40}")
    return value


def _fields(value: Any, n: int, what: str) -> list[Any]:
    if not isinstance(value, list) or len(value) != n:
        raise WireError(f"{what}: expected {n} fields, got {value!r:.60}")
    return value


def _items(value: Any, what: str) -> list[Any]:
    return _check(value, list, what)


def _opt_str(value: Any, what: str) -> str | None:
    return None if value is None else _check(value, str, what)


def _rd_record(v: Any) -> TxRecord:
    tx_id, ts, origin, created, replay_of = _fields(v, 5, "record")
    return TxRecord(_check(tx_id, str, "tx_id"), _check(ts, int, "timestamp"),
                    _check(origin, str, "origin"), _check(created, int, "created_ms"),
                    _opt_str(replay_of, "replay_of"))


def _rd_op(v: Any) -> Operation:
    data = b""
    if isinstance(v, list) and len(v) == 4:  # with the data of a broker's enqueue
        *v, data = v
        _check(data, bytes, "data")
    kind, queue, message_id = _fields(v, 3, "operation")
    if kind not in ("enqueue", "dequeue"):
        raise WireError(f"operation kind {kind!r:.20}")
    return Operation(kind, _check(queue, str, "queue"), _check(message_id, str, "message_id"),
                     data)


def _rd_body(v: Any) -> TxBody:
    tx_id, ops = _fields(v, 2, "body")
    return TxBody(_check(tx_id, str, "tx_id"), tuple(_rd_op(o) for o in _items(ops, "ops")))


def _rd_base(v: Any) -> MergeBase:
    length, digest, last_id = _fields(v, 3, "merge base")
    return MergeBase(_check(length, int, "length"), _check(digest, str, "digest"),
                     _opt_str(last_id, "last_id"))


def _rd_members(v: Any) -> frozenset[str]:
    return frozenset(_check(m, str, "member") for m in _items(v, "members"))


def _rd_ballot(v: Any) -> Ballot:
    master, generation, offset, records = _fields(v, 4, "ballot")
    return Ballot(_check(master, str, "master"), _check(generation, int, "generation"),
                  _rd_base(offset), tuple(_rd_record(r) for r in _items(records, "records")))


def records(v: Any) -> tuple[TxRecord, ...]:
    return tuple(_rd_record(r) for r in _items(v, "records"))


def bodies(v: Any) -> tuple[TxBody, ...]:
    return tuple(_rd_body(b) for b in _items(v, "bodies"))


def from_list(v: Any) -> Message:
    if not isinstance(v, list) or not v or v[0] not in _KINDS:
        raise WireError(f"unknown TxLog message {v!r:.60}")
    kind, sender = v[0], _check(v[1] if len(v) > 1 else None, str, "sender")
    if kind == "post":
        _, _, gen, members, base, counter, incoming, bs = _fields(v, 8, "post")
        return Post(sender, _check(gen, int, "generation"), _rd_members(members), _rd_base(base),
                    _check(counter, int, "counter"), records(incoming), bodies(bs))
    if kind == "catchup":
        _, _, gen, members, base, tail, bs = _fields(v, 7, "catchup")
        return CatchUp(sender, _check(gen, int, "generation"), _rd_members(members),
                       _rd_base(base), records(tail), bodies(bs))
    if kind == "fetch":
        _, _, ids = _fields(v, 3, "fetch")
        return FetchBodies(sender, tuple(_check(t, str, "tx_id") for t in _items(ids, "ids")))
    if kind == "bodies":
        _, _, rs, bs = _fields(v, 4, "bodies")
        return Bodies(sender, records(rs), bodies(bs))
    _, _, gen, ballots = _fields(v, 4, "vote")
    return Vote(sender, _check(gen, int, "generation"),
                tuple(_rd_ballot(b) for b in _items(ballots, "ballots")))


def decode(pkt: TxLogPacket) -> Message:
    if not isinstance(pkt.payload, bytes):
        raise WireError("payload is not bytes")
    try:
        obj = msgpack.unpackb(pkt.payload, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"malformed msgpack: {exc}") from None
    if not isinstance(obj, list) or not obj or obj[0] != WIRE_VERSION:
        raise WireError(f"unsupported TxLog wire version {obj[:1] if isinstance(obj, list) else obj!r:.20}")
    return from_list(obj[1:])
