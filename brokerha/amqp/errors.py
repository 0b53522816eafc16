"""Protocol errors: each carries the reply code and the method that caused it."""

from __future__ import annotations

from brokerha.amqp import constants as C


class AMQPError(Exception):
    """An error to report to the peer with ``channel.close`` or ``connection.close``."""

    def __init__(self, code: int, text: str, class_id: int = 0, method_id: int = 0) -> None:
        name = C.REPLY_NAMES.get(code, "ERROR")
        full = text if text.startswith(name) else f"{name} - {text}"
        super().__init__(full)
        self.code = code
        self.text = full[:255]
        self.class_id = class_id
        self.method_id = method_id

    @property
    def closes_connection(self) -> bool:
        return self.code not in C.CHANNEL_LEVEL


class FrameError(AMQPError):
    """Broken framing: the stream cannot be trusted any more (501)."""

    def __init__(self, text: str) -> None:
        super().__init__(C.FRAME_ERROR, text)


class ProtocolHeaderMismatch(Exception):
    """The peer did not open with ``AMQP 0-9-1``; the spec says: send ours and close."""
