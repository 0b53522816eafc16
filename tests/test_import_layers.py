"""The import-layer contract: every import in brokerha runs down the floors, never up.

docs/architecture.md draws these floors. A module may import from its own
package and from any package on a lower floor; packages on the same floor do
not import each other. Imports under ``if TYPE_CHECKING:`` count too (a type
that must come from above is a join that wants a Protocol on the lower floor).
A change that needs an import up a floor breaks this test: move the shared
part down, or hand the upper object in (an observer, a callback, a Protocol).
"""

from __future__ import annotations

import ast
from pathlib import Path

import brokerha

ROOT = Path(brokerha.__file__).parent

# top floor first; each entry is a subpackage or a top-level module of brokerha
FLOORS: list[set[str]] = [
    {"cli"},
    {"node", "pipeline", "testing_containers", "client"},
    {"testing_postgres"},
    {"testing"},
    {"admin"},
    {"txlog", "partition"},
    {"ha"},
    {"primary"},
    {"backup", "amqp"},
    {"store", "httpapi"},
    {"broker"},
    {"cluster"},
    {"files", "seed_runner", "certs", "tls_start", "slices", "gc_hooks", "thread_priority",
     "__init__"},
    {"native"},
]

FLOOR_OF = {unit: depth for depth, units in enumerate(FLOORS) for unit in units}


def unit_of(module: str) -> str:
    """``brokerha.txlog.engine.rounds`` -> ``txlog``; ``brokerha`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) of every brokerha import in ``path``, relative ones resolved."""
    package = ".".join(("brokerha", *path.relative_to(root).with_suffix("").parts[:-1]))
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("brokerha")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            if module == "brokerha":  # ``from brokerha import seed_runner``
                found += [(node.lineno, f"brokerha.{a.name}") if a.name in FLOOR_OF
                          else (node.lineno, module) for a in node.names]
            elif module.startswith("brokerha."):
                found.append((node.lineno, module))
    return found


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        source = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for line, module in imports(path, root):
            target = unit_of(module)
            if target == source:
                continue
            where = f"brokerha/{rel}:{line} imports {module}"
            if source not in FLOOR_OF or target not in FLOOR_OF:
                found.append(f"{where}: {source if source not in FLOOR_OF else target} "
                             "is on no floor (add it to FLOORS and docs/architecture.md)")
            elif FLOOR_OF[target] <= FLOOR_OF[source]:
                relation = "the same floor" if FLOOR_OF[target] == FLOOR_OF[source] else "a floor up"
                found.append(f"{where}: {target} is on {relation} from {source}")
    return found


def test_every_package_is_on_a_floor() -> None:
    units = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units |= {p.stem for p in ROOT.glob("*.py")}
    assert units == set(FLOOR_OF)


KNOWN: set[str] = set()  # known violations, to be removed (none now)


def test_no_import_runs_up_a_floor() -> None:
    found = violations()
    unknown = [v for v in found if not any(_matches(v, k) for k in KNOWN)]
    assert unknown == []
    assert {k for k in KNOWN if any(_matches(v, k) for v in found)} == KNOWN, \
        "a known violation is gone: take it off KNOWN"


def _matches(violation: str, known: str) -> bool:
    path, module = known.split(" imports ")
    return violation.startswith(path + ":") and f" imports {module}:" in violation


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The contract is not vacuous: an import from the broker model up into HA is caught."""
    (tmp_path / "broker").mkdir()
    (tmp_path / "broker" / "queue.py").write_text(
        "from brokerha.cluster import replication\n"
        "from brokerha.primary.primary import Primary\n"
        "from . import message\n")
    (tmp_path / "backup").mkdir()
    (tmp_path / "backup" / "backup.py").write_text("from ..amqp import channel\n")
    assert violations(tmp_path) == [
        "brokerha/backup/backup.py:1 imports brokerha.amqp: amqp is on the same floor from backup",
        "brokerha/broker/queue.py:2 imports brokerha.primary.primary: primary is on a floor up "
        "from broker",
    ]


# Inside txlog/, by role, top first: its command, the simulations (of the engine, and of the
# bridge in an HA datacenter), the broker integration, the master process, the sans-I/O round
# engine at the bottom.
TXLOG_ROLES: list[set[str]] = [{"cli"}, {"simulation"}, {"bridge"}, {"master"}, {"engine"}]
TXLOG_ROLE_OF = {role: depth for depth, roles in enumerate(TXLOG_ROLES) for role in roles}


def txlog_role_violations(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / "txlog").rglob("*.py")):
        rel = path.relative_to(root / "txlog")
        source = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if source == "__init__":
            continue
        for line, module in imports(path, root):
            parts = module.split(".")
            if parts[:2] != ["brokerha", "txlog"] or len(parts) < 3:
                continue
            target = parts[2]
            if target == source:
                continue
            where = f"brokerha/txlog/{rel}:{line} imports {module}"
            if source not in TXLOG_ROLE_OF or target not in TXLOG_ROLE_OF:
                found.append(f"{where}: a txlog module outside the roles (add it to TXLOG_ROLES)")
            elif TXLOG_ROLE_OF[target] <= TXLOG_ROLE_OF[source]:
                found.append(f"{where}: {target} is not below {source}")
    return found


def test_txlog_is_arranged_by_role_and_imports_run_down() -> None:
    roles = {p.name for p in (ROOT / "txlog").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert roles | {"cli"} == set(TXLOG_ROLE_OF)
    assert txlog_role_violations() == []


def floors_drawn(doc: Path) -> list[set[str]]:
    """The floors docs/architecture.md draws: each block between ``↓`` lines, its units the
    names that start a line (``node/``, ``files.py``), up to the description."""
    text = doc.read_text()
    block = text.split("## Floors", 1)[1].split("```", 2)[1]
    floors: list[set[str]] = [set()]
    for line in block.splitlines():
        if line.strip() == "↓":
            floors.append(set())
        elif line and not line[0].isspace():
            names = line.split("  ", 1)[0].split()
            floors[-1].update(n.rstrip("/").removesuffix(".py") for n in names)
    return floors


def test_the_floors_docs_architecture_draws_are_this_table() -> None:
    drawn = floors_drawn(ROOT.parent / "docs" / "architecture.md")
    assert drawn == FLOORS
