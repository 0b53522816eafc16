"""CPU cgroups for the benchmarks: capped "machines" (scale_out.py) and a weighted
cgroup that makes a benchmark's processes win the CPU over the rest of a shared box.

cgroup v1 (a ``cpu`` and a ``cpuacct`` hierarchy, as mounted here) or v2 (the unified
hierarchy with the cpu controller), whichever has the cpu controller; root only. Every
cgroup made here is named ``brokerha-scale-<pid>-...``, removed by whoever made it, also
on an error; empty ones left by a SIGKILLed benchmark are removed at the next start
(:func:`remove_stale_cgroups`).
"""

from __future__ import annotations

import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CGROUP_PREFIX = "brokerha-scale-"


@dataclass(frozen=True)
class CgroupRoots:
    """Where the cpu controller (quota) and the CPU usage live on this machine."""

    version: int  # 1 or 2
    cpu: Path  # v1: the cpu hierarchy (cfs quota, cpu.stat); v2: the unified root
    acct: Path  # v1: the cpuacct hierarchy (cpuacct.usage); v2: same as cpu

    @staticmethod
    def find(mounts: str | None = None) -> CgroupRoots | None:
        """The cgroup hierarchy with a cpu controller, from /proc/mounts; None if none."""
        if mounts is None:
            try:
                mounts = Path("/proc/mounts").read_text()
            except OSError:
                return None
        cpu = acct = v2 = None
        for line in mounts.splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            where, kind, options = Path(parts[1]), parts[2], parts[3].split(",")
            if kind == "cgroup":
                if "cpu" in options and cpu is None:
                    cpu = where
                if "cpuacct" in options and acct is None:
                    acct = where
            elif kind == "cgroup2" and v2 is None:
                v2 = where
        if cpu is not None and acct is not None:
            return CgroupRoots(1, cpu, acct)
        if v2 is not None:
            try:
                controllers = (v2 / "cgroup.controllers").read_text().split()
            except OSError:
                controllers = []
            if "cpu" in controllers:
                return CgroupRoots(2, v2, v2)
        return None


@dataclass(frozen=True)
class CpuSample:
    usage_s: float  # CPU seconds used by the cgroup's processes so far
    periods: int  # CFS periods in which it ran
    throttled: int  # of which it was throttled at the quota


class CpuCgroup:
    """One capped cgroup (a "machine"): ``cap`` CPUs per ``period_us``."""

    def __init__(self, roots: CgroupRoots, name: str, cap: float | None,
                 period_us: int = 100_000, shares: int = 0) -> None:
        self.roots, self.name, self.cap, self.period_us = roots, name, cap, period_us
        self.shares = shares  # cgroup v1 cpu.shares (v2: cpu.weight scaled); 0: the default
        self.cpu_dir = roots.cpu / name
        self.acct_dir = roots.acct / name
        self.created: list[Path] = []

    def create(self) -> CpuCgroup:
        for d in dict.fromkeys((self.cpu_dir, self.acct_dir)):
            d.mkdir()
            self.created.append(d)
        if self.roots.version == 1:
            if self.cap is not None:
                (self.cpu_dir / "cpu.cfs_period_us").write_text(str(self.period_us))
                (self.cpu_dir / "cpu.cfs_quota_us").write_text(str(int(self.cap * self.period_us)))
            if self.shares:
                (self.cpu_dir / "cpu.shares").write_text(str(self.shares))
        else:
            control = self.roots.cpu / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
            if self.cap is not None:
                (self.cpu_dir / "cpu.max").write_text(
                    f"{int(self.cap * self.period_us)} {self.period_us}")
            if self.shares:  # v2's weight is 1..10000, 100 by default (v1: 1024)
                (self.cpu_dir / "cpu.weight").write_text(
                    str(max(1, min(10_000, self.shares * 100 // 1024))))
        return self

    def add(self, pid: int) -> None:
        """Move a process (all its threads) into this cgroup; its later children follow."""
        for d in self.created:
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        pids: set[int] = set()
        for d in self.created:
            try:
                pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(pids)

    def sample(self) -> CpuSample:
        stat = dict(line.split() for line in (self.cpu_dir / "cpu.stat").read_text().splitlines()
                    if len(line.split()) == 2)
        if self.roots.version == 1:
            usage = int((self.acct_dir / "cpuacct.usage").read_text()) / 1e9
        else:
            usage = int(stat["usage_usec"]) / 1e6
        return CpuSample(usage, int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0)))

    def remove(self, timeout: float = 15.0) -> None:
        """Move what is left back to the parent cgroup, then remove the directories.

        A process killed just before (RabbitMQ's VM after its script) may still
        be exiting and keep the directory busy a moment: retried until ``timeout``.
        """
        deadline = time.monotonic() + timeout
        for d in reversed(self.created):
            while True:
                try:
                    for pid in (d / "cgroup.procs").read_text().split():
                        try:
                            (d.parent / "cgroup.procs").write_text(pid)
                        except OSError:
                            pass  # it exited meanwhile
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        print(f"warning: could not remove cgroup {d}: {exc}", file=sys.stderr)
                        break
                    time.sleep(0.1)
        self.created.clear()


def remove_stale_cgroups(roots: CgroupRoots) -> list[Path]:
    """Empty ``brokerha-scale-<pid>-*`` cgroups whose benchmark process is gone."""
    removed = []
    for root in dict.fromkeys((roots.cpu, roots.acct)):
        for d in root.glob(f"{CGROUP_PREFIX}*"):
            m = re.match(rf"{CGROUP_PREFIX}(\d+)-", d.name)
            if not m or Path(f"/proc/{m[1]}").exists():
                continue
            try:
                d.rmdir()  # only if empty (no process in it)
                removed.append(d)
            except OSError:
                pass
    return removed


def process_tree(root: int) -> list[int]:
    """``root`` and its live descendants (RabbitMQ: the script, the VM and its helpers)."""
    parent: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    parent[int(entry.name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(p for p, pp in parent.items() if pp == pid)
    return tree


@contextmanager
def weighted(shares: int, roots: CgroupRoots | None = None) -> Iterator[CpuCgroup | None]:
    """This process, and every process it starts from then on, in an uncapped cgroup of
    ``shares`` (v1 cpu.shares; v2 cpu.weight ``shares`` x 100 / 1024), so that work on the
    box outside it (1024 each: other sessions' tests, builds) yields the CPU to it: a
    shared machine made to behave as a quiet one for what runs inside. What runs inside
    (nodes, clients) competes as it would on a quiet machine, but only while it leaves
    the cores idle now and then: the kernel's threads (I/O completion workers, softirq,
    writeback) are outside it, so something inside that keeps every core busy (CPU
    burners) starves them and every fsync with them (issue 33, eleventh session; hence
    ha_heavy_work.py refuses ``--shares`` with ``--burners``). 0: nothing done (None)."""
    if not shares:
        yield None
        return
    roots = roots or CgroupRoots.find()
    if roots is None:
        raise RuntimeError("no cgroup hierarchy with a cpu controller is mounted")
    if os.geteuid() != 0:
        raise RuntimeError("a weighted cgroup needs root (cgroup directories are created here)")
    remove_stale_cgroups(roots)
    group = CpuCgroup(roots, f"{CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:4]}-weighted",
                      None, shares=shares)
    try:
        group.create().add(os.getpid())
        yield group
    finally:
        group.remove()
