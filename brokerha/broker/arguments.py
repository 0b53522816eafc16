"""Validation of queue and exchange declaration arguments, with RabbitMQ's texts."""

from __future__ import annotations

from typing import Any

from brokerha.broker.dedup import MAX_WINDOW, WINDOW_ARG
from brokerha.broker.errors import PreconditionFailed
from brokerha.broker.queue import OVERFLOW_MODES

# argument -> (check, description of what is acceptable)
_INT_ARGS = {
    "x-message-ttl": 0,
    "x-expires": 1,
    "x-max-length": 0,
    "x-max-length-bytes": 0,
    "x-max-priority": 0,
    WINDOW_ARG: 1,
}
MAX_PRIORITY = 255

# what HA replicates of a queue (brokerha/primary/policy.py applies it)
HA_REPLICATE = "x-ha-replicate"
REPLICATE_ALL = "all"
REPLICATE_CONFIGURATION = "configuration"
REPLICATE_NONE = "none"
POLICIES = (REPLICATE_ALL, REPLICATE_CONFIGURATION, REPLICATE_NONE)

# a queue whose contents every datacenter orders through the TxLog (docs/txlog.md)
GLOBAL_ARG = "x-global"
# what would drop messages in one datacenter only
LOCAL_ONLY_ARGS = ("x-message-ttl", "x-expires", "x-max-length", "x-max-length-bytes")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_queue_arguments(vhost: str, name: str, args: dict[str, Any]) -> None:
    def bad(arg: str, why: str) -> PreconditionFailed:
        return PreconditionFailed(
            f"invalid arg '{arg}' for queue '{name}' in vhost '{vhost}': {why}"
        )

    for arg, minimum in _INT_ARGS.items():
        if arg not in args:
            continue
        value = args[arg]
        if not _is_int(value):
            raise bad(arg, f"{{unacceptable_type,{type(value).__name__}}}")
        if value < minimum:
            raise bad(arg, f"{{value_negative,{value}}}" if value < 0 else f"{{value_zero,{value}}}")
    if args.get("x-max-priority", 0) > MAX_PRIORITY:
        raise bad("x-max-priority", f"{{value_too_large,{args['x-max-priority']},{MAX_PRIORITY}}}")
    if args.get(WINDOW_ARG, 0) > MAX_WINDOW:
        raise bad(WINDOW_ARG, f"{{value_too_large,{args[WINDOW_ARG]},{MAX_WINDOW}}}")
    replicate = args.get(HA_REPLICATE)
    if replicate is not None and replicate not in POLICIES:
        raise bad(HA_REPLICATE, f"{{unacceptable_value,{replicate}}} (one of {', '.join(POLICIES)})")
    if GLOBAL_ARG in args:
        if not isinstance(args[GLOBAL_ARG], bool):
            raise bad(GLOBAL_ARG, f"{{unacceptable_type,{type(args[GLOBAL_ARG]).__name__}}} "
                      "(true or false)")
        if args[GLOBAL_ARG]:
            for local_only in LOCAL_ONLY_ARGS:
                if local_only in args:
                    raise bad(GLOBAL_ARG, f"{{incompatible_with,{local_only}}} (a global queue "
                              "drops messages only through ordered dequeues)")
    overflow = args.get("x-overflow")
    if overflow is not None and overflow not in OVERFLOW_MODES:
        raise bad("x-overflow", f"{{unacceptable_value,{overflow}}}")
    for arg in ("x-dead-letter-exchange", "x-dead-letter-routing-key"):
        if arg in args and not isinstance(args[arg], str):
            raise bad(arg, f"{{unacceptable_type,{type(args[arg]).__name__}}}")
    if "x-dead-letter-routing-key" in args and "x-dead-letter-exchange" not in args:
        raise bad("x-dead-letter-routing-key", "{routing_key_but_no_dlx_defined}")


def validate_exchange_arguments(vhost: str, name: str, args: dict[str, Any]) -> None:
    ae = args.get("alternate-exchange")
    if ae is not None and not isinstance(ae, str):
        raise PreconditionFailed(
            f"invalid arg 'alternate-exchange' for exchange '{name}' in vhost '{vhost}': "
            f"{{unacceptable_type,{type(ae).__name__}}}"
        )


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def check_equivalent(kind: str, vhost: str, name: str, arg: str, received: Any, current: Any) -> None:
    """406 when a re-declare differs, worded as RabbitMQ words it."""
    if received != current:
        raise PreconditionFailed(
            f"inequivalent arg '{arg}' for {kind} '{name}' in vhost '{vhost}': "
            f"received {_describe(received)} but current is {_describe(current)}"
        )


def _describe(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool | str):
        return f"'{_fmt(value)}'"
    return f"the value '{_fmt(value)}' of type '{_type_name(value)}'"


def _type_name(value: Any) -> str:
    if isinstance(value, int):
        return "long"
    if isinstance(value, str | bytes):
        return "longstr"
    return type(value).__name__


# Arguments whose values must match on re-declare (RabbitMQ's equivalence list)
QUEUE_EQUIVALENCE_ARGS = (
    "x-message-ttl", "x-expires", "x-max-length", "x-max-length-bytes", "x-overflow",
    "x-dead-letter-exchange", "x-dead-letter-routing-key", "x-max-priority",
    "x-queue-type", "x-ha-replicate", "x-global", "x-deduplication-window",
)
