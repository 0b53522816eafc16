"""brokerha.partition: partitions of the queues over the nodes (issue 35, docs/ha.md "Partitions")."""
