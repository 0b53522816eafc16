"""Protocol errors: each carries the reply code and the method that caused it."""

from __future__ import annotations

from typing import Any

from brokerha.amqp import constants as C


class AMQPError(Exception):
    """An error to report to the peer with ``channel.close`` or ``connection.close``."""

    def __init__(self, code: int, text: str, class_id: int = 0, method_id: int = 0) -> None:
        name = C.REPLY_NAMES.get(code, "ERROR")
        full = text if text.startswith(name) else f"{name} - {text}"
        super().__init__(full)
        self.code = code
        self.text = reply_text(full)
        self.class_id = class_id
        self.method_id = method_id

    @property
    def closes_connection(self) -> bool:
        return self.code not in C.CHANNEL_LEVEL


def reply_text(text: str) -> str:
    """``text`` as a reply-text short string: at most 255 octets of UTF-8.

    A longer text keeps its first 252 octets and ends in "...", as RabbitMQ cuts
    it (rabbit_binary_generator); counted in octets, not characters, so that a
    name beyond ASCII cannot make the close itself fail to encode.
    """
    raw = text.encode("utf-8", "replace")  # a lone surrogate (surrogateescape) becomes "?"
    if len(raw) > 255:
        return raw[:252].decode("utf-8", "ignore") + "..."
    return raw.decode("utf-8")


class FrameError(AMQPError):
    """Broken framing: the stream cannot be trusted any more (501).

    ``frames``: the complete frames that came before the broken one in the same
    read (``FrameReader.frames``), handled before the error, as RabbitMQ reads a
    stream frame by frame: a connection.close ahead of garbage is still answered.
    """

    def __init__(self, text: str) -> None:
        super().__init__(C.FRAME_ERROR, text)
        self.frames: list[Any] = []


class ProtocolHeaderMismatch(Exception):
    """The peer did not open with ``AMQP 0-9-1``; the spec says: send ours and close."""
