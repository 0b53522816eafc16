"""Policies and operator policies, as RabbitMQ 3.10's ``rabbit_policy`` decides them.

A policy is a vhost's named rule: queues and/or exchanges (``apply-to``) whose
name matches ``pattern`` (a regular expression, searched, as ``re:run``) get the
keys of ``definition``. Of the policies that match an object, the one with the
highest ``priority`` applies, alone (ties: the first name in order; RabbitMQ
leaves them to its table's order). Operator policies are a second set, matched
the same way; the effective definition is the user policy's keys merged with
the operator policy's, the smaller number winning for the numeric limits
(``merge``), as RabbitMQ's ``rabbit_policies:merge_policy_value``.

A queue's own ``x-`` arguments and the effective definition then resolve per
key as RabbitMQ's classic queue does (``rabbit_amqqueue_process``): the smaller
of the two for the limits and timers, the argument for the rest
(``resolve``). An exchange's ``alternate-exchange`` argument wins over a
policy's.

Validation gives RabbitMQ's 400 reasons word for word, the values printed as
Erlang prints the decoded JSON (``<<"a">>`` for a string); this module is pure:
what applies a policy to the broker's objects is ``broker/policy_effects.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

POLICY = "policy"
OPERATOR_POLICY = "operator_policy"
KINDS = (POLICY, OPERATOR_POLICY)
APPLY_TO = ("all", "exchanges", "queues")
HA_REPLICATE = "ha-replicate"  # brokerha's own key: x-ha-replicate as a policy (docs/ha.md)
REPLICATE_VALUES = ("all", "configuration", "none")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _int_at_least(minimum: int) -> Callable[[Any], bool]:
    return lambda value: _is_int(value) and value >= minimum


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is type(v) for v in values)


# key -> (valid?, RabbitMQ's reason after the value): rabbit_policies:validate_policy0
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "alternate-exchange": (_is_str, "is not a valid alternate exchange name"),
    "dead-letter-exchange": (_is_str, "is not a valid dead letter exchange name"),
    "dead-letter-routing-key": (_is_str, "is not a valid dead letter routing key"),
    "dead-letter-strategy": (_one_of("at-most-once", "at-least-once"),
                             "is not a valid dead letter strategy"),
    "message-ttl": (_int_at_least(0), "is not a valid message TTL"),
    "expires": (_int_at_least(1), "is not a valid queue expiry"),
    "max-length": (_int_at_least(0), "is not a valid maximum length"),
    "max-length-bytes": (_int_at_least(0), "is not a valid maximum length in bytes"),
    "max-in-memory-length": (_int_at_least(0), "is not a valid maximum memory in bytes"),
    "max-in-memory-bytes": (_int_at_least(0), "is not a valid maximum memory in bytes"),
    "queue-mode": (_one_of("default", "lazy"), "is not a valid queue-mode value"),
    "queue-version": (_one_of(1, 2), "is not a valid queue-version value"),
    "overflow": (_one_of("drop-head", "reject-publish", "reject-publish-dlx"),
                 "is not a valid overflow value"),
    "delivery-limit": (_int_at_least(0), "is not a valid delivery limit"),
    HA_REPLICATE: (_one_of(*REPLICATE_VALUES), "is not a valid ha-replicate value "
                   "(one of all, configuration, none)"),
}
# what an operator policy may set (rabbit_policies' operator_policy_validator)
OPERATOR_KEYS = frozenset({"expires", "message-ttl", "max-length", "max-length-bytes",
                           "max-in-memory-length", "max-in-memory-bytes", "delivery-limit"})
# merged by the smaller value when both kinds set them (policy_merge_strategy)
MERGED_BY_MIN = OPERATOR_KEYS


class PolicyInvalid(ValueError):
    """Refused: ``reason`` is RabbitMQ's 400 text (``status`` 500 where RabbitMQ crashes)."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


# -- Erlang's ~p of a decoded JSON value -------------------------------------------------

def erl(value: Any) -> str:
    """``value`` as RabbitMQ's messages print it (``~p`` of what its JSON decoder made)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return f'<<"{_erl_string(value)}">>' if value.isascii() else \
            f'<<"{_erl_string(value)}"/utf8>>'
    if isinstance(value, list):
        return "[" + ",".join(erl(v) for v in value) + "]"
    if isinstance(value, dict):
        items = sorted(value.items())
        return "#{" + ",".join(f"{erl(k)} => {erl(v)}" for k, v in items) + "}"
    return repr(value)


def _erl_string(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


# PCRE's words for the errors Python's re words differently (RabbitMQ compiles with re:compile)
_PCRE_ERRORS = {
    "missing ), unterminated subpattern": "missing )",
    "unterminated character set": "missing terminating ] for character class",
    "unbalanced parenthesis": "unmatched parentheses",
    "multiple repeat": "nothing to repeat",
}
_LINE = 80  # io_lib's line length: a longer ~p wraps after the tuple's first element


def pcre_error(exc: re.error, pattern: str) -> tuple[str, int]:
    """PCRE's words and offset for Python's ``re.error`` (RabbitMQ compiles with re:compile):
    what RabbitMQ's refusals of a bad pattern quote (policies, permissions)."""
    text = _PCRE_ERRORS.get(exc.msg, exc.msg)
    at = len(pattern) if text in ("missing )", "missing terminating ] for character class") \
        else (exc.pos or 0)
    return text, at


def _regex_error(exc: re.error, pattern: str) -> str:
    prefix = "pattern should be regular expression but is invalid: "
    text, at = pcre_error(exc, pattern)
    first = f'{{"{text}",'
    if len(prefix) + len(first) + len(str(at)) + 1 >= _LINE:
        return f"{prefix}{first}\n{' ' * (len(prefix) + 1)}{at}}}"
    return f"{prefix}{first}{at}}}"


# -- a policy ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Policy:
    """One policy (or operator policy) of a vhost, valid."""

    vhost: str
    name: str
    pattern: str
    definition: dict[str, Any]
    priority: int | float = 0
    apply_to: str = "all"
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", re.compile(self.pattern))

    def applies_to(self, kind: str, name: str) -> bool:
        """``kind``: ``queue`` or ``exchange``."""
        if self.apply_to != "all" and self.apply_to != kind + "s":
            return False
        return self.regex.search(name) is not None

    def as_json(self) -> dict[str, Any]:
        """RabbitMQ's shape (``/api/policies``, definitions export)."""
        return {"vhost": self.vhost, "name": self.name, "pattern": self.pattern,
                "apply-to": self.apply_to, "definition": dict(sorted(self.definition.items())),
                "priority": self.priority}

    def value(self) -> dict[str, Any]:
        """What the definitions hold: the JSON without vhost and name."""
        return {"pattern": self.pattern, "apply-to": self.apply_to,
                "definition": dict(sorted(self.definition.items())), "priority": self.priority}


def parse(kind: str, vhost: str, name: str, body: dict[str, Any]) -> Policy:
    """A policy from what ``PUT /api/policies/vhost/name`` got; PolicyInvalid with RabbitMQ's
    reason. ``priority`` defaults to 0 and ``apply-to`` to ``all``."""
    missing = [key for key in ("pattern", "definition") if key not in body]
    if missing:
        raise PolicyInvalid("[" + ",".join(f"{{key_missing,{key}}}" for key in missing) + "]")
    definition = body["definition"]
    if not isinstance(definition, dict):
        raise PolicyInvalid("", status=500)  # RabbitMQ's handler crashes on it
    priority = body.get("priority", 0)
    apply_to = body.get("apply-to", "all")
    pattern = body["pattern"]
    errors: list[str] = []  # RabbitMQ's order: definition, apply-to, pattern, priority
    why = _definition_error(kind, definition)
    if why:
        errors.append(why)
    if apply_to not in APPLY_TO or not isinstance(apply_to, str):
        shown = apply_to if isinstance(apply_to, str) else erl(apply_to)
        errors.append(f"apply-to '{shown}' unrecognised; should be 'queues', 'exchanges' or 'all'")
    if not isinstance(pattern, str):
        errors.append(f"pattern should be a binary but was {erl(pattern)}")
    else:
        try:
            re.compile(pattern)
        except re.error as exc:
            errors.append(_regex_error(exc, pattern))
    if isinstance(priority, bool) or not isinstance(priority, int | float):
        errors.append(f"priority should be a number, actually was {erl(priority)}")
    if errors:
        raise PolicyInvalid("Validation failed\n\n" + "\n".join(errors) + "\n")
    return Policy(vhost, name, pattern, dict(definition), priority, apply_to)


def from_value(vhost: str, name: str, value: dict[str, Any]) -> Policy:
    """A policy as the definitions hold it (``Policy.value``), valid already."""
    return Policy(vhost, name, value["pattern"], dict(value.get("definition") or {}),
                  value.get("priority", 0), value.get("apply-to", "all"))


def _definition_error(kind: str, definition: dict[str, Any]) -> str | None:
    if not definition:
        return "no policy provided"
    allowed = OPERATOR_KEYS if kind == OPERATOR_POLICY else _CHECKS.keys()
    for key in sorted(definition):
        if key in allowed:
            valid, reason = _CHECKS[key]
            if not valid(definition[key]):
                return f"{erl(definition[key])} {reason}"
    unknown = [(k, v) for k, v in sorted(definition.items()) if k not in allowed]
    if unknown:
        shown = ",".join(f"{{{erl(k)},{erl(v)}}}" for k, v in unknown)
        return f"[{shown}] are not recognised policy settings"
    return None


# -- which applies ------------------------------------------------------------------------

def best(policies: Iterable[Policy], kind: str, name: str) -> Policy | None:
    """The matching policy of highest priority (ties: the first by name); None if none."""
    found: Policy | None = None
    for policy in policies:
        if policy.applies_to(kind, name) and (
                found is None or policy.priority > found.priority
                or (policy.priority == found.priority and policy.name < found.name)):
            found = policy
    return found


def merge(policy: Policy | None, operator: Policy | None) -> dict[str, Any]:
    """The effective definition (``rabbit_policy:merge_operator_definitions``)."""
    merged = dict(policy.definition) if policy is not None else {}
    if operator is not None:
        for key, value in operator.definition.items():
            if key in merged and key in MERGED_BY_MIN:
                merged[key] = min(merged[key], value)
            else:
                merged[key] = value
    return dict(sorted(merged.items()))


@dataclass(frozen=True)
class Applied:
    """What applies to one queue or exchange: the two policies and their merged keys."""

    policy: Policy | None = None
    operator_policy: Policy | None = None
    definition: dict[str, Any] = field(default_factory=dict)

    @property
    def policy_name(self) -> str:
        return self.policy.name if self.policy is not None else ""

    @property
    def operator_policy_name(self) -> str:
        return self.operator_policy.name if self.operator_policy is not None else ""


NONE = Applied()


class PolicyBook:
    """Every vhost's policies and operator policies, by name."""

    def __init__(self) -> None:
        self._sets: dict[str, dict[tuple[str, str], Policy]] = {kind: {} for kind in KINDS}

    def set(self, kind: str, policy: Policy) -> None:
        self._sets[kind][(policy.vhost, policy.name)] = policy

    def clear(self, kind: str, vhost: str, name: str) -> Policy | None:
        return self._sets[kind].pop((vhost, name), None)

    def clear_vhost(self, vhost: str) -> None:
        for policies in self._sets.values():
            for key in [k for k in policies if k[0] == vhost]:
                del policies[key]

    def get(self, kind: str, vhost: str, name: str) -> Policy | None:
        return self._sets[kind].get((vhost, name))

    def list(self, kind: str, vhost: str | None = None) -> list[Policy]:
        """RabbitMQ's order: by priority, ascending, then vhost and name."""
        found = [p for p in self._sets[kind].values() if vhost is None or p.vhost == vhost]
        return sorted(found, key=lambda p: (p.priority, p.vhost, p.name))

    def applied(self, vhost: str, kind: str, name: str) -> Applied:
        """What applies to the ``kind`` (``queue``/``exchange``) ``name`` in ``vhost``."""
        policy = best(self.list(POLICY, vhost), kind, name)
        operator = best(self.list(OPERATOR_POLICY, vhost), kind, name)
        if policy is None and operator is None:
            return NONE
        return Applied(policy, operator, merge(policy, operator))


# -- a queue's arguments against the effective definition ------------------------------------

def _smaller(policy: Any, argument: Any) -> Any:
    return min(policy, argument)


def _argument(policy: Any, argument: Any) -> Any:
    return argument


# rabbit_amqqueue_process:process_args_policy: key -> how both are resolved
QUEUE_KEYS: dict[str, Callable[[Any, Any], Any]] = {
    "expires": _smaller,
    "dead-letter-exchange": _argument,
    "dead-letter-routing-key": _argument,
    "message-ttl": _smaller,
    "max-length": _smaller,
    "max-length-bytes": _smaller,
    "overflow": _argument,
    "queue-mode": _argument,
    HA_REPLICATE: _argument,
}


def resolve(key: str, arguments: dict[str, Any], definition: dict[str, Any]) -> Any:
    """``key``'s value for a queue (``rabbit_queue_type_util:args_policy_lookup``): the
    ``x-`` argument, the policy's, or both resolved as ``QUEUE_KEYS`` says; None: neither."""
    argument = arguments.get("x-" + key)
    policy = definition.get(key)
    if policy is None:
        return argument
    if argument is None:
        return policy
    return QUEUE_KEYS.get(key, _argument)(policy, argument)
