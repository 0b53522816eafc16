"""Node-to-node messages: one dataclass per packet code (seed 004's packet table).

A packet on the wire is the msgpack array ``[msg_id, code, args]`` where
``args`` is the message's fields in declaration order (``astuple`` order).
Every module that speaks on the cluster link declares its messages here or
with ``@packet(code)`` in its own module; the codec (``cluster.protocol``)
finds the class by code. Codes are small integers grouped by concern:

====  ======================================
0-9   link: Error, identification, ping
10-29 election and membership
30-59 replication (configuration, queues)
60-79 transactions (tx-queues, verification)
80-99 admin over the cluster port
====  ======================================

Every election and replication message carries the sender's ``epoch``
(architecture.md): a receiver compares it before anything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, dataclass_transform

T = TypeVar("T")

REGISTRY: dict[int, type[Message]] = {}


class Message:
    """Base of every packet body; subclasses are dataclasses registered with ``@packet``."""

    CODE: ClassVar[int]
    # sent alike to several peers (a primary's events to its backups): the codec
    # packs its args once and keeps them on the object (PacketCodec.encode_parts)
    ENCODE_ONCE: ClassVar[bool] = False

    def to_args(self) -> list[Any]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]  # type: ignore[arg-type]

    @classmethod
    def from_args(cls, args: list[Any]) -> Message:
        """Build from wire args; raises TypeError/ValueError on a wrong shape."""
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        if not isinstance(args, list) or len(args) != len(fields):
            raise TypeError(f"{cls.__name__} takes {len(fields)} args, got {args!r:.80}")
        return cls(*args)


@dataclass_transform()
def packet(code: int) -> Callable[[type[T]], type[T]]:
    """Class decorator: make ``cls`` a frozen-free dataclass and register it under ``code``."""

    def wrap(cls: type[T]) -> type[T]:
        if code in REGISTRY:
            raise ValueError(f"packet code {code} registered twice "
                             f"({REGISTRY[code].__name__}, {cls.__name__})")
        dc = dataclasses.dataclass(cls)
        dc.CODE = code  # type: ignore[attr-defined]
        REGISTRY[code] = dc  # type: ignore[assignment]
        return dc

    return wrap


@packet(0)
class Error(Message):
    """The generic error answer (seed 004): ``code`` from ErrorCode, a human message."""

    code: str
    message: str


class ErrorCode:
    PROTOCOL = "protocol-error"      # malformed packet, unknown code, wrong shape
    NOT_READY = "not-ready"          # the receiver cannot answer that now
    OLD_EPOCH = "old-epoch"          # the sender's epoch is older than ours
    REFUSED = "refused"              # identification or authentication refused
    NOT_PRIMARY = "not-primary"      # a request only the primary answers
    UNKNOWN = "unknown"              # names something the receiver does not have
