"""The TxLog's deterministic simulation (the real engine over a simulated WAN) and its search."""
