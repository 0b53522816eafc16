"""brokerha: an AMQP 0-9-1 broker with replicated transactions."""

from brokerha import native as native  # first: decides whether compiled modules may load

__version__ = "0.1.0"
