"""A TxLog master as a process: the asyncio driver, journal, wire, HTTP API, export, ctl."""
