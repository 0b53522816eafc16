"""Start/stop a private RabbitMQ node to validate this suite against.

Usage (from the repository root)::

    python tests/clients/rabbitmq_ref.py start /tmp/rmq-ref   # prints the env to export
    BROKERHA_TEST_URL=amqp://guest:guest@127.0.0.1:5699/%2F \\
    BROKERHA_TEST_RABBITMQCTL="env HOME=/tmp/rmq-ref /usr/lib/rabbitmq/bin/rabbitmqctl -n conf@localhost" \\
        .venv/bin/pytest tests/clients -p no:cacheprovider -q
    python tests/clients/rabbitmq_ref.py stop /tmp/rmq-ref

The node runs as the current user with its own HOME (the Erlang cookie lives
there) and every data/log path inside DIR, so it never touches a system node.
The default configuration is kept (guest may log in from loopback only).
If this script started ``epmd`` it stops it again by PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

NODE = "conf@localhost"
PORT = 5699
DIST_PORT = 25699
BIN = Path("/usr/lib/rabbitmq/bin")


def node_env(base: Path) -> dict[str, str]:
    return dict(
        os.environ,
        HOME=str(base),
        RABBITMQ_NODENAME=NODE,
        RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
        RABBITMQ_NODE_PORT=str(PORT),
        RABBITMQ_DIST_PORT=str(DIST_PORT),
        RABBITMQ_MNESIA_BASE=str(base / "mnesia"),
        RABBITMQ_LOG_BASE=str(base / "log"),
        RABBITMQ_PID_FILE=str(base / "rabbit.pid"),
        RABBITMQ_PLUGINS_EXPAND_DIR=str(base / "plugins-expand"),
        RABBITMQ_ENABLED_PLUGINS_FILE=str(base / "enabled_plugins"),
        RABBITMQ_CONFIG_FILE=str(base / "rabbitmq.conf"),
    )


def epmd_pids() -> set[str]:
    out = subprocess.run(["pgrep", "-x", "epmd"], capture_output=True, text=True).stdout
    return set(out.split())


def start(base: Path) -> None:
    base.mkdir(parents=True, exist_ok=True)
    (base / "enabled_plugins").write_text("[].\n")
    (base / "rabbitmq.conf").write_text("log.console = false\n")
    env = node_env(base)
    before = epmd_pids()
    with open(base / "server.out", "w") as out:
        subprocess.Popen(
            [str(BIN / "rabbitmq-server")], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 90
    while subprocess.run(  # await_startup fails at once until the VM has registered
        [str(BIN / "rabbitmqctl"), "-n", NODE, "await_startup", "--timeout", "60"],
        env=env, capture_output=True,
    ).returncode != 0:
        if time.monotonic() > deadline:
            sys.exit(f"RabbitMQ did not start; see {base / 'server.out'}")
        time.sleep(1)
    started = epmd_pids() - before
    (base / "epmd.pids").write_text("\n".join(sorted(started)))
    print(f"export BROKERHA_TEST_URL=amqp://guest:guest@127.0.0.1:{PORT}/%2F")
    print(
        f'export BROKERHA_TEST_RABBITMQCTL="env HOME={base} '
        f'{BIN / "rabbitmqctl"} -n {NODE}"'
    )


def stop(base: Path) -> None:
    env = node_env(base)
    subprocess.run([str(BIN / "rabbitmqctl"), "-n", NODE, "stop"], env=env, check=False)
    pids = base / "epmd.pids"
    if pids.exists():
        for pid in pids.read_text().split():
            subprocess.run(["kill", pid], check=False)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("start", "stop"):
        sys.exit(__doc__)
    {"start": start, "stop": stop}[sys.argv[1]](Path(sys.argv[2]))
