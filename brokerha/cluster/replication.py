"""Replication packets (codes 30-59) and the vocabulary of the events they carry.

Imported by both sides: ``brokerha.primary`` builds events, ``brokerha.backup``
applies them. An event is a compact msgpack-able list whose first item says
what it is; every event of a primary's log has its own sequence number, and an
``Events`` packet carries a run of consecutive ones.

=======  ==============================================================  ==========
kind     fields after the kind                                           meaning
=======  ==============================================================  ==========
``v``    vhost                                                           vhost exists
``xd``   vhost, name, type, durable, auto_delete, internal, arguments   exchange declared
``xx``   vhost, name                                                     exchange deleted
``qd``   vhost, name, durable, auto_delete, arguments                    queue declared
``qx``   vhost, name                                                     queue deleted
``bd``   vhost, source, kind, destination, routing_key, arguments        binding created
``bx``   vhost, source, kind, destination, routing_key, arguments        binding deleted
``e``    vhost, queue, position, exchange, routing_key, header, body,    enqueued
         expires_in_ms (None: no expiry)
``d``    vhost, queue, [positions]                                       dequeued
``b``    session (the Join's)                                            catch-up begins
``s``    (none)                                                          config snapshot done
``c``    seq                                                             caught up
=======  ==============================================================  ==========

``arguments`` travel as an AMQP field table (bytes, keys sorted), so whatever a
client can declare survives msgpack and compares byte for byte.

A catch-up (the primary's answer to a ``Join``) is numbered so that its ``c``
marker lands on the primary's seq at the join: the numbers before it are
private to that backup, which holds no consistent copy until the marker.
"""

from __future__ import annotations

from typing import Any

from pamqp import decode, encode

from brokerha.cluster.messages import Message, packet

VHOST = "v"
EXCHANGE_DECLARED = "xd"
EXCHANGE_DELETED = "xx"
QUEUE_DECLARED = "qd"
QUEUE_DELETED = "qx"
BINDING_CREATED = "bd"
BINDING_DELETED = "bx"
ENQUEUED = "e"
DEQUEUED = "d"
CATCH_UP_BEGINS = "b"
SNAPSHOT_DONE = "s"
CAUGHT_UP = "c"

# The queue argument holding a replicated queue's identity (the primary's
# epoch and seq when it was declared): a queue deleted and declared again under
# the same name is another queue, and its positions mean other messages.
HA_ID = "x-ha-id"


@packet(30)
class Join(Message):
    """Backup -> primary: follow me from here.

    ``pos_epoch``/``pos_seq``: the backup's last consistent position (for the
    log); ``inventory``: ``[vhost, queue, ha_id, ranges]`` per replicated queue
    it holds, ``ranges`` the ``[first, last]`` runs of positions on it;
    ``session``: unique per join, echoed by the catch-up's ``b`` event, so a
    backup that joined twice applies only the answer to its last join (the
    diff is against that join's inventory).
    """

    epoch: int
    node: str
    pos_epoch: int
    pos_seq: int
    inventory: list[Any]
    session: int


@packet(31)
class Events(Message):
    """Primary -> backup: ``events[i]`` has sequence number ``first_seq + i``."""

    epoch: int
    first_seq: int
    events: list[Any]


@packet(32)
class Ack(Message):
    """Backup -> primary: I hold every event up to ``seq`` (cumulative), durably."""

    epoch: int
    node: str
    seq: int


class ReplicationError(Exception):
    """The stream cannot be applied (gap, unknown event): the backup joins again."""


class StaleEpoch(ReplicationError):
    """Events of a primary older than the epoch this backup follows: refused."""


def encode_table(arguments: dict[str, Any]) -> bytes:
    """Arguments as an AMQP field table, keys sorted (a stable identity)."""
    return bytes(encode.field_table(_encodable(arguments)))


def decode_table(data: bytes) -> dict[str, Any]:
    _, table = decode.field_table(bytes(data))
    return dict(table)


def _encodable(value: Any) -> Any:
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return {k: _encodable(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_encodable(v) for v in value]
    return value
