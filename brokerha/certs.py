"""``brokerha tls make-certs DIR``: a private CA and node/client certificates for first set-ups.

Made with the ``cryptography`` package (no ``openssl`` shell-outs): one CA
(``ca.pem``/``ca.key``, kept and reused when it exists, so later runs add
certificates signed by the same CA), then for each ``--name`` a node
certificate usable as server and client (the amqps/HTTPS listeners, the
``[cluster.tls]`` and TxLog links: its common name and a DNS name are the
node's name, plus every ``--host``), and for each ``--client`` a client
certificate whose common name is the user it logs in as with SASL EXTERNAL.
Keys are ECDSA P-256, written with mode 0600. Tests use the same functions.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DAYS = 825
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Authority:
    """A CA that signs: its certificate, key and where its PEM file is."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    path: Path


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    path.chmod(0o600)


def _name(common_name: str, organization: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(directory: Path, common_name: str = "brokerha CA", *,
            days: int = DEFAULT_DAYS, stem: str = "ca") -> Authority:
    """A new self-signed CA in ``DIR/<stem>.pem`` and ``DIR/<stem>.key``."""
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name, "brokerha")
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    path = directory / f"{stem}.pem"
    _write_key(directory / f"{stem}.key", key)
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Authority(cert, key, path)


def load_ca(directory: Path, stem: str = "ca") -> Authority | None:
    """The CA in ``DIR/<stem>.pem`` + ``.key``, or None if there is none."""
    pem, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    if not pem.exists() or not key_path.exists():
        return None
    cert = x509.load_pem_x509_certificate(pem.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: not an EC key (this tool makes P-256 keys)")
    return Authority(cert, key, pem)


def issue(ca: Authority, directory: Path, common_name: str, *, stem: str | None = None,
          hosts: tuple[str, ...] = (), client_only: bool = False,
          organization: str = "brokerha", days: int = DEFAULT_DAYS,
          not_before: datetime.datetime | None = None,
          not_after: datetime.datetime | None = None) -> tuple[Path, Path]:
    """A certificate signed by ``ca`` in ``DIR/<stem>.pem`` and its key in ``DIR/<stem>.key``.

    A node certificate (default) is for servers and clients, with the common
    name and ``hosts`` as subject alternative names; ``client_only`` makes a
    client certificate. ``not_before``/``not_after`` override the validity
    (tests make expired certificates with them).
    """
    stem = stem or common_name
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if not client_only:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name, organization))
               .issuer_name(ca.cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
               .not_valid_after(not_after or now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca.key.public_key()), critical=False))
    if not client_only:
        names: list[x509.GeneralName] = []
        for host in (common_name, *hosts):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(list(dict.fromkeys(names))),
                                        critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def make_certs(directory: Path, names: list[str], clients: list[str], *,
               hosts: tuple[str, ...] = DEFAULT_HOSTS, days: int = DEFAULT_DAYS) -> list[Path]:
    """The CA (reused if present), node and client certificates; the files written."""
    ca = load_ca(directory)
    written: list[Path] = []
    if ca is None:
        ca = make_ca(directory, days=days)
        written += [ca.path, directory / "ca.key"]
    for name in names:
        written += issue(ca, directory, name, hosts=hosts, days=days)
    for name in clients:
        written += issue(ca, directory, name, stem=f"client-{name}", client_only=True, days=days)
    return written


def cmd_make_certs(args: argparse.Namespace) -> int:
    hosts = tuple(dict.fromkeys([*DEFAULT_HOSTS, *(args.host or [])]))
    try:
        written = make_certs(args.dir, args.name or ["server"], args.client or [], hosts=hosts,
                             days=args.days)
    except (OSError, ValueError) as exc:
        print(f"brokerha tls make-certs: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tls_command", metavar="COMMAND", required=True)
    p = sub.add_parser("make-certs", help="a private CA (reused if DIR has one) and node and "
                       "client certificates signed by it")
    p.add_argument("dir", type=Path, metavar="DIR")
    p.add_argument("--name", action="append", metavar="NAME",
                   help="a node certificate NAME.pem/NAME.key (server and client use; CN and "
                        "DNS name NAME); repeatable, default: server")
    p.add_argument("--client", action="append", metavar="USER",
                   help="a client certificate client-USER.pem/.key with CN=USER (the user "
                        "SASL EXTERNAL logs in as); repeatable")
    p.add_argument("--host", action="append", metavar="HOST",
                   help="another DNS name or IP address for the node certificates (always: "
                        "localhost, 127.0.0.1, ::1)")
    p.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity (default 825)")
    p.set_defaults(handler=cmd_make_certs)
