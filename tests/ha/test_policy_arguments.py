"""``x-ha-replicate`` is checked when the queue is declared (406, like RabbitMQ's x-args)."""

from __future__ import annotations

import pytest

from brokerha.broker.arguments import POLICIES, validate_queue_arguments
from brokerha.broker.errors import PreconditionFailed


@pytest.mark.parametrize("value", POLICIES)
def test_known_replicate_values_are_accepted(value: str) -> None:
    validate_queue_arguments("/", "q", {"x-ha-replicate": value})


@pytest.mark.parametrize("value", ["All", "some", 1, b"all"])
def test_unknown_replicate_values_are_refused_with_406(value: object) -> None:
    with pytest.raises(PreconditionFailed) as info:
        validate_queue_arguments("/", "q", {"x-ha-replicate": value})
    assert "x-ha-replicate" in str(info.value) and info.value.code == 406


def test_policies_apply_by_pattern_and_vhost_unless_the_queue_argument_says_otherwise() -> None:
    import re

    from brokerha.broker.broker import Broker
    from brokerha.primary.policy import ReplicationPolicy, queue_policy

    broker = Broker("t")
    vh = broker.add_vhost("/")
    broker.add_vhost("other").declare_queue("tmp.x", owner=None)
    policies = [ReplicationPolicy(re.compile(r"^tmp\."), "none", "/"),
                ReplicationPolicy(re.compile(r"^cfg\."), "configuration")]
    tmp = vh.declare_queue("tmp.a", owner=None)
    cfg = vh.declare_queue("cfg.a", owner=None)
    pinned = vh.declare_queue("tmp.b", owner=None, arguments={"x-ha-replicate": "all"})
    plain = vh.declare_queue("orders", owner=None)
    other = broker.vhost("other").queues["tmp.x"]
    assert [queue_policy(q, "all", policies) for q in (tmp, cfg, pinned, plain, other)] == \
        ["none", "configuration", "all", "all", "all"]


def test_cluster_policies_are_parsed_and_checked() -> None:
    from pathlib import Path

    from brokerha.node.cluster_config import parse_cluster
    from brokerha.node.config import ConfigError

    table = {"name": "dc1", "secret": "0123456789abcdef",
             "nodes": [{"name": "n1", "amqp": "127.0.0.1:5672"}],
             "policies": [{"pattern": "^tmp\\.", "replicate": "none", "vhost": "/"}]}
    (policy,) = parse_cluster(table, "t", Path(".")).policies
    assert (policy.pattern.pattern, policy.replicate, policy.vhost) == ("^tmp\\.", "none", "/")
    for bad, why in [({"pattern": "("}, "bad pattern"), ({"replicate": "none"}, "required"),
                     ({"pattern": "x", "replicate": "most"}, "replicate must be"),
                     ({"pattern": "x", "replicate": "all", "color": 1}, "unknown key")]:
        with pytest.raises(ConfigError, match=why):
            parse_cluster({**table, "policies": [bad]}, "t", Path("."))
