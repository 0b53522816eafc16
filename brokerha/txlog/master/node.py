"""``brokerha txlog node --config FILE``: a standalone TxLog master process.

It runs one :class:`TxLogDriver` and a small loopback HTTP API, so that
datacenter masters can run as real processes before the broker feeds its
global queues into the TxLog:

====== ======================= ==========================================================
GET    ``/api/status``          the master's view: generation, members, peers, lengths,
                                counters, agreement latency, recent events
GET    ``/api/log?start=N``     synchronised entries from position N
POST   ``/api/tx``              ``{"operations": [["enqueue", "/q", "m1"], ...],
                                "wait": "confirm"|"synchronised", "timeout": s}``:
                                a local transaction, answered when the engine confirms it
                                (enqueue-only: once acquired; with a dequeue: once ordered
                                and validated), or once in this master's synchronised queue
POST   ``/api/peers``           ``{"id": ..., "url": "txlog://host:port"}``: add a sync peer
POST   ``/api/peers/remove``    ``{"id": ...}``: remove a sync peer
POST   ``/api/split-recovery``  ``{"value": "none"|"simple"|"smart"}`` (refused while split)
POST   ``/api/export``          ``{"out": DIR}``: Parquet export (docs/txlog-export.md)
====== ======================= ==========================================================

The API binds to a loopback address only (it has no authentication). The
process logs one line containing ``ready`` with both addresses, and exits 0
after SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from pathlib import Path
from typing import Any

from brokerha.cluster.link import links_reload
from brokerha.httpapi.server import AdminServer, HTTPError, Request, Response
from brokerha.txlog.engine.config import ConfigError
from brokerha.txlog.engine.records import Operation
from brokerha.txlog.master.driver import TxLogDriver
from brokerha.txlog.master.settings import MasterSettings

log = logging.getLogger("brokerha.txlog")


def parse_operations(raw: Any) -> list[Operation]:
    if not isinstance(raw, list) or not raw:
        raise HTTPError(400, "operations: a non-empty list of [kind, queue, message_id]")
    ops = []
    for item in raw:
        if isinstance(item, dict):
            item = [item.get("kind"), item.get("queue"), item.get("message_id")]
        if (not isinstance(item, list) or len(item) != 3 or item[0] not in ("enqueue", "dequeue")
                or not all(isinstance(x, str) and x for x in item)):
            raise HTTPError(400, f"operation {item!r:.80}: expected [enqueue|dequeue, queue, message_id]")
        ops.append(Operation(item[0], item[1], item[2]))
    return ops


class MasterAPI:
    """The routes of the local HTTP API over one driver."""

    def __init__(self, driver: TxLogDriver) -> None:
        self.driver = driver
        self.server = AdminServer(None)  # no users: its routes are loopback-only and public
        for method, path, handler in (
            ("GET", "/api/status", self.status),
            ("GET", "/api/log", self.log),
            ("POST", "/api/tx", self.tx),
            ("POST", "/api/peers", self.add_peer),
            ("POST", "/api/peers/remove", self.remove_peer),
            ("POST", "/api/split-recovery", self.split_recovery),
            ("POST", "/api/export", self.export),
        ):
            self.server.route(method, path, handler, public=True)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        return await self.server.start(host, port)

    def close(self) -> None:
        self.server.close()

    def status(self, request: Request) -> Response:
        return Response.json(self.driver.status())

    def log(self, request: Request) -> Response:
        start = request.query.get("start", ["0"])[0]
        if not start.isdigit():
            raise HTTPError(400, "start: a position")
        return Response.json({"node_id": self.driver.me, "length": len(self.driver.engine.sync),
                              "entries": self.driver.log_rows(int(start))})

    async def tx(self, request: Request) -> Response:
        body = request.json()
        ops = parse_operations(body.get("operations"))
        wait = body.get("wait", "confirm")
        timeout = body.get("timeout", 30)
        if wait not in ("confirm", "synchronised") or not isinstance(timeout, int | float):
            raise HTTPError(400, "wait: confirm|synchronised; timeout: seconds")
        try:
            return Response.json(await self.driver.submit(ops, wait, float(timeout)))
        except TimeoutError:
            raise HTTPError(503, f"not {wait}ed within {timeout}s") from None

    async def add_peer(self, request: Request) -> Response:
        body = request.json()
        node_id, url = body.get("id"), body.get("url")
        if not isinstance(node_id, str) or not isinstance(url, str):
            raise HTTPError(400, "id and url required")
        return await self._peer_change(self.driver.add_peer(node_id, url))

    async def remove_peer(self, request: Request) -> Response:
        node_id = request.json().get("id")
        if not isinstance(node_id, str):
            raise HTTPError(400, "id required")
        return await self._peer_change(self.driver.remove_peer(node_id))

    async def _peer_change(self, change: Any) -> Response:
        try:
            await change
        except ConfigError as exc:
            raise HTTPError(409, str(exc)) from None
        except TimeoutError as exc:  # the driver's message says what stalled
            raise HTTPError(503, str(exc)) from None
        return Response.json(self.driver.status())

    def split_recovery(self, request: Request) -> Response:
        value = request.json().get("value")
        if not isinstance(value, str):
            raise HTTPError(400, "value required")
        return self._change(lambda: self.driver.set_split_recovery(value))

    def _change(self, action: Any) -> Response:
        try:
            action()
        except ConfigError as exc:
            raise HTTPError(409, str(exc)) from None
        return Response.json(self.driver.status())

    async def export(self, request: Request) -> Response:
        out = request.json().get("out")
        if not isinstance(out, str) or not out:
            raise HTTPError(400, "out: a directory")
        folder = await self.driver.export(out)
        return Response.json({"folder": str(folder),
                              "files": sorted(p.name for p in Path(folder).iterdir())})


async def serve(settings: MasterSettings) -> int:
    driver = TxLogDriver(settings)
    await driver.start()
    api = MasterAPI(driver)
    try:
        host, port = await api.start(*settings.admin)
    except OSError as exc:
        log.error("txlog: cannot bind the API on %s:%d: %s", *settings.admin, exc)
        await driver.close()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if settings.tls is not None:  # SIGHUP: read the link certificate files again
        tls = settings.tls
        reload = links_reload(tls.cert, tls.key, tls.ca, lambda: driver.links)

        def on_sighup() -> None:
            try:
                reload()()
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.error("SIGHUP: TLS reload failed, the old certificates stay in use: %s", exc)
            else:
                log.info("SIGHUP: TLS certificates of the links reloaded")

        loop.add_signal_handler(signal.SIGHUP, on_sighup)
    assert driver.address is not None
    tls = settings.tls
    log.info("txlog master %s ready: peers on %s:%d (%s), api http://%s:%d, group %s, "
             "%d peer(s), synchronised length %d", driver.me, *driver.address,
             "plain TCP" if tls is None else
             f"TLS, CA {tls.ca}{', peer names checked' if tls.check_peer_name else ''}",
             host, port, settings.group, len(driver.engine.config.peers),
             len(driver.engine.sync))
    await stop.wait()
    log.info("txlog master %s stopping", driver.me)
    api.close()
    await driver.close()
    return 0
