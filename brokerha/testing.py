"""Helpers for tests (ours and users'): start real brokerha nodes as processes.

``NodeProcess`` runs ``brokerha node`` in a subprocess on a free loopback port,
waits for its ``ready`` log line and stops it by PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Self

from brokerha.cluster.ports import ADMIN_OFFSET, CLUSTER_OFFSET, TXLOG_OFFSET


def get(url: str, timeout: float = 1.0, context: Any = None, user: str = "guest",
        password: str = "guest") -> bytes:
    """GET from a node's admin listener with HTTP Basic credentials: every route but
    /metrics needs them (guest, the default user, from loopback)."""
    import base64
    import urllib.request

    req = urllib.request.Request(url)
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    req.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
        return bytes(r.read())


def get_json(url: str, timeout: float = 1.0, context: Any = None, user: str = "guest",
             password: str = "guest") -> Any:
    """``get``, as JSON."""
    import json

    return json.loads(get(url, timeout, context, user, password))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NodeProcess:
    """One ``brokerha node`` process, as a context manager."""

    def __init__(
        self,
        name: str = "node1",
        *,
        port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 20.0,
    ) -> None:
        self.name = name
        self.port = port or free_port()
        self._tmp = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"brokerha-{name}-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir)
        self.extra_args = list(extra_args or [])
        self.env = env
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.log: deque[str] = deque(maxlen=2000)
        self._ready = threading.Event()
        self._spawned = 0.0

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "brokerha.cli", "node",
            "--name", self.name,
            "--listen", f"127.0.0.1:{self.port}",
            "--data", str(self.data_dir),
            *self.extra_args,
        ]

    def start(self) -> NodeProcess:
        return self.spawn().wait_ready()

    def spawn(self) -> NodeProcess:
        """Start the process without waiting for it (``wait_ready`` waits)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"node {self.name} is already running (pid {self.proc.pid}); "
                               "use either start() or the with statement, not both")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(self.env or {}))
        self._ready.clear()
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env,
        )
        self._spawned = time.monotonic()
        threading.Thread(target=self._pump, daemon=True).start()
        return self

    def wait_ready(self) -> NodeProcess:
        """Until the node logs that it is ready (``ready_timeout`` from its spawn)."""
        assert self.proc is not None, "spawn() first"
        deadline = self._spawned + self.ready_timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = "\n".join(self.log)
                self.stop()
                raise RuntimeError(f"node {self.name} did not become ready:\n{output}")
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip("\n"))
            if " ready" in line:
                self._ready.set()

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ephemeral_low() -> int:
    """The first port the kernel may give an outgoing connection (Linux: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


STRIPE_ENV = "BROKERHA_TEST_PORT_STRIPE"
STRIPE_BLOCK = 100  # base ports come in blocks of 100; a stripe holds every n-th block


def _stripe() -> tuple[int, int]:
    """This process's share of the base ports, ``(k, n)`` from ``BROKERHA_TEST_PORT_STRIPE=k/n``
    (``scripts/pytest_jobs.py`` gives each of its sessions its own); ``(0, 1)``: all of them.

    Two sessions that checked the same free ports at once, or one that found free a port
    the other's node had let go for a restart, would otherwise start two nodes on it.
    """
    raw = os.environ.get(STRIPE_ENV, "")
    if not raw:
        return 0, 1
    try:
        k, n = (int(x) for x in raw.split("/"))
    except ValueError:
        raise ValueError(f"{STRIPE_ENV}={raw!r}: expected k/n, such as 0/2") from None
    if not 0 <= k < n:
        raise ValueError(f"{STRIPE_ENV}={raw!r}: k must be in 0..n-1")
    return k, n


def free_base_port(count: int,
                   offsets: tuple[int, ...] = (0, ADMIN_OFFSET, CLUSTER_OFFSET)) -> int:
    """A base port P such that P..P+count-1 plus each offset were all free a moment ago.

    Every port lies below the kernel's ephemeral range, so an outgoing
    connection's local port cannot take one between this check and the bind. Under a
    stripe (``_stripe``) every port lies in this process's own blocks of 100: a port
    ``P + i + offset`` is in block ``(P + i) // 100 + offset // 100``, and the offsets are
    multiples of ``100 * n``, so no two stripes' ports can meet.
    """
    import random

    k, n = _stripe()
    if n > 1 and (count > STRIPE_BLOCK or any(off % (STRIPE_BLOCK * n) for off in offsets)):
        raise ValueError(f"{count} ports at offsets {offsets} do not fit stripe {k}/{n} "
                         f"(blocks of {STRIPE_BLOCK}, offsets multiples of {STRIPE_BLOCK * n})")
    rnd = random.Random()
    high = _ephemeral_low() - max(offsets) - count
    if high <= 2000:
        raise ValueError(f"offsets up to {max(offsets)} leave no base port below the ephemeral "
                         f"range ({_ephemeral_low()})")
    for _ in range(200 * n):
        base = rnd.randrange(2000, high)
        if n > 1 and ((base // STRIPE_BLOCK) % n != k
                      or base % STRIPE_BLOCK + count > STRIPE_BLOCK):
            continue
        ports = [base + i + off for i in range(count) for off in offsets]
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range found")


class ClusterView:
    """Addresses and readiness of a local cluster's nodes, whatever runs them.

    Subclasses set ``names`` and ``base_port`` and provide ``status(name)``
    (a node's own ``/api/status``, or None) and, optionally, ``is_running``.
    """

    names: list[str]
    base_port: int
    poll_interval = 0.05

    def port(self, name: str) -> int:
        return self.base_port + self.names.index(name)

    def url(self, name: str) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port(name)}/%2F"

    @property
    def urls(self) -> list[str]:
        return [self.url(n) for n in self.names]

    def admin_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port(name) + ADMIN_OFFSET}"

    def status(self, name: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def is_running(self, name: str) -> bool:
        return True

    def diagnostics(self) -> str:
        return ""

    def primary(self) -> str | None:
        """The node that says it is a serving primary, if exactly one does."""
        found = []
        for name in self.names:
            if not self.is_running(name):
                continue
            st = self.status(name)
            if st and st["node"].get("role") == "primary" and st["node"].get("serving"):
                found.append(name)
        return found[0] if len(found) == 1 else None

    def wait_primary(self, timeout: float = 20.0, *, other_than: str | None = None) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            name = self.primary()
            if name is not None and name != other_than:
                return name
            time.sleep(self.poll_interval)
        raise TimeoutError(f"no primary within {timeout} s; statuses: "
                           f"{ {n: self.status(n) for n in self.names} }\n{self.diagnostics()}")

    def wait_ready(self, name: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status(name)
            if st and st["node"].get("ready"):
                return
            time.sleep(self.poll_interval)
        raise TimeoutError(f"{name} not ready within {timeout} s: {self.status(name)}")


class ProcessCluster(ClusterView):
    """A cluster of ``NodeProcess``es this process starts (``make_node``: which kind)."""

    nodes: dict[str, Any]

    def make_node(self, name: str) -> NodeProcess:
        """The process of node ``name``, not started."""
        raise NotImplementedError

    def start(self) -> Self:
        """Every node started at once (a node's start is mostly its imports: on two cores
        the nodes' starts overlap), then each waited for."""
        for name in self.names:
            self.nodes[name] = self.make_node(name).spawn()
        try:
            for name in self.names:
                self.nodes[name].wait_ready()
        except BaseException:
            for node in self.nodes.values():
                node.stop()
            raise
        return self

    def start_node(self, name: str) -> NodeProcess:
        node = self.nodes[name] = self.make_node(name).start()
        return node


class LocalCluster(ProcessCluster):
    """N ``brokerha node`` processes of one datacenter on loopback (what ``cluster up`` runs).

    Each node is its own process, so one can be SIGKILLed (``kill``), paused
    (``pause``/``resume``: SIGSTOP/SIGCONT) and started again alone
    (``restart``) on the same data directory. ``options`` adds keys to the
    ``[cluster]`` table (e.g. shorter timeouts for tests). With ``tls``, every
    node also has amqps and HTTPS listeners; ``https_only`` turns the plain
    admin listeners off (``--admin off``): the nodes, and ``status`` here, read
    each other over HTTPS.
    """

    def __init__(self, nodes: int = 3, *, data_dir: str | os.PathLike[str] | None = None,
                 options: dict[str, float | str | bool] | None = None,
                 extra_args: list[str] | None = None, name: str = "dc1",
                 tls: bool = False, https_only: bool = False) -> None:
        from brokerha.admin.cluster_cli import cluster_file

        if https_only and not tls:
            raise ValueError("https_only needs tls")
        self.https_only = https_only

        self._tmp = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="brokerha-cluster-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir)
        # any member may run a TxLog master (a test adds [txlog]): its port is free too
        # with ``tls``: amqps on the ports after the AMQP ones (cluster_file, DIR/tls/)
        self.base_port = free_base_port(nodes * (2 if tls else 1),
                                        (0, ADMIN_OFFSET, CLUSTER_OFFSET, TXLOG_OFFSET))
        self.tls = tls
        self.config = cluster_file(self.data_dir, nodes, self.base_port, name, tls=tls)
        if options:
            text = self.config.read_text()
            extra = "".join(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}\n"
                            .replace("'", '"') for k, v in options.items())
            self.config.write_text(text.replace("[cluster]\n", "[cluster]\n" + extra, 1))
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.extra_args = [*(["--admin", "off"] if https_only else []), *(extra_args or [])]
        self.nodes: dict[str, NodeProcess] = {}
        self.paused: set[str] = set()

    def amqps_url(self, name: str) -> str:
        """A pika URL for a node's amqps listener (``LocalCluster(tls=True)``), trusting
        the cluster's CA and presenting the guest client certificate."""
        from urllib.parse import quote

        tls = self.data_dir / "tls"
        opts = {"ca_certs": str(tls / "ca.pem"), "certfile": str(tls / "client-guest.pem"),
                "keyfile": str(tls / "client-guest.key"), "server_hostname": "localhost"}
        port = self.port(name) + len(self.names)
        return f"amqps://guest:guest@localhost:{port}/%2F?ssl_options={quote(repr(opts))}"

    def admin_url(self, name: str) -> str:
        if self.https_only:
            return f"https://127.0.0.1:{self.port(name) + len(self.names) + ADMIN_OFFSET}"
        return super().admin_url(name)

    def make_node(self, name: str) -> NodeProcess:
        return NodeProcess(name, port=self.port(name), data_dir=self.data_dir / name,
                           extra_args=["--config", str(self.config), *self.extra_args])

    def restart(self, name: str) -> NodeProcess:
        old = self.nodes.get(name)
        if old is not None:
            old.stop()
        return self.start_node(name)

    def kill(self, name: str) -> None:
        self.nodes[name].kill()

    def pause(self, name: str) -> None:
        proc = self.nodes[name].proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        self.paused.add(name)

    def resume(self, name: str) -> None:
        proc = self.nodes[name].proc
        assert proc is not None
        proc.send_signal(signal.SIGCONT)
        self.paused.discard(name)

    def is_running(self, name: str) -> bool:
        """Alive and not paused (a paused node's status would only time out)."""
        node = self.nodes.get(name)
        return (node is not None and node.proc is not None and node.proc.poll() is None
                and name not in self.paused)

    def status(self, name: str) -> dict[str, Any] | None:
        """A node's own /api/status, or None when it does not answer."""
        context = None
        if self.https_only:
            import ssl

            context = ssl.create_default_context(cafile=str(self.data_dir / "tls" / "ca.pem"))
            context.check_hostname = False  # the node certificate names localhost
        try:
            return dict(get_json(self.admin_url(name) + "/api/status", 1, context))
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        for node in self.nodes.values():
            proc = node.proc
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
            node.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
