"""XA resources for pika, kombu and aio-pika channels, speaking brokerha's DTX control messages.

The wire design is in docs/dtx.md (and brokerha/amqp/dtx_control.py): a verb is
a publish to ``amq.dtx`` with the verb as routing key and a JSON body; the
answer comes back on a private reply queue. Each resource below is the same
protocol over a different client library; none of them needs a changed client.

    xa = PikaXAResource(channel)
    xid = Xid(1, b"order-42", b"broker")
    xa.start(xid)
    channel.basic_publish("", "orders", b"...")   # part of the branch
    xa.end(xid)
    if xa.prepare(xid) == XA_OK:
        xa.commit(xid)
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

XA_OK = 0
XA_RDONLY = 3
XA_HEURHAZ = 8
XA_HEURCOM = 7
XA_HEURRB = 6
XA_HEURMIX = 5
XA_RBROLLBACK = 100
XA_RBTIMEOUT = 106
XAER_RMERR = -3
XAER_NOTA = -4
XAER_INVAL = -5
XAER_PROTO = -6
XAER_RMFAIL = -7
XAER_DUPID = -8

DTX_EXCHANGE = "amq.dtx"


@dataclass(frozen=True)
class Xid:
    format_id: int
    gtrid: bytes
    bqual: bytes = b""

    def to_json(self) -> dict[str, Any]:
        return {"format_id": self.format_id, "gtrid": self.gtrid.hex(), "bqual": self.bqual.hex()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Xid:
        return cls(int(data["format_id"]), bytes.fromhex(data["gtrid"]),
                   bytes.fromhex(data.get("bqual", "")))


class XAException(Exception):
    """An XA error (XAER_*) or a rollback (XA_RB*) reported by the broker."""

    def __init__(self, code: int, status: str, text: str) -> None:
        super().__init__(f"{status} ({code}): {text}" if text else f"{status} ({code})")
        self.code = code
        self.status = status


# Results that are outcomes rather than errors for each verb
_OUTCOMES = {
    "end": {XA_OK, XA_RBROLLBACK, XA_RBTIMEOUT},
    "prepare": {XA_OK, XA_RDONLY},
    "commit": {XA_OK},
}


def _request(xid: Xid | None, **flags: Any) -> bytes:
    body: dict[str, Any] = {k: v for k, v in flags.items() if v is not None}
    if xid is not None:
        body["xid"] = xid.to_json()
    return json.dumps(body).encode()


def _result(verb: str, reply: dict[str, Any]) -> dict[str, Any]:
    code = int(reply["code"])
    if code in _OUTCOMES.get(verb, {XA_OK}):
        return reply
    raise XAException(code, reply.get("status", str(code)), reply.get("text", ""))


class XAResourceBase:
    """The XA verbs over a ``call(verb, body) -> reply dict`` transport."""

    def __init__(self, call: Callable[[str, bytes], dict[str, Any]]) -> None:
        self._call = call

    def _do(self, verb: str, xid: Xid | None, **flags: Any) -> dict[str, Any]:
        return _result(verb, self._call(verb, _request(xid, **flags)))

    def start(self, xid: Xid, *, join: bool = False, resume: bool = False) -> None:
        self._do("start", xid, join=join, resume=resume)

    def end(self, xid: Xid, *, suspend: bool = False, fail: bool = False) -> int:
        """XA_OK, or XA_RBROLLBACK / XA_RBTIMEOUT when the branch can only roll back."""
        return int(self._do("end", xid, suspend=suspend, fail=fail)["code"])

    def prepare(self, xid: Xid) -> int:
        """XA_OK or XA_RDONLY; raises XAException for XA_RB* (the branch rolled back)."""
        return int(self._do("prepare", xid)["code"])

    def commit(self, xid: Xid, *, one_phase: bool = False) -> None:
        self._do("commit", xid, one_phase=one_phase)

    def rollback(self, xid: Xid) -> None:
        self._do("rollback", xid)

    def forget(self, xid: Xid) -> None:
        self._do("forget", xid)

    def recover(self) -> list[Xid]:
        return [Xid.from_json(x) for x in self._do("recover", None).get("xids", [])]

    def set_transaction_timeout(self, xid: Xid, seconds: float) -> None:
        self._do("set-timeout", xid, timeout=seconds)

    def get_transaction_timeout(self, xid: Xid) -> float:
        return float(self._do("get-timeout", xid)["timeout"])


def _wait_for(get: Callable[[], dict[str, Any] | None], timeout: float,
              idle: Callable[[], None]) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = get()
        if reply is not None:
            return reply
        idle()
    raise TimeoutError("no answer from the broker to a dtx control message")


class PikaXAResource(XAResourceBase):
    """For a pika BlockingConnection channel."""

    def __init__(self, channel: Any, timeout: float = 30.0) -> None:
        import pika

        self._pika = pika
        self.channel = channel
        self.reply_queue = channel.queue_declare("", exclusive=True, auto_delete=True).method.queue
        self.timeout = timeout
        super().__init__(self._send)

    def _send(self, verb: str, body: bytes) -> dict[str, Any]:
        corr = uuid.uuid4().hex
        props = self._pika.BasicProperties(reply_to=self.reply_queue, correlation_id=corr,
                                           content_type="application/json")
        self.channel.basic_publish(DTX_EXCHANGE, verb, body, props)

        def get() -> dict[str, Any] | None:
            method, props_in, data = self.channel.basic_get(self.reply_queue, auto_ack=True)
            if method is not None and props_in.correlation_id == corr:
                return json.loads(data)
            return None

        return _wait_for(get, self.timeout,
                         lambda: self.channel.connection.process_data_events(time_limit=0.005))


class KombuXAResource(XAResourceBase):
    """For a kombu channel (``connection.default_channel``: py-amqp underneath)."""

    def __init__(self, channel: Any, timeout: float = 30.0) -> None:
        self.channel = channel
        self.reply_queue = channel.queue_declare(queue="", exclusive=True, auto_delete=True)[0]
        self.timeout = timeout
        super().__init__(self._send)

    def _send(self, verb: str, body: bytes) -> dict[str, Any]:
        corr = uuid.uuid4().hex
        message = self.channel.prepare_message(
            body, content_type="application/json",
            properties={"reply_to": self.reply_queue, "correlation_id": corr})
        self.channel.basic_publish(message, exchange=DTX_EXCHANGE, routing_key=verb)

        def get() -> dict[str, Any] | None:
            msg = self.channel.basic_get(queue=self.reply_queue, no_ack=True)
            if msg is not None and msg.properties.get("correlation_id") == corr:
                return json.loads(msg.body)
            return None

        return _wait_for(get, self.timeout, lambda: time.sleep(0.005))


class AioPikaXAResource:
    """For an aio-pika channel; every verb is a coroutine."""

    def __init__(self, channel: Any, timeout: float = 30.0) -> None:
        self.channel = channel
        self.timeout = timeout
        self._queue: Any = None
        self._exchange: Any = None

    async def _send(self, verb: str, body: bytes) -> dict[str, Any]:
        import asyncio

        import aio_pika

        if self._queue is None:
            self._queue = await self.channel.declare_queue(exclusive=True, auto_delete=True)
            self._exchange = await self.channel.get_exchange(DTX_EXCHANGE, ensure=False)
        corr = uuid.uuid4().hex
        await self._exchange.publish(
            aio_pika.Message(body, reply_to=self._queue.name, correlation_id=corr,
                             content_type="application/json"), routing_key=verb)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            msg = await self._queue.get(no_ack=True, fail=False)
            if msg is not None and msg.correlation_id == corr:
                return json.loads(msg.body)
            await asyncio.sleep(0.005)
        raise TimeoutError("no answer from the broker to a dtx control message")

    async def _do(self, verb: str, xid: Xid | None, **flags: Any) -> dict[str, Any]:
        return _result(verb, await self._send(verb, _request(xid, **flags)))

    async def start(self, xid: Xid, *, join: bool = False, resume: bool = False) -> None:
        await self._do("start", xid, join=join, resume=resume)

    async def end(self, xid: Xid, *, suspend: bool = False, fail: bool = False) -> int:
        return int((await self._do("end", xid, suspend=suspend, fail=fail))["code"])

    async def prepare(self, xid: Xid) -> int:
        return int((await self._do("prepare", xid))["code"])

    async def commit(self, xid: Xid, *, one_phase: bool = False) -> None:
        await self._do("commit", xid, one_phase=one_phase)

    async def rollback(self, xid: Xid) -> None:
        await self._do("rollback", xid)

    async def forget(self, xid: Xid) -> None:
        await self._do("forget", xid)

    async def recover(self) -> list[Xid]:
        return [Xid.from_json(x) for x in (await self._do("recover", None)).get("xids", [])]
