"""benchmarks/scale_out.py (issue 35 stage 0): its arguments and its CPU-cap cgroups.

Fast: no broker is started. The cgroup test runs only as root on a machine with
a cpu controller mounted, and removes what it creates.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scale_out  # noqa: E402

V1 = """cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
V1_JOINED = "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0\n"


def test_stage0_is_the_default_and_runs_stay_bounded() -> None:
    args = scale_out.parse_args([])
    assert args.layouts == scale_out.STAGE0_LAYOUTS
    assert args.workloads == ("confirm", "tx") and args.queues == 12 and args.cap == 0.6
    args = scale_out.parse_args(["--stage0", "--no-rabbitmq", "--workloads", "confirm"])
    assert args.layouts == ("single-group", "partitioned-direct")
    for bad in (["--layouts", "nine"], ["--seconds", "600"], ["--cap", "0"],
                ["--workloads", "pipe"]):
        with pytest.raises(SystemExit):
            scale_out.parse_args(bad)


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
