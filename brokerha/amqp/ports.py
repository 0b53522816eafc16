"""What a channel needs of its connection, as a Protocol.

Channels and method handlers depend on this contract, not on the connection
class, so the connection (which owns channels) sits above them with no import
running back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from brokerha.amqp.errors import AMQPError
    from brokerha.amqp.frames import Frame, Publish
    from brokerha.broker.auth import User
    from brokerha.broker.broker import Broker
    from brokerha.broker.queue import Queue
    from brokerha.broker.vhost import VirtualHost

MethodHandler = Callable[[Any, Any], None]
PublishHandler = Callable[[Any, "Publish", bytes, bytes], None]


class ConnectionPort(Protocol):
    broker: Broker
    vhost: VirtualHost | None
    user: User | None
    frame_max: int
    writable: bool
    has_published: bool
    exclusive_queues: dict[str, Queue]
    handlers: Mapping[type, MethodHandler]  # channel methods by pamqp type

    @property
    def publish_handler(self) -> PublishHandler:
        """basic.publish once its content is complete (read-only: a static method will do)."""

    def write(self, data: bytes) -> None: ...
    def send_method(self, channel: int, method: Any) -> None: ...
    def capability(self, name: str) -> bool: ...
    def confirms_pending(self, channel: Any) -> None: ...
    def decode_method(self, index: int, payload: bytes) -> Any: ...
    def handle_channel_frame(self, channel: Any, frame: Frame) -> None: ...
    def join_body(self, channel: int, parts: list[bytes],
                  then: Callable[[bytes], None]) -> None:
        """``then(b"".join(parts))`` -- on a thread if the transport offers one, this
        connection's later frames held until ``then`` ran (errors are ``channel``'s)."""
    def fail(self, channel: Any, exc: AMQPError) -> None: ...
    def close_channel_by_peer(self, channel: Any) -> None: ...
