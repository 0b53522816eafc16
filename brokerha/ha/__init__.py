"""HA in one datacenter, sans-I/O: the node core the asyncio layer and the simulations drive."""
