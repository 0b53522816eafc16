"""XA (DTX) over AMQP 0-9-1 for unmodified clients: control messages.

AMQP 0-9-1 has no dtx class, and pika, aio-pika and kombu cannot send methods
they do not know. So a client drives XA with ordinary ``basic.publish`` on the
channel whose work is transactional:

- exchange ``amq.dtx`` (reserved; it routes nowhere), routing key = the verb:
  ``start``, ``end``, ``prepare``, ``commit``, ``rollback``, ``recover``,
  ``forget``, ``set-timeout``, ``get-timeout``;
- body: JSON ``{"xid": {"format_id": 1, "gtrid": "<hex>", "bqual": "<hex>"},
  "join", "resume", "fail", "suspend", "one_phase": bool, "timeout": seconds}``;
- properties: ``reply_to`` (a queue of the client's) and ``correlation_id``.

The answer is a message on ``reply_to`` with the same correlation id and a
JSON body ``{"verb", "code", "status", "text", "xids", "timeout"}``, where code
and status are XA's (``0``/``XA_OK``, ``-6``/``XAER_PROTO`` …). Because a
channel's frames are handled in order, a ``start`` followed by publishes and
acks on the same channel puts them in the branch, exactly as a dtx.select
would. Verbs that wait (prepare, commit) block the channel until answered.
See docs/dtx.md.

One more verb is not XA's: ``tx-outcome`` with body ``{"tx_id": "..."}`` asks
whether the transaction a client named (header ``x-tx-id``) committed; the
answer's ``outcome`` is ``committed``, ``rolled back`` or ``unknown``. A
commit of that transaction still under way is waited for. See docs/ha.md
("Transactions").
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands

from brokerha.broker.content import build_header, decode_header
from brokerha.broker.dtx import XA, XAError, XaResource, Xid, xtx_partition
from brokerha.broker.errors import PreconditionFailed
from brokerha.broker.message import Message

if TYPE_CHECKING:
    from brokerha.amqp.channel import Channel

log = logging.getLogger(__name__)

DTX_EXCHANGE = "amq.dtx"


def parse_xid(data: Any) -> Xid:
    if not isinstance(data, dict):
        raise XAError(XA.ER_INVAL, "xid must be an object with format_id, gtrid, bqual")
    try:
        xid = Xid(int(data["format_id"]), bytes.fromhex(data["gtrid"]),
                  bytes.fromhex(data.get("bqual", "")))
    except (KeyError, ValueError, TypeError) as exc:
        raise XAError(XA.ER_INVAL, f"malformed xid: {exc}") from exc
    if xtx_partition(xid) is not None:
        # a branch of a transaction across partitions: its partitions decide it, no TM
        raise XAError(XA.ER_INVAL, f"xid {xid.key} names a branch of a transaction across "
                                   "partitions, which is not a TM's to act on")
    return xid


def xid_json(xid: Xid) -> dict[str, Any]:
    return {"format_id": xid.format_id, "gtrid": xid.gtrid.hex(), "bqual": xid.bqual.hex()}


class Control:
    """One control request on one channel, answered once."""

    def __init__(self, ch: Channel, verb: str, request: dict[str, Any], reply_to: str,
                 correlation_id: str | None, manager: XaResource | None = None) -> None:
        self.ch = ch
        self.verb = verb
        self.request = request
        self.reply_to = reply_to
        self.correlation_id = correlation_id
        # a partitioned node's resource manager (``partition/xa.py``), else the broker's
        self.dtx: XaResource = manager if manager is not None else ch.conn.broker.dtx
        # when the answer may go: a partitioned node's manager waits through the groups it
        # serves (``NodeXa.after_durable``): the broker's own gate is the metadata group's,
        # which a node not leading it never passes -- the answer never came (issue 35)
        self.after_durable: Callable[[Callable[[], None]], None] = getattr(
            manager, "after_durable", None) or ch.conn.broker.after_durable

    def flag(self, name: str) -> bool:
        return bool(self.request.get(name, False))

    def run(self) -> None:
        try:
            handler = getattr(self, "verb_" + self.verb.replace("-", "_"), None)
            if handler is None:
                raise XAError(XA.ER_INVAL, f"unknown dtx verb '{self.verb}'")
            handler()
        except XAError as exc:
            self.answer(exc.code, exc.text)

    # -- synchronous verbs ----------------------------------------------------------------

    def verb_start(self) -> None:
        ch = self.ch
        xid = parse_xid(self.request.get("xid"))
        if ch.tx_mode:
            raise XAError(XA.ER_PROTO, "channel is in tx mode")
        if ch.dtx_branch is not None:
            raise XAError(XA.ER_PROTO, f"channel already works for xid {ch.dtx_branch.xid.key}")
        ch.dtx_branch = self.dtx.start(xid, ch, join=self.flag("join"), resume=self.flag("resume"))
        self.answer(XA.OK)

    def verb_end(self) -> None:
        ch = self.ch
        xid = parse_xid(self.request.get("xid"))
        code = self.dtx.end(xid, ch, fail=self.flag("fail"), suspend=self.flag("suspend"))
        if ch.dtx_branch is not None and ch.dtx_branch.xid == xid:
            ch.dtx_branch = None
        self.answer(code)

    def verb_rollback(self) -> None:
        result = self.dtx.rollback(parse_xid(self.request.get("xid")))
        if isinstance(result, XA):
            self.answer(result)
        else:  # a partitioned node's transaction across partitions: its partitions finish it
            self.wait(result, self.answer)

    def verb_forget(self) -> None:
        self.answer(self.dtx.forget(parse_xid(self.request.get("xid"))))

    def verb_recover(self) -> None:
        result = self.dtx.recover()
        if isinstance(result, list):
            self.answer(XA.OK, xids=[xid_json(x) for x in result])
            return

        async def listed() -> XA:  # a partitioned node asks every partition's leader
            self._xids = await result
            return XA.OK

        self.wait(listed(), lambda code: self.answer(code, xids=[xid_json(x)
                                                                  for x in self._xids]))

    def verb_set_timeout(self) -> None:
        try:
            seconds = float(self.request.get("timeout", -1))
        except (TypeError, ValueError) as exc:
            raise XAError(XA.ER_INVAL, "timeout must be a number of seconds") from exc
        self.dtx.set_timeout(parse_xid(self.request.get("xid")), seconds)
        self.answer(XA.OK)

    def verb_get_timeout(self) -> None:
        timeout = self.dtx.get_timeout(parse_xid(self.request.get("xid")))
        self.answer(XA.OK, timeout=timeout)

    def verb_tx_outcome(self) -> None:
        tx_id = self.request.get("tx_id")
        if not isinstance(tx_id, str) or not tx_id:
            raise XAError(XA.ER_INVAL, "tx-outcome needs a tx_id string")
        self.ch.block()  # answered in order, after a commit under way
        self.ch.conn.broker.outcomes.when_known(
            tx_id, lambda outcome: self.answer(XA.OK, outcome=outcome, tx_id=tx_id))

    # -- verbs that wait ----------------------------------------------------------------------

    def verb_prepare(self) -> None:
        self.wait(self.dtx.prepare(parse_xid(self.request.get("xid"))), self.answer)

    def verb_commit(self) -> None:
        xid = parse_xid(self.request.get("xid"))
        one_phase = self.flag("one_phase")
        self.wait(self.dtx.commit(xid, one_phase=one_phase), self.answer)

    _xids: list[Xid] = []

    def wait(self, work: Awaitable[XA], then: Callable[[XA], None]) -> None:
        """Block the channel while ``work`` runs, then answer with its result."""
        ch = self.ch
        broker = ch.conn.broker
        ch.block()
        result: list[XA] = []

        async def run() -> None:
            result.append(await work)

        def done(exc: BaseException | None) -> None:
            if isinstance(exc, XAError):
                self.answer(exc.code, exc.text)
            elif exc is not None:
                log.error("dtx %s failed: %r", self.verb, exc)
                self.answer(XA.ER_RMERR, f"{type(exc).__name__}: {exc}")
            else:
                then(result[0])

        broker.spawn(run(), done)

    # -- the answer -----------------------------------------------------------------------------

    def answer(self, code: XA, text: str = "", **extra: Any) -> None:
        """Publish the result on reply_to once the store has what it covers."""
        ch = self.ch
        body = json.dumps({"verb": self.verb, "code": int(code), "status": code.label,
                           "text": text, **extra}).encode()
        props = commands.Basic.Properties(content_type="application/json",
                                          correlation_id=self.correlation_id,
                                          headers={"x-xa-code": int(code)})
        message = Message("", self.reply_to, build_header(len(body), props), body)

        def deliver() -> None:
            queue = ch.vhost.queues.get(self.reply_to) if ch.vhost else None
            if queue is None:
                log.warning("dtx %s answer %s dropped: no reply queue '%s'", self.verb,
                            code.label, self.reply_to)
            else:
                queue.enqueue(message)
            ch.unblock()

        self.after_durable(deliver)


def handle_control(ch: Channel, verb: str, header: bytes, body: bytes,
                   manager: XaResource | None = None) -> None:
    """``manager``: a partitioned node's XA resource manager (``GroupGuard.
    check_transactions``); None: the broker's ``DtxManager``."""
    try:
        props = decode_header(header).properties
    except (ValueError, OverflowError, OSError, struct.error, RecursionError) as exc:
        # pamqp cannot read them (a reply_to that is not UTF-8, a broken table)
        raise PreconditionFailed(f"dtx control message properties do not decode: {exc}") from None
    if not props.reply_to:
        raise PreconditionFailed("dtx control messages need a reply_to queue")
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        request = None
    control = Control(ch, verb, request if isinstance(request, dict) else {},
                      props.reply_to, props.correlation_id, manager)
    if request is None or not isinstance(request, dict):
        control.answer(XA.ER_INVAL, "body must be a JSON object")
        return
    control.run()
