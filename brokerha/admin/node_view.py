"""What the admin endpoints read of the node they serve: a Protocol, since admin sits below it.

``brokerha.node.server.Node`` installs the endpoints on itself
(``admin/endpoints.py``); the admin package cannot import it (the import-layer
contract, ``tests/test_import_layers.py``). Every endpoint module types its
node as ``NodeView``, so what admin depends on is written here, once, and a
node that lacks it fails the type check rather than a request.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, Protocol

from brokerha.amqp.connection import ServerConnection
from brokerha.broker.broker import Broker
from brokerha.cluster.election import Election
from brokerha.httpapi.server import AdminServer
from brokerha.primary.primary import Primary


class ClientView(Protocol):
    """A client's transport (``node/transport.py``, ``AMQPProtocol``)."""

    @property
    def conn(self) -> ServerConnection | None: ...  # None until the protocol header was read


class ConfigView(Protocol):
    @property
    def name(self) -> str: ...  # the node's name


class TLSView(Protocol):
    @property
    def member_client(self) -> ssl.SSLContext | None: ...  # HTTPS between members


class ClusterView(Protocol):
    """The datacenter's configuration (``node/cluster_config.py``, ``ClusterConfig``)."""

    @property
    def name(self) -> str: ...

    @property
    def members(self) -> list[Any]: ...  # ClusterMember: name, admin_url, https_url


class HAView(Protocol):
    """The node's HA layer (``node/ha.py``, ``HANode``)."""

    @property
    def phase(self) -> str: ...

    @property
    def election(self) -> Election: ...

    @property
    def cluster(self) -> ClusterView: ...

    @property
    def primary(self) -> Primary | None: ...


class TxLogView(Protocol):
    """The node's TxLog bridge (``txlog/bridge/broker_bridge.py``, ``TxLogBridge``), with
    ``[txlog]``: its status, counters and the operators' changes (the TxLog imports admin's
    HTTP pieces, so admin names what it uses here instead of importing it)."""

    node_id: str
    reason: str
    counters: dict[str, int]
    driver: Any  # the running master (txlog/master/driver.py), or None

    def status(self) -> dict[str, Any]: ...

    async def add_peer(self, node_id: str, url: str) -> bool: ...

    async def remove_peer(self, node_id: str) -> bool: ...

    async def set_split_recovery(self, value: str) -> bool: ...

    def check_peer_url(self, node_id: str, url: str) -> None: ...

    def parse_split_recovery(self, value: str) -> str: ...


class AdmissionView(Protocol):
    """Which connections the node serves (``ha/admission.py``, ``ClientAdmission``)."""

    refused: int  # connections handed over when the node could not serve them


class NodeView(Protocol):
    broker: Broker
    admin: AdminServer
    loop: asyncio.AbstractEventLoop
    management: Any  # set by admin/endpoints.py
    metrics: Any
    loop_monitor: Any  # node/loop_monitor.py: lag histogram, stalls

    @property
    def connections(self) -> list[Any]: ...  # the served clients, ClientView each

    @property
    def admission(self) -> AdmissionView: ...

    @property
    def config(self) -> ConfigView: ...

    @property
    def tls(self) -> TLSView: ...

    @property
    def ha(self) -> HAView | None: ...

    @property
    def txlog(self) -> TxLogView | None: ...

    def status(self) -> dict[str, Any]: ...
