"""The HA simulation: the product\x27s HA members on a virtual clock, simulated links and disks."""
