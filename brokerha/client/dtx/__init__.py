"""XA for brokerha from Python: resources for pika, kombu and aio-pika, and a coordinator.

See docs/dtx.md for the wire design and a worked example.
"""

from brokerha.client.dtx.coordinator import Coordinator, CoordinatorLog
from brokerha.client.dtx.resources import (
    DTX_EXCHANGE,
    XA_HEURCOM,
    XA_HEURHAZ,
    XA_HEURMIX,
    XA_HEURRB,
    XA_OK,
    XA_RBROLLBACK,
    XA_RBTIMEOUT,
    XA_RDONLY,
    XAER_DUPID,
    XAER_INVAL,
    XAER_NOTA,
    XAER_PROTO,
    XAER_RMERR,
    XAER_RMFAIL,
    AioPikaXAResource,
    KombuXAResource,
    PikaXAResource,
    XAException,
    XAResourceBase,
    Xid,
)

__all__ = [
    "DTX_EXCHANGE", "XA_HEURCOM", "XA_HEURHAZ", "XA_HEURMIX", "XA_HEURRB", "XA_OK",
    "XA_RBROLLBACK", "XA_RBTIMEOUT", "XA_RDONLY", "XAER_DUPID", "XAER_INVAL", "XAER_NOTA",
    "XAER_PROTO", "XAER_RMERR", "XAER_RMFAIL", "AioPikaXAResource", "Coordinator",
    "CoordinatorLog", "KombuXAResource", "PikaXAResource", "XAException", "XAResourceBase", "Xid",
]
