"""The management API's error answer, in RabbitMQ's shape (``management.py`` and the
modules it asks: ``leader_requests.py``, the definitions' and policies' routes)."""

from __future__ import annotations

from brokerha.httpapi.server import Response


class ManagementError(Exception):
    """An answer in RabbitMQ's error shape: ``{"error": ..., "reason": ...}``."""

    def __init__(self, status: int, error: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.error, self.reason = status, error, reason

    def response(self) -> Response:
        if not self.error:
            return Response(self.status, b"")
        return Response.json({"error": self.error, "reason": self.reason}, self.status)
