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

from brokerha.broker.errors import AccessRefused


def hash_password(password: str, salt: bytes | None = None) -> str:
    salt = os.urandom(4) if salt is None else salt
    digest = hashlib.sha256(salt + password.encode("utf-8")).digest()
    return base64.b64encode(salt + digest).decode("ascii")


def check_password(password: str, password_hash: str) -> bool:
    try:
        raw = base64.b64decode(password_hash, validate=True)
    except ValueError:
        return False
    if len(raw) != 36:
        return False
    expected = hash_password(password, raw[:4])
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
    name: str
    password_hash: str
    tags: list[str] = field(default_factory=list)
    permissions: dict[str, Permission] = field(default_factory=dict)

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


class AuthenticationFailed(Exception):
    """Wrong user or password, or a loopback-only user from elsewhere."""


class UserDatabase:
    """All users; ``loopback_users`` may only connect from a loopback address."""

    def __init__(self, loopback_users: tuple[str, ...] = ("guest",)) -> None:
        self.users: dict[str, User] = {}
        self.loopback_users = set(loopback_users)

    def add_user(self, name: str, password: str | None = None, *,
                 password_hash: str | None = None, tags: list[str] | None = None) -> User:
        if password_hash is None:
            if password is None:
                raise ValueError(f"user '{name}' needs a password or a password_hash")
            password_hash = hash_password(password)
        user = User(name, password_hash, list(tags or []))
        self.users[name] = user
        return user

    def set_permissions(self, user: str, vhost: str, configure: str = ".*",
                        write: str = ".*", read: str = ".*") -> None:
        self.users[user].permissions[vhost] = Permission(configure, write, read)

    def authenticate(self, name: str, password: str, peer_host: str | None) -> User:
        user = self.users.get(name)
        if user is None or not check_password(password, user.password_hash):
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
