#!/usr/bin/env python3
"""Docker HEALTHCHECK: exit 0 only when this node is ready.

Ready, as /api/status says it: a serving primary, a backup that has caught up
with its primary, or a standalone node. The admin address is found as the
node finds it: BROKERHA_HEALTH_URL, else BROKERHA_ADMIN, else this member's
``admin`` (or AMQP port + 10000) in the configuration file, else the AMQP
listen address + 10000.
"""

import base64
import json
import os
import sys
import tomllib
import urllib.request


def admin_address() -> str:
    if os.environ.get("BROKERHA_HEALTH_URL"):
        return os.environ["BROKERHA_HEALTH_URL"].rstrip("/")
    if os.environ.get("BROKERHA_ADMIN", "off") != "off":
        return "http://" + os.environ["BROKERHA_ADMIN"]
    name = os.environ.get("BROKERHA_NAME")
    listen = os.environ.get("BROKERHA_LISTEN", "127.0.0.1:5672")
    path = os.environ.get("BROKERHA_CONFIG", "/etc/brokerha/brokerha.toml")
    if os.path.exists(path):
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
        node = cfg.get("node", {})
        name = name or node.get("name")
        listen = node.get("listen", listen)
        if node.get("admin"):
            return "http://" + node["admin"]
        for member in cfg.get("cluster", {}).get("nodes", []):
            if member.get("name") == name:
                if member.get("admin"):
                    return "http://" + member["admin"]
                listen = member["amqp"]
    host, _, port = listen.rpartition(":")
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host
    return f"http://{host}:{int(port) + 10000}"


def main() -> int:
    url = admin_address() + "/api/status"
    # every admin route but /metrics needs credentials: a user with a management tag
    user = os.environ.get("BROKERHA_HEALTHCHECK_USER", "guest")
    password = os.environ.get("BROKERHA_HEALTHCHECK_PASSWORD", "guest")
    req = urllib.request.Request(url)
    req.add_header("Authorization", "Basic " + base64.b64encode(
        f"{user}:{password}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            me = json.load(resp)["node"]
    except Exception as exc:  # noqa: BLE001 - any failure is "not healthy"
        print(f"not ready: {url}: {exc}")
        return 1
    role = me.get("role")
    ready = bool(me.get("ready")) and (role in ("backup", "standalone")
                                       or (role == "primary" and me.get("serving")))
    print(f"{me.get('name')}: {role}, epoch {me.get('epoch')}, "
          f"{'ready' if ready else 'not ready'}")
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
