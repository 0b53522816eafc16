"""``admin/partition_views.py``'s merge (issue 35): the management lists of a partitioned
node, each queue as its leader answered, the queues and bindings the node holds no copy
of added once, and the partitions an export cannot list."""

from __future__ import annotations

from typing import Any

from brokerha.admin.partition_views import Views


def queue(name: str, consumers: int, node: str, vhost: str = "/") -> dict[str, Any]:
    return {"name": name, "vhost": vhost, "consumers": consumers, "node": f"brokerha@{node}"}


def binding(dest: str, key: str, vhost: str = "/") -> dict[str, Any]:
    return {"vhost": vhost, "source": "x", "destination_type": "queue", "destination": dest,
            "routing_key": key, "arguments": {}, "properties_key": key}


def test_a_queue_led_elsewhere_is_listed_as_its_leader_answered() -> None:
    views = Views("n1", [{"node": "n2", "served": [1], "queues": [queue("q", 2, "n2")],
                          "bindings": []}], [])
    local = [queue("q", 0, "n2"), queue("mine", 1, "n1")]
    assert views.queue_entries(local, "/") == [queue("q", 2, "n2"), queue("mine", 1, "n1")]


def test_queues_and_bindings_held_by_no_copy_here_are_added_once_in_their_vhost() -> None:
    views = Views("n1", [
        {"node": "n2", "served": [0], "queues": [queue("far", 0, "n2"),
                                                 queue("other", 0, "n2", "v2")],
         "bindings": [binding("far", "k"), binding("near", "k")]},
        {"node": "n3", "served": [2], "queues": [], "bindings": [binding("far", "k")]},
    ], [0])
    assert views.queue_entries([queue("near", 0, "n1")], "/") == [
        queue("near", 0, "n1"), queue("far", 0, "n2")]
    assert views.binding_entries([binding("near", "k")], "/") == [
        binding("near", "k"), binding("far", "k")]
    assert views.binding_entries([], "v2") == []
    assert views.missing() == []


def test_an_export_knows_the_partitions_it_cannot_list() -> None:
    assert Views("n1", [{"served": [1]}], [0, 1]).missing() == [0]
    assert Views("n1", [], None).missing() is None  # no table here yet
