"""TxBuffer and DtxBuffer (seed 002): a transaction's tx-queue as a backup holds it.

Built from the ``te``/``td`` events; at ``tp`` the buffer is recorded in the
backup's store (``Store.ha_tx_prepared``, a msgpack payload) before the
backup acknowledges the prepare, so a prepared transaction survives a crash
of the backup; the record goes in the same store batch as the commit's
effects (``tc``) or with the rollback (``tr``).

A DtxBuffer is a TxBuffer with the XA xid: when its primary fails, the
prepared branch stays in doubt and becomes a prepared branch of the new
primary's DtxManager (``brokerha.primary.verification``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from brokerha.broker.message import Message

# (vhost, [queue names], exchange, routing_key, header, body)
BufferedMessage = tuple[str, list[str], str, str, bytes, bytes]


@dataclass
class TxBuffer:
    txid: str
    messages: list[BufferedMessage] = field(default_factory=list)
    # the same contents as Messages, made as each te arrives (not all at the commit:
    # a TX of 100,000 messages would make them in one step of the backup's loop)
    built: list[Message] = field(default_factory=list)
    dequeues: list[tuple[str, str, list[int]]] = field(default_factory=list)
    client_id: str | None = None
    prepared: bool = False

    xid: str | None = None

    def enqueue(self, vhost: str, queues: list[str], exchange: str, routing_key: str,
                header: bytes, body: bytes) -> None:
        header, body = bytes(header), bytes(body)
        self.messages.append((vhost, list(queues), exchange, routing_key, header, body))
        self.built.append(Message(exchange, routing_key, header, body))

    def dequeue(self, vhost: str, queue: str, positions: list[int]) -> None:
        self.dequeues.append((vhost, queue, list(positions)))

    def payload(self) -> bytes:
        data: bytes = msgpack.packb({"xid": self.xid, "client_id": self.client_id,
                                     "messages": self.messages, "dequeues": self.dequeues},
                                    use_bin_type=True)
        return data

    @staticmethod
    def from_payload(txid: str, payload: bytes) -> TxBuffer:
        doc: dict[str, Any] = msgpack.unpackb(bytes(payload), raw=False)
        buffer: TxBuffer = (DtxBuffer(txid) if doc.get("xid") else TxBuffer(txid))
        buffer.xid = doc.get("xid")
        buffer.client_id = doc.get("client_id")
        for v, qs, ex, rk, h, b in doc["messages"]:
            buffer.enqueue(v, qs, ex, rk, h, b)
        buffer.dequeues = [(v, q, list(ps)) for v, q, ps in doc["dequeues"]]
        buffer.prepared = True
        return buffer


@dataclass
class DtxBuffer(TxBuffer):
    """The buffer of an XA branch (``xid`` set)."""


def new_buffer(txid: str, xid: str | None) -> TxBuffer:
    buffer = DtxBuffer(txid) if xid else TxBuffer(txid)
    buffer.xid = xid
    return buffer
