"""A private RabbitMQ reference node on loopback, for benchmarks and behaviour comparisons.

Runs Debian's ``rabbitmq-server`` without the system service manager, as
``../shared/design/performance-notes.md`` describes: its own ``HOME`` (so its
own Erlang cookie), a unique ``RABBITMQ_NODENAME``, ``127.0.0.1`` only, and
mnesia, log, config, enabled-plugins (an empty list), plugin-expand and pid
files inside one throwaway directory, with distinct AMQP and distribution ports.

It also runs its own ``epmd`` on a private port (``ERL_EPMD_PORT``) as a child
of this process, so the epmd it stops by PID is always the one it started, and
other engineers' Erlang nodes on the shared port 4369 are never touched.

As a library::

    from rabbitmq_ref import RabbitMQRef, available   # with benchmarks/ on sys.path
    if available():
        with RabbitMQRef() as url:   # amqp://guest:guest@127.0.0.1:PORT/%2F
            ...

From a shell (foreground until Ctrl-C or SIGTERM)::

    python benchmarks/rabbitmq_ref.py --port 5673
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

RABBITMQ_SBIN = Path("/usr/lib/rabbitmq/bin")
RABBITMQ_SERVER = RABBITMQ_SBIN / "rabbitmq-server"
RABBITMQCTL = RABBITMQ_SBIN / "rabbitmqctl"

CONFIG = """\
listeners.tcp.default = {port}
loopback_users.guest = true
log.console = false
log.file.level = info
"""
# an amqps listener (``RabbitMQRef(tls=...)``): TLS 1.3 and 1.2 as brokerha's listener
# allows; client certificates asked for and checked only with ``verify_peer=True``
TLS_CONFIG = """\
listeners.ssl.default = {ssl_port}
ssl_options.certfile = {cert}
ssl_options.keyfile = {key}
ssl_options.cacertfile = {ca}
ssl_options.verify = {verify}
ssl_options.fail_if_no_peer_cert = false
ssl_options.versions.1 = tlsv1.3
ssl_options.versions.2 = tlsv1.2
"""


def available() -> bool:
    """True when Debian's rabbitmq-server (and epmd) are installed here."""
    return (
        os.access(RABBITMQ_SERVER, os.X_OK)
        and os.access(RABBITMQCTL, os.X_OK)
        and shutil.which("epmd") is not None
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _stop_process(proc: subprocess.Popen[bytes], timeout: float, group: bool = False,
                  signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL)) -> None:
    """SIGTERM a child we started (its process group if ``group``), then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig in signals:
        try:
            if group:
                os.killpg(proc.pid, sig)  # the group we created with start_new_session
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            continue


class RabbitMQRef:
    """A private single RabbitMQ node; ``with RabbitMQRef() as url: ...``."""

    def __init__(
        self,
        port: int | None = None,
        *,
        dist_port: int | None = None,
        epmd_port: int | None = None,
        startup_timeout: float = 60.0,
        keep_dir: bool = False,
        tls: tuple[Path, Path, Path] | None = None,
        verify_peer: bool = False,
        plugins: tuple[str, ...] = (),
        extra_config: str = "",
    ) -> None:
        self.port = port or free_port()
        # (cert, key, ca) PEM files: also an amqps listener on ssl_port
        self.tls = tls
        self.verify_peer = verify_peer
        self.ssl_port = free_port() if tls else None
        self.plugins = plugins  # e.g. ("rabbitmq_auth_mechanism_ssl",)
        self.extra_config = extra_config  # more rabbitmq.conf lines
        self.dist_port = dist_port or free_port()
        self.epmd_port = epmd_port or free_port()
        self.startup_timeout = startup_timeout
        self.keep_dir = keep_dir
        self.nodename = f"brokerha-ref-{os.getpid()}-{uuid.uuid4().hex[:8]}@localhost"
        self.base: Path | None = None
        self.server: subprocess.Popen[bytes] | None = None
        self.epmd: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    # -- environment ---------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment for rabbitmq-server and rabbitmqctl (same HOME, same epmd)."""
        assert self.base is not None
        b = self.base
        # CLI tools take their own distribution port from a range; keep it beside ours.
        ctl_min = self.dist_port + 1 if self.dist_port < 65000 else 40000
        return dict(
            os.environ,
            HOME=str(b / "home"),
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS="127.0.0.1",
            RABBITMQ_NODENAME=self.nodename,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CTL_DIST_PORT_MIN=str(ctl_min),
            RABBITMQ_CTL_DIST_PORT_MAX=str(ctl_min + 10),
            RABBITMQ_MNESIA_BASE=str(b / "mnesia"),
            RABBITMQ_LOG_BASE=str(b / "log"),
            RABBITMQ_CONFIG_FILE=str(b / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(b / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(b / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(b / "rabbitmq.pid"),
            RABBITMQ_PLUGINS_EXPAND_DIR=str(b / "plugins-expand"),
        )

    def _prepare_dir(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="brokerha-rabbitmq-ref-"))
        for sub in ("home", "mnesia", "log", "plugins-expand"):
            (self.base / sub).mkdir()
        config = CONFIG.format(port=self.port)
        if self.tls is not None:
            cert, key, ca = self.tls
            config += TLS_CONFIG.format(
                ssl_port=self.ssl_port, cert=cert, key=key, ca=ca,
                verify="verify_peer" if self.verify_peer else "verify_none")
        (self.base / "rabbitmq.conf").write_text(config + self.extra_config)
        (self.base / "advanced.config").write_text("[].\n")
        (self.base / "enabled_plugins").write_text(f"[{','.join(self.plugins)}].\n")

    # -- lifecycle -----------------------------------------------------------------

    def ctl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``rabbitmqctl -n NODE ARGS`` against this node."""
        return subprocess.run(
            [str(RABBITMQCTL), "-n", self.nodename, *args],
            env=self.env(), capture_output=True, text=True, timeout=timeout,
        )

    def start(self) -> str:
        if not available():
            raise RuntimeError("rabbitmq-server is not installed")
        self._prepare_dir()
        assert self.base is not None
        try:
            self._start_epmd()
            with open(self.base / "log" / "stdout.log", "wb") as log:
                self.server = subprocess.Popen(
                    [str(RABBITMQ_SERVER)], env=self.env(), stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C in our terminal must not reach it
                )
            deadline = time.monotonic() + self.startup_timeout
            self._await_registered(deadline)
            remaining = max(1, int(deadline - time.monotonic()))
            result = self.ctl("await_startup", "--timeout", str(remaining),
                              timeout=remaining + 15)
            if result.returncode != 0 or self.server.poll() is not None:
                raise RuntimeError(
                    f"RabbitMQ node {self.nodename} did not start:\n"
                    f"{result.stdout}{result.stderr}\n{self._log_tail()}"
                )
        except BaseException:
            self.stop()
            raise
        return self.url

    def _start_epmd(self) -> None:
        """Our own epmd on a private port, as our child, so we know its PID."""
        epmd = shutil.which("epmd")
        assert epmd is not None
        self.epmd = subprocess.Popen(
            [epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
            env=self.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while not _port_open(self.epmd_port):
            if self.epmd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"epmd did not start on port {self.epmd_port}")
            time.sleep(0.05)

    def _await_registered(self, deadline: float) -> None:
        """Wait until the VM has registered with our epmd (await_startup fails before)."""
        assert self.server is not None
        short = self.nodename.split("@", 1)[0]
        epmd = shutil.which("epmd")
        assert epmd is not None
        while time.monotonic() < deadline and self.server.poll() is None:
            names = subprocess.run(
                [epmd, "-port", str(self.epmd_port), "-names"],
                capture_output=True, text=True, timeout=10,
            ).stdout
            if f"name {short} " in names:
                return
            time.sleep(0.2)

    def _log_tail(self, lines: int = 30) -> str:
        if self.base is None:
            return ""
        out = []
        for f in sorted((self.base / "log").glob("*.log")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    def stop(self) -> None:
        """``rabbitmqctl stop`` (SIGTERM/SIGKILL if that fails) when the directory is kept,
        else SIGKILL at once: the directory goes next, so there is nothing to shut down
        cleanly (``rabbitmqctl stop`` took 8 s with the management plugin, SIGTERM 6 s);
        then our epmd; then the dir."""
        try:
            if self.server is not None and self.server.poll() is None:
                if self.keep_dir:
                    try:
                        self.ctl("stop", timeout=60)
                        self.server.wait(30)
                    except subprocess.TimeoutExpired:
                        pass
                    _stop_process(self.server, timeout=15, group=True)
                else:
                    _stop_process(self.server, timeout=15, group=True,
                                  signals=(signal.SIGKILL,))
        finally:
            if self.epmd is not None:
                _stop_process(self.epmd, timeout=5, group=True)
            if self.base is not None and not self.keep_dir:
                shutil.rmtree(self.base, ignore_errors=True)
                self.base = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextmanager
def rabbitmq_or_none(port: int | None = None) -> Iterator[str | None]:
    """The URL of a private node, or None (without error) when RabbitMQ is not installed."""
    if not available():
        yield None
        return
    with RabbitMQRef(port) as url:
        yield url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run a private RabbitMQ reference node")
    parser.add_argument("--port", type=int, default=None, help="AMQP port (default: a free one)")
    parser.add_argument("--dist-port", type=int, default=None)
    parser.add_argument("--keep-dir", action="store_true", help="keep the data/log dir on exit")
    args = parser.parse_args(argv)
    if not available():
        print("rabbitmq-server is not installed", file=sys.stderr)
        return 2

    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ref = RabbitMQRef(args.port, dist_port=args.dist_port, keep_dir=args.keep_dir)
    try:
        t0 = time.monotonic()
        url = ref.start()
        assert ref.base is not None
        print(f"RabbitMQ reference node {ref.nodename} ready in "
              f"{time.monotonic() - t0:.1f} s: {url}", flush=True)
        print(f"  dir: {ref.base}\n  rabbitmqctl: env HOME={ref.base / 'home'} "
              f"ERL_EPMD_PORT={ref.epmd_port} {RABBITMQCTL} -n {ref.nodename} status",
              flush=True)
        print("Ctrl-C or SIGTERM stops it.", flush=True)
        while not stopping:
            if ref.server is not None and ref.server.poll() is not None:
                print("RabbitMQ exited on its own", file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # don't interrupt the clean stop
        print("stopping RabbitMQ ...", flush=True)
        ref.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
