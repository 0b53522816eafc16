"""The client side of brokerha's HTTP/JSON APIs: one request, its JSON answer or a ``CtlError``.

``brokerha ctl`` (``admin/ctl.py``) and ``brokerha txlog ctl`` (``txlog/master/ctl.py``)
send every request through ``request``.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any

TIMEOUT = 3.0


class CtlError(Exception):
    """A refused or failed request; ``code`` is the exit code (2: the node did not answer)."""

    def __init__(self, message: str, code: int = 1, status: int | None = None,
                 reason: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status  # the HTTP status of a refusal, and its body's reason
        self.reason = reason


# every request of a command carries --user/--password (main sets them): the node
# answers nothing without credentials, reads included (as RabbitMQ's management API)
CREDENTIALS: dict[str, str] = {"user": "guest", "password": "guest"}


def request(base: str, path: str, *, body: Any = None, user: str | None = None,
            password: str | None = None, timeout: float = TIMEOUT,
            method: str | None = None) -> Any:
    """``method`` defaults to GET, or POST with a ``body``."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data,
                                 method=method or ("GET" if data is None else "POST"))
    req.add_header("Content-Type", "application/json")
    if user is None:
        user, password = CREDENTIALS["user"], CREDENTIALS["password"]
    if user is not None:
        token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        reason = None
        try:
            answer = json.loads(exc.read())
            message = answer.get("error", exc.reason)
            reason = answer.get("reason")
            if reason:  # RabbitMQ's 400s say why there (a text, or an Erlang term as a list)
                message += ": " + (reason if isinstance(reason, str) else json.dumps(reason))
        except (ValueError, AttributeError):
            message = exc.reason
        raise CtlError(f"{base}{path}: {exc.code} {message}", status=exc.code,
                       reason=reason) from exc
    except (urllib.error.URLError, OSError) as exc:
        raise CtlError(f"{base}{path}: cannot reach the node: {exc}", 2) from exc
    except ValueError as exc:
        raise CtlError(f"{base}{path}: not JSON: {exc}") from exc
