"""``x-ha-replicate`` is checked when the queue is declared (406, like RabbitMQ's x-args)."""

from __future__ import annotations

import pytest

from brokerha.broker.arguments import POLICIES, validate_queue_arguments
from brokerha.broker.errors import PreconditionFailed


@pytest.mark.parametrize("value", POLICIES)
def test_known_replicate_values_are_accepted(value: str) -> None:
    validate_queue_arguments("/", "q", {"x-ha-replicate": value})


@pytest.mark.parametrize("value", ["All", "some", 1, b"all"])
def test_unknown_replicate_values_are_refused_with_406(value: object) -> None:
    with pytest.raises(PreconditionFailed) as info:
        validate_queue_arguments("/", "q", {"x-ha-replicate": value})
    assert "x-ha-replicate" in str(info.value) and info.value.code == 406
