"""Fixtures for the client conformance suite (pika, aio-pika, kombu/Celery, raw frames).

The suite's expectations are RabbitMQ's actual answers. It runs against:

* a brokerha node started with :class:`brokerha.testing.NodeProcess` (default), or
* any broker named by ``BROKERHA_TEST_URL`` — this is how the suite is validated
  against a private RabbitMQ::

      python benchmarks/rabbitmq_ref.py --port 5699   # foreground; prints its rabbitmqctl line
      BROKERHA_TEST_URL=amqp://guest:guest@127.0.0.1:5699/%2F \\
      BROKERHA_TEST_RABBITMQCTL="<the rabbitmqctl line it printed>" \\
          .venv/bin/pytest tests/clients -p no:cacheprovider -q

Users, vhosts and permissions
-----------------------------
Tests that need more than ``guest`` use the ``broker_with_users`` fixture. The
accounts come from :data:`ACCESS`, applied

* to brokerha through ``brokerha node --config FILE``, FILE being TOML of this
  exact shape (all three tables optional, each an array of tables)::

      [[users]]
      name = "alice"            # required
      password = "secret"       # required, clear text; the node stores a hash
      tags = ["management"]     # optional, default []

      [[vhosts]]
      name = "vh1"              # required

      [[permissions]]
      user = "alice"            # required, must be a user from [[users]] or guest
      vhost = "vh1"             # required, must be "/" or a vhost from [[vhosts]]
      configure = "^alice-.*"   # required, regular expressions as RabbitMQ's:
      write = ".*"              #   "" matches nothing, ".*" everything, matched
      read = ".*"               #   against the whole resource name

  The users/vhosts in the file come *in addition to* the defaults: vhost "/"
  and user guest/guest (full permissions on "/", loopback only).

* to RabbitMQ through ``rabbitmqctl add_vhost / add_user / set_permissions``,
  using the command given in ``BROKERHA_TEST_RABBITMQCTL`` (e.g.
  ``"rabbitmqctl -n conf@localhost"``); without it those tests are skipped when
  ``BROKERHA_TEST_URL`` is set.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import pika
import pytest

ACCESS: dict[str, list[dict[str, str]]] = {
    "users": [
        {"name": "alice", "password": "secret"},
        {"name": "bob", "password": "hunter2"},
    ],
    "vhosts": [{"name": "vh1"}],
    "permissions": [
        # alice may create only alice-* things, write only to alice-* things, read all
        {"user": "alice", "vhost": "vh1", "configure": "^alice-.*", "write": "^alice-.*",
         "read": ".*"},
        # bob has a user but no permissions anywhere: connecting to vh1 → 530
    ],
}


@dataclass(frozen=True)
class Broker:
    host: str
    port: int
    vhost: str = "/"
    user: str = "guest"
    password: str = "guest"

    @property
    def url(self) -> str:
        return self.url_for(self.user, self.password, self.vhost)

    def url_for(self, user: str, password: str, vhost: str = "/") -> str:
        return (f"amqp://{quote(user, safe='')}:{quote(password, safe='')}"
                f"@{self.host}:{self.port}/{quote(vhost, safe='')}")

    def params(self, user: str | None = None, password: str | None = None,
               vhost: str | None = None, **kw: object) -> pika.ConnectionParameters:
        kw.setdefault("connection_attempts", 1)
        kw.setdefault("blocked_connection_timeout", 30)
        return pika.ConnectionParameters(
            host=self.host, port=self.port, virtual_host=vhost or self.vhost,
            credentials=pika.PlainCredentials(user or self.user, password or self.password),
            **kw,
        )

    @classmethod
    def from_url(cls, url: str) -> Broker:
        u = urlsplit(url)
        vhost = unquote(u.path[1:]) if len(u.path) > 1 else "/"
        return cls(u.hostname or "127.0.0.1", u.port or 5672, vhost,
                   unquote(u.username or "guest"), unquote(u.password or "guest"))


def render_toml(access: dict[str, list[dict[str, str]]]) -> str:
    """ACCESS as the TOML file ``brokerha node --config`` reads (see module doc)."""
    def q(v: str) -> str:
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    out = []
    for table, rows in access.items():
        for row in rows:
            out.append(f"[[{table}]]")
            out.extend(f"{k} = {q(v)}" for k, v in row.items())
            out.append("")
    return "\n".join(out)


@contextlib.contextmanager
def _brokerha_node(name: str, config: str | None = None) -> Iterator[Broker]:
    from brokerha.testing import NodeProcess

    with tempfile.TemporaryDirectory(prefix="brokerha-clients-") as tmp:
        extra = []
        if config is not None:
            path = Path(tmp) / "access.toml"
            path.write_text(config)
            extra = ["--config", str(path)]
        with NodeProcess(name, data_dir=Path(tmp) / "data", extra_args=extra) as node:
            yield Broker("127.0.0.1", node.port)


@pytest.fixture(scope="session")
def broker() -> Iterator[Broker]:
    url = os.environ.get("BROKERHA_TEST_URL")
    if url:
        yield Broker.from_url(url)
        return
    with _brokerha_node("clients") as b:
        yield b


def _rabbitmqctl(ctl: str, *args: str, check: bool = True) -> None:
    subprocess.run([*shlex.split(ctl), *args], check=check, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def broker_with_users() -> Iterator[Broker]:
    """A broker that also has :data:`ACCESS`'s users, vhosts and permissions."""
    url = os.environ.get("BROKERHA_TEST_URL")
    if not url:
        with _brokerha_node("clients-acl", render_toml(ACCESS)) as b:
            yield b
        return
    ctl = os.environ.get("BROKERHA_TEST_RABBITMQCTL")
    if not ctl:
        pytest.skip("BROKERHA_TEST_URL without BROKERHA_TEST_RABBITMQCTL: cannot add users")

    def cleanup(check: bool) -> None:
        for u in ACCESS["users"]:
            _rabbitmqctl(ctl, "delete_user", u["name"], check=check)
        for v in ACCESS["vhosts"]:
            _rabbitmqctl(ctl, "delete_vhost", v["name"], check=check)

    cleanup(check=False)
    for v in ACCESS["vhosts"]:
        _rabbitmqctl(ctl, "add_vhost", v["name"])
    for u in ACCESS["users"]:
        _rabbitmqctl(ctl, "add_user", u["name"], u["password"])
    for p in ACCESS["permissions"]:
        _rabbitmqctl(ctl, "set_permissions", "-p", p["vhost"], p["user"],
                     p["configure"], p["write"], p["read"])
    try:
        yield Broker.from_url(url)
    finally:
        cleanup(check=False)


class Names:
    """Unique queue/exchange names for one test; the test's leftovers are deleted after it."""

    def __init__(self, test: str) -> None:
        self.stem = re.sub(r"[^A-Za-z0-9]+", "-", test)[-40:].strip("-")
        self.made: list[str] = []

    def __call__(self, kind: str = "q", prefix: str = "") -> str:
        name = f"{prefix}{self.stem}-{kind}-{uuid.uuid4().hex[:8]}"
        self.made.append(name)
        return name


@pytest.fixture
def names(request: pytest.FixtureRequest, broker: Broker) -> Iterator[Names]:
    n = Names(request.node.name)
    yield n
    delete_made(broker, n)


def delete_made(broker: Broker, names: Names) -> None:
    """Delete every queue or exchange ``names`` made (whichever each is), errors ignored."""
    if not names.made:
        return
    with contextlib.suppress(Exception):
        conn = pika.BlockingConnection(broker.params(socket_timeout=5))
        try:
            for name in names.made:
                for delete in ("queue_delete", "exchange_delete"):
                    try:
                        ch = conn.channel()
                        getattr(ch, delete)(name)
                        ch.close()
                    except pika.exceptions.AMQPChannelError:
                        pass
        finally:
            with contextlib.suppress(Exception):
                conn.close()


class Connections:
    """Opens pika BlockingConnections and closes whatever is still open at teardown."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.opened: list[pika.BlockingConnection] = []

    def __call__(self, **kw: object) -> pika.BlockingConnection:
        conn = pika.BlockingConnection(self.broker.params(**kw))
        self.opened.append(conn)
        return conn

    def close_all(self) -> None:
        for conn in self.opened:
            with contextlib.suppress(Exception):
                if conn.is_open:
                    conn.close()


@pytest.fixture
def connect(broker: Broker) -> Iterator[Connections]:
    c = Connections(broker)
    yield c
    c.close_all()


@pytest.fixture
def conn(connect: Connections) -> pika.BlockingConnection:
    return connect()


@pytest.fixture
def channel(conn: pika.BlockingConnection):
    return conn.channel()
