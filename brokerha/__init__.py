"""brokerha: an AMQP 0-9-1 broker with replicated transactions."""

__version__ = "0.1.0"
