"""Profiling a brokerha node under load: cProfile (deterministic) or py-spy (sampling).

Both summaries are given per message delivered, so that "where the time goes
per message" can be read straight off them. cProfile adds a cost to every
Python call (it inflates small functions most); py-spy samples the running
process from outside and barely slows it, so its totals are the ones to quote.
"""

from __future__ import annotations

import pstats
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from brokerha.testing import NodeProcess

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def make_node(name: str, cprofile_out: Path | None = None) -> NodeProcess:
    """A brokerha NodeProcess; under ``python -m cProfile -o cprofile_out`` if given."""
    from brokerha.testing import NodeProcess

    class CProfiledNode(NodeProcess):
        def command(self) -> list[str]:
            python, *rest = super().command()
            return [python, "-m", "cProfile", "-o", str(cprofile_out), *rest]

    return CProfiledNode(name) if cprofile_out else NodeProcess(name)


def summarize_cprofile(path: Path, messages: int, top: int = 30) -> str:
    """The functions with the most own time, in µs per message delivered."""
    stats = pstats.Stats(str(path))
    table = stats.stats  # type: ignore[attr-defined]
    rows = sorted(table.items(), key=lambda kv: kv[1][2], reverse=True)
    total = sum(v[2] for _, v in rows)
    per = max(1, messages)
    out = [f"cProfile {path}: {total:.2f} s own time in all, {messages:,} messages delivered "
           f"-> {1e6 * total / per:.1f} µs/msg (cProfile inflates this)",
           f"{'µs/msg':>8} {'calls/msg':>9}  function"]
    for (file, line, name), (_cc, ncalls, tottime, _cum, _callers) in rows[:top]:
        where = f"{Path(file).name}:{line}({name})" if line else name
        out.append(f"{1e6 * tottime / per:8.2f} {ncalls / per:9.2f}  {where}")
    return "\n".join(out)


class PySpy:
    """``py-spy record`` attached to a PID while the context is open (raw collapsed stacks)."""

    def __init__(self, pid: int, out: Path, rate: int = 250,
                 cpu: Callable[[], tuple[float, float]] | None = None) -> None:
        exe = Path(sys.executable).with_name("py-spy")
        found = str(exe) if exe.exists() else shutil.which("py-spy")
        if found is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy into the venv)")
        self.command = [found, "record", "--pid", str(pid), "--rate", str(rate),
                        "--format", "raw", "--output", str(out), "--nonblocking"]
        self.rate = rate
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = None
        self._cpu = cpu
        self._cpu_start = (0.0, 0.0)
        self.cpu_times: tuple[float, float] | None = None  # target's (user, sys) CPU while recording

    def __enter__(self) -> PySpy:
        if self._cpu is not None:
            self._cpu_start = self._cpu()
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """SIGINT makes py-spy write its output; SIGKILL if it does not exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if self._cpu is not None:
            end = self._cpu()
            self.cpu_times = (end[0] - self._cpu_start[0], end[1] - self._cpu_start[1])
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _function(frame: str) -> tuple[str, str]:
    """(function label, source area) of one py-spy frame ``func (path:line)``."""
    m = FRAME.match(frame)
    if not m:
        return frame, "?"
    path = m["file"]  # py-spy shortens it to the import path, e.g. brokerha/amqp/frames.py
    return f"{m['func']} ({Path(path).name})", path


def summarize_pyspy(path: Path, rate: int, messages: int,
                    cpu_times: tuple[float, float] | None = None, top: int = 25) -> str:
    """Where the time goes per message: own time by source file and by function, in µs/msg.

    py-spy counts a thread that is runnable but waiting for a core as busy, so on
    a loaded machine its sample count overstates CPU; when the process's measured
    (user, system) CPU time is known, each share is applied to that. A function's
    own time includes the C code it calls (struct, socket send/recv).
    """
    own: Counter[str] = Counter()
    by_area: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_function(f) for f in stack.split(";")]
        total += count
        own[frames[-1][0]] += count
        by_area[frames[-1][1]] += count
        for label in {label for label, _ in frames}:
            inclusive[label] += count
    per = max(1, messages)
    seconds = sum(cpu_times) if cpu_times is not None else total / rate

    def row(label: str, n: int) -> str:
        return f"{1e6 * seconds * n / max(1, total) / per:8.2f} {n / max(1, total):6.1%}  {label}"

    if cpu_times is not None:
        user, system = cpu_times
        basis = (f"{seconds:.2f} s CPU measured ({user:.2f} user, {system:.2f} system = "
                 f"{1e6 * system / per:.1f} µs/msg in the kernel)")
    else:
        basis = f"{seconds:.2f} s from samples"
    head = f"{'µs/msg':>8} {'share':>6}"
    out = [f"py-spy {path}: {total} samples at {rate}/s; {basis}; {messages:,} messages "
           f"delivered -> {1e6 * seconds / per:.1f} µs/msg", "",
           f"own time by source file:\n{head}  file"]
    out += [row(a, n) for a, n in by_area.most_common(top)]
    out += ["", f"own time by function:\n{head}  function"]
    out += [row(f, n) for f, n in own.most_common(top)]
    scaffolding = 0.95 * total  # event-loop frames that are on every stack say nothing
    out += ["", f"inclusive time (frames on < 95 % of stacks):\n{head}  function"]
    out += [row(f, n) for f, n in inclusive.most_common() if n < scaffolding][:top]
    return "\n".join(out)
