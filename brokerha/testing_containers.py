"""brokerha nodes in Docker containers, for integration tests (ours and users').

Built on testcontainers' ``DockerContainer``, the way one runs a RabbitMQ
container in tests::

    from brokerha.testing_containers import BrokerhaContainer, BrokerhaClusterContainers

    with BrokerhaContainer() as node:              # one standalone node
        pika.BlockingConnection(pika.URLParameters(node.amqp_url))

    with BrokerhaClusterContainers(3) as cluster:  # one datacenter of three nodes
        primary = cluster.wait_primary()
        cluster.kill(primary)                      # docker kill: SIGKILL
        cluster.wait_primary(other_than=primary)

Containers use host networking and listen on free 127.0.0.1 ports (no bridge
is needed, and nothing listens beyond loopback). Ryuk, testcontainers'
reaper, is disabled (``TESTCONTAINERS_RYUK_DISABLED=true`` unless set
otherwise): its image cannot be pulled without a registry, so every container
is removed here, with its volumes, on ``stop``/``close`` and on leaving the
``with`` block. The image (``brokerha:dev`` by default, ``BROKERHA_IMAGE``
overrides it) comes from ``docker/engine.sh build`` (no registry needed) or
``docker build docker/``; see docs/operations.md.

pytest fixtures (``pytest_plugins = ["brokerha.testing_containers"]`` in a
conftest.py): ``brokerha_docker`` (session; an engine, started by
docker/engine.sh if none runs and this is root, stopped again at the end; the
tests are skipped, with the reason, when none can run), ``brokerha_image``
(session; the image, built from this source tree unless an image of the same
source is there; ``BROKERHA_IMAGE_PREBUILT=1`` uses ``BROKERHA_IMAGE`` as it
is) and ``brokerha_cluster`` (a started three-node datacenter, removed after
the test).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

from testcontainers.core.container import DockerContainer  # noqa: E402

from brokerha.cluster.ports import ADMIN_OFFSET, loopback_nodes_toml  # noqa: E402
from brokerha.testing import ClusterView, free_base_port, get_json  # noqa: E402

DEFAULT_IMAGE = "brokerha:dev"
SECRET_PATH = "/var/lib/brokerha/cluster-secret"
CONFIG_PATH = "/etc/brokerha/brokerha.toml"
REPO_DOCKER_DIR = Path(__file__).resolve().parent.parent / "docker"


def default_image() -> str:
    return os.environ.get("BROKERHA_IMAGE", DEFAULT_IMAGE)


def _get_json(url: str, timeout: float = 1.0) -> Any:
    return get_json(url, timeout)  # guest from loopback: the containers use host networking


class BrokerhaContainer(DockerContainer):
    """One brokerha node in a container (host networking, 127.0.0.1 ports).

    Standalone by default; with ``config`` (a host path to a TOML file with a
    ``[cluster]`` table) it is the member ``name`` of that datacenter, and
    ``port`` must be its AMQP port there.
    """

    def __init__(self, image: str | None = None, *, name: str = "brokerha",
                 port: int | None = None, admin_port: int | None = None,
                 config: str | os.PathLike[str] | None = None,
                 cluster_secret: str | None = None, log_level: str | None = None,
                 env: dict[str, str] | None = None, ready_timeout: float = 60.0) -> None:
        super().__init__(image or default_image())
        self.node_name = name
        self.port = port or free_base_port(1, (0, ADMIN_OFFSET))
        self.admin_port = admin_port or self.port + ADMIN_OFFSET
        self.ready_timeout = ready_timeout
        self.with_kwargs(network_mode="host")
        self.with_env("BROKERHA_NAME", name)
        if config is not None:
            self.with_volume_mapping(str(Path(config).resolve()), CONFIG_PATH, "ro")
        else:
            self.with_env("BROKERHA_LISTEN", f"127.0.0.1:{self.port}")
            self.with_env("BROKERHA_ADMIN", f"127.0.0.1:{self.admin_port}")
        if cluster_secret is not None:
            self.with_env("BROKERHA_CLUSTER_SECRET", cluster_secret)
        if log_level is not None:
            self.with_env("BROKERHA_LOG_LEVEL", log_level)
        for key, value in (env or {}).items():
            self.with_env(key, value)

    # -- addresses ---------------------------------------------------------------------

    @property
    def amqp_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    # -- life cycle --------------------------------------------------------------------

    def start(self, wait: bool = True) -> BrokerhaContainer:  # type: ignore[override]
        super().start()
        if wait:
            self.wait_started()
        return self

    def wait_started(self, timeout: float | None = None) -> None:
        """Until the admin listener answers (a member may still be electing)."""
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        while time.monotonic() < deadline:
            if self.node_status() is not None:
                return
            if not self.running():
                raise RuntimeError(f"container of {self.node_name} exited:\n{self.logs_text()}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.node_name} did not answer on {self.admin_url} within "
                           f"{timeout or self.ready_timeout} s:\n{self.logs_text()}")

    def node_status(self) -> dict[str, Any] | None:
        """The node's own /api/status, or None when it does not answer."""
        try:
            return dict(_get_json(self.admin_url + "/api/status"))
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        container = self._container
        if container is None:
            return False
        try:
            container.reload()
        except Exception:  # removed
            return False
        return bool(container.status == "running")

    def kill(self, signal: str = "SIGKILL") -> None:
        """``docker kill``: SIGKILL by default, as a crash."""
        if self._container is not None and self.running():
            self._container.kill(signal=signal)

    def logs_text(self, tail: int = 60) -> str:
        if self._container is None:
            return ""
        try:
            return str(self._container.logs(tail=tail).decode("utf-8", "replace"))
        except Exception as exc:  # the container may be gone
            return f"(no logs: {exc})"

    def close(self) -> None:
        """Remove the container and its volumes (nothing is left behind)."""
        try:
            self.stop(force=True, delete_volume=True)
        except Exception:  # already removed
            pass
        self._container = None


class BrokerhaClusterContainers(ClusterView):
    """One datacenter of ``nodes`` brokerha containers (n1..nN), as ``LocalCluster`` does
    with processes: ``wait_primary``, ``wait_ready``, ``kill`` (SIGKILL), ``start_node``.

    The configuration (``cluster.toml``, written to a temporary directory and
    mounted read-only) puts node ``nI`` at AMQP ``base_port + I - 1``, admin
    ``+10000`` and cluster ``+20000`` on 127.0.0.1; the shared secret is random
    and reaches the containers as ``BROKERHA_CLUSTER_SECRET``. ``options``
    adds keys to ``[cluster]`` (e.g. shorter timeouts for tests).
    """

    def __init__(self, nodes: int = 3, *, image: str | None = None, name: str = "dc1",
                 base_port: int | None = None, options: dict[str, float | str] | None = None,
                 log_level: str | None = None) -> None:
        self.image = image or default_image()
        self.cluster_name = name
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.base_port = base_port or free_base_port(nodes)
        self.secret = secrets.token_hex(24)
        self.log_level = log_level
        self._dir = Path(tempfile.mkdtemp(prefix="brokerha-containers-"))
        self.config = self._dir / "cluster.toml"
        self.config.write_text(cluster_toml(name, nodes, self.base_port, options))
        self.config.chmod(0o644)
        self.containers: dict[str, BrokerhaContainer] = {}

    poll_interval = 0.1

    def start(self) -> BrokerhaClusterContainers:
        try:
            for name in self.names:
                self.start_node(name, wait=False)
            for name in self.names:
                self.containers[name].wait_started()
        except BaseException:
            self.close()
            raise
        return self

    def start_node(self, name: str, *, wait: bool = True) -> BrokerhaContainer:
        """Start (again) the container of ``name``; a killed one is replaced by a new one
        with an empty data directory, which joins as a backup and catches up."""
        old = self.containers.pop(name, None)
        if old is not None:
            old.close()
        container = BrokerhaContainer(self.image, name=name, port=self.port(name),
                                      config=self.config, cluster_secret=self.secret,
                                      log_level=self.log_level)
        self.containers[name] = container
        container.start(wait=wait)
        return container

    def kill(self, name: str) -> None:
        self.containers[name].kill()

    def status(self, name: str) -> dict[str, Any] | None:
        container = self.containers.get(name)
        return container.node_status() if container is not None else None

    def diagnostics(self) -> str:
        return self.logs()

    def health(self, name: str) -> str | None:
        """Docker's health status of the container (the image's HEALTHCHECK)."""
        container = self.containers[name]._container
        if container is None:
            return None
        container.reload()
        return container.attrs.get("State", {}).get("Health", {}).get("Status")

    def logs(self, tail: int = 30) -> str:
        return "\n".join(f"--- {n} ---\n{c.logs_text(tail)}" for n, c in self.containers.items())

    def close(self) -> None:
        for container in self.containers.values():
            container.close()
        self.containers.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> BrokerhaClusterContainers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def cluster_toml(name: str, nodes: int, base_port: int,
                 options: dict[str, float | str] | None = None) -> str:
    """A ``[cluster]`` file for containers: loopback addresses, secret from the environment."""
    lines = [f'[cluster]\nname = "{name}"\nsecret_file = "{SECRET_PATH}"\n']
    for key, value in (options or {}).items():
        lines[0] += f"{key} = {json.dumps(value)}\n"
    return "\n".join([*lines, *loopback_nodes_toml(nodes, base_port)])


# -- the engine and the image, for fixtures ----------------------------------------------

ENGINE_SCRIPT = REPO_DOCKER_DIR / "engine.sh"


class EngineUnavailable(Exception):
    """No Docker engine answers and none can be started here (the reason says why)."""


def engine_running() -> bool:
    if shutil.which("docker") is None:
        return False
    done = subprocess.run(["docker", "info"], capture_output=True, timeout=30)
    return done.returncode == 0


def ensure_engine(timeout: float = 300.0) -> bool:
    """An engine that answers; True if this call started one (stop it with ``stop_engine``).

    Uses ``docker/engine.sh start`` (root only; it installs docker.io with apt
    if missing). Raises EngineUnavailable with the reason when that cannot work.
    """
    if engine_running():
        return False
    if not ENGINE_SCRIPT.exists():
        raise EngineUnavailable("no Docker engine answers and docker/engine.sh is not here")
    if os.geteuid() != 0:
        raise EngineUnavailable(f"no Docker engine answers and starting one needs root "
                                f"(uid {os.geteuid()})")
    try:
        done = subprocess.run([str(ENGINE_SCRIPT), "start"], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise EngineUnavailable(f"docker/engine.sh start took over {timeout:.0f} s") from exc
    if done.returncode != 0:
        raise EngineUnavailable(f"docker/engine.sh start failed ({done.returncode}): "
                                f"{done.stderr.strip()[-500:]}")
    return True


def stop_engine() -> None:
    subprocess.run([str(ENGINE_SCRIPT), "stop"], capture_output=True, timeout=60)


def source_hash() -> str:
    """A digest of what goes into the image: the package's sources and docker/."""
    import hashlib

    root = REPO_DOCKER_DIR.parent
    digest = hashlib.sha256()
    files = sorted([*(root / "brokerha").rglob("*.py"), root / "pyproject.toml",
                    *(p for p in REPO_DOCKER_DIR.iterdir() if p.is_file())])
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def image_source(image: str) -> str | None:
    """The ``brokerha.source`` label of a local image (None: no such image)."""
    done = subprocess.run(["docker", "image", "inspect", "--format",
                           '{{ index .Config.Labels "brokerha.source" }}', image],
                          capture_output=True, text=True, timeout=30)
    return done.stdout.strip() if done.returncode == 0 else None


def build_image(image: str | None = None, timeout: float = 900.0, *, nice: int = 0) -> float:
    """``docker/engine.sh build`` (base image, wheels, docker build); returns the seconds.

    The image is labelled ``brokerha.source`` with ``source_hash()``. ``nice``: the
    script's niceness (its debootstrap and pip; the engine builds at its own).
    """
    env = dict(os.environ, BROKERHA_IMAGE=image or default_image(),
               BROKERHA_IMAGE_LABEL=f"brokerha.source={source_hash()}")
    start = time.monotonic()
    niced = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
    done = subprocess.run([*niced, str(ENGINE_SCRIPT), "build"], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"docker/engine.sh build failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return time.monotonic() - start


class Preparation(threading.Thread):
    """The engine started and the image built off the main thread, while other tests run.

    ``prepare_in_background()`` starts one (a conftest's ``pytest_collection_finish``
    calls it when container tests were collected); the fixtures below then wait for it
    instead of doing the same work in front of the first container test. Starting an
    engine needs no CPU to speak of; the build runs at nice 10, so the tests running
    meanwhile keep their CPU.
    """

    def __init__(self, image: str) -> None:
        super().__init__(name="brokerha-docker-preparation", daemon=True)
        self.image = image
        self.started_engine = False  # this thread started the engine: the fixture stops it
        self.unavailable: EngineUnavailable | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.started_engine = ensure_engine()
        except EngineUnavailable as exc:
            self.unavailable = exc
            return
        except BaseException as exc:
            self.error = exc
            return
        try:
            if os.environ.get("BROKERHA_IMAGE_PREBUILT") != "1" and \
                    image_source(self.image) != source_hash():
                build_image(self.image, nice=10)
        except BaseException as exc:  # the image fixture raises it (or builds again)
            self.error = exc


_preparation: Preparation | None = None


def prepare_in_background() -> Preparation:
    """Start (once) the engine and the image build in a thread; see ``Preparation``."""
    global _preparation
    if _preparation is None:
        _preparation = Preparation(default_image())
        _preparation.start()
    return _preparation


def _prepared() -> Preparation | None:
    """The background preparation, once finished (None if none was started)."""
    if _preparation is not None:
        _preparation.join()
    return _preparation


# -- pytest fixtures ---------------------------------------------------------------------

try:
    import pytest
except ImportError:  # a runtime install without pytest: the classes above still work
    pytest = None  # type: ignore[assignment]

if pytest is not None:
    from collections.abc import Iterator

    @pytest.fixture(scope="session")
    def brokerha_docker() -> Iterator[None]:
        """A Docker engine for the session, or the tests skipped with the reason."""
        prepared = _prepared()
        try:
            if prepared is not None and prepared.unavailable is not None:
                raise prepared.unavailable
            started = ensure_engine() or (prepared is not None and prepared.started_engine)
        except EngineUnavailable as exc:
            pytest.skip(f"Docker engine unavailable: {exc}")
        try:
            yield None
        finally:
            if started:
                stop_engine()

    @pytest.fixture(scope="session")
    def brokerha_image(brokerha_docker: None) -> str:
        """The node image, built from this source tree when it is missing or stale."""
        image = default_image()
        prepared = _prepared()
        if prepared is not None and prepared.error is not None:
            raise prepared.error
        if os.environ.get("BROKERHA_IMAGE_PREBUILT") == "1":
            if image_source(image) is None:
                pytest.fail(f"BROKERHA_IMAGE_PREBUILT=1 but there is no image {image}")
            return image
        if image_source(image) != source_hash():
            build_image(image)
        return image

    @pytest.fixture()
    def brokerha_cluster(brokerha_image: str) -> Iterator[BrokerhaClusterContainers]:
        with BrokerhaClusterContainers(3, image=brokerha_image) as cluster:
            yield cluster
