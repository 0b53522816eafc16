"""The management UI (brokerha/admin/ui.py) in Debian's headless Chromium, driven by Selenium.

Every page with real traffic (its numbers against the API's), and each
action (declare, publish, get, purge, delete; log in and out). Screenshots go
to ``$BROKERHA_TEST_ARTEFACTS`` (else the test's temporary directory).
``scripts/test`` installs Chromium and ChromeDriver where it can
(``scripts/ensure-chromium``); without them the tests are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from brokerha.testing import NodeProcess
from tests.ops.test_management_api import api

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="no chromium/chromedriver (scripts/ensure-chromium)"),
    pytest.mark.timeout(180),
]


@pytest.fixture()
def node(managed_node: NodeProcess) -> NodeProcess:
    return managed_node


@pytest.fixture()
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    assert CHROMIUM is not None and CHROMEDRIVER is not None
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1280,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture()
def artefacts(tmp_path: Path) -> Path:
    where = Path(os.environ.get("BROKERHA_TEST_ARTEFACTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    return where


def base(node: NodeProcess) -> str:
    return f"http://127.0.0.1:{node.port + 10000}"


def wait(browser: Any, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    def probe(_driver: Any) -> Any:
        try:
            return check()
        except (NoSuchElementException, StaleElementReferenceException):
            return False

    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(probe)


def css(browser: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.CSS_SELECTOR, selector)


def all_css(browser: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(browser.find_elements(By.CSS_SELECTOR, selector))


def login(browser: Any, node: NodeProcess, user: str = "guest", password: str = "guest") -> None:
    browser.get(base(node) + "/")
    wait(browser, lambda: css(browser, "#login").is_displayed())
    css(browser, "#login-user").send_keys(user)
    css(browser, "#login-password").send_keys(password)
    css(browser, "#login-submit").click()
    wait(browser, lambda: css(browser, "#nav").is_displayed())
    assert css(browser, "#who").text == user


def show(browser: Any, node: NodeProcess, page: str) -> None:
    browser.get(f"{base(node)}/#{page}")  # a fresh load: the session keeps the credentials
    wait(browser, lambda: css(browser, f'nav a[data-page="{page}"]').get_attribute("class")
         == "active")


def test_login_is_refused_with_a_wrong_password_and_logout_signs_out(
        browser: Any, node: NodeProcess, artefacts: Path) -> None:
    browser.get(base(node) + "/")
    wait(browser, lambda: css(browser, "#login").is_displayed())
    css(browser, "#login-user").send_keys("guest")
    css(browser, "#login-password").send_keys("wrong")
    css(browser, "#login-submit").click()
    wait(browser, lambda: "Login refused" in css(browser, "#login-error").text)
    assert not css(browser, "#nav").is_displayed()
    login(browser, node)
    browser.save_screenshot(str(artefacts / "ui-logged-in.png"))
    css(browser, "#logout").click()
    wait(browser, lambda: css(browser, "#login").is_displayed())
    browser.get(base(node) + "/")  # the session forgot the credentials
    wait(browser, lambda: css(browser, "#login").is_displayed())


def test_overview_shows_the_apis_numbers_charts_and_nodes(browser: Any, node: NodeProcess,
                                                          artefacts: Path) -> None:
    with pika.BlockingConnection(pika.URLParameters(node.url)) as conn:
        ch = conn.channel()
        ch.queue_declare("ui-overview")
        ch.confirm_delivery()
        for i in range(7):
            ch.basic_publish("", "ui-overview", f"m{i}".encode())
        login(browser, node)
        show(browser, node, "overview")
        _, overview = api(node, "GET", "overview")
        queued = wait(browser, lambda: css(browser, '[data-value="queued"]').text)
        assert queued == f"{overview['queue_totals']['messages']:,}"
        assert css(browser, '[data-value="connections"]').text == str(
            overview["object_totals"]["connections"])
        assert len(all_css(browser, ".uplot canvas")) == 2  # queued messages, message rates
        row = css(browser, '[data-node="brokerha@mgmt"] [data-role]')
        assert row.text == "standalone"
        assert wait(browser, lambda: css(browser, "[data-txlog]").get_attribute("data-txlog")) \
            == "off"
        browser.save_screenshot(str(artefacts / "ui-overview.png"))


def test_queue_page_declares_publishes_gets_purges_and_deletes(browser: Any, node: NodeProcess,
                                                               artefacts: Path) -> None:
    login(browser, node)
    show(browser, node, "queues")
    form = wait(browser, lambda: css(browser, "#declare-queue"))
    form.find_element("name", "name").send_keys("ui-q")
    form.find_element("css selector", "button").click()
    wait(browser, lambda: css(browser, '[data-queue="ui-q"]'))
    assert api(node, "GET", "queues/%2F/ui-q")[1]["durable"] is True

    publish = css(browser, "#publish-queue")
    publish.find_element("name", "queue").send_keys("ui-q")
    publish.find_element("name", "payload").send_keys("hello from the UI")
    publish.find_element("css selector", "button").click()
    wait(browser, lambda: api(node, "GET", "queues/%2F/ui-q")[1]["messages_ready"] == 1)
    wait(browser, lambda: css(browser, '[data-queue="ui-q"] td:nth-child(3)').text == "1")

    css(browser, '[data-queue="ui-q"] button[data-act="get"]').click()
    got = wait(browser, lambda: css(browser, '[data-got="payload"]').text)
    assert got == "hello from the UI"
    assert api(node, "GET", "queues/%2F/ui-q")[1]["messages_ready"] == 1  # looked, put back
    browser.save_screenshot(str(artefacts / "ui-queues.png"))

    css(browser, '[data-queue="ui-q"] button[data-act="purge"]').click()
    wait(browser, lambda: api(node, "GET", "queues/%2F/ui-q")[1]["messages_ready"] == 0)

    # sortable: by name, then reversed
    api(node, "PUT", "queues/%2F/ui-a", body={"durable": False})
    show(browser, node, "queues")
    wait(browser, lambda: css(browser, '[data-queue="ui-a"]'))
    header = css(browser, '[data-table="queue-table"] th[data-sort="name"]')
    header.click()
    names = wait(browser, lambda: [r.get_attribute("data-queue") for r in
                                   all_css(browser, "[data-table='queue-table'] tbody tr")])
    assert names == sorted(names)
    css(browser, '[data-table="queue-table"] th[data-sort="name"]').click()
    wait(browser, lambda: [r.get_attribute("data-queue") for r in
                           all_css(browser, "[data-table='queue-table'] tbody tr")]
         == sorted(names, reverse=True))

    css(browser, '[data-queue="ui-q"] button[data-act="delete"]').click()
    browser.switch_to.alert.accept()
    wait(browser, lambda: api(node, "GET", "queues/%2F/ui-q")[0] == 404)
    wait(browser, lambda: not all_css(browser, '[data-queue="ui-q"]'))


def test_exchange_page_declares_and_deletes(browser: Any, node: NodeProcess) -> None:
    login(browser, node)
    show(browser, node, "exchanges")
    form = wait(browser, lambda: css(browser, "#declare-exchange"))
    form.find_element("name", "name").send_keys("ui-x")
    form.find_element("name", "type").send_keys("topic")
    form.find_element("css selector", "button").click()
    wait(browser, lambda: css(browser, '[data-exchange="ui-x"]'))
    assert api(node, "GET", "exchanges/%2F/ui-x")[1]["type"] == "topic"
    css(browser, '[data-exchange="ui-x"] button[data-act="delete"]').click()
    browser.switch_to.alert.accept()
    wait(browser, lambda: api(node, "GET", "exchanges/%2F/ui-x")[0] == 404)


def test_connections_and_channels_pages_list_what_the_api_lists(
        browser: Any, node: NodeProcess, artefacts: Path) -> None:
    with pika.BlockingConnection(pika.URLParameters(node.url)) as conn:
        conn.channel()
        conn.channel()
        login(browser, node)
        for page, path, attr in (("connections", "connections", "data-connection"),
                                 ("channels", "channels", "data-channel")):
            show(browser, node, page)
            names = {c["name"] for c in api(node, "GET", path)[1]}
            shown = wait(browser, lambda a=attr: {r.get_attribute(a) for r in
                                                  all_css(browser, f"[{a}]")})
            assert shown == names and names
            browser.save_screenshot(str(artefacts / f"ui-{page}.png"))


def test_users_page_for_an_administrator_and_refused_to_monitoring(
        browser: Any, node: NodeProcess, artefacts: Path) -> None:
    login(browser, node)
    show(browser, node, "admin")
    users = wait(browser, lambda: {r.get_attribute("data-user")
                                   for r in all_css(browser, "[data-user]")})
    assert users == {u["name"] for u in api(node, "GET", "users")[1]}
    browser.save_screenshot(str(artefacts / "ui-users.png"))
    css(browser, "#logout").click()
    login(browser, node, "watcher", "w-secret")
    show(browser, node, "admin")
    denied = wait(browser, lambda: css(browser, '[data-denied="users"]').text)
    assert "Not administrator user" in denied
    assert json.dumps(api(node, "GET", "users", "watcher", "w-secret")[1]) == json.dumps(
        {"error": "not_authorised", "reason": "Not administrator user"})
