"""TxLog masters as real processes on loopback (``brokerha txlog node``), for the driver tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from brokerha.testing import free_port
from brokerha.txlog.master.ctl import call
from tests.netfaults import Partition

ROOT = Path(__file__).resolve().parents[2]
FAST = {"round-timeout": 100, "idle-interval": 200, "max-peer-lag": 2500}


@dataclass
class Master:
    name: str
    config: Path
    data_dir: Path
    listen_port: int
    url_port: int  # what peers dial (a proxy's port when there is a WAN)
    api_port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _offset: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"txlog://127.0.0.1:{self.url_port}"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def write_config(self, peers: list[Master], group: str = "txlog-test", **keys: Any) -> None:
        lines = [f'node-id = "{self.name}"', f'master-url = "{self.url}"',
                 f'listen = "127.0.0.1:{self.listen_port}"', f'admin = "127.0.0.1:{self.api_port}"',
                 f'group = "{group}"', 'secret = "s3cret-for-tests"', f'data-dir = "{self.data_dir}"']
        for key, value in {**FAST, **keys}.items():
            lines.append(f"{key} = {value!r}".replace("'", '"'))
        for i, peer in enumerate(peers, start=1):
            lines += [f'peer.{i}.id = "{peer.name}"', f'peer.{i}.url = "{peer.url}"']
        self.config.write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = 15.0) -> None:
        self.spawn()
        self.wait_ready(timeout)

    def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        out = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "brokerha.cli", "txlog", "node", "--config", str(self.config)],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        out.close()

    def wait_ready(self, timeout: float = 15.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_bytes()[self._offset:].decode(errors="replace")
            if " ready: " in text:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready within {timeout}s:\n{self.log_text()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # ---- the local API -----------------------------------------------------------------

    def call(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        return call(self.api, method, path, body, timeout)

    def status(self) -> dict[str, Any]:
        return self.call("GET", "/api/status")

    def tx(self, *message_ids: str, queue: str = "/orders", wait: str = "confirm",
           kind: str = "enqueue", timeout: float = 20) -> dict[str, Any]:
        ops = [[kind, queue, m] for m in message_ids]
        return self.call("POST", "/api/tx", {"operations": ops, "wait": wait, "timeout": timeout},
                         timeout=timeout + 5)

    def entries(self) -> list[dict[str, Any]]:
        return self.call("GET", "/api/log")["entries"]

    def ids(self) -> list[str]:
        return [e["tx_id"] for e in self.entries()]


@dataclass
class Group:
    masters: dict[str, Master]
    wan: Partition | None

    def __getitem__(self, name: str) -> Master:
        return self.masters[name]

    def logs(self, names: list[str] | None = None) -> dict[str, list[str]]:
        return {n: self.masters[n].ids() for n in names or self.masters}

    def assert_prefix_consistent(self, names: list[str] | None = None) -> dict[str, list[str]]:
        logs = self.logs(names)
        for a, la in logs.items():
            for b, lb in logs.items():
                short, long_ = (la, lb) if len(la) <= len(lb) else (lb, la)
                assert long_[: len(short)] == short, f"{a} and {b} diverge:\n{la}\n{lb}"
        return logs

    def wait_applied(self, timeout: float = 10) -> None:
        """Every master executed its whole synchronised queue (outcomes are final)."""
        def done() -> bool:
            return all(s["applied"] == s["synchronised"]["length"]
                       for s in (m.status() for m in self.masters.values()))
        wait_for(done, timeout, "every master applied its log")

    def wait_converged(self, must_hold: set[str] = frozenset(), timeout: float = 15,  # type: ignore[assignment]
                       names: list[str] | None = None) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            logs = self.logs(names)
            first = next(iter(logs.values()))
            if all(log == first for log in logs.values()) and must_hold <= set(first):
                return first
            if time.monotonic() > deadline:
                raise AssertionError(f"not converged within {timeout}s (want {sorted(must_hold)}):\n"
                                     + "\n".join(f"{n}: {log}" for n, log in logs.items()))
            time.sleep(0.1)


def wait_for(predicate: Callable[[], Any], timeout: float = 10, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)


def make_masters(tmp: Path, names: list[str], wan: bool = False) -> dict[str, Master]:
    masters = {}
    for name in names:
        listen = free_port()
        masters[name] = Master(name, tmp / f"{name}.toml", tmp / name, listen,
                               free_port() if wan else listen, free_port(), tmp / f"{name}.log")
    return masters


@contextmanager
def running_group(tmp: Path, names: list[str], *, wan: bool = False, one_way_ms: float = 0,
                  peers: dict[str, list[str]] | None = None, **keys: Any) -> Iterator[Group]:
    """Start masters named ``names`` (each with every other as peer unless ``peers`` says)."""
    masters = make_masters(tmp, names, wan or one_way_ms > 0)
    proxy = None
    if wan or one_way_ms > 0:
        proxy = Partition({m.name: (m.url_port, m.listen_port) for m in masters.values()}, one_way_ms)

    def chosen_peers(name: str) -> list[str]:
        return peers.get(name, []) if peers is not None else [n for n in names if n != name]

    for m in masters.values():
        m.write_config([masters[p] for p in chosen_peers(m.name)], **keys)
    group = Group(masters, proxy)
    try:
        for m in masters.values():
            m.spawn()
        for m in masters.values():
            m.wait_ready()
        for m in masters.values():
            mutual = [n for n in chosen_peers(m.name) if m.name in chosen_peers(n)]
            wait_for(lambda m=m, mutual=mutual: all(
                p["connected"] for p in m.status()["peers"] if p["id"] in mutual), 10,
                f"{m.name}'s links up")
        yield group
    except BaseException:
        for m in masters.values():
            sys.stderr.write(f"---- {m.name} log ----\n{m.log_text()[-6000:]}\n")
        raise
    finally:
        for m in masters.values():
            m.stop()
        if proxy is not None:
            proxy.close()
