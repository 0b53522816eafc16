"""HTTP/JSON APIs of brokerha processes: the server (a node's admin API, a TxLog master's local API) and the client of ``brokerha ctl``."""
