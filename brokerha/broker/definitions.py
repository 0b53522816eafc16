"""The definitions: vhosts, users, permissions, topic permissions and policies, as data.

One ``Definitions`` per broker is the single source of truth for what
RabbitMQ keeps in its schema database: who may log in, with which password
hash and tags, to which vhosts, with which permissions, and which policies
apply. They change at runtime (management API, ``brokerha ctl``, definitions
import), are persisted in the store, replicated to the HA backups and
recovered at start, so they survive restarts and failover.

Every change, whatever its kind, is one record, ``DefinitionChange(kind, key,
value)`` (``value`` None: the definition is deleted), applied by one method,
``apply``, which tells the listeners (``subscribe``). So persisting a change
(the store), replicating it (the HA primary), applying it on a backup
(``BrokerReplicator``) and acting on it (users and permissions in
``broker/auth.py``, vhosts in ``broker/broker.py``, policies in
``broker/policy_effects.py``, closing connections in ``node/server.py``) are
one code path each, for every kind.

``apply`` stores what it is given: checking a request (RabbitMQ's 400
answers) is the caller's. A delete that cascades as RabbitMQ's (a user's
permissions with the user, a vhost's permissions and policies with the vhost)
is a list of changes, dependents first (``deleting``), so that every node
applies and stores exactly the same records.

Values are RabbitMQ-shaped JSON objects:

==================  ==========================  ==============================================
kind                key                         value
==================  ==========================  ==============================================
vhost               (name,)                     description, tags, default_queue_type (or None)
user                (name,)                     password_hash, hashing_algorithm, tags
permission          (user, vhost)               configure, write, read (regular expressions)
topic_permission    (user, vhost, exchange)     write, read (regular expressions)
policy              (vhost, name)               pattern, apply-to, definition, priority
operator_policy     (vhost, name)               the same (``broker/policies.py`` reads them)
==================  ==========================  ==============================================
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

VHOST = "vhost"
USER = "user"
PERMISSION = "permission"
TOPIC_PERMISSION = "topic_permission"
POLICY = "policy"  # the same names as broker/policies.py's POLICY and OPERATOR_POLICY
OPERATOR_POLICY = "operator_policy"
#: every kind, in the order a whole set is applied (what others refer to first)
KINDS = (VHOST, USER, PERMISSION, TOPIC_PERMISSION, POLICY, OPERATOR_POLICY)
KEY_FIELDS: dict[str, tuple[str, ...]] = {
    VHOST: ("name",),
    USER: ("name",),
    PERMISSION: ("user", "vhost"),
    TOPIC_PERMISSION: ("user", "vhost", "exchange"),
    POLICY: ("vhost", "name"),
    OPERATOR_POLICY: ("vhost", "name"),
}

SHA256 = "rabbit_password_hashing_sha256"  # RabbitMQ's default, the one brokerha checks
DEFAULT_PERMISSION = {"configure": ".*", "write": ".*", "read": ".*"}

Value = dict[str, Any]
Key = tuple[str, ...]


@dataclass(frozen=True)
class DefinitionChange:
    """One definition set (``value``) or deleted (``value`` None)."""

    kind: str
    key: Key
    value: Value | None

    def __post_init__(self) -> None:
        fields = KEY_FIELDS.get(self.kind)
        if fields is None:
            raise ValueError(f"unknown definition kind {self.kind!r}")
        if len(self.key) != len(fields) or not all(isinstance(k, str) for k in self.key):
            raise ValueError(f"a {self.kind} is keyed by {', '.join(fields)}: {self.key!r}")

    @property
    def deleted(self) -> bool:
        return self.value is None

    def as_wire(self) -> list[Any]:
        """[kind, key, value as JSON text or None]: for the store and replication."""
        return [self.kind, list(self.key), None if self.value is None else encode(self.value)]

    @classmethod
    def from_wire(cls, data: Iterable[Any]) -> DefinitionChange:
        kind, key, value = data
        return cls(str(kind), tuple(key), None if value is None else decode(value))


def encode(value: Value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def decode(text: str | bytes) -> Value:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"a definition is a JSON object, not {text!r:.40}")
    return value


def key_of(kind: str, key: Key) -> str:
    """The key as one text (the store's column): a JSON array."""
    return json.dumps([kind, *key], separators=(",", ":"))


Listener = Callable[[DefinitionChange], None]


class Definitions:
    """The broker's definitions (see the module's docstring)."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[Key, Value]] = {kind: {} for kind in KINDS}
        self._listeners: list[Listener] = []
        # True while ``restore`` applies what the store recovered: the store does not
        # write it again (the listeners still act on it)
        self.restoring = False

    # -- reading -------------------------------------------------------------------------

    def get(self, kind: str, *key: str) -> Value | None:
        return self.tables[kind].get(key)

    def items(self, kind: str) -> list[tuple[Key, Value]]:
        """The kind's definitions, sorted by key."""
        return sorted(self.tables[kind].items())

    @property
    def vhosts(self) -> dict[str, Value]:
        return {key[0]: value for key, value in self.tables[VHOST].items()}

    @property
    def users(self) -> dict[str, Value]:
        return {key[0]: value for key, value in self.tables[USER].items()}

    def permissions(self, *, user: str | None = None,
                    vhost: str | None = None) -> list[tuple[Key, Value]]:
        """Permissions, of one user and/or in one vhost, sorted by (user, vhost)."""
        return self._matching(PERMISSION, user, vhost)

    def topic_permissions(self, *, user: str | None = None,
                          vhost: str | None = None) -> list[tuple[Key, Value]]:
        return self._matching(TOPIC_PERMISSION, user, vhost)

    def _matching(self, kind: str, user: str | None, vhost: str | None) -> list[tuple[Key, Value]]:
        return [(k, v) for k, v in self.items(kind)
                if (user is None or k[0] == user) and (vhost is None or k[1] == vhost)]

    def __len__(self) -> int:
        return sum(len(table) for table in self.tables.values())

    def changes(self) -> list[DefinitionChange]:
        """Everything, as the changes that make it from nothing (kinds in ``KINDS`` order)."""
        return [DefinitionChange(kind, key, value)
                for kind in KINDS for key, value in self.items(kind)]

    # -- changing ------------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` after each change is applied; returns what unsubscribes it
        (once or more)."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def apply(self, change: DefinitionChange) -> Value | None:
        """Apply one change and tell the listeners (in subscription order); the old value.

        A delete of what is not there changes nothing and tells nobody.
        """
        table = self.tables[change.kind]
        if change.value is None:
            old = table.pop(change.key, None)
            if old is None:
                return None
        else:
            old = table.get(change.key)
            if old == change.value:
                return old
            table[change.key] = dict(change.value)
        for listener in list(self._listeners):
            listener(change)
        return old

    def apply_all(self, changes: Iterable[DefinitionChange]) -> None:
        for change in changes:
            self.apply(change)

    def restore(self, changes: Iterable[DefinitionChange]) -> None:
        """What the store recovered: applied, acted on, not written again."""
        self.restoring = True
        try:
            self.apply_all(changes)
        finally:
            self.restoring = False

    def changes_to(self, target: Iterable[DefinitionChange]) -> list[DefinitionChange]:
        """The changes that make these definitions equal to ``target`` (a whole set).

        Deletes first, dependents before what they refer to (reverse ``KINDS``
        order), then sets in ``KINDS`` order: a backup applies a primary's
        whole set with this, as the store's records, one by one.
        """
        wanted: dict[str, dict[Key, Value]] = {kind: {} for kind in KINDS}
        for change in target:
            if change.value is not None:
                wanted[change.kind][change.key] = change.value
        deletes = [DefinitionChange(kind, key, None) for kind in reversed(KINDS)
                   for key in sorted(self.tables[kind]) if key not in wanted[kind]]
        sets = [DefinitionChange(kind, key, value) for kind in KINDS
                for key, value in sorted(wanted[kind].items())
                if self.tables[kind].get(key) != value]
        return deletes + sets

    # -- deletes that cascade, as RabbitMQ's ----------------------------------------------

    def deleting(self, kind: str, *key: str) -> list[DefinitionChange]:
        """The changes that delete a definition and what depends on it, dependents first.

        A user's permissions and topic permissions go with the user; a vhost's
        permissions, topic permissions, policies and operator policies with
        the vhost (RabbitMQ's ``rabbit_auth_backend_internal:delete_user`` and
        ``rabbit_vhost:delete``). Nothing if the definition is not there.
        """
        if key not in self.tables[kind]:
            return []
        out: list[DefinitionChange] = []
        if kind == USER:
            (user,) = key
            for dep in (PERMISSION, TOPIC_PERMISSION):
                out += [DefinitionChange(dep, k, None) for k in sorted(self.tables[dep])
                        if k[0] == user]
        elif kind == VHOST:
            (vhost,) = key
            for dep in (PERMISSION, TOPIC_PERMISSION):
                out += [DefinitionChange(dep, k, None) for k in sorted(self.tables[dep])
                        if k[1] == vhost]
            for dep in (POLICY, OPERATOR_POLICY):
                out += [DefinitionChange(dep, k, None) for k in sorted(self.tables[dep])
                        if k[0] == vhost]
        out.append(DefinitionChange(kind, key, None))
        return out

    def delete(self, kind: str, *key: str) -> bool:
        """Delete a definition and its dependents; whether it was there."""
        changes = self.deleting(kind, *key)
        self.apply_all(changes)
        return bool(changes)


# -- values --------------------------------------------------------------------------------

def vhost_value(description: str = "", tags: Iterable[str] = (),
                default_queue_type: str | None = None) -> Value:
    value: Value = {"description": description, "tags": list(tags)}
    if default_queue_type is not None:
        value["default_queue_type"] = default_queue_type
    return value


def user_value(password_hash: str, tags: Iterable[str] = (),
               hashing_algorithm: str = SHA256) -> Value:
    return {"password_hash": password_hash, "hashing_algorithm": hashing_algorithm,
            "tags": list(tags)}


def permission_value(configure: str = ".*", write: str = ".*", read: str = ".*") -> Value:
    return {"configure": configure, "write": write, "read": read}


def topic_permission_value(write: str = ".*", read: str = ".*") -> Value:
    return {"write": write, "read": read}


def vhost_set(name: str, **metadata: Any) -> DefinitionChange:
    return DefinitionChange(VHOST, (name,), vhost_value(**metadata))


def user_set(name: str, password_hash: str, tags: Iterable[str] = (),
             hashing_algorithm: str = SHA256) -> DefinitionChange:
    return DefinitionChange(USER, (name,), user_value(password_hash, tags, hashing_algorithm))


def permission_set(user: str, vhost: str, configure: str = ".*", write: str = ".*",
                   read: str = ".*") -> DefinitionChange:
    return DefinitionChange(PERMISSION, (user, vhost), permission_value(configure, write, read))


def topic_permission_set(user: str, vhost: str, exchange: str, write: str = ".*",
                         read: str = ".*") -> DefinitionChange:
    return DefinitionChange(TOPIC_PERMISSION, (user, vhost, exchange),
                            topic_permission_value(write, read))
