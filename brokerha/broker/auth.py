"""Users, password hashes and per-vhost permissions, as RabbitMQ has them.

Passwords are stored as RabbitMQ's ``rabbit_password_hashing_sha256`` hashes
(base64 of a 4-byte salt followed by SHA-256(salt + password)), so user
definitions can move between RabbitMQ and brokerha. Permissions are three
regular expressions per user and vhost: configure, write, read.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Any

from brokerha.broker import definitions as D
from brokerha.broker.definitions import DefinitionChange, Definitions
from brokerha.broker.errors import AccessRefused

# RabbitMQ's password hashing modules: the digest of a 4-byte salt and the password
HASHES = {
    "rabbit_password_hashing_sha256": hashlib.sha256,
    "rabbit_password_hashing_sha512": hashlib.sha512,
    "rabbit_password_hashing_md5": hashlib.md5,
}
SHA256 = D.SHA256


def hash_password(password: str, salt: bytes | None = None, algorithm: str = SHA256) -> str:
    salt = os.urandom(4) if salt is None else salt
    digest = HASHES[algorithm](salt + password.encode("utf-8")).digest()
    return base64.b64encode(salt + digest).decode("ascii")


def check_password(password: str, password_hash: str, algorithm: str = SHA256) -> bool:
    hasher = HASHES.get(algorithm)
    try:
        raw = base64.b64decode(password_hash, validate=True)
    except ValueError:
        return False
    if hasher is None or len(raw) != 4 + hasher().digest_size:
        return False
    expected = hash_password(password, raw[:4], algorithm)
    return hmac.compare_digest(expected, password_hash)


@dataclass
class Permission:
    configure: str = ".*"
    write: str = ".*"
    read: str = ".*"

    def __post_init__(self) -> None:
        self._compiled = {
            kind: re.compile(getattr(self, kind)) for kind in ("configure", "write", "read")
        }

    def allows(self, kind: str, name: str) -> bool:
        return self._compiled[kind].match(name) is not None


@dataclass
class User:
    """A user as a connection holds it: kept up to date by its ``UserDatabase``.

    A connection keeps the object it logged in with, so a changed or revoked
    permission refuses its next operation, and a deleted user's object has
    no permissions left (its connections are closed, ``node/server.py``).
    """

    name: str
    password_hash: str
    tags: list[str] = field(default_factory=list)
    permissions: dict[str, Permission] = field(default_factory=dict)
    hashing_algorithm: str = SHA256
    # (vhost, exchange) -> the topic permission's write and read patterns
    topic_permissions: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    deleted: bool = False

    def check(self, kind: str, vhost: str, resource: str, name: str) -> None:
        """Raise AccessRefused (403) unless ``kind`` access to ``name`` is granted.

        ``resource`` is 'queue' or 'exchange'. The default exchange is named
        'amq.default' in permission checks, as in RabbitMQ.
        """
        perm = self.permissions.get(vhost)
        checked = name or "amq.default"
        if perm is None or not perm.allows(kind, checked):
            raise AccessRefused(
                f"access to {resource} '{checked}' in vhost '{vhost}' refused for user '{self.name}'"
            )

    def check_topic(self, kind: str, vhost: str, exchange: str, routing_key: str) -> None:
        """RabbitMQ's topic authorisation (``rabbit_auth_backend_internal:check_topic_access``).

        Only for topic exchanges (the caller's to decide); no topic permission
        for the exchange allows every routing key. ``{username}`` and
        ``{vhost}`` in a pattern stand for the user's name and the vhost.
        """
        if not self.topic_permissions:
            return
        found = self.topic_permissions.get((vhost, exchange))
        if found is None:
            return
        pattern = (found[kind].replace("{username}", re.escape(self.name))
                   .replace("{vhost}", re.escape(vhost)))
        if re.match(pattern, routing_key) is None:
            raise AccessRefused(
                f"access to topic '{routing_key}' in exchange '{exchange}' in vhost "
                f"'{vhost}' refused for user '{self.name}'")


class AuthenticationFailed(Exception):
    """Wrong user or password, or a loopback-only user from elsewhere."""


class UserDatabase:
    """Every user, as the broker's ``Definitions`` say (``broker/definitions.py``).

    A listener of the definitions keeps one ``User`` per user name, changed in
    place, so that connections see a change at once; ``add_user`` and
    ``set_permissions`` are definition changes. ``loopback_users`` may only
    connect from a loopback address.
    """

    def __init__(self, loopback_users: tuple[str, ...] = ("guest",),
                 definitions: Definitions | None = None) -> None:
        self.users: dict[str, User] = {}
        self.loopback_users = set(loopback_users)
        self.definitions = definitions if definitions is not None else Definitions()
        for change in self.definitions.changes():
            self._changed(change)
        self.definitions.subscribe(self._changed)

    def add_user(self, name: str, password: str | None = None, *,
                 password_hash: str | None = None, tags: list[str] | None = None) -> User:
        if password_hash is None:
            if password is None:
                raise ValueError(f"user '{name}' needs a password or a password_hash")
            password_hash = hash_password(password)
        self.definitions.apply(D.user_set(name, password_hash, tags or []))
        return self.users[name]

    def set_permissions(self, user: str, vhost: str, configure: str = ".*",
                        write: str = ".*", read: str = ".*") -> None:
        self.definitions.apply(D.permission_set(user, vhost, configure, write, read))

    def _changed(self, change: DefinitionChange) -> None:
        kind, key, value = change.kind, change.key, change.value
        if kind == D.USER:
            self._user_changed(key[0], value)
            return
        user = self.users.get(key[0])
        if user is None:
            return
        if kind == D.PERMISSION:
            if value is None:
                user.permissions.pop(key[1], None)
            else:
                user.permissions[key[1]] = Permission(value["configure"], value["write"],
                                                      value["read"])
        elif kind == D.TOPIC_PERMISSION:
            if value is None:
                user.topic_permissions.pop((key[1], key[2]), None)
            else:
                user.topic_permissions[(key[1], key[2])] = {"write": value["write"],
                                                            "read": value["read"]}

    def _user_changed(self, name: str, value: dict[str, Any] | None) -> None:
        user = self.users.get(name)
        if value is None:
            if user is not None:
                del self.users[name]
                user.deleted = True
                user.permissions.clear()
                user.topic_permissions.clear()
            return
        if user is None:
            user = self.users[name] = User(name, value["password_hash"])
        user.password_hash = value["password_hash"]
        user.hashing_algorithm = value.get("hashing_algorithm", SHA256)
        user.tags = list(value.get("tags", []))

    def authenticate(self, name: str, password: str, peer_host: str | None) -> User:
        if password == "":  # RabbitMQ's internal backend: a blank password never logs in
            raise AuthenticationFailed(f"user '{name}' attempted to log in with a blank "
                                       "password, which is prohibited by the internal "
                                       "authN backend")
        user = self.users.get(name)
        if user is None or not check_password(password, user.password_hash,
                                                user.hashing_algorithm):
            raise AuthenticationFailed(f"user '{name}' - invalid credentials")
        return self._from(user, peer_host)

    def authenticate_external(self, name: str, peer_host: str | None) -> User:
        """The user a verified client certificate names (SASL EXTERNAL): no password."""
        user = self.users.get(name)
        if user is None:
            raise AuthenticationFailed(f"user '{name}' - invalid credentials")
        return self._from(user, peer_host)

    def _from(self, user: User, peer_host: str | None) -> User:
        if user.name in self.loopback_users and not _is_loopback(peer_host):
            raise AuthenticationFailed(
                f"user '{user.name}' can only connect via localhost"
            )
        return user


def _is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"
