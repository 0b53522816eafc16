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
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(self.env or {}))
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout
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
