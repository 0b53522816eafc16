"""The ``tx-outcome`` examples of docs/ha.md ("Transactions") run against a real node.

Each block commits a transaction of three messages named with ``x-tx-id``
and asks for its outcome: it must say ``committed`` and the three messages
must be on the queue.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from brokerha.testing import NodeProcess

DOC = Path(__file__).resolve().parents[2] / "docs" / "ha.md"
SECTION = DOC.read_text().split("## Transactions", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, re.S)
URL_LINE = re.compile(r'^URL = "amqp://guest:guest@localhost:5672/(%2F|/)"', re.M)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    with NodeProcess("docs-tx") as n:
        yield n


def test_the_section_has_one_example_per_client() -> None:
    assert len(BLOCKS) == 3
    assert ["import pika" in BLOCKS[0], "import aio_pika" in BLOCKS[1],
            "import kombu" in BLOCKS[2]] == [True, True, True]


@pytest.mark.parametrize("index", range(3), ids=["pika", "aio-pika", "kombu"])
def test_docs_tx_outcome_example(node: NodeProcess, index: int) -> None:
    block = BLOCKS[index]
    url = node.url if index < 2 else node.url.replace("/%2F", "//")
    code, n = URL_LINE.subn(f"URL = {url!r}", block)
    assert n == 1
    namespace: dict[str, Any] = {"__name__": "docs_ha_example"}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102
    assert namespace["outcome"] == "committed"
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    got = []
    while (m := ch.basic_get("tx-orders", auto_ack=True))[0] is not None:
        got.append(m[2])
    conn.close()
    assert got == [b"order 0", b"order 1", b"order 2"]
