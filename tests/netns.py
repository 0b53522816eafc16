"""Three brokerha nodes in network namespaces of their own, and faults by iptables inside them.

The partition test of docs/ha.md ("Failure history"): each node runs in its
own namespace (``ip netns exec``) on a bridge of the test's own, with a
private /24 chosen per run, and the clients reach them from the root
namespace through that bridge. Faults are iptables rules inside the
namespaces: DROP, so links *stall* instead of closing as they do on a real
network that loses a switch or a route (no RST, no FIN: only timeouts tell);
random loss (``-m statistic``); and WAN latency by ``tests/nfqdelay.py`` (an
NFQUEUE delayer in the namespace: the kernel here has no ``netem``; chosen
over a delaying proxy because the proxy would move the nodes' links onto its
own address, out of reach of the DROP rules on the nodes' addresses, and
over a package because it needs none). ``NamespacedCluster.pause`` stalls a
node's process instead (SIGSTOP, then SIGCONT), as a busy event loop does.

Everything created is named with a per-run prefix and removed by ``close``
(namespaces, the bridge, the veths with them, the delayers by PID); nothing
else on the machine is touched. Needs root, ``ip`` and ``iptables``
(``scripts/ensure-iptables``); ``available()`` says why not otherwise.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from brokerha.testing import NodeProcess, ProcessCluster, get_json

USER, PASSWORD = "jepsen", "jepsen"
_INSTANCES = itertools.count()
AMQP_PORT, ADMIN_PORT, CLUSTER_PORT = 5672, 15672, 25672


def available() -> str | None:
    """None if namespaces and iptables can be used here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (scripts/ensure-iptables)"
    probe = f"bhprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        rule = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-L", "-n"],
                              capture_output=True, text=True)
        if rule.returncode != 0:
            return f"iptables in a namespace failed: {rule.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = digits[d] + out
        if n == 0:
            return out


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Namespaces:
    """``count`` namespaces with one address each on a private bridge."""

    def __init__(self, count: int, seed: int | None = None) -> None:
        instance = next(_INSTANCES) % 100
        # the subnet is drawn per run and process (two runs of one seed may overlap)
        rng = random.Random(f"{seed}:{os.getpid()}:{instance}")
        # unique among live processes: the PID in base 36 (5 characters up to 60 million)
        tag = f"{_base36(os.getpid()):0>5}{instance:02d}"
        self.prefix = f"bh{tag}"  # interface names stay within 15 characters
        self.bridge = f"{self.prefix}br"
        used = "".join(subprocess.run(["ip", "-4", what], capture_output=True, text=True).stdout
                       for what in ("addr", "route"))
        third = rng.randrange(256)
        while f"10.213.{third}." in used:
            third = (third + 1) % 256
        self.net = f"10.213.{third}"
        self.host = f"{self.net}.1"  # the root namespace's address: the clients'
        self.names = [f"{self.prefix}n{i + 1}" for i in range(count)]
        self.delayers: dict[int, subprocess.Popen[bytes]] = {}
        self._made: list[str] = []
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def ip(self, i: int) -> str:
        return f"{self.net}.{11 + i}"

    def exec(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def _create(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        sh("ip", "addr", "add", f"{self.host}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            sh("ip", "netns", "add", ns)
            self._made.append(ns)
            outside, inside = f"{self.prefix}v{i + 1}", f"{self.prefix}p{i + 1}"
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            sh("ip", "link", "set", inside, "netns", ns)
            sh("ip", "-n", ns, "link", "set", inside, "name", "eth0")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "set", outside, "master", self.bridge, "up")

    # -- faults ---------------------------------------------------------------------------

    def iptables(self, i: int, *rule: str) -> None:
        sh(*self.exec(i), "iptables", *rule)

    def cut(self, a: int, b: int) -> None:
        """Drop every packet between nodes ``a`` and ``b``, both ways, on both sides."""
        for me, peer in ((a, b), (b, a)):
            self.iptables(me, "-A", "INPUT", "-s", self.ip(peer), "-j", "DROP")
            self.iptables(me, "-A", "OUTPUT", "-d", self.ip(peer), "-j", "DROP")

    def isolate(self, i: int) -> None:
        """Node ``i`` cut from everyone: the other nodes and the clients."""
        self.iptables(i, "-A", "INPUT", "-i", "eth0", "-j", "DROP")
        self.iptables(i, "-A", "OUTPUT", "-o", "eth0", "-j", "DROP")

    def slow(self, i: int, delay: float, jitter: float, loss: float, seed: int = 0) -> None:
        """Node ``i``'s outgoing packets: ``loss`` dropped at random, the rest delayed."""
        queue = 7000 + i
        if loss > 0:
            self.iptables(i, "-A", "OUTPUT", "-o", "eth0", "-m", "statistic", "--mode",
                          "random", "--probability", f"{loss}", "-j", "DROP")
        proc = subprocess.Popen([*self.exec(i), sys.executable, "-m", "tests.nfqdelay",
                                 "--queue", str(queue), "--delay", str(delay), "--jitter",
                                 str(jitter), "--seed", str(seed)],
                                cwd=Path(__file__).resolve().parent.parent,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.delayers[i] = proc
        time.sleep(0.3)  # bound to its queue before packets go there (bypass meanwhile)
        if proc.poll() is not None:  # with --queue-bypass its absence would go unnoticed
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"tests.nfqdelay exited ({proc.returncode}): {err.strip()}")
        self.iptables(i, "-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE", "--queue-num",
                      str(queue), "--queue-bypass")

    def heal(self) -> None:
        """Every rule removed, every delayer stopped: the network as it was."""
        for i in range(len(self.names)):
            if f"{self.prefix}n{i + 1}" in self._made:
                subprocess.run([*self.exec(i), "iptables", "-F"], capture_output=True)
        for proc in self.delayers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            if proc.stderr is not None:
                proc.stderr.close()
        self.delayers.clear()

    def close(self) -> None:
        self.heal()
        for name in reversed(self._made):
            if name == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()


class NamespacedNode(NodeProcess):
    """A ``brokerha node`` process inside its namespace."""

    def __init__(self, name: str, prefix: list[str], ip: str, **kw: Any) -> None:
        super().__init__(name, port=AMQP_PORT, **kw)
        self.prefix, self.ip = prefix, ip

    @property
    def url(self) -> str:
        return f"amqp://{USER}:{PASSWORD}@{self.ip}:{AMQP_PORT}/%2F"

    def command(self) -> list[str]:
        cmd = super().command()
        listen = cmd.index("--listen")
        cmd[listen + 1] = f"{self.ip}:{AMQP_PORT}"
        return [*self.prefix, *cmd]


def cluster_toml(net: Namespaces, names: list[str], options: dict[str, float]) -> str:
    lines = ['[cluster]', 'name = "jepsen"', 'secret_file = "secret"',
             *(f"{k} = {v}" for k, v in options.items()), ""]
    for i, name in enumerate(names):
        ip = net.ip(i)
        lines += ["[[cluster.nodes]]", f'name = "{name}"', f'amqp = "{ip}:{AMQP_PORT}"',
                  f'admin = "{ip}:{ADMIN_PORT}"', f'cluster = "{ip}:{CLUSTER_PORT}"', ""]
    lines += ["[[users]]", f'name = "{USER}"', f'password = "{PASSWORD}"',
              'tags = ["administrator"]', "", "[[permissions]]", f'user = "{USER}"',
              'vhost = "/"', 'configure = ".*"', 'write = ".*"', 'read = ".*"', ""]
    return "\n".join(lines)


class NamespacedCluster(ProcessCluster):
    """A 3-node cluster, one node per namespace; the shipped election timing by default."""

    poll_interval = 0.2

    def __init__(self, nodes: int = 3, *, options: dict[str, float] | None = None,
                 seed: int | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="brokerha-netns-")
        self.data_dir = Path(self._tmp.name)
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.base_port = AMQP_PORT
        self.net = Namespaces(nodes, seed)
        (self.data_dir / "secret").write_text(os.urandom(24).hex() + "\n")
        self.config = self.data_dir / "cluster.toml"
        self.config.write_text(cluster_toml(self.net, self.names, options or {}))
        self.nodes: dict[str, NamespacedNode] = {}

    def index(self, name: str) -> int:
        return self.names.index(name)

    def url(self, name: str) -> str:
        return f"amqp://{USER}:{PASSWORD}@{self.net.ip(self.index(name))}:{AMQP_PORT}/%2F"

    def admin_url(self, name: str) -> str:
        return f"http://{self.net.ip(self.index(name))}:{ADMIN_PORT}"

    def make_node(self, name: str) -> NamespacedNode:
        i = self.index(name)
        return NamespacedNode(name, self.net.exec(i), self.net.ip(i),
                              data_dir=self.data_dir / name,
                              extra_args=["--config", str(self.config)], ready_timeout=30)

    def is_running(self, name: str) -> bool:
        node = self.nodes.get(name)
        return node is not None and node.proc is not None and node.proc.poll() is None

    def pause(self, name: str, seconds: float) -> None:
        """Stop node ``name``'s process for ``seconds`` (SIGSTOP, then SIGCONT): its event
        loop stalls as a busy one does, and what arrives meanwhile waits in its sockets'
        queues and its listener's accept backlog."""
        node = self.nodes[name]
        if node.proc is None or node.proc.poll() is not None:
            return
        pid = node.proc.pid  # ``ip netns exec`` execs the node: the PID is the node's
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)

    def status(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(get_json(self.admin_url(name) + "/api/status", 1, None, USER, PASSWORD))
        except (OSError, ValueError):
            return None

    def settled(self) -> str | None:
        """The serving primary if every node agrees on it and every other is a ready backup."""
        primary = self.primary()
        if primary is None:
            return None
        for name in self.names:
            st = self.status(name)
            if st is None:
                return None
            me = st["node"]
            if name != primary and (me.get("role") != "backup" or not me.get("ready")
                                    or me.get("primary") != primary):
                return None
        return primary

    def wait_settled(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.settled()
            if found is not None:
                return found
            time.sleep(self.poll_interval)
        raise TimeoutError(f"not settled within {timeout}s: "
                           f"{ {n: (self.status(n) or {}).get('node') for n in self.names} }"
                           f"\n{self.diagnostics()}")

    def diagnostics(self) -> str:
        return "\n".join(f"--- {name}\n" + "\n".join(list(node.log)[-25:])
                         for name, node in self.nodes.items())

    def logs(self, name: str) -> list[str]:
        return list(self.nodes[name].log)

    def close(self) -> None:
        try:
            for node in self.nodes.values():
                proc = node.proc
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)  # a paused node would not see SIGTERM
                node.close()
        finally:
            self.net.close()
            self._tmp.cleanup()

    def __enter__(self) -> NamespacedCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
