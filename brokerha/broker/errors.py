"""Errors the broker model raises, carrying the AMQP reply code they map to.

The broker model does not import the wire protocol; it only knows the numbers,
so that an error raised deep in routing reaches the client with the right code.
"""

from __future__ import annotations


class BrokerError(Exception):
    """An operation refused by the broker; ``code`` is the AMQP reply code."""

    code = 541
    name = "INTERNAL_ERROR"

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    @property
    def reply_text(self) -> str:
        """The text as RabbitMQ formats it: ``NAME - detail``."""
        return f"{self.name} - {self.text}"


class AccessRefused(BrokerError):
    code, name = 403, "ACCESS_REFUSED"


class NotFound(BrokerError):
    code, name = 404, "NOT_FOUND"


class ResourceLocked(BrokerError):
    code, name = 405, "RESOURCE_LOCKED"


class PreconditionFailed(BrokerError):
    code, name = 406, "PRECONDITION_FAILED"


class CommandInvalid(BrokerError):
    """A hard error: closes the connection."""

    code, name = 503, "COMMAND_INVALID"


class NotAllowed(BrokerError):
    """A hard error: closes the connection."""

    code, name = 530, "NOT_ALLOWED"


class NotImplementedByBroker(BrokerError):
    """A hard error: closes the connection."""

    code, name = 540, "NOT_IMPLEMENTED"


class ResourceError(BrokerError):
    code, name = 506, "RESOURCE_ERROR"
