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


# -- the definitions pages (issue 34): virtual hosts, users and permissions, policies ----------

def choose(form: Any, name: str, text: str) -> None:
    """Pick ``text`` in the form's select (its options are made again on every refresh)."""
    from selenium.webdriver.support.ui import Select

    def pick() -> bool:
        select = Select(form.find_element("name", name))
        select.select_by_visible_text(text)
        return bool(select.first_selected_option.text == text)

    wait(form.parent, pick)


def click(browser: Any, selector: str) -> None:
    """Click what ``selector`` finds (a table's rows are made again on every refresh)."""
    wait(browser, lambda: css(browser, selector).click() or True)


def fill_in(form: Any, **values: str) -> None:
    for name, value in values.items():
        field = form.find_element("name", name)
        field.clear()
        field.send_keys(value)


def whoami(node: NodeProcess, user: str, password: str) -> int:
    return api(node, "GET", "whoami", user, password)[0]


def test_vhosts_page_adds_and_deletes_a_vhost(browser: Any, node: NodeProcess,
                                              artefacts: Path) -> None:
    login(browser, node)
    show(browser, node, "vhosts")
    form = wait(browser, lambda: css(browser, "#add-vhost"))
    fill_in(form, name="ui-v", description="made in the UI")
    form.find_element("css selector", "button").click()
    wait(browser, lambda: "made in the UI" in css(
        browser, '[data-table="vhost-table"] [data-vhost="ui-v"]').text)
    assert api(node, "GET", "vhosts/ui-v")[1]["description"] == "made in the UI"
    listed = {v["name"] for v in api(node, "GET", "vhosts")[1]}
    wait(browser, lambda: {r.get_attribute("data-vhost") for r in all_css(
        browser, '[data-table="vhost-table"] tbody tr')} == listed)
    browser.save_screenshot(str(artefacts / "ui-vhosts.png"))
    click(browser, '[data-vhost="ui-v"] button[data-act="delete"]')
    browser.switch_to.alert.accept()
    wait(browser, lambda: api(node, "GET", "vhosts/ui-v")[0] == 404)
    wait(browser, lambda: not all_css(browser, '[data-table="vhost-table"] [data-vhost="ui-v"]'))


def test_users_page_adds_a_user_changes_password_and_tags_sets_permissions_and_deletes(
        browser: Any, node: NodeProcess, artefacts: Path) -> None:
    login(browser, node)
    show(browser, node, "admin")
    form = wait(browser, lambda: css(browser, "#add-user"))
    fill_in(form, name="ui-u", password="one", tags="management")
    form.find_element("css selector", "button").click()
    wait(browser, lambda: css(browser, '[data-user="ui-u"]'))
    assert whoami(node, "ui-u", "one") == 200

    form = css(browser, "#set-password")
    choose(form, "user", "ui-u")
    fill_in(form, password="two")
    form.find_element("css selector", "button").click()
    wait(browser, lambda: whoami(node, "ui-u", "one") == 401)
    assert whoami(node, "ui-u", "two") == 200

    form = css(browser, "#set-tags")
    choose(form, "user", "ui-u")
    fill_in(form, tags="monitoring, policymaker")
    form.find_element("css selector", "button").click()
    wait(browser, lambda: api(node, "GET", "users/ui-u")[1]["tags"] == ["monitoring",
                                                                         "policymaker"])
    assert whoami(node, "ui-u", "two") == 200  # the password stayed
    wait(browser, lambda: "monitoring, policymaker" in css(browser, '[data-user="ui-u"]').text)

    form = css(browser, "#set-permission")
    choose(form, "user", "ui-u")
    choose(form, "vhost", "orders")
    fill_in(form, configure="^ui-", write="^ui-", read=".*")
    form.find_element("css selector", "button").click()
    wait(browser, lambda: api(node, "GET", "permissions/orders/ui-u")[0] == 200)
    assert api(node, "GET", "permissions/orders/ui-u")[1] == {
        "user": "ui-u", "vhost": "orders", "configure": "^ui-", "write": "^ui-", "read": ".*"}
    wait(browser, lambda: "^ui-" in css(browser, '[data-permission="orders/ui-u"]').text)
    browser.save_screenshot(str(artefacts / "ui-users-permissions.png"))
    click(browser, '[data-permission="orders/ui-u"] button[data-act="clear"]')
    wait(browser, lambda: api(node, "GET", "permissions/orders/ui-u")[0] == 404)

    click(browser, '[data-user="ui-u"] button[data-act="delete"]')
    browser.switch_to.alert.accept()
    wait(browser, lambda: api(node, "GET", "users/ui-u")[0] == 404)
    wait(browser, lambda: not all_css(browser, '[data-user="ui-u"]'))
    assert whoami(node, "ui-u", "two") == 401


def test_policies_page_sets_and_clears_policies_and_shows_refusals(
        browser: Any, node: NodeProcess, artefacts: Path) -> None:
    login(browser, node)
    show(browser, node, "policies")
    form = wait(browser, lambda: css(browser, "#set-policy"))
    choose(form, "vhost", "/")
    fill_in(form, name="ui-p", pattern="^ui\\.", priority="3",
            definition='{"max-length": 5, "message-ttl": 60000}')
    choose(form, "applyto", "queues")
    form.find_element("css selector", "button").click()
    wait(browser, lambda: '"max-length":5' in css(browser, '[data-policy="//ui-p"]').text)
    assert api(node, "GET", "policies/%2F/ui-p")[1] == {
        "vhost": "/", "name": "ui-p", "pattern": "^ui\\.", "apply-to": "queues",
        "definition": {"max-length": 5, "message-ttl": 60000}, "priority": 3}

    # RabbitMQ's reason for a key it does not know, shown; nothing set
    fill_in(form, name="ui-bad", definition='{"nonesuch": 1}')
    form.find_element("css selector", "button").click()
    assert "are not recognised policy settings" in wait(
        browser, lambda: css(browser, "#message").text)
    assert api(node, "GET", "policies/%2F/ui-bad")[0] == 404
    fill_in(form, definition="{not json")
    form.find_element("css selector", "button").click()
    wait(browser, lambda: "not JSON" in css(browser, "#message").text)

    choose(form, "kind", "operator policy")
    fill_in(form, name="ui-op", pattern=".*", definition='{"max-length": 100}')
    form.find_element("css selector", "button").click()
    wait(browser, lambda: css(browser, '[data-operator-policy="//ui-op"]'))
    assert api(node, "GET", "operator-policies/%2F/ui-op")[1]["definition"] == {
        "max-length": 100}
    browser.save_screenshot(str(artefacts / "ui-policies.png"))

    click(browser, '[data-policy="//ui-p"] button[data-act="clear"]')
    wait(browser, lambda: api(node, "GET", "policies/%2F/ui-p")[0] == 404)
    click(browser, '[data-operator-policy="//ui-op"] button[data-act="clear"]')
    wait(browser, lambda: api(node, "GET", "operator-policies/%2F/ui-op")[0] == 404)
    wait(browser, lambda: not all_css(browser, "[data-policy], [data-operator-policy]"))


def test_vhosts_page_exports_and_imports_definitions(browser: Any, node: NodeProcess,
                                                     tmp_path: Path) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    browser.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow",
                                                         "downloadPath": str(downloads)})
    login(browser, node)
    show(browser, node, "vhosts")
    form = wait(browser, lambda: css(browser, "#export-definitions"))
    form.find_element("css selector", "button").click()
    saved = downloads / "definitions.json"
    wait(browser, saved.exists)  # the file the browser saved: the API's export
    wait(browser, lambda: json.loads(saved.read_text() or "null") == api(
        node, "GET", "definitions")[1])

    file = tmp_path / "defs.json"
    file.write_text(json.dumps({
        "vhosts": [{"name": "ui-imported"}],
        "users": [{"name": "ui-imported-user", "password_hash": "", "tags": ["monitoring"]}],
        "permissions": [{"user": "ui-imported-user", "vhost": "ui-imported",
                         "configure": ".*", "write": ".*", "read": ".*"}]}))
    form = css(browser, "#import-definitions")
    form.find_element("name", "file").send_keys(str(file))
    form.find_element("css selector", "button").click()
    wait(browser, lambda: api(node, "GET", "permissions/ui-imported/ui-imported-user")[0] == 200)
    assert api(node, "GET", "users/ui-imported-user")[1]["tags"] == ["monitoring"]
    wait(browser, lambda: css(browser, '[data-table="vhost-table"] [data-vhost="ui-imported"]'))

    # a refused file: RabbitMQ's reason shown, nothing changed
    file.write_text(json.dumps({"permissions": [{"user": "nobody", "vhost": "ui-imported",
                                                 "configure": "", "write": "", "read": ""}]}))
    form.find_element("name", "file").send_keys(str(file))
    form.find_element("css selector", "button").click()
    assert "no_such_user" in wait(browser, lambda: css(browser, "#message").text)
    assert api(node, "GET", "permissions/ui-imported/nobody")[0] == 404
