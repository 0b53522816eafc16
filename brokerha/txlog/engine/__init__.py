"""The TxLog round engine, sans-I/O: rounds, voting, membership, the log's state and rules."""
