"""benchmarks/scale_out.py (issue 35 stages 0 and 6): its arguments, its CPU-cap cgroups,
the partitioned layouts' queues and leaders, and (slow) one tiny run of them.

Fast but the last: no broker is started. The cgroup test runs only as root on a machine with
a cpu controller mounted, and removes what it creates.
"""

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from brokerha.cluster.partition_table import hash_partition

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scale_out  # noqa: E402

V1 = """cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
V1_JOINED = "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0\n"


def test_every_layout_is_the_default_and_runs_stay_bounded() -> None:
    args = scale_out.parse_args([])
    assert args.layouts == scale_out.LAYOUTS and "partitioned" in args.layouts
    assert args.workloads == ("confirm", "tx") and args.queues == 12 and args.cap == 0.6
    assert args.nodes == 3
    args = scale_out.parse_args(["--stage0", "--no-rabbitmq", "--workloads", "confirm"])
    assert args.layouts == ("single-group", "partitioned-direct")
    args = scale_out.parse_args(["--nodes", "5", "--layouts", "partitioned"])
    assert args.cap == 0.36 and args.layouts == ("partitioned",)  # the same 1.8 CPU in all
    assert scale_out.parse_args(["--nodes", "5", "--cap", "0.5"]).cap == 0.5
    for bad in (["--layouts", "nine"], ["--seconds", "600"], ["--cap", "0"],
                ["--workloads", "pipe"], ["--nodes", "4"]):
        with pytest.raises(SystemExit):
            scale_out.parse_args(bad)


def test_partitioned_queues_spread_over_leaders_with_clients_off_them() -> None:
    names = ["n1", "n2", "n3"]
    leaders = {p: (names[p % 3], 1) for p in range(9)}
    spread = scale_out.spread(names, leaders, 12)
    assert Counter(leader for _, leader, _ in spread) == {"n1": 4, "n2": 4, "n3": 4}
    assert Counter(client for _, _, client in spread) == {"n1": 4, "n2": 4, "n3": 4}
    assert all(leaders[p][0] == leader for p, leader, _ in spread)
    # 1/3 of the queues have their clients on their leader, 2/3 forwarded
    assert [q for q, (_, leader, client) in enumerate(spread) if leader == client] == [0, 5, 7, 9]
    # every node's clients reach every other node's partitions (each forwards, each takes)
    assert {(leader, client) for _, leader, client in spread} == {
        (a, b) for a in names for b in names}
    assert len({p for p, _, _ in spread}) == 9  # every partition has a queue
    five = ["a", "b", "c", "d", "e"]
    spread5 = scale_out.spread(five, {p: (five[p % 5], 1) for p in range(9)}, 12)
    assert sum(leader == client for _, leader, client in spread5) == 2  # q = 0, 9
    # a partition on 3 of the 5 nodes: clients only on its cells, never on the leader more
    cells = {p: [five[(p + i) % 5] for i in range(3)] for p in range(9)}
    within = scale_out.spread(five, {p: (five[p % 5], 1) for p in range(9)}, 12, cells)
    assert all(client in cells[p] for p, _, client in within)
    assert sum(leader == client for _, leader, client in within) == 2
    # a node leading nothing gets no queue (its clients still do)
    skewed = {p: (names[p % 2], 1) for p in range(9)}
    assert {leader for _, leader, _ in scale_out.spread(names, skewed, 12)} == {"n1", "n2"}
    name = scale_out.queue_name_in(4, "scale-out-x")
    assert hash_partition("/", name, 9) == 4 and name.startswith("scale-out-x-")


def test_group_leaders_wait_for_one_serving_node_a_group_all_ready() -> None:
    def node(serving: set[int], ready: bool = True) -> dict[str, object]:
        return {"node": {"groups": {str(g): {"serving": g in serving, "ready": ready,
                                             "epoch": 2} for g in range(4)}}}

    statuses: dict[str, dict[str, object] | None] = {
        "n1": node({0, 1}), "n2": node({2}), "n3": node({3})}
    assert scale_out.group_leaders(statuses, 3) == {0: ("n1", 2), 1: ("n2", 2), 2: ("n3", 2)}
    assert scale_out.group_leaders({**statuses, "n3": node(set())}, 3) is None  # 3 unled
    assert scale_out.group_leaders({**statuses, "n3": node({2, 3})}, 3) is None  # two lead 2
    assert scale_out.group_leaders({**statuses, "n2": node({2}, ready=False)}, 3) is None
    assert scale_out.group_leaders({**statuses, "n2": None}, 3) is None  # not answering


def test_the_cpu_controller_is_found_in_v1_and_v2_mounts(tmp_path: Path) -> None:
    roots = scale_out.CgroupRoots.find(V1)
    assert roots == scale_out.CgroupRoots(1, Path("/sys/fs/cgroup/cpu"),
                                          Path("/sys/fs/cgroup/cpuacct"))
    joined = scale_out.CgroupRoots.find(V1_JOINED)
    assert joined is not None and joined.cpu == joined.acct
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    v2 = scale_out.CgroupRoots.find(f"cgroup2 {tmp_path} cgroup2 rw 0 0\n")
    assert v2 == scale_out.CgroupRoots(2, tmp_path, tmp_path)
    assert scale_out.CgroupRoots.find(V1.splitlines()[2]) is None  # no cpu controller
    assert scale_out.ratios([], "confirm", "partitioned-direct", "single-group") == []


@pytest.mark.skipif(os.geteuid() != 0 or scale_out.CgroupRoots.find() is None,
                    reason="needs root and a cgroup cpu controller")
def test_a_capped_machine_holds_a_process_and_is_removed() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with scale_out.Machines(0.3) as machines:
            machines.place(1, sleeper.pid)
            assert sleeper.pid in machines[1].pids()
            before = machines.sample()
            time.sleep(0.05)
            assert [s.usage_s >= 0 for s in before] == [True] * scale_out.MACHINES
            dirs = [d for g in machines.groups for d in g.created]
            if machines.roots.version == 1:
                quota = machines[1].cpu_dir / "cpu.cfs_quota_us"
                assert quota.read_text().strip() == "30000"
        assert not any(d.exists() for d in dirs)  # the live sleeper went back to the parent
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.skipif(os.geteuid() != 0 or scale_out.CgroupRoots.find() is None,
                    reason="needs root and a cgroup cpu controller")
def test_shares_weigh_the_machines_and_put_the_load_generator_in_its_own_cgroup() -> None:
    with scale_out.Machines(0.3, count=2, shares=16384) as machines:
        clients = machines.clients
        assert clients is not None and os.getpid() in clients.pids()
        dirs = [d for g in [*machines.groups, clients] for d in g.created]
        if machines.roots.version == 1:
            assert (machines[0].cpu_dir / "cpu.shares").read_text().strip() == "16384"
            assert (clients.cpu_dir / "cpu.shares").read_text().strip() == "16384"
            assert (clients.cpu_dir / "cpu.cfs_quota_us").read_text().strip() == "-1"
        else:
            assert (clients.cpu_dir / "cpu.weight").read_text().strip() == "1600"
    assert not any(d.exists() for d in dirs)  # this process went back to the parent
    assert scale_out.Machines(0.3, count=1).clients is None  # no shares: no clients cgroup


@pytest.mark.skipif(os.geteuid() != 0 or scale_out.CgroupRoots.find() is None,
                    reason="needs root and a cgroup cpu controller")
def test_a_weighted_cgroup_holds_this_process_and_its_children_then_goes() -> None:
    import cgroups

    with cgroups.weighted(0) as none:
        assert none is None
    with cgroups.weighted(8192) as group:
        assert group is not None and os.getpid() in group.pids()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert child.pid in group.pids()  # started inside: inherits the cgroup
        finally:
            child.kill()
            child.wait()
        dirs = list(group.created)
        if group.roots.version == 1:
            assert (group.cpu_dir / "cpu.shares").read_text().strip() == "8192"
    assert not any(d.exists() for d in dirs)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(os.geteuid() != 0 or scale_out.CgroupRoots.find() is None,
                    reason="needs root and a cgroup cpu controller")
def test_a_tiny_run_of_the_partitioned_layouts() -> None:
    """Both partitioned layouts, confirms, 3 queues, 1 s, caps of 4 CPUs (none in effect):
    a cluster of 3 nodes running partition groups started, measured and stopped."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "scale_out.py"
    done = subprocess.run(
        [sys.executable, str(script), "--layouts", "partitioned,partitioned-leader",
         "--workloads", "confirm", "--queues", "3", "--seconds", "1", "--warmup", "0.5",
         "--cap", "4"], capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "(2 of 3 queues' clients off their leader)" in out
    assert "(0 of 3 queues' clients off their leader)" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()
            if line.startswith("| partitioned")}
    assert set(rows) == {"partitioned", "partitioned-leader"}
    for row in rows.values():
        assert int(row.split("|")[3].strip().replace(",", "")) > 0  # msgs/s delivered
    assert "NOTE" not in out  # no partition elected during the run


def test_a_failed_cell_names_the_nodes_errors_and_elections_since_it_began() -> None:
    class Node:
        log = ["2026-11-29 15:31:20,000 ERROR [n1] brokerha.store: an older failure",
               "2026-11-29 15:31:24,736 ERROR [n1] brokerha.store: commit failed",
               "2026-11-29 15:31:24,800 INFO [n1] brokerha.node: node n1 stopped",
               "2026-11-29 15:31:25,087 WARNING [n1] brokerha.ha: node n1 stands for election"]

    class Cluster:
        nodes = {"n1": Node()}

    layout = scale_out.Layout("x", lambda q, name: "", [], clusters=[Cluster()])  # type: ignore[list-item]
    assert layout.why("2026-11-29 15:31:24,000") == (
        "n1: brokerha.store: commit failed; n1: brokerha.ha: node n1 stands for election")
    assert layout.why("2026-11-29 15:32:00,000") == ""
    assert len(scale_out.log_stamp()) == 23


def test_the_report_ends_with_the_partitioned_ratios_measured_or_why_not() -> None:
    def fig(layout: str, msgs: float, error: str | None = None) -> scale_out.Figures:
        return scale_out.Figures(layout, "confirm", 0, (1.0, 1.0), 0.6, msgs_per_s=msgs,
                                 machine_cpu=[0.6, 0.6, 0.6], leading_machines=[0, 1, 2],
                                 error=error)

    figs = [fig("single-group", 1000), fig("partitioned-leader", 2500),
            fig("partitioned", 2000), fig("rabbitmq-quorum", 0, "320 shutdown")]
    last = scale_out.report(figs, ["confirm"], 0.6).splitlines()[-2:]
    assert last[0].startswith("partitioned / single-group = 2.00x (confirm; per round 2.00; "
                              "both saturated: 2.00)")
    assert last[1] == ("partitioned / RabbitMQ = not measured (confirm: rabbitmq-quorum "
                       "round 1: 320 shutdown)")
