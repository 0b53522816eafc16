"""Differential (issue 34): ``brokerha ctl``'s user, vhost and permission verbs against
``rabbitmqctl``'s on RabbitMQ 3.10: the same arguments, the same banners and tab-separated
lists, the same ``Error:`` words for a refusal (lines of other users and vhosts left out)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import pytest

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(300)]


def steps(s: str) -> list[list[str]]:
    v, u = f"v-{s}", f"u-{s}"
    return [["add_vhost", v], ["add_user", u, "pw"], ["add_user", u, "pw"],
            ["set_permissions", "-p", v, u, "^c", "^w", "^r"],
            ["set_topic_permissions", "-p", v, u, "amq.topic", "^a", "^b"],
            ["set_user_tags", u, "monitoring", "management"],
            ["change_password", u, "pw2"], ["list_users"], ["list_vhosts"],
            ["list_permissions", "-p", v], ["list_user_permissions", u],
            ["list_topic_permissions", "-p", v],
            ["clear_topic_permissions", "-p", v, u], ["clear_permissions", "-p", v, u],
            ["list_user_permissions", u], ["delete_user", u], ["delete_user", u],
            ["change_password", u, "x"], ["set_permissions", "-p", v, u, ".*", ".*", ".*"],
            ["clear_permissions", "-p", v, f"nobody-{s}"],
            ["set_topic_permissions", "-p", f"none-{s}", "guest", "x", ".*", ".*"],
            ["delete_vhost", v], ["delete_vhost", v], ["list_permissions", "-p", v],
            ["clear_permissions", "-p", v, "guest"]]


def mine(output: str, s: str) -> list[str]:
    """The lines of this run: banners, headers and rows naming its objects, errors."""
    keep = []
    for line in output.splitlines():
        line = line.removeprefix("brokerha ctl: ")  # brokerha ctl names itself on errors
        if not line.strip():
            continue
        if "\t" in line or line in ("name",):  # a row or a header
            if s in line or line.split("\t")[0] in ("user", "vhost", "name"):
                keep.append(line)
            continue
        if s in line or line.startswith("Error") or line.startswith("Listing"):
            keep.append(line)
    return keep


def test_the_verbs_answer_as_rabbitmqctls(rabbit_node: Any, brokerha_node: Any) -> None:
    s = uuid.uuid4().hex[:8]
    admin = f"http://127.0.0.1:{brokerha_node.port + 10000}"
    for argv in steps(s):
        # each step on both at once (the two brokers share nothing; each side's steps stay
        # in order): the two tools' start-up times overlap instead of adding up
        ours = subprocess.Popen([sys.executable, "-W", "ignore", "-m", "brokerha.cli", "ctl",
                                 "--node", admin, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            theirs = rabbit_node.ref.ctl(*argv)
            out, err = ours.communicate(timeout=60)
        finally:
            if ours.poll() is None:
                ours.kill()
                ours.wait()
        expected = (theirs.returncode == 0, mine(theirs.stdout + theirs.stderr, s))
        got = (ours.returncode == 0, mine(out + err, s))
        assert got == expected, argv
