"""A consumer on a channel: the queue's view of a basic.consume."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from brokerha.broker.content import pack_shortstr

if TYPE_CHECKING:
    from brokerha.broker.message import Entry
    from brokerha.broker.queue import Queue


class ConsumerOwner(Protocol):
    """The channel a consumer belongs to, as the consumer sees it."""

    def can_deliver(self, no_ack: bool) -> bool: ...
    def deliver(self, consumer: ChannelConsumer, queue: Queue, entry: Entry) -> None: ...
    def consumer_cancelled_by_server(self, consumer: ChannelConsumer) -> None: ...


class ChannelConsumer:
    """Implements brokerha.broker.queue.Consumer for one consumer tag."""

    __slots__ = ("tag", "no_ack", "exclusive", "channel", "queue", "prefetch", "unacked",
                 "arguments", "packed_tag")

    def __init__(self, channel: ConsumerOwner, queue: Queue, tag: str, *, no_ack: bool,
                 exclusive: bool, prefetch: int, arguments: dict[str, object]) -> None:
        self.channel = channel
        self.queue = queue
        self.tag = tag
        self.packed_tag = pack_shortstr(tag)
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.prefetch = prefetch
        self.unacked = 0
        self.arguments = arguments

    def can_take(self) -> bool:
        if self.prefetch and self.unacked >= self.prefetch and not self.no_ack:
            return False
        return self.channel.can_deliver(self.no_ack)

    def deliver(self, queue: Queue, entry: Entry) -> None:
        self.channel.deliver(self, queue, entry)

    def cancelled_by_server(self, queue: Queue) -> None:
        self.channel.consumer_cancelled_by_server(self)


class Delivery:
    """An unacknowledged delivery: where it came from and who got it (None: basic.get)."""

    __slots__ = ("queue", "entry", "consumer")

    def __init__(self, queue: Queue, entry: Entry, consumer: ChannelConsumer | None) -> None:
        self.queue = queue
        self.entry = entry
        self.consumer = consumer
