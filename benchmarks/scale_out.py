"""Scale-out benchmark (issue 35): queues spread over partitions, each node capped in CPU.

docs/ha.md "Partitions (design, issue 35)" asks: on 3 nodes, each in its own
CPU cgroup capped at 0.6 CPU, 12 queues, publisher confirms and TX, how much
more does a partitioned cluster confirm than one replication group, and than
a RabbitMQ 3-node quorum cluster? Every node process goes into the cgroup of
the "machine" it would run on; the load generator (``loadgen.py``, all queues
in one event loop) stays outside the caps.

Stage 0 (``--stage0``, today's default: nothing partitioned is built yet)
measures the ceiling with what exists, one layout at a time (started, measured
with each workload, stopped), in one run:

- ``single-group`` (P = 1): one ordinary 3-node brokerha cluster (a
  ``LocalCluster``, what ``brokerha cluster up`` runs, docs/ha.md's default
  timeouts), one node per machine; all queues on its primary.
- ``partitioned-direct``: three ordinary 3-node clusters; node i of cluster k
  (i counted from the cluster's elected primary, 0 = the primary) in machine
  (i + k) % 3, so each machine holds one primary and two backups, as a
  balanced partition table would; queue q lives on cluster q % 3 and its
  clients connect straight to that cluster's primary: the partitioned layout
  without forwarding (an upper bound for stage 3's, which adds a hop for 2/3
  of the publishes).
- ``rabbitmq-quorum``: three private RabbitMQ nodes clustered
  (``ha_cluster.RabbitCluster``), one per machine, quorum queues declared with
  ``x-queue-leader-locator: balanced``, each queue's clients on its leader's
  node (as brokerha's go to the primary). The Erlang VM runs with
  ``+sbwt none +sbwtdcpu none +sbwtdio none`` (no scheduler busy-waiting,
  which would eat the quota; ``rabbitmq-server`` passes the first by default).

Workloads: ``confirm`` (one publisher, window 256, and one manual-ack
consumer per queue) and ``tx`` (10 messages per commit, one commit in flight
per publisher, ``--tx-publishers`` per queue, 8 by default so that the caps,
not the commit latency, bound it).

Figures per layout and workload: msgs/s (delivered; committed for tx),
latency p50/p99 (publish -> confirm per written batch of up to 64, or
tx.commit -> commit-ok), each machine's CPU (cpuacct over the measured window)
and the share of CFS periods it was throttled in, "saturated" when every
machine holding a primary (leader) used >= 90 % of its cap (otherwise the
shared box, not the cap, bounded the layout), an estimate scaled to the caps
(CPU per message held), and for brokerha the CPU per message of the primaries
and of the backups (from /proc), with their event loop's (main thread's)
share. Last lines: ``partitioned / single-group = R.RRx`` and ``partitioned /
RabbitMQ = R.RRx`` per workload (per round, and over the rounds where both
layouts saturated), after the ceiling the single group's own per-message
costs predict (docs/ha.md: R = 3 c_p / (c_p + 2 c_b)). Results:
docs/benchmarks.md, "Scale-out ceiling".

CPU caps: cgroup v1 (``/sys/fs/cgroup/cpu/brokerha-scale-<pid>-<id>-m<i>/``,
``cpu.cfs_period_us`` 100000, ``cpu.cfs_quota_us`` = cap x period, plus the
same name under the cpuacct hierarchy for the usage) or cgroup v2 (``cpu.max``,
``cpu.stat``), whichever has the cpu controller; root only. Processes are moved
into their cgroup once started and ready (start-up is not capped). Everything
started here is stopped here, and the cgroups removed, also on an error,
Ctrl-C or SIGTERM; empty cgroups left by a benchmark that was SIGKILLed are
removed at the next start.

Examples::

    sudo .venv/bin/python benchmarks/scale_out.py --stage0
    .venv/bin/python benchmarks/scale_out.py --layouts single-group,partitioned-direct \\
        --workloads confirm --seconds 8 --rounds 2
    # where a backup's time goes (py-spy is not a project dependency):
    PATH=/tmp/pyspy/bin:$PATH .venv/bin/python benchmarks/scale_out.py \\
        --layouts single-group --workloads confirm --py-spy /tmp/scale-out-prof
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import loadgen
import pika
from amqp_profile import PySpy, summarize_pyspy
from amqp_throughput import CLK_TCK, tree_cpu_times
from cgroups import (  # noqa: F401 - tests and tools use them through this module
    CGROUP_PREFIX,
    CgroupRoots,
    CpuCgroup,
    CpuSample,
    process_tree,
    remove_stale_cgroups,
    weighted,
)
from ha_cluster import (
    HA_DEFAULTS,
    RabbitCluster,
    Terminated,
    _elections,
    _raise_on_sigterm,
    wait_all_ready,
)
from loadgen import WORKLOADS, Result, Workload, percentiles_ms
from rabbitmq_ref import available as rabbitmq_available

from brokerha.cluster.partition_table import hash_partition
from brokerha.testing import LocalCluster

MACHINES = 3  # the default; --nodes 5 (at 0.36 CPU each: the same total)
TOTAL_CPU = 1.8  # --cap's default is TOTAL_CPU / --nodes
STAGE0_LAYOUTS = ("single-group", "partitioned-direct", "rabbitmq-quorum")
PARTITIONED_LAYOUTS = ("partitioned", "partitioned-leader")
LAYOUTS = ("single-group", "partitioned-direct", *PARTITIONED_LAYOUTS, "rabbitmq-quorum")
PARTITIONS = 9  # the partitioned layouts' P
RABBIT_ERL_ARGS = "+sbwt none +sbwtdcpu none +sbwtdio none"
QUORUM_ARGUMENTS: tuple[tuple[str, str | int], ...] = (
    ("x-queue-type", "quorum"), ("x-queue-leader-locator", "balanced"))
PY_SPY_RATE = 100
# brokerha's timings: HA_DEFAULTS (docs/ha.md's defaults), lease and election timeouts
# times --slow-timers (main sets it)
OPTIONS: dict[str, float | str] = dict(HA_DEFAULTS)
IDLE_SECONDS = 3.0  # each layout's nodes measured idle once started (timers, heartbeats)


def loop_thread_cpu(pid: int) -> float:
    """CPU seconds of a process's main thread (a brokerha node's event loop; the store's
    log and SQL threads are the others)."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Machines:
    """``MACHINES`` capped cgroups for one run; ``with Machines(cap) as m: m[i].add(pid)``."""

    def __init__(self, cap: float, period_us: int = 100_000,
                 roots: CgroupRoots | None = None, count: int = MACHINES,
                 shares: int = 0) -> None:
        found = roots or CgroupRoots.find()
        if found is None:
            raise RuntimeError("no cgroup hierarchy with a cpu controller is mounted")
        if os.geteuid() != 0:
            raise RuntimeError("CPU caps need root (cgroup directories are created here)")
        self.roots = found
        tag = f"{CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.groups = [CpuCgroup(found, f"{tag}-m{i}", cap, period_us, shares)
                       for i in range(count)]
        # With shares: the load generator (this process) in an uncapped cgroup of the same
        # weight (cgroups.weighted, from __enter__), so that the box's other work (outside
        # these cgroups) yields the CPU to the emulated machines and their clients rather
        # than taking the caps' time.
        self.shares = shares
        self.clients: CpuCgroup | None = None
        self._weighted = ExitStack()

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> CpuCgroup:
        return self.groups[i]

    def place(self, i: int, pid: int) -> None:
        for p in process_tree(pid):
            self.groups[i].add(p)

    def sample(self) -> list[CpuSample]:
        return [g.sample() for g in self.groups]

    def __enter__(self) -> Machines:
        remove_stale_cgroups(self.roots)
        try:
            for g in self.groups:
                g.create()
            self.clients = self._weighted.enter_context(weighted(self.shares, self.roots))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for g in self.groups:
            g.remove()
        self._weighted.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- layouts ---------------------------------------------------------------------------


@dataclass
class Node:
    label: str  # e.g. "c2/n1"
    pid: int
    machine: int
    role: str  # "primary", "backup", "leader" (partitioned: leads some, backs others) or "rabbit"


@dataclass
class Layout:
    """A started layout: where each queue's clients go and which process runs where."""

    name: str
    queue_url: Callable[[int, str], str]  # (queue index, its name) -> its clients' URL
    nodes: list[Node]
    queue_arguments: tuple[tuple[str, str | int], ...] = ()
    checks: list[Callable[[], str | None]] = field(default_factory=list)  # notes after a run
    # before queue_url: declares the queues (RabbitMQ: finds their leaders; partitioned:
    # names each into a partition and declares it on the leader), returns the names used
    declare: Callable[[list[str]], list[str]] | None = None
    client_declares: bool = True  # False: the queues are declared and deleted by the layout
    cleanup: Callable[[], None] | None = None  # after each measurement
    idle_cpu: float | None = None  # CPUs all its nodes used idle, once started (capped)
    clusters: list[LocalCluster] = field(default_factory=list)  # brokerha's, for their logs

    def why(self, since: str, limit: int = 6) -> str:
        """The brokerha nodes' ERROR lines and elections logged from ``since`` (a log
        line's time stamp, ``log_stamp``): why a cell failed (a node stopped on an error,
        or an election closed its clients)."""
        found = []
        for c in self.clusters:
            for name, node in c.nodes.items():
                found += [f"{name}: {line.split('] ', 1)[-1][:200]}" for line in list(node.log)
                          if line[:23] >= since and (" ERROR " in line or "lease lapsed" in line
                                                     or "stands for election" in line)][:2]
        return "; ".join(found[:limit])

    def workload(self, name: str) -> Workload:
        return replace(WORKLOADS[name], queue_arguments=self.queue_arguments,
                       declare=self.client_declares)

    def targets(self, workload: str, queues: int, publishers: int) -> list[tuple[str, str]]:
        """Fresh queues for one measurement; ``publishers`` (url, queue) pairs per queue."""
        names = [f"scale-out-{workload}-{uuid.uuid4().hex[:8]}-{q}" for q in range(queues)]
        if self.declare is not None:
            names = self.declare(names)
        return [(self.queue_url(q, name), name) for q, name in enumerate(names)
                for _ in range(publishers)]


def log_stamp() -> str:
    """Now as a node's log line starts (local time, milliseconds)."""
    now = time.time()
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"


def _brokerha_cluster(
    stack: ExitStack, machines: Machines, k: int, label: str, size: int = 3,
) -> tuple[LocalCluster, str, list[Node], Callable[[], str | None]]:
    """Start one cluster of ``size`` nodes; node i from its primary goes to machine
    (i + k) % machines."""
    cluster = stack.enter_context(LocalCluster(size, options=OPTIONS))
    primary = wait_all_ready(cluster)
    order = [primary] + [n for n in cluster.names if n != primary]
    nodes = []
    for i, name in enumerate(order):
        proc = cluster.nodes[name].proc
        assert proc is not None
        machine = (i + k) % len(machines)
        machines.place(machine, proc.pid)
        nodes.append(Node(f"{label}/{name}", proc.pid, machine, "backup" if i else "primary"))
    elected = _elections(cluster)

    def check() -> str | None:
        now, extra = cluster.primary(), _elections(cluster) - elected
        if now != primary or extra:
            return (f"{label}: {extra} election(s) during the run, primary {primary} -> {now}: "
                    f"the caps starve the election timers")
        return None

    return cluster, primary, nodes, check


@contextmanager
def started(layout: str, machines: Machines) -> Iterator[Layout]:
    t0 = time.monotonic()
    n = len(machines)
    with ExitStack() as stack:
        if layout == "single-group":
            cluster, primary, nodes, check = _brokerha_cluster(stack, machines, 0, "c1", n)
            url = cluster.url(primary)
            result = Layout(layout, lambda q, name: url, nodes, checks=[check],
                            clusters=[cluster])
        elif layout == "partitioned-direct":
            urls, nodes, checks, clusters = [], [], [], []
            for k in range(n):
                cluster, primary, cnodes, check = _brokerha_cluster(stack, machines, k,
                                                                    f"c{k + 1}")
                urls.append(cluster.url(primary))
                nodes += cnodes
                checks.append(check)
                clusters.append(cluster)
            result = Layout(layout, lambda q, name: urls[q % n], nodes, checks=checks,
                            clusters=clusters)
        elif layout in PARTITIONED_LAYOUTS:
            result = _partitioned(stack, machines, layout)
        elif layout == "rabbitmq-quorum":
            result = _rabbitmq(stack, machines)
        else:
            raise ValueError(layout)
        where = ", ".join(f"{n.label} {n.role[0]}@m{n.machine}" for n in result.nodes)
        result.idle_cpu = idle_cpu([n.pid for n in result.nodes], IDLE_SECONDS)
        print(f"  ({layout}: ready in {time.monotonic() - t0:.0f} s; {where}; idle "
              f"{result.idle_cpu:.3f} CPU in all)", flush=True)
        yield result


def idle_cpu(pids: Sequence[int], seconds: float) -> float:
    """CPUs the processes (with their children) used over ``seconds`` with no client."""
    before, t0 = [sum(tree_cpu_times(pid)) for pid in pids], time.perf_counter()
    time.sleep(seconds)
    after, t1 = [sum(tree_cpu_times(pid)) for pid in pids], time.perf_counter()
    return (sum(after) - sum(before)) / (t1 - t0)


def group_leaders(statuses: dict[str, dict[str, object] | None],
                  partitions: int = PARTITIONS) -> dict[int, tuple[str, int]] | None:
    """Per partition, its leader and epoch, once every group (the metadata group 0 and
    partition p's group p + 1) has exactly one serving node and every node is ready in
    every group it is in (``ctl status --json``'s ``node.groups``); None until then."""
    serving: dict[int, list[tuple[str, int]]] = {}
    for name, status in statuses.items():
        node = status.get("node") if isinstance(status, dict) else None
        groups = node.get("groups") if isinstance(node, dict) else None
        if not isinstance(groups, dict) or not groups:
            return None
        for group, g in groups.items():
            if not g.get("ready"):
                return None
            if g.get("serving"):
                serving.setdefault(int(group), []).append((name, int(g.get("epoch") or 0)))
    if sorted(serving) != list(range(partitions + 1)) or any(
            len(v) != 1 for v in serving.values()):
        return None
    return {group - 1: v[0] for group, v in serving.items() if group}


def queue_name_in(partition: int, base: str, partitions: int = PARTITIONS) -> str:
    """``base`` with a suffix making it hash into ``partition`` (vhost /)."""
    return next(f"{base}-{i}" for i in itertools.count()
                if hash_partition("/", f"{base}-{i}", partitions) == partition)


def group_members(statuses: dict[str, dict[str, object] | None],
                  partitions: int = PARTITIONS) -> dict[int, list[str]]:
    """Per partition, the nodes in its group (its cells: all N when N <= NR + 1)."""
    out: dict[int, list[str]] = {p: [] for p in range(partitions)}
    for name, status in statuses.items():
        node = status.get("node") if isinstance(status, dict) else None
        groups = node.get("groups") if isinstance(node, dict) else None
        for group in groups if isinstance(groups, dict) else ():
            if 0 < int(group) <= partitions:
                out[int(group) - 1].append(name)
    return out


def spread(names: Sequence[str], leaders: dict[int, tuple[str, int]],
           queues: int, members: dict[int, list[str]] | None = None,
           ) -> list[tuple[int, str, str]]:
    """Queue q's (partition, leader, client node) for the partitioned layouts: leaders
    round-robin over the nodes (``names`` order; within a node, over the partitions it
    leads), so each node leads its share of the queues, as RabbitMQ's balanced locator
    does. Queue q of round r = q // N led by node L gets its clients on node (2 L + r) mod
    N: each round puts one client on each node (N odd) and one queue's clients on its
    leader, and over N rounds every (leader, client) pair comes once, so every node both
    forwards to and takes forwards from every other (on 3 nodes, 12 queues: 4 on their
    leader, 2/3 of the publishes forwarded and 2/3 of the consumers remote). With
    ``members`` (N > NR + 1: a partition on 3 of the N nodes), a client node that is not
    in the queue's partition is replaced by one of its cells that is not the leader, in
    turn (a node outside the group does not know the queue: its consume is refused 404)."""
    led = {n: sorted(p for p, (leader, _) in leaders.items() if leader == n) for n in names}
    leading = [n for n in names if led[n]]
    out = []
    for q in range(queues):
        leader = leading[q % len(leading)]
        partition = led[leader][(q // len(leading)) % len(led[leader])]
        client = names[(2 * names.index(leader) + q // len(leading)) % len(names)]
        cells = (members or {}).get(partition) or list(names)
        if client not in cells:
            others = [n for n in cells if n != leader] or [leader]
            client = others[q % len(others)]
        out.append((partition, leader, client))
    return out


def _partitioned(stack: ExitStack, machines: Machines, layout: str) -> Layout:
    """One brokerha cluster of N nodes (one a machine) running partition groups,
    P = ``PARTITIONS``, NR = 2; each queue declared on its partition's leader;
    ``partitioned``: its clients on another node for (N-1)/N of the queues (``spread``:
    forwarding and remote consumers); ``partitioned-leader``: on the leader."""
    n = len(machines)
    options: dict[str, float | str | bool] = {**OPTIONS, "partitions": PARTITIONS,
                                              "partition_groups": True}
    cluster = stack.enter_context(LocalCluster(n, options=options))
    cluster.wait_primary(60)

    def leaders_now(timeout: float = 90.0) -> dict[int, tuple[str, int]]:
        deadline = time.monotonic() + timeout
        while True:
            found = group_leaders({name: cluster.status(name) for name in cluster.names})
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"{layout}: not every group led and ready in {timeout:g} s")
            time.sleep(0.2)

    leaders = leaders_now()
    members = group_members({name: cluster.status(name) for name in cluster.names})
    counts = [sum(leader == name for leader, _ in leaders.values()) for name in cluster.names]
    if max(counts) - min(counts) > 1:  # a start's election race: back to the preferred cells
        subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                        cluster.url(cluster.names[0]), "partitions", "balance", "--timeout",
                        "60"], capture_output=True, timeout=90)
        leaders = leaders_now()
    nodes = []
    for i, name in enumerate(cluster.names):
        proc = cluster.nodes[name].proc
        assert proc is not None
        machines.place(i, proc.pid)
        nodes.append(Node(f"p/{name}", proc.pid, i, "leader"))
    on_leader = layout == "partitioned-leader"
    url_of: dict[str, str] = {}
    leader_of: dict[str, str] = {}

    def declare(bases: list[str]) -> list[str]:
        names = []
        for base, (partition, leader, client) in zip(
                bases, spread(cluster.names, leaders, len(bases), members), strict=True):
            name = queue_name_in(partition, base)
            names.append(name)
            leader_of[name] = leader
            url_of[name] = cluster.url(leader if on_leader else client)
        for leader in dict.fromkeys(leader_of[name] for name in names):
            conn = pika.BlockingConnection(pika.URLParameters(cluster.url(leader)))
            try:
                ch = conn.channel()
                for name in names:
                    if leader_of[name] == leader:
                        ch.queue_declare(name, durable=True)
            finally:
                conn.close()
        off = sum(url_of[name] != cluster.url(leader_of[name]) for name in names)
        print(f" ({off} of {len(names)} queues' clients off their leader)", end="", flush=True)
        return names

    def cleanup() -> None:
        for leader in dict.fromkeys(leader_of.values()):
            try:
                conn = pika.BlockingConnection(pika.URLParameters(cluster.url(leader)))
                try:
                    ch = conn.channel()
                    for name, at in leader_of.items():
                        if at == leader:
                            ch.queue_delete(name)
                finally:
                    conn.close()
            except (pika.exceptions.AMQPError, OSError) as exc:
                print(f" (cleanup on {leader}: {type(exc).__name__})", end="", flush=True)
        leader_of.clear()
        url_of.clear()

    def check() -> str | None:
        try:
            now = leaders_now(10)
        except TimeoutError as exc:
            return str(exc)
        if now != leaders:
            moved = {p: f"{leaders[p]} -> {now.get(p)}" for p in leaders if now.get(p) != leaders[p]}
            return f"{layout}: partitions elected during the run (leader, epoch): {moved}"
        return None

    return Layout(layout, lambda q, name: url_of[name], nodes, checks=[check], declare=declare,
                  client_declares=False, cleanup=cleanup, clusters=[cluster])


def _rabbitmq(stack: ExitStack, machines: Machines) -> Layout:
    saved = os.environ.get("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS")
    os.environ["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"] = RABBIT_ERL_ARGS
    try:
        rabbits = RabbitCluster(len(machines))
        urls = stack.enter_context(rabbits)
    finally:
        if saved is None:
            os.environ.pop("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", None)
        else:
            os.environ["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"] = saved
    nodes = []
    for i, node in enumerate(rabbits.nodes):
        assert node.pid is not None
        machines.place(i, node.pid)
        nodes.append(Node(node.nodename.split("-")[0], node.pid, i, "rabbit"))
    by_node = {n.nodename: n.url for n in rabbits.nodes}
    leaders: dict[str, str] = {}
    # 3 replicas a queue on more than 3 nodes, as brokerha's NR = 2
    arguments = QUORUM_ARGUMENTS + ((("x-quorum-initial-group-size", 3),)
                                    if len(machines) > 3 else ())

    def declare(names: list[str]) -> list[str]:
        """Declare on one node, one at a time ("balanced" sees the ones before); find leaders."""
        conn = pika.BlockingConnection(pika.URLParameters(urls[0]))
        try:
            ch = conn.channel()
            for name in names:
                ch.queue_declare(name, durable=True, arguments=dict(arguments))
        finally:
            conn.close()
        rows = json.loads(rabbits.nodes[0].check("list_queues", "name", "leader", "--formatter",
                                                 "json", "--quiet"))
        leaders.update({row["name"]: row["leader"] for row in rows})
        spread = {n.nodename.split("-")[0]: sum(leaders.get(q) == n.nodename for q in names)
                  for n in rabbits.nodes}
        print(f" (leaders per node {spread})", end="", flush=True)
        return names

    return Layout("rabbitmq-quorum", lambda q, name: by_node.get(leaders.get(name, ""), urls[0]),
                  nodes, arguments, declare=declare)


# -- measuring -------------------------------------------------------------------------


# (when, machines' CPU, per node pid: (user s, system s, event-loop thread s))
Mark = tuple[float, list[CpuSample], dict[int, tuple[float, float, float]]]


@dataclass
class Figures:
    layout: str
    workload: str
    round: int
    load: tuple[float, float]  # 1-minute load average before and after
    cap: float
    msgs_per_s: float = 0.0
    commits_per_s: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    machine_cpu: list[float] = field(default_factory=list)  # CPUs used per machine
    machine_throttled: list[float] = field(default_factory=list)  # share of periods throttled
    primary_us_per_msg: float | None = None  # all primaries' CPU / messages
    backup_us_per_msg: float | None = None  # all backups' CPU / (2 x messages)
    kernel_share: float | None = None  # of the brokerha nodes' CPU, in the kernel (system)
    primary_loop_us_per_msg: float | None = None  # of primary_us_per_msg, the event loop's
    backup_loop_us_per_msg: float | None = None  # the rest: the store's threads
    # every brokerha node's CPU / messages (partitioned-direct: c_p + 2 c_b; partitioned:
    # the same plus forwarding and remote consumers, whose nodes lead and back at once)
    nodes_us_per_msg: float | None = None
    nodes_loop_us_per_msg: float | None = None  # of it, the event loops'
    loadgen_cpu: float = 0.0  # CPUs used by the load generator (one process)
    idle_cpu: float | None = None  # CPUs the layout's nodes used idle (Layout.idle_cpu)
    leading_machines: list[int] = field(default_factory=list)  # hold a primary / leader
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def saturated(self) -> bool:
        """Every machine holding a primary (leader) used >= 90 % of its cap: the figure is
        the caps', not the shared box's (other engineers' load) or the clients'."""
        used = [self.machine_cpu[m] for m in self.leading_machines if m < len(self.machine_cpu)]
        return bool(used) and not self.error and min(used) >= 0.9 * self.cap

    def at_cap(self) -> float | None:
        """msgs/s scaled to the busiest machine using its whole cap (CPU per message held):
        what the layout would do if the shared 2-core box had let every machine reach
        its cap. An estimate; the measured msgs/s is the figure."""
        busiest = max(self.machine_cpu, default=0.0)
        return self.msgs_per_s * self.cap / busiest if busiest and not self.error else None

    def predicted_ratio(self) -> float | None:
        """docs/ha.md's ceiling from these per-message costs: N c_p / (c_p + 2 c_b)."""
        cp, cb = self.primary_us_per_msg, self.backup_us_per_msg
        return len(self.machine_cpu) * cp / (cp + 2 * cb) if cp and cb else None


def measure(layout: Layout, workload: str, args: argparse.Namespace, machines: Machines,
            rnd: int) -> Figures:
    seconds, warmup, cap, py_spy = args.seconds, args.warmup, args.cap, args.py_spy
    fig = Figures(layout.name, workload, rnd, (os.getloadavg()[0], 0.0), cap,
                  idle_cpu=layout.idle_cpu)
    marks: dict[str, Mark] = {}
    spies = ExitStack()
    spy_of: dict[int, PySpy] = {}

    def on_window(edge: str) -> None:
        marks[edge] = (time.perf_counter(), machines.sample(),
                       {n.pid: (*tree_cpu_times(n.pid), loop_thread_cpu(n.pid))
                        for n in layout.nodes})
        if py_spy is not None and edge == "start":
            for n in layout.nodes[:3]:  # one cluster's primary and backups are enough
                if n.role in ("primary", "backup", "leader"):
                    spy_of[n.pid] = spies.enter_context(PySpy(
                        n.pid, py_spy / f"{layout.name}-{workload}-{n.label.replace('/', '-')}"
                        f"-{n.role}.txt", PY_SPY_RATE,
                        cpu=functools.partial(tree_cpu_times, n.pid)))
        elif edge == "end":
            spies.close()

    print(f"  {layout.name:20} {workload:8} ...", end="", flush=True)
    publishers = args.tx_publishers if workload == "tx" else args.publishers
    logged = log_stamp()
    try:
        targets = layout.targets(workload, args.queues, publishers)
        with spies:
            results = asyncio.run(loadgen.run_workloads(
                targets, layout.workload(workload), seconds, warmup, on_window=on_window))
    except Exception as exc:  # one failing cell must not stop the others
        if isinstance(exc, Terminated):
            raise
        fig.error = f"{type(exc).__name__}: {exc}"[:2000]
        why = layout.why(logged)
        if why:
            fig.error += f" (the nodes' log: {why})"
        print(f" error: {fig.error}", flush=True)
        return fig
    finally:
        if layout.cleanup is not None:
            layout.cleanup()
    fig.load = (fig.load[0], os.getloadavg()[0])
    _fill(fig, results, marks, layout)
    for check in layout.checks:
        note = check()
        if note:
            fig.notes.append(note)
    print(" " + one_line(fig), flush=True)
    if py_spy is not None:
        _write_profiles(fig, layout, py_spy, results, spy_of)
    return fig


def _fill(fig: Figures, results: Sequence[Result],
          marks: dict[str, Mark],
          layout: Layout) -> None:
    fig.leading_machines = sorted({n.machine for n in layout.nodes
                                   if n.role in ("primary", "leader", "rabbit")})
    fig.msgs_per_s = sum(r.msgs_per_s for r in results)
    fig.commits_per_s = sum(r.commits_per_s for r in results)
    fig.p50_ms, fig.p99_ms = percentiles_ms([x for r in results for x in r.latency_ms])
    fig.loadgen_cpu = results[0].client_cpu_s / results[0].duration if results else 0.0
    for r in results:
        if r.nacked or r.returned:
            fig.notes.append(f"{r.nacked} nacked, {r.returned} returned")
    (t0, s0, c0), (t1, s1, c1) = marks["start"], marks["end"]
    wall = t1 - t0
    fig.machine_cpu = [(b.usage_s - a.usage_s) / wall for a, b in zip(s0, s1, strict=True)]
    fig.machine_throttled = [(b.throttled - a.throttled) / max(1, b.periods - a.periods)
                             for a, b in zip(s0, s1, strict=True)]
    messages = fig.msgs_per_s * wall
    roles = ("primary", "backup", "leader")
    brokerha = [n for n in layout.nodes if n.role in roles]
    if messages and brokerha:
        used = {role: sum(sum(c1[n.pid][:2]) - sum(c0[n.pid][:2]) for n in brokerha
                          if n.role == role) for role in roles}
        loop = {role: sum(c1[n.pid][2] - c0[n.pid][2] for n in brokerha
                          if n.role == role) for role in roles}
        fig.nodes_us_per_msg = 1e6 * sum(used.values()) / messages
        fig.nodes_loop_us_per_msg = 1e6 * sum(loop.values()) / messages
        kernel = sum(c1[n.pid][1] - c0[n.pid][1] for n in brokerha)
        fig.kernel_share = kernel / max(1e-9, sum(used.values()))
        primaries = sum(n.role == "primary" for n in brokerha)
        if primaries:  # backups per group: 2 (partitioned-direct) or N - 1 (single-group)
            backups = sum(n.role == "backup" for n in brokerha) / primaries
            fig.primary_loop_us_per_msg = 1e6 * loop["primary"] / messages
            fig.backup_loop_us_per_msg = 1e6 * loop["backup"] / (backups * messages)
            fig.primary_us_per_msg = 1e6 * used["primary"] / messages
            fig.backup_us_per_msg = 1e6 * used["backup"] / (backups * messages)


def _write_profiles(fig: Figures, layout: Layout, out: Path, results: Sequence[Result],
                    spy_of: dict[int, PySpy]) -> None:
    """Per-message summaries of the py-spy records, scaled to each node's measured CPU
    (py-spy also counts a thread waiting for a core, or for the disk, as busy)."""
    messages = round(fig.msgs_per_s * sum(r.duration for r in results) / max(1, len(results)))
    for n in layout.nodes:
        spy = spy_of.get(n.pid)
        if spy is not None and spy.out.exists():
            summary = out / f"{spy.out.stem}.summary.txt"
            summary.write_text(summarize_pyspy(spy.out, PY_SPY_RATE, messages, spy.cpu_times))
            print(f"    py-spy {n.label} ({n.role}): {summary}", flush=True)


def one_line(f: Figures) -> str:
    if f.error:
        return f"error: {f.error[:300]}"
    cpu = " ".join(f"{c:.2f}" for c in f.machine_cpu)
    thr = " ".join(f"{t:.0%}" for t in f.machine_throttled)
    per = (f", primary {f.primary_us_per_msg:.1f} (loop {_ms(f.primary_loop_us_per_msg)}) / "
           f"backup {f.backup_us_per_msg:.1f} (loop {_ms(f.backup_loop_us_per_msg)})"
           if f.primary_us_per_msg is not None and f.backup_us_per_msg is not None else "")
    if f.nodes_us_per_msg is not None and f.kernel_share is not None:
        per += (f"{',' if not per else ';'} all nodes {f.nodes_us_per_msg:.1f} "
                f"(loops {_ms(f.nodes_loop_us_per_msg)}) µs/msg ({f.kernel_share:.0%} kernel)")
    commits = f" ({f.commits_per_s:,.0f} commits/s)" if f.commits_per_s else ""
    return (f"{f.msgs_per_s:,.0f} msgs/s{commits}, p50 {_ms(f.p50_ms)} p99 {_ms(f.p99_ms)} ms, "
            f"machines {cpu} CPU (throttled {thr}){per}, loadgen {f.loadgen_cpu:.2f} CPU, "
            f"load {f.load[0]:.1f}->{f.load[1]:.1f}"
            + "".join(f"; NOTE {n}" for n in f.notes))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


# -- reporting -------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


def ratios(figs: Sequence[Figures], workload: str, num: str, den: str,
           scaled: bool = False, saturated: bool = False) -> list[float]:
    """``num / den`` msgs/s per round (both measured in the same round); ``scaled``:
    of ``Figures.at_cap``; ``saturated``: only rounds where both saturated their caps."""
    out = []
    for r in sorted({f.round for f in figs}):
        a = [f for f in figs if (f.round, f.workload, f.layout) == (r, workload, num) and not f.error]
        b = [f for f in figs if (f.round, f.workload, f.layout) == (r, workload, den) and not f.error]
        if saturated and not (a and b and a[0].saturated() and b[0].saturated()):
            continue
        x, y = ((a[0].at_cap(), b[0].at_cap()) if scaled else
                (a[0].msgs_per_s, b[0].msgs_per_s)) if a and b else (None, None)
        if x and y:
            out.append(x / y)
    return out


def report(figs: Sequence[Figures], workloads: Sequence[str], cap: float) -> str:
    head = ["layout", "workload", "msgs/s", "at cap (est.)", "saturated", "p50 ms", "p99 ms",
            f"CPU per machine (cap {cap:.2f})", "throttled periods", "primary µs/msg (loop)",
            "backup µs/msg (loop)", "all nodes µs/msg (loops)", "of which kernel", "idle CPU", "loadgen CPU", "load"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in figs:
        if f.error:
            lines.append(f"| {f.layout} | {f.workload} | error |" + " - |" * (len(head) - 3))
            continue
        lines.append(
            f"| {f.layout} | {f.workload} | {f.msgs_per_s:,.0f} | {f.at_cap() or 0:,.0f} | "
            f"{'yes' if f.saturated() else 'no'} | "
            f"{_ms(f.p50_ms)} | "
            f"{_ms(f.p99_ms)} | {' / '.join(f'{c:.2f}' for c in f.machine_cpu)} | "
            f"{' / '.join(f'{t:.0%}' for t in f.machine_throttled)} | "
            f"{_ms(f.primary_us_per_msg)} ({_ms(f.primary_loop_us_per_msg)}) | "
            f"{_ms(f.backup_us_per_msg)} ({_ms(f.backup_loop_us_per_msg)}) | "
            f"{_ms(f.nodes_us_per_msg)} ({_ms(f.nodes_loop_us_per_msg)}) | "
            f"{'-' if f.kernel_share is None else f'{f.kernel_share:.0%}'} | "
            f"{'-' if f.idle_cpu is None else f'{f.idle_cpu:.3f}'} | "
            f"{f.loadgen_cpu:.2f} | {f.load[0]:.1f}–{f.load[1]:.1f} |")
    lines.append("")
    for w in workloads:
        single = [f for f in figs if (f.layout, f.workload) == ("single-group", w) and not f.error]
        predicted = _median([f.predicted_ratio() for f in single])
        if predicted is not None:
            n = len(single[0].machine_cpu)
            lines.append(f"{w}: single-group's own costs predict a ceiling of "
                         f"{n} c_p / (c_p + 2 c_b) = {predicted:.2f}x")
    # the real partitioned layout's measured ratios last, as issue 35 asks
    numerators = ("partitioned-direct", "partitioned-leader", "partitioned")
    for scaled in (True, False):
        for num in numerators:
            for w in workloads:
                for den, label in (("single-group", "single-group"),
                                   ("rabbitmq-quorum", "RabbitMQ")):
                    rs = ratios(figs, w, num, den, scaled)
                    if not rs:
                        continue
                    each = ", ".join(f"{r:.2f}" for r in rs)
                    what = "scaled to the caps, est.: " if scaled else ""
                    clean = ratios(figs, w, num, den, scaled, saturated=True)
                    both = ", ".join(f"{r:.2f}" for r in clean) or "none"
                    lines.append(f"{what}{num} / {label} = {statistics.median(rs):.2f}x "
                                 f"({w}; per round {each}; both saturated: {both})")
    # the last lines, as issue 35 asks, also when a side has no figure (why, then)
    layouts = {f.layout for f in figs}
    for w in workloads:
        for den, label in (("single-group", "single-group"), ("rabbitmq-quorum", "RabbitMQ")):
            if "partitioned" not in layouts or den not in layouts or ratios(
                    figs, w, "partitioned", den):
                continue
            failed = [f for f in figs if f.workload == w and f.layout in ("partitioned", den)
                      and f.error]
            lines.append(f"partitioned / {label} = not measured ({w}: "
                         + "; ".join(f"{f.layout} round {f.round + 1}: {(f.error or '')[:160]}"
                                     for f in failed[:2]) + ")")
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage0", action="store_true",
                   help="issue 35 stage 0: layouts single-group, partitioned-direct, "
                        "rabbitmq-quorum")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated, of {', '.join(LAYOUTS)} (all by default)")
    p.add_argument("--nodes", type=int, default=MACHINES,
                   help="machines (and nodes of each brokerha or RabbitMQ cluster): 3 or 5, "
                        "odd so that the partitioned layout's clients are off their leader for "
                        "(N-1)/N of the queues")
    p.add_argument("--workloads", default="confirm,tx", help="comma-separated: confirm, tx")
    p.add_argument("--queues", type=int, default=12)
    p.add_argument("--publishers", type=int, default=1,
                   help="publisher (and consumer) connections per queue, confirm workload")
    p.add_argument("--tx-publishers", type=int, default=8,
                   help="the same for the tx workload, one commit in flight each (8: enough "
                        "that the caps bound it, not the commit latency; with 1 per queue the "
                        "12 commits in flight leave the machines idle)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per cell")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each")
    p.add_argument("--rounds", type=int, default=1,
                   help="each layout started afresh per round, order reversed on odd rounds")
    p.add_argument("--cap", type=float, default=None,
                   help=f"CPUs per machine (cgroup quota); default {TOTAL_CPU:g} / --nodes "
                        "(0.6 for 3, 0.36 for 5: the same total)")
    p.add_argument("--period-us", type=int, default=100_000, help="CFS period")
    p.add_argument("--shares", type=int, default=0, metavar="N",
                   help="cgroup v1 cpu.shares of each machine and of an uncapped cgroup for "
                        "the load generator (v2: cpu.weight N x 100 / 1024); e.g. 16384 so that "
                        "other work on the box (1024 each) cannot starve the caps; 0: default "
                        "weight, the machines compete with everything else")
    p.add_argument("--no-rabbitmq", action="store_true", help="leave out rabbitmq-quorum")
    p.add_argument("--slow-timers", type=float, default=1.0, metavar="K",
                   help="brokerha's lease and election timeouts K times docs/ha.md's defaults "
                        "(0.4 and 0.6 s): on a box whose load starves the capped nodes for "
                        "longer than a lease, the default timers elect mid-run")
    p.add_argument("--py-spy", type=Path, metavar="DIR",
                   help="py-spy record the brokerha nodes in each measured window (raw stacks "
                        "and per-message summaries into DIR; py-spy on PATH)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write all figures as JSON")
    p.add_argument("--report", type=Path, metavar="FILE",
                   help="measure nothing: print the table of a --json file written before")
    args = p.parse_args(argv)
    args.layouts = STAGE0_LAYOUTS if args.stage0 else tuple(
        x for x in args.layouts.split(",") if x)
    args.workloads = tuple(x for x in args.workloads.split(",") if x)
    if args.no_rabbitmq:
        args.layouts = tuple(x for x in args.layouts if x != "rabbitmq-quorum")
    bad = [x for x in args.layouts if x not in LAYOUTS] + [
        x for x in args.workloads if x not in ("confirm", "tx")]
    if bad:
        p.error(f"unknown layout or workload: {', '.join(bad)}")
    if args.cap is None:
        args.cap = round(TOTAL_CPU / args.nodes, 3) if args.nodes > 0 else 0.0
    if args.nodes not in (3, 5, 7):
        p.error("--nodes: 3, 5 or 7")
    if not (0 < args.seconds <= 120 and 0 <= args.warmup <= 60 and 1 <= args.rounds <= 10
            and 0.05 <= args.cap <= 4 and 1 <= args.queues <= 120
            and 1 <= args.publishers <= 8 and 1 <= args.tx_publishers <= 8
            and 1 <= args.slow_timers <= 10
            and 1000 <= args.period_us <= 1_000_000 and 0 <= args.shares <= 262_144):
        p.error("keep runs bounded: 0 < --seconds <= 120, --warmup <= 60, 1 <= --rounds <= 10, "
                "0.05 <= --cap <= 4, 1 <= --queues <= 120")
    return args


def code_state() -> str:
    """Which code the nodes run: the commit, edits in the working tree, compiled or not."""
    import brokerha.broker.broker as compiled_or_not

    root = Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "?"
    dirty = subprocess.run([*git, "status", "--short", "--", "brokerha"], capture_output=True,
                           text=True).stdout.splitlines()
    native = "compiled" if str(compiled_or_not.__file__).endswith(".so") else "pure Python"
    return f"brokerha at {head}, {len(dirty)} file(s) of brokerha/ edited in the working tree, {native}"


def from_json(path: Path) -> str:
    data = json.loads(path.read_text())
    figs = [Figures(**{**f, "load": tuple(f["load"])}) for f in data["figures"]]
    for f in figs:  # written before the field existed
        f.leading_machines = f.leading_machines or ([0] if f.layout == "single-group" else
                                                    list(range(len(f.machine_cpu))))
    args = data["args"]
    head = f"{data['started'][:16]} UTC; uptime at start: {data['uptime'][0]}; at end: " \
           f"{data['uptime'][-1]}"
    return head + "\n\n" + report(figs, args["workloads"], args["cap"])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        print(from_json(args.report))
        return 0
    loadgen.selftest()
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    for key in ("lease_timeout", "election_timeout"):
        OPTIONS[key] = float(HA_DEFAULTS[key]) * args.slow_timers
    layouts = list(args.layouts)
    if "rabbitmq-quorum" in layouts and not rabbitmq_available():
        print("rabbitmq-server is not installed: brokerha layouts only", flush=True)
        layouts.remove("rabbitmq-quorum")
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    started_at = datetime.now(UTC)
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    code = code_state()
    if args.slow_timers != 1:
        code += (f"; lease and election timeouts x{args.slow_timers:g} "
                 f"({OPTIONS['lease_timeout']:g} and {OPTIONS['election_timeout']:g} s)")
    print(f"code: {code}", flush=True)
    figs: list[Figures] = []
    t0 = time.monotonic()
    with Machines(args.cap, args.period_us, count=args.nodes, shares=args.shares) as machines:
        print(f"scale-out: {len(layouts)} layout(s) x {len(args.workloads)} workload(s), "
              f"{args.queues} queues, {args.seconds:g} s (+{args.warmup:g} s warm-up) each, "
              f"{args.rounds} round(s); {args.nodes} machines = cgroup v{machines.roots.version} "
              f"{machines.roots.cpu}/{machines[0].name[:-3]}-m*, {args.cap:g} CPU each"
              f"{f', shares {args.shares} (and the load generator)' if args.shares else ''}; "
              f"{os.cpu_count()} CPUs; {uptime[0]}", flush=True)
        for rnd in range(args.rounds):
            for layout in (layouts if rnd % 2 == 0 else list(reversed(layouts))):
                try:
                    with started(layout, machines) as lay:
                        for w in args.workloads:
                            figs.append(measure(lay, w, args, machines, rnd))
                except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError,
                        pika.exceptions.AMQPError) as exc:
                    error = f"could not start: {type(exc).__name__}: {exc}"[:2000]
                    print(f"  {layout}: {error}", flush=True)
                    figs += [Figures(layout, w, rnd, (os.getloadavg()[0],) * 2, args.cap,
                                     error=error) for w in args.workloads]
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"\nscale-out ({', '.join(layouts)}; {args.nodes} nodes), {started_at:%Y-%m-%d %H:%M} UTC, "
          f"{time.monotonic() - t0:.0f} s in all; {args.queues} queues, {args.seconds:g} s "
          f"per cell; uptime at start: {uptime[0]}; at end: {uptime[1]}; {code}\n")
    for f in figs:
        for note in f.notes:
            print(f"note: {f.layout} {f.workload} round {f.round + 1}: {note}")
    print(report(figs, args.workloads, args.cap))
    if args.json:
        args.json.write_text(json.dumps({
            "started": started_at.isoformat(), "uptime": uptime, "code": code, "args": {
                k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "figures": [f.__dict__ for f in figs]}, indent=2))
    return 1 if any(f.error for f in figs) else 0


if __name__ == "__main__":
    sys.exit(main())
