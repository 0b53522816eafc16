"""TLS on the TxLog links between datacenters (``[tls]`` of a master, ``[txlog.tls]`` of a node).

Three ``brokerha txlog node`` processes: dc1 and dc2 hold certificates of the
group's CA naming themselves and agree on a log over TLS; dc3 first presents
a certificate of another CA (refused in the handshake and logged), then one of
the right CA that names another datacenter (refused by the name check and
logged). The TLS part of the broker nodes' three-DC test is in
tests/txlog/test_broker_txlog.py (its links run with TLS).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from brokerha.certs import issue, make_ca
from tests.txlog.masters import Master, make_masters, wait_for

pytestmark = pytest.mark.timeout(90)


def tls_keys(d: Path, stem: str, ca: str = "ca") -> dict[str, str]:
    return {"tls.cert": str(d / f"{stem}.pem"), "tls.key": str(d / f"{stem}.key"),
            "tls.ca": str(d / f"{ca}.pem"), "tls.check-peer-name": "true"}


def test_txlog_links_with_tls_refuse_another_ca_and_a_wrong_name(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    ca = make_ca(d)
    other = make_ca(d, "impostor CA", stem="other-ca")
    for name in ("dc1", "dc2"):
        issue(ca, d, name)
    issue(other, d, "dc3", stem="dc3-other-ca")
    issue(ca, d, "dc2", stem="dc3-named-dc2")
    masters = make_masters(tmp_path, ["dc1", "dc2", "dc3"])
    m1, m2, m3 = masters.values()
    m1.write_config([m2, m3], **tls_keys(d, "dc1"))
    m2.write_config([m1], **tls_keys(d, "dc2"))
    m3.write_config([m1], **tls_keys(d, "dc3-other-ca", ca="other-ca"))
    started: list[Master] = []
    try:
        for m in (m1, m2, m3):
            m.start()
            started.append(m)
        wait_for(lambda: m1.status()["peers"][0]["connected"], 10, "dc1-dc2 link over TLS")
        tx = m1.tx("over-tls", wait="synchronised")
        wait_for(lambda: tx["tx_id"] in m2.ids(), 10, "dc2 has dc1's transaction")
        assert "TLS" in m1.log_text()

        # dc1 dials dc3 (its name sorts first) and refuses dc3's certificate
        wait_for(lambda: "CERTIFICATE_VERIFY_FAILED" in m1.log_text(), 10, "dc1 logs the refusal")
        line = next(x for x in m1.log_text().splitlines() if "CERTIFICATE_VERIFY_FAILED" in x)
        assert "cluster link to dc3" in line and "TLS refused" in line
        assert not next(p for p in m1.status()["peers"] if p["id"] == "dc3")["connected"]

        # the right CA, but the certificate names dc2: refused by the name check
        m3.stop()
        m3.write_config([m1], **tls_keys(d, "dc3-named-dc2"))
        m3.start()
        wait_for(lambda: "its TLS certificate names dc2, not dc3" in m1.log_text(), 10,
                 "dc1 refuses a certificate naming another peer")
        assert not next(p for p in m1.status()["peers"] if p["id"] == "dc3")["connected"]
        # dc1-dc2 is untouched
        tx = m2.tx("still-fine", wait="synchronised")
        wait_for(lambda: tx["tx_id"] in m1.ids(), 10, "dc1 has dc2's transaction")

        # a certificate naming dc3 put in place of those files, then SIGHUP: no restart,
        # and dc1's next dial is accepted
        cert, key = issue(ca, d, "dc3", stem="dc3-fixed")
        (d / "dc3-named-dc2.pem").write_bytes(cert.read_bytes())
        (d / "dc3-named-dc2.key").write_bytes(key.read_bytes())
        assert m3.proc is not None
        m3.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "TLS certificates of the links reloaded" in m3.log_text(), 10,
                 "dc3 reloads")
        wait_for(lambda: next(p for p in m1.status()["peers"] if p["id"] == "dc3")["connected"],
                 15, "dc1-dc3 link up with dc3's reloaded certificate")
        assert m3.status()["peers"][0]["connected"]
    finally:
        for m in started:
            m.stop()


def test_txlog_tls_keys_are_checked(tmp_path: Path) -> None:
    from brokerha.txlog.engine.config import ConfigError
    from brokerha.txlog.master.settings import from_properties

    base = {"node-id": "dc1", "master-url": "txlog://127.0.0.1:1", "group": "g",
            "secret": "s", "data-dir": "data", "peer.1.id": "dc2",
            "peer.1.url": "txlog://127.0.0.1:2"}
    with pytest.raises(ConfigError, match="tls.key, tls.ca: required with tls.cert"):
        from_properties({**base, "tls.cert": "a.pem"}, tmp_path)
    with pytest.raises(ConfigError, match="is not a readable file"):
        from_properties({**base, "tls.cert": "a.pem", "tls.key": "a.key", "tls.ca": "c.pem"},
                        tmp_path)
    with pytest.raises(ConfigError, match="tls.check-peer-name: expected true or false"):
        from_properties({**base, **tls_keys(tmp_path, "x"), "tls.check-peer-name": "yes"},
                        tmp_path)
