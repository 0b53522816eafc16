"""One private RabbitMQ node (with its management plugin) and one brokerha node for this
directory (package scope: stopped once its last test ran, not left running beside the rest
of the session), side by side; per module, the same RabbitMQ node brought back to its baseline
definitions (``rabbit_node``, ``rabbit_api``) and a fresh brokerha node with its management
API (``brokerha_node``, ``brokerha_api``).

Starting a RabbitMQ node costs 7-9 s; one per module cost the suite about a minute. The
modules stay independent: before and after each module that takes ``rabbit_node``, every
vhost, user, permission, topic permission, policy, operator policy, parameter, queue and
exchange that is not in the baseline (the node's own definitions plus the users of
tests/management_http.py's ``USERS`` below) is deleted, and the baseline's definitions
are imported again (passwords, tags and permissions as they were)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from brokerha.testing import NodeProcess, free_base_port, free_port
from tests.management_http import USERS, call

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rabbitmq_ref import RabbitMQRef, available  # noqa: E402

ALL = {"configure": ".*", "write": ".*", "read": ".*"}
# what the differential cases need of USERS on RabbitMQ (guest is the administrator)
BASELINE_CALLS: list[tuple[str, str, Any]] = [
    ("PUT", "/users/watcher", {"password": "w-secret", "tags": "monitoring"}),
    ("PUT", "/permissions/%2F/watcher", ALL),
    ("PUT", "/users/app", {"password": "p-secret", "tags": ""}),
]


def _q(name: str) -> str:
    return quote(name, safe="")


@dataclass
class ManagedRabbit:
    ref: RabbitMQRef
    management_port: int
    baseline: dict[str, Any] = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.management_port}/api"

    def _delete(self, paths: list[str]) -> None:
        def one(path: str) -> None:
            status, answer = call(self.api, "DELETE", path)
            assert status in (204, 404), (path, status, answer)  # 404: gone with its vhost

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, paths))

    def restore_baseline(self) -> None:
        """Delete what is not in the baseline, then import the baseline again."""
        status, now = call(self.api, "GET", "/definitions")
        assert status == 200, now
        base = self.baseline
        vhosts = {v["name"] for v in base["vhosts"]}
        users = {u["name"] for u in base["users"]}

        def extra(key: str, *ident: str) -> list[dict[str, Any]]:
            kept = {tuple(e.get(k) for k in ident) for e in base.get(key) or []}
            return [e for e in now.get(key) or []
                    if e.get("vhost", "/") in vhosts
                    and tuple(e.get(k) for k in ident) not in kept]

        self._delete([f"/vhosts/{_q(v['name'])}" for v in now["vhosts"]
                      if v["name"] not in vhosts])
        gone = [u["name"] for u in now["users"] if u["name"] not in users]
        if gone:
            status, answer = call(self.api, "POST", "/users/bulk-delete", body={"users": gone})
            assert status == 204, (status, answer)
        paths = [f"/policies/{_q(p['vhost'])}/{_q(p['name'])}"
                 for p in extra("policies", "vhost", "name")]
        for p in extra("parameters", "component", "vhost", "name"):
            kind = ("/operator-policies" if p["component"] == "operator_policy"
                    else f"/parameters/{_q(p['component'])}")
            paths.append(f"{kind}/{_q(p['vhost'])}/{_q(p['name'])}")
        paths += [f"/global-parameters/{_q(p['name'])}" for p in now.get("global_parameters")
                  or [] if p["name"] not in {g["name"] for g in base["global_parameters"]}]
        paths += [f"/permissions/{_q(p['vhost'])}/{_q(p['user'])}"
                  for p in extra("permissions", "user", "vhost") if p["user"] in users]
        paths += [f"/topic-permissions/{_q(p['vhost'])}/{_q(p['user'])}"
                  for p in extra("topic_permissions", "user", "vhost", "exchange")
                  if p["user"] in users]
        paths += [f"/exchanges/{_q(e['vhost'])}/{_q(e['name'])}"
                  for e in extra("exchanges", "vhost", "name")]
        # every queue, not only the exported ones (transient, exclusive ones too)
        status, queues = call(self.api, "GET", "/queues")
        assert status == 200, queues
        kept_queues = {(q["vhost"], q["name"]) for q in base.get("queues") or []}
        paths += [f"/queues/{_q(q['vhost'])}/{_q(q['name'])}" for q in queues
                  if q["vhost"] in vhosts and (q["vhost"], q["name"]) not in kept_queues]
        self._delete(paths)
        status, answer = call(self.api, "POST", "/definitions", body=base)
        assert status == 204, (status, answer)
        status, after = call(self.api, "GET", "/definitions")
        assert status == 200, after
        for key in ("users", "vhosts", "permissions", "topic_permissions", "policies",
                    "parameters", "global_parameters", "queues", "exchanges", "bindings"):
            assert _canonical(after.get(key)) == _canonical(base.get(key)), key


def _canonical(entries: Any) -> list[str]:
    return sorted(json.dumps(e, sort_keys=True) for e in entries or [])


def _rabbitmq_or_skip() -> None:
    if not available():
        pytest.skip("rabbitmq-server is not installed (scripts/ensure-rabbitmq installs it)")


@pytest.fixture(scope="package")
def managed_rabbit() -> Iterator[ManagedRabbit]:
    """The package's RabbitMQ node: the management plugin (``management_port``) and the
    users of tests/management_http.py's ``USERS`` that the differential cases use."""
    _rabbitmq_or_skip()
    port = free_port()
    ref = RabbitMQRef(plugins=("rabbitmq_management",),
                      extra_config=f"management.tcp.port = {port}\n"
                                   "management.tcp.ip = 127.0.0.1\n")
    with ref:
        node = ManagedRabbit(ref, port)
        for method, path, body in BASELINE_CALLS:
            status, answer = call(node.api, method, path, body=body)
            assert status in (201, 204), (path, status, answer)
        status, node.baseline = call(node.api, "GET", "/definitions")
        assert status == 200, node.baseline
        yield node


@pytest.fixture(scope="package")
def rabbitmq_url(managed_rabbit: ManagedRabbit) -> str:
    """The AMQP URL of the package's RabbitMQ node (guest, vhost /)."""
    return managed_rabbit.ref.url


@pytest.fixture(scope="package")
def brokerha_url() -> Iterator[str]:
    with NodeProcess("differential") as node:
        yield node.url


@pytest.fixture(scope="module")
def rabbit_node(managed_rabbit: ManagedRabbit) -> Iterator[ManagedRabbit]:
    """The package's RabbitMQ node, at its baseline definitions for this module (and left
    at them after it)."""
    managed_rabbit.restore_baseline()
    yield managed_rabbit
    managed_rabbit.restore_baseline()


@pytest.fixture(scope="module")
def rabbit_api(rabbit_node: ManagedRabbit) -> str:
    return rabbit_node.api


@pytest.fixture(scope="module")
def brokerha_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A brokerha node with the users of ``USERS``; its management API at port + 10000."""
    config = tmp_path_factory.mktemp("diff-mgmt") / "node.toml"
    config.write_text(USERS)
    with NodeProcess("diff-mgmt", port=free_base_port(1),
                     extra_args=["--config", str(config)]) as node:
        yield node


@pytest.fixture(scope="module")
def brokerha_api(brokerha_node: NodeProcess) -> str:
    return f"http://127.0.0.1:{brokerha_node.port + 10000}/api"
