"""The policy engine (broker/policies.py): validation with RabbitMQ's texts, matching,
precedence, the operator-policy merge and a queue's arguments against the policy."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from brokerha.broker.policies import (
    OPERATOR_POLICY,
    POLICY,
    Policy,
    PolicyBook,
    PolicyInvalid,
    best,
    erl,
    merge,
    parse,
    resolve,
)


def reason(body: dict, kind: str = POLICY) -> str:
    with pytest.raises(PolicyInvalid) as refused:
        parse(kind, "v", "p", body)
    assert refused.value.status == 400
    return refused.value.reason


def failed(*lines: str) -> str:
    return "Validation failed\n\n" + "\n".join(lines) + "\n"


# -- validation: the texts RabbitMQ 3.10.8's management API answered -----------------------

def test_a_valid_policy_gets_rabbitmqs_defaults() -> None:
    p = parse(POLICY, "v", "p", {"pattern": "^pol\\.", "definition": {"message-ttl": 60000,
                                                                       "max-length": 5}})
    assert p.as_json() == {"vhost": "v", "name": "p", "pattern": "^pol\\.", "apply-to": "all",
                           "definition": {"max-length": 5, "message-ttl": 60000}, "priority": 0}


@pytest.mark.parametrize(("body", "expected"), [
    ({"pattern": "^x"}, "[{key_missing,definition}]"),
    ({}, "[{key_missing,pattern},{key_missing,definition}]"),
    ({"definition": {"max-length": 1}}, "[{key_missing,pattern}]"),
    ({"pattern": "^x", "definition": {"max-length": -1}},
     failed("-1 is not a valid maximum length")),
    ({"pattern": "^x", "definition": {"max-length": "a"}},
     failed('<<"a">> is not a valid maximum length')),
    ({"pattern": "^x", "definition": {"max-length": 1.0}},
     failed("1.0 is not a valid maximum length")),
    ({"pattern": "^x", "definition": {"foo": 1}},
     failed('[{<<"foo">>,1}] are not recognised policy settings')),
    ({"pattern": "x", "definition": {"foo": 1, "bar": "s", "max-length": 3}},
     failed('[{<<"bar">>,<<"s">>},{<<"foo">>,1}] are not recognised policy settings')),
    ({"pattern": "x", "definition": {"foo": 1, "max-length": -3}},
     failed("-3 is not a valid maximum length")),
    ({"pattern": "^x", "definition": {}}, failed("no policy provided")),
    ({"pattern": "x", "definition": {"message-ttl": 1.5, "expires": 0}},
     failed("0 is not a valid queue expiry")),
    ({"pattern": "x", "definition": {"overflow": "nope"}},
     failed('<<"nope">> is not a valid overflow value')),
    ({"pattern": "x", "definition": {"dead-letter-exchange": 5}},
     failed("5 is not a valid dead letter exchange name")),
    ({"pattern": "x", "definition": {"alternate-exchange": [1, 2]}},
     failed("[1,2] is not a valid alternate exchange name")),
    ({"pattern": "x", "definition": {"queue-mode": "fast"}},
     failed('<<"fast">> is not a valid queue-mode value')),
    ({"pattern": "x", "definition": {"delivery-limit": True}},
     failed("true is not a valid delivery limit")),
    ({"pattern": "x", "definition": {"message-ttl": {"a": 1}}},
     failed('#{<<"a">> => 1} is not a valid message TTL')),
    ({"pattern": 5, "definition": {"max-length": 1}},
     failed("pattern should be a binary but was 5")),
    ({"pattern": "(", "definition": {"max-length": 1}},
     failed('pattern should be regular expression but is invalid: {"missing )",1}')),
    ({"pattern": "[", "definition": {"max-length": 1}},
     failed('pattern should be regular expression but is invalid: '
            '{"missing terminating ] for character class",\n' + " " * 54 + "1}")),
    ({"pattern": "x", "definition": {"max-length": 1}, "priority": "a"},
     failed('priority should be a number, actually was <<"a">>')),
    ({"pattern": "x", "definition": {"max-length": 1}, "priority": None},
     failed("priority should be a number, actually was null")),
    ({"pattern": "x", "definition": {"max-length": 1}, "apply-to": "bogus"},
     failed("apply-to 'bogus' unrecognised; should be 'queues', 'exchanges' or 'all'")),
    ({"pattern": "(", "definition": {"max-length": -1}, "priority": "a", "apply-to": "z"},
     failed("-1 is not a valid maximum length",
            "apply-to 'z' unrecognised; should be 'queues', 'exchanges' or 'all'",
            'pattern should be regular expression but is invalid: {"missing )",1}',
            'priority should be a number, actually was <<"a">>')),
])
def test_bad_policies_get_rabbitmqs_reason(body: dict, expected: str) -> None:
    assert reason(body) == expected


def test_a_definition_that_is_not_an_object_is_rabbitmqs_500() -> None:
    with pytest.raises(PolicyInvalid) as refused:
        parse(POLICY, "v", "p", {"pattern": "x", "definition": "str"})
    assert refused.value.status == 500


def test_operator_policies_take_only_the_limits() -> None:
    assert reason({"pattern": "x", "definition": {"overflow": "drop-head"}}, OPERATOR_POLICY) \
        == failed('[{<<"overflow">>,<<"drop-head">>}] are not recognised policy settings')
    p = parse(OPERATOR_POLICY, "v", "o", {"pattern": "x", "priority": 2,
                                          "definition": {"max-length": 3, "message-ttl": 100}})
    assert p.priority == 2


def test_a_float_priority_is_a_number() -> None:
    assert parse(POLICY, "v", "p", {"pattern": "x", "definition": {"max-length": 1},
                                    "priority": 1.5}).priority == 1.5


def test_ha_replicate_is_a_policy_key() -> None:
    assert parse(POLICY, "v", "p", {"pattern": "x", "definition": {"ha-replicate": "none"}})
    assert reason({"pattern": "x", "definition": {"ha-replicate": "most"}}).startswith(
        failed('<<"most">> is not a valid ha-replicate value')[:-1])


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=8))
def test_erlang_printing_never_fails_and_marks_strings(value: object) -> None:
    shown = erl(value)
    if isinstance(value, str):
        assert shown.startswith('<<"')


# -- matching and precedence -----------------------------------------------------------------

def policy(name: str, pattern: str, priority: int = 0, apply_to: str = "all",
           vhost: str = "v", **definition: object) -> Policy:
    return Policy(vhost, name, pattern, {k.replace("_", "-"): v for k, v in definition.items()},
                  priority, apply_to)


def test_the_pattern_is_searched_not_anchored() -> None:
    p = policy("p", "pol\\.", max_length=1)
    assert p.applies_to("queue", "a.pol.b") and not p.applies_to("queue", "polx")


def test_apply_to_selects_queues_or_exchanges() -> None:
    queues = policy("q", ".", apply_to="queues", max_length=1)
    exchanges = policy("e", ".", apply_to="exchanges", alternate_exchange="ae")
    both = policy("a", ".", max_length=1)
    assert queues.applies_to("queue", "x") and not queues.applies_to("exchange", "x")
    assert exchanges.applies_to("exchange", "x") and not exchanges.applies_to("queue", "x")
    assert both.applies_to("queue", "x") and both.applies_to("exchange", "x")


def test_the_highest_priority_match_applies_alone() -> None:
    low = policy("low", "^a", 1, message_ttl=10, max_length=100)
    high = policy("high", "^a", 5, max_length=7)
    other = policy("other", "^b", 9, max_length=1)
    chosen = best([low, high, other], "queue", "abc")
    assert chosen is high
    book = PolicyBook()
    for p in (low, high, other):
        book.set(POLICY, p)
    assert book.applied("v", "queue", "abc").definition == {"max-length": 7}  # no ttl from low


def test_policies_of_another_vhost_do_not_apply() -> None:
    book = PolicyBook()
    book.set(POLICY, policy("p", ".", vhost="w", max_length=1))
    assert book.applied("v", "queue", "q").policy is None


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(-3, 3), st.booleans()),
                min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_the_chosen_policy_matches_and_no_matching_one_outranks_it(
        specs: list[tuple[str, int, bool]]) -> None:
    policies = [policy(name, "^q" if matches else "^z", prio, max_length=1)
                for name, prio, matches in specs]
    chosen = best(policies, "queue", "queue-1")
    matching = [p for p in policies if p.applies_to("queue", "queue-1")]
    if not matching:
        assert chosen is None
        return
    assert chosen in matching
    assert all((p.priority, p.name) == (chosen.priority, chosen.name)
               or p.priority < chosen.priority
               or (p.priority == chosen.priority and p.name > chosen.name) for p in matching)


def test_the_list_is_by_priority_ascending_as_rabbitmqs() -> None:
    book = PolicyBook()
    book.set(POLICY, policy("p", "^pol", 1, max_length=1))
    book.set(POLICY, policy("p2", "x", 0, max_length=1))
    book.set(POLICY, policy("pw", "x", 0, vhost="w", max_length=1))
    assert [(p.vhost, p.name) for p in book.list(POLICY)] == [("v", "p2"), ("w", "pw"),
                                                              ("v", "p")]


# -- operator policies ---------------------------------------------------------------------

def test_the_operator_policy_merges_and_the_smaller_limit_wins() -> None:
    user = policy("p", ".", message_ttl=60000, max_length=5, dead_letter_exchange="dlx")
    operator = policy("o", ".", max_length=3, message_ttl=100000, expires=5000)
    assert merge(user, operator) == {"dead-letter-exchange": "dlx", "expires": 5000,
                                     "max-length": 3, "message-ttl": 60000}
    assert merge(None, operator) == operator.definition
    assert merge(user, None) == dict(sorted(user.definition.items()))


@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_operator_limits_never_loosen_a_policy(mine: int, theirs: int) -> None:
    merged = merge(policy("p", ".", max_length=mine), policy("o", ".", max_length=theirs))
    assert merged["max-length"] == min(mine, theirs)


def test_book_applied_names_both_policies() -> None:
    book = PolicyBook()
    book.set(POLICY, policy("p", "^pol", max_length=5))
    book.set(OPERATOR_POLICY, policy("o", ".", max_length=3))
    applied = book.applied("v", "queue", "pol.1")
    assert (applied.policy_name, applied.operator_policy_name) == ("p", "o")
    assert applied.definition == {"max-length": 3}


# -- a queue's arguments against the policy ----------------------------------------------------

@pytest.mark.parametrize(("key", "argument", "from_policy", "expected"), [
    ("message-ttl", 5000, 1000, 1000),       # the smaller
    ("message-ttl", 1000, 5000, 1000),
    ("expires", 5000, 1000, 1000),
    ("max-length", 10, 3, 3),
    ("max-length", 3, 10, 3),
    ("max-length-bytes", 100, 1000, 100),
    ("overflow", "reject-publish", "drop-head", "reject-publish"),  # the argument
    ("dead-letter-exchange", "mine", "theirs", "mine"),
    ("dead-letter-routing-key", "mine", "theirs", "mine"),
    ("ha-replicate", "none", "all", "none"),
    ("message-ttl", None, 1000, 1000),       # only one of them
    ("message-ttl", 1000, None, 1000),
    ("message-ttl", None, None, None),
])
def test_arguments_against_the_policy_as_rabbitmqs_classic_queue(
        key: str, argument: object, from_policy: object, expected: object) -> None:
    args = {} if argument is None else {"x-" + key: argument}
    definition = {} if from_policy is None else {key: from_policy}
    assert resolve(key, args, definition) == expected
