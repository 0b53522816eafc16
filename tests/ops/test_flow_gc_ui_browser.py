"""The management UI's overview shows publishers held by flow control and the GC pauses, on
a real cluster in headless Chromium (issue 33).

A backup is SIGSTOPped under a publisher without confirms (tests/failover/test_flow_real.py).
Here ``backup_unheard_timeout`` and ``backup_timeout`` are long enough for the page to be
loaded while publishers are held (its nodes API waits for the paused member's answer): the
hold lasts until the primary closes its silent link to the paused backup (about 5 s).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pika

from brokerha.testing import LocalCluster
from tests.failover.test_flow_real import QUEUE, Publisher, scrape, wait_for
from tests.ops.test_management_ui_browser import (  # noqa: F401 - fixtures
    all_css,
    artefacts,
    browser,
    css,
    login,
    pytestmark,
    show,
    wait,
)

OPTIONS = {"backup_unheard_timeout": 6.0, "backup_timeout": 8.0}


def node_cell(driver: Any, node: str, selector: str, attribute: str) -> tuple[str, str]:
    """An attribute and the text of the cell of ``node``'s row, read at once (the table is
    rendered again at each refresh: ``wait`` retries a read that met a replaced element)."""
    found = css(driver, f'[data-node="brokerha@{node}"] {selector}')
    return found.get_attribute(attribute), found.find_element("xpath", "..").text


def test_the_overview_shows_publishers_held_by_a_lagging_backup_and_gc_pauses(
        browser: Any, artefacts: Path) -> None:  # noqa: F811
    with LocalCluster(3, options=OPTIONS) as cluster:
        primary = cluster.wait_primary(30)
        lagging = next(n for n in cluster.names if n != primary)
        for name in cluster.names:
            if name != primary:
                cluster.wait_ready(name, 30)
        url, admin = cluster.url(primary), cluster.admin_url(primary)
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().queue_declare(QUEUE, durable=True)
        conn.close()
        node = cluster.nodes[primary]
        login(browser, node)
        show(browser, node, "overview")
        held, text = wait(browser, lambda: node_cell(browser, primary, "[data-flow-held]",
                                                     "data-flow-held"))
        assert held == "0" and text.startswith("no (0 holds"), text
        for name in cluster.names:  # every member's longest GC pause, its collections
            pause, text = wait(browser, lambda: node_cell(browser, name,  # noqa: B023
                                                          "[data-gc-pause-max]",
                                                          "data-gc-pause-max"))
            assert float(pause) >= 0 and " ms (collections " in text and "frozen" in text, text

        publisher = Publisher(url)
        publisher.start()
        try:
            time.sleep(0.3)
            cluster.pause(lagging)
            wait_for("publishers held", lambda: scrape(admin),
                     lambda m: m[("brokerha_publishers_held", ())] == 1, 3)
            show(browser, node, "overview")
            _, text = wait(browser, lambda: node_cell(browser, primary, '[data-flow-held="1"]',
                                                      "data-flow-held"))
            assert text.startswith(f"held ({lagging})"), text
            browser.save_screenshot(str(artefacts / "ui-overview-flow-held.png"))
            wait_for("publishers released", lambda: scrape(admin),
                     lambda m: m[("brokerha_publishers_held", ())] == 0, 8)
        finally:
            publisher.stopping.set()
            publisher.join(30)
            cluster.resume(lagging)
        assert publisher.error is None, publisher.error
        show(browser, node, "overview")
        holds, _ = wait(browser, lambda: node_cell(browser, primary, '[data-flow-held="0"]',
                                                   "data-flow-holds"))
        assert int(holds) >= 1
        assert len(all_css(browser, "[data-gc-pause-max]")) == len(cluster.names)
