"""The TxLog on a broker node: global queues, the bridge to the master, its HA replica."""
