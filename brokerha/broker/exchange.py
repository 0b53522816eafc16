"""Exchanges and their routing: direct, fanout, topic, headers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from brokerha.broker.message import Message
    from brokerha.broker.queue import Queue

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers")


@dataclass(eq=False)
class Binding:
    """source --routing_key/arguments--> destination (a queue or an exchange)."""

    source: Exchange
    destination: Queue | Exchange
    routing_key: str
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str, tuple[tuple[str, Any], ...]]:
        kind = "exchange" if isinstance(self.destination, Exchange) else "queue"
        return (kind, self.destination.name, self.routing_key, _freeze(self.arguments))


def _freeze(args: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, repr(v)) for k, v in args.items()))


class Exchange:
    """Common state; subclasses decide which bindings match a message."""

    type = "direct"

    def __init__(self, vhost: str, name: str, *, durable: bool = False,
                 auto_delete: bool = False, internal: bool = False,
                 arguments: dict[str, Any] | None = None) -> None:
        self.vhost = vhost
        self.name = name
        self.durable = durable
        self.auto_delete = auto_delete
        self.internal = internal
        self.arguments = dict(arguments or {})
        self.bindings: dict[tuple[Any, ...], Binding] = {}
        self.deleted = False
        # a policy's alternate-exchange (broker/policy_effects.py); the argument wins over it
        self.policy_alternate: str | None = None

    @property
    def alternate(self) -> str | None:
        value = self.arguments.get("alternate-exchange", self.policy_alternate)
        return value if isinstance(value, str) and value else None

    def add_binding(self, binding: Binding) -> bool:
        """Add; False if an identical binding exists already."""
        if binding.key in self.bindings:
            return False
        self.bindings[binding.key] = binding
        self._changed()
        return True

    def remove_binding(self, key: tuple[Any, ...]) -> Binding | None:
        binding = self.bindings.pop(key, None)
        if binding is not None:
            self._changed()
        return binding

    def _changed(self) -> None:
        """Bindings changed: drop any derived index."""

    def match(self, routing_key: str, message: Message) -> list[Binding]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.vhost!r}, {self.name!r})"


class DirectExchange(Exchange):
    type = "direct"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._index: dict[str, list[Binding]] | None = None
        super().__init__(*args, **kwargs)

    def _changed(self) -> None:
        self._index = None

    def match(self, routing_key: str, message: Message) -> list[Binding]:
        if self._index is None:
            index: dict[str, list[Binding]] = {}
            for b in self.bindings.values():
                index.setdefault(b.routing_key, []).append(b)
            self._index = index
        return self._index.get(routing_key, [])


class FanoutExchange(Exchange):
    type = "fanout"

    def match(self, routing_key: str, message: Message) -> list[Binding]:
        return list(self.bindings.values())


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching: ``*`` is exactly one word, ``#`` zero or more words."""
    return _words_match(tuple(pattern.split(".")), tuple(routing_key.split(".")))


def _words_match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    # iterative two-pointer match with backtracking to the last '#'
    p = w = 0
    star_p, star_w = -1, 0
    while w < len(words):
        if p < len(pattern) and pattern[p] == "#":
            star_p, star_w = p, w
            p += 1
        elif p < len(pattern) and pattern[p] in ("*", words[w]):
            p += 1
            w += 1
        elif star_p >= 0:
            star_w += 1
            p, w = star_p + 1, star_w
        else:
            return False
    while p < len(pattern) and pattern[p] == "#":
        p += 1
    return p == len(pattern)


class TopicExchange(Exchange):
    type = "topic"
    _CACHE_LIMIT = 4096

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._cache: dict[str, list[Binding]] = {}
        super().__init__(*args, **kwargs)

    def _changed(self) -> None:
        self._cache = {}

    def match(self, routing_key: str, message: Message) -> list[Binding]:
        hit = self._cache.get(routing_key)
        if hit is not None:
            return hit
        hit = [b for b in self.bindings.values() if topic_matches(b.routing_key, routing_key)]
        if len(self._cache) >= self._CACHE_LIMIT:
            self._cache.clear()
        self._cache[routing_key] = hit
        return hit


class HeadersExchange(Exchange):
    type = "headers"

    def match(self, routing_key: str, message: Message) -> list[Binding]:
        if not self.bindings:
            return []
        headers = message.headers
        return [b for b in self.bindings.values() if headers_match(b.arguments, headers)]


def headers_match(arguments: dict[str, Any], headers: dict[str, Any]) -> bool:
    """RabbitMQ's rule: x-match all (default) or any; keys starting with x- are ignored."""
    mode = arguments.get("x-match", "all")
    wanted = [(k, v) for k, v in arguments.items() if not k.startswith("x-")]
    if mode == "any":
        return any(_header_ok(headers, k, v) for k, v in wanted)
    return all(_header_ok(headers, k, v) for k, v in wanted)


def _header_ok(headers: dict[str, Any], key: str, value: Any) -> bool:
    if key not in headers:
        return False
    # a binding argument with no value (void) matches any value of that header
    return value is None or headers[key] == value


EXCHANGE_CLASSES: dict[str, type[Exchange]] = {
    "direct": DirectExchange,
    "fanout": FanoutExchange,
    "topic": TopicExchange,
    "headers": HeadersExchange,
}
