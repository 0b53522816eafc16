"""The port conventions of a node, as RabbitMQ's: admin = AMQP + 10000, cluster = AMQP + 20000.

With ``[txlog]`` in an HA cluster and no ``listen``, the TxLog master (on the
serving primary only) listens on the node's cluster port + 10000 = AMQP + 30000.

One place for them: the configuration's defaults, ``brokerha cluster up``,
``brokerha ctl --node amqp://...`` and the test helpers all read these.
"""

from __future__ import annotations

ADMIN_OFFSET = 10000    # RabbitMQ's management port is 15672 for AMQP 5672
CLUSTER_OFFSET = 20000  # and its inter-node port 25672
TXLOG_OFFSET = 30000    # the TxLog master of an HA member (cluster port + 10000)


def loopback_nodes_toml(nodes: int, base_port: int, *, amqps: bool = False) -> list[str]:
    """``[[cluster.nodes]]`` entries n1..nN on 127.0.0.1, AMQP ports from ``base_port``.

    ``amqps``: each node also gets an amqps listener, on the ports right after
    the AMQP ones (``base_port + nodes + i``; amqps has no offset convention),
    and an HTTPS admin listener on those ports + ``ADMIN_OFFSET``.
    """
    entries = []
    for i in range(nodes):
        port = base_port + i
        tls = (f'amqps = "127.0.0.1:{base_port + nodes + i}"\n'
               f'https = "127.0.0.1:{base_port + nodes + i + ADMIN_OFFSET}"\n' if amqps else "")
        entries.append(f'[[cluster.nodes]]\nname = "n{i + 1}"\namqp = "127.0.0.1:{port}"\n'
                       f'{tls}admin = "127.0.0.1:{port + ADMIN_OFFSET}"\n'
                       f'cluster = "127.0.0.1:{port + CLUSTER_OFFSET}"\n')
    return entries


def loopback_txlog_urls(nodes: int, base_port: int) -> str:
    """``peer.N.url`` naming every node of such a loopback datacenter (its TxLog ports)."""
    return ", ".join(f"txlog://127.0.0.1:{base_port + i + TXLOG_OFFSET}" for i in range(nodes))
