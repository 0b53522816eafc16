"""The ``brokerha`` command: one entry point, one sub-command module per area.

Each area registers its own sub-commands through a ``register(subparsers)``
function in its ``cli`` module, imported lazily so that, for example, no
PySpark import happens unless a ``pipeline`` command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# sub-command name -> module with register(subparsers) and the handlers
AREAS: dict[str, tuple[str, str]] = {
    "node": ("brokerha.node", "run one broker node in the foreground"),
    "cluster": ("brokerha.admin.cluster_cli", "a local HA cluster on loopback; HA simulation"),
    "ctl": ("brokerha.admin.ctl", "status and operator actions on running nodes"),
    "txlog": ("brokerha.txlog.cli", "TxLog tools: deterministic simulation, export"),
    "tls": ("brokerha.certs", "TLS set-up: make a CA and node/client certificates"),
    "pipeline": ("brokerha.pipeline.cli", "PySpark audit, replay-plan, check-history, stats"),
    "native": ("brokerha.native", "the hot modules compiled with mypyc: build, status, clean"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brokerha", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in AREAS.items():
        if wanted == name:
            importlib.import_module(module).register(sub.add_parser(name, help=help_text))
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:  # area parsed without its module (e.g. `brokerha --help`)
        build_parser([args.command]).parse_args([args.command, "--help"])
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
