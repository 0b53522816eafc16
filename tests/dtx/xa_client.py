"""An XA test client: an XA channel, a confirming plain channel, and requests sent blind.

Shared by the crash loops on one node (tests/dtx/test_dtx_crash.py) and on a
cluster (tests/failover/test_dtx_failover.py).
"""

from __future__ import annotations

import uuid

import pika
import pika.exceptions

from brokerha.client.dtx import PikaXAResource
from brokerha.client.dtx.resources import DTX_EXCHANGE, Xid, _request

OUT = "xa-out"


class XAClient:
    def __init__(self, conn: pika.BlockingConnection) -> None:
        self.conn = conn
        self.channel = conn.channel()
        self.xa = PikaXAResource(self.channel)
        self.plain = conn.channel()
        self.plain.confirm_delivery()
        self.plain.queue_declare(OUT, durable=True)

    def send_only(self, verb: str, xid: Xid) -> None:
        """The XA request goes out; its answer is never read."""
        props = pika.BasicProperties(reply_to=self.xa.reply_queue, correlation_id=uuid.uuid4().hex,
                                     content_type="application/json")
        self.channel.basic_publish(DTX_EXCHANGE, verb, _request(xid), props)
        self.conn.process_data_events(time_limit=0)  # flush the frame to the socket

    def close(self) -> None:
        try:
            if self.conn.is_open:
                self.conn.close()
        except (pika.exceptions.AMQPError, OSError):
            pass
