"""HTTPS for the admin listener, ``brokerha ctl --ca``, certificate reload, TLS configuration errors."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pika
import pytest
from cryptography import x509

from brokerha.certs import issue
from tests.tls.conftest import Certs, TLSNode

pytestmark = pytest.mark.timeout(60)


def served_serial(port: int, ctx: ssl.SSLContext) -> int:
    """The serial number of the certificate a TLS listener presents now."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with ctx.wrap_socket(sock, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def file_serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def https_json(node: TLSNode, path: str, ctx: ssl.SSLContext, body: bytes | None = None,
               user: str = "guest", password: str = "guest") -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(f"https://localhost:{node.https_port}{path}", data=body,
                                 method="GET" if body is None else "POST")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_https_serves_the_admin_api_and_ctl_connects_with_its_ca(tls_node: TLSNode,
                                                                 certs: Certs) -> None:
    status, answer = https_json(tls_node, "/api/status", certs.client_context())
    assert status == 200 and answer["node"]["amqps_url"] == f"amqps://127.0.0.1:{tls_node.amqps_port}"
    with urllib.request.urlopen(f"https://localhost:{tls_node.https_port}/metrics", timeout=5,
                                context=certs.client_context()) as resp:
        metrics = resp.read().decode()
    expiry = next(line for line in metrics.splitlines()
                  if line.startswith("brokerha_tls_certificate_expiry_timestamp_seconds "))
    not_after = x509.load_pem_x509_certificate(certs.pem("server").read_bytes()).not_valid_after_utc
    assert float(expiry.split()[1]) == not_after.timestamp()
    ctl = [sys.executable, "-m", "brokerha.cli", "ctl", "--node",
           f"https://localhost:{tls_node.https_port}"]
    done = subprocess.run([*ctl[:-2], "--ca", str(certs.pem("ca")), *ctl[-2:], "status",
                           "--json"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["nodes"][0]["role"] == "standalone"
    # without the CA the node's certificate is not trusted: ctl says so and exits 2
    done = subprocess.run([*ctl, "status"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in done.stderr


def test_https_with_required_client_certificates_and_ctl_cert(strict_node: TLSNode,
                                                              certs: Certs) -> None:
    ctl = [sys.executable, "-m", "brokerha.cli", "ctl", "--ca", str(certs.pem("ca"))]
    node = ["--node", f"https://localhost:{strict_node.https_port}", "tls", "status"]
    done = subprocess.run([*ctl, *node], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stdout  # the listener wants a client certificate
    done = subprocess.run([*ctl, "--cert", str(certs.pem("client-guest")), "--key",
                           str(certs.key("client-guest")), *node],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "CN=server" in done.stdout, done.stderr


def test_https_only_with_the_plain_admin_listener_off(certs: Certs) -> None:
    with TLSNode(certs, extra=["--http-listen", "off"]) as node:
        status, answer = https_json(node, "/api/status", certs.client_context())
        assert status == 200 and answer["node"]["serving"]
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}/api/status", timeout=2)
        assert "admin HTTP on" not in node.log_text()


def replace_server_cert(certs: Certs, target: Path) -> tuple[Path, Path]:
    """A new certificate + key for the node, signed by the same CA, at ``target``."""
    cert, key = issue(certs.ca, target, "server", hosts=("localhost", "127.0.0.1"))
    return cert, key


def test_sighup_and_the_admin_call_reload_the_certificate(certs: Certs, tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(certs.pem("server"), live / "server.pem")
    shutil.copy(certs.key("server"), live / "server.key")
    node = TLSNode(certs, extra=["--tls-cert", str(live / "server.pem"),
                                 "--tls-key", str(live / "server.key")])
    with node:
        ctx = certs.client_context()
        first = served_serial(node.amqps_port, ctx)
        assert first == file_serial(certs.pem("server"))
        # a connection opened before the reload stays up through it
        before = pika.BlockingConnection(pika.URLParameters(node.amqps_url()))

        replace_server_cert(certs, tmp_path / "new")
        shutil.copy(tmp_path / "new" / "server.pem", live / "server.pem")
        shutil.copy(tmp_path / "new" / "server.key", live / "server.key")
        assert node.proc is not None
        node.proc.send_signal(signal.SIGHUP)
        want = file_serial(live / "server.pem")
        deadline = time.monotonic() + 5
        while served_serial(node.amqps_port, ctx) != want:
            assert time.monotonic() < deadline, "SIGHUP did not reload the certificate"
            time.sleep(0.05)
        assert served_serial(node.https_port, ctx) == want  # HTTPS too
        before.channel().queue_declare("", exclusive=True)  # still usable
        before.close()

        # the admin call: a broken key file is refused and nothing changes
        (live / "server.key").write_text("not a key\n")
        status, answer = https_json(node, "/api/tls/reload", ctx, b"{}")
        assert status == 400 and "nothing changed" in str(answer["error"])
        assert served_serial(node.amqps_port, ctx) == want
        # ... and a good one is taken at once, with an administrator's credentials only
        third_cert, third_key = replace_server_cert(certs, tmp_path / "third")
        shutil.copy(third_cert, live / "server.pem")
        shutil.copy(third_key, live / "server.key")
        status, _ = https_json(node, "/api/tls/reload", ctx, b"{}", password="wrong")
        assert status == 401
        status, answer = https_json(node, "/api/tls/reload", ctx, b"{}")
        assert status == 200 and answer["reloads"] == 2
        assert served_serial(node.amqps_port, ctx) == file_serial(third_cert)
        cert = answer["certificate"]
        assert isinstance(cert, dict) and int(str(cert["serial"]), 16) == file_serial(third_cert)
        # and brokerha ctl tls reload / status, over HTTPS
        ctl = [sys.executable, "-m", "brokerha.cli", "ctl", "--ca", str(certs.pem("ca")),
               "--node", f"https://localhost:{node.https_port}", "tls"]
        done = subprocess.run([*ctl, "reload"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert "reloaded 3 time(s)" in done.stdout and "CN=server" in done.stdout
        done = subprocess.run([*ctl, "status", "--json"], capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0 and json.loads(done.stdout)["reloads"] == 3


def run_node(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "brokerha.cli", "node", "--store", "memory",
                           "--listen", "127.0.0.1:1", *args],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(("args", "message"), [
    (["--amqps-listen", "127.0.0.1:1"], "amqps_listen: need tls.cert and tls.key"),
    (["--listen", "off"], "listen = off: needs amqps_listen"),
    (["--tls-cert", "{server}.pem", "--tls-key", "{server}.key", "--tls-verify-peer"],
     "tls.verify_peer: needs tls.ca"),
    (["--tls-cert", "{server}.pem", "--tls-key", "{server}.key", "--tls-ca", "{ca}.pem",
      "--tls-fail-if-no-peer-cert"], "tls.fail_if_no_peer_cert: needs tls.verify_peer"),
    (["--tls-cert", "{server}.pem", "--tls-key", "{ca}.key", "--amqps-listen", "127.0.0.1:1"],
     "tls: "),
    (["--tls-cert", "/nonexistent.pem", "--tls-key", "{server}.key", "--amqps-listen",
      "127.0.0.1:1"], "No such file"),
])
def test_tls_configuration_errors_exit_2_naming_the_problem(certs: Certs, args: list[str],
                                                            message: str) -> None:
    args = [a.format(server=certs.dir / "server", ca=certs.dir / "ca") for a in args]
    done = run_node(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr


def test_tls_keys_in_the_configuration_file(certs: Certs, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[tls]\ncert = "x.pem"\nverify = true\n')
    done = run_node("--config", str(bad))
    assert done.returncode == 2 and "[tls]: unknown key(s) verify" in done.stderr
    bad.write_text('[tls]\nlogin_from = "email"\n')
    done = run_node("--config", str(bad))
    assert done.returncode == 2 and "tls.login_from: expected one of" in done.stderr
