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


def test_the_toml_policies_seeded_as_ha_replicate_policies_decide_alike() -> None:
    """One way to decide replication: [[cluster.policies]] as policies give what they gave."""
    import re

    from brokerha.broker.broker import Broker
    from brokerha.broker.policies import POLICY
    from brokerha.broker.policy_effects import PolicyEffects
    from brokerha.primary.policy import ReplicationPolicy, as_policies, queue_policy

    broker = Broker("t")
    effects = PolicyEffects(broker)
    vh = broker.add_vhost("/")
    broker.add_vhost("other").declare_queue("tmp.x", owner=None)
    toml = [ReplicationPolicy(re.compile(r"^tmp\."), "none", "/"),
            ReplicationPolicy(re.compile(r"^(cfg|tmp)\."), "configuration")]
    for policy in as_policies(toml, ["/", "other"]):
        effects.set_policy(POLICY, policy)
    queues = [vh.declare_queue("tmp.a", owner=None), vh.declare_queue("cfg.a", owner=None),
              vh.declare_queue("tmp.b", owner=None, arguments={"x-ha-replicate": "all"}),
              vh.declare_queue("orders", owner=None), broker.vhost("other").queues["tmp.x"]]
    assert [queue_policy(q, "all", (), effects) for q in queues] == \
        [queue_policy(q, "all", toml) for q in queues] == \
        ["none", "configuration", "all", "all", "configuration"]


def test_a_primary_replicates_as_the_ha_replicate_policy_says() -> None:
    from brokerha.broker.broker import Broker
    from brokerha.broker.policies import POLICY, Policy
    from brokerha.broker.policy_effects import PolicyEffects
    from brokerha.primary.primary import Primary

    broker = Broker("t")
    effects = PolicyEffects(broker)
    vh = broker.add_vhost("/")
    effects.set_policy(POLICY, Policy("/", "scratch", "^tmp\\.", {"ha-replicate": "none"}))
    primary = Primary(broker, me="n1", members=3, epoch=1, start_seq=0, clock=lambda: 0.0,
                      backup_timeout=5.0)
    tmp = vh.declare_queue("tmp.a", owner=None)
    kept = vh.declare_queue("orders", owner=None)
    assert not primary.messages_replicated(tmp) and primary.messages_replicated(kept)


def test_cluster_policies_seed_a_new_clusters_definitions_as_policies() -> None:
    from pathlib import Path

    from brokerha.broker.broker import Broker
    from brokerha.broker.policies import POLICY
    from brokerha.broker.policy_effects import PolicyEffects
    from brokerha.node.cluster_config import parse_cluster
    from brokerha.node.config import NodeConfig
    from brokerha.node.server import configured_definitions
    from brokerha.primary.policy import queue_policy

    cluster = parse_cluster({"name": "dc1", "secret": "0123456789abcdef",
                             "nodes": [{"name": "n1", "amqp": "127.0.0.1:5672"}],
                             "policies": [{"pattern": "^tmp\\.", "replicate": "none"}]},
                            "t", Path("."))
    broker = Broker("t")
    effects = PolicyEffects(broker)
    broker.definitions.apply_all(configured_definitions(NodeConfig(name="t"), cluster))
    (seeded,) = effects.book.list(POLICY)
    assert seeded.as_json() == {"vhost": "/", "name": "cluster-policy-1", "pattern": "^tmp\\.",
                                "apply-to": "queues", "definition": {"ha-replicate": "none"},
                                "priority": -1}
    tmp = broker.vhost("/").declare_queue("tmp.a", owner=None)
    assert queue_policy(tmp, "all", (), effects) == "none"
    broker.definitions.apply_all(broker.definitions.deleting(POLICY, "/", "cluster-policy-1"))
    assert effects.replicate(tmp) is None  # deleted like any policy: the default again
