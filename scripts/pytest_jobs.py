"""Run the test suite as two pytest processes at once, on disjoint halves of tests/.

``scripts/test`` calls this. Most of the suite's time is real processes waiting (clusters
electing, nodes killed and restarted, a Spark or RabbitMQ node starting), so two sessions
side by side on the 2-core CI machine take about half the time of one (README, "Quick
start"). The halves are whole directories, so that each directory's session resources --
the private RabbitMQ node of tests/differential, the Docker engine of tests/ops, the Spark
session of tests/pipeline -- are started once, by one session: ``FIRST`` (the failover,
TxLog, TLS and DTX suites: real clusters) and everything else under tests/ (new
directories go there by themselves). The split is by the measured durations of
``--durations=0`` (failover 643 s + txlog 76 + tls 31 + dtx 19 against the rest's ~765 s,
2026-11-29); move a directory when one half grows.

Both sessions get the same pytest arguments (``-m slow``, ``-k``, ``--durations``...).
Arguments naming a test path (``tests/ha``, ``tests/x.py::test_y``) run one session on
exactly those, as before; so does ``BROKERHA_TEST_JOBS=1``. The first half's output is
shown as it comes, the second's when it ends (it is written to a log meanwhile, named in
the output). Each session starts its nodes on its own ports (``stripe_env``). Exit
status: 0 only if both passed; pytest's 5 (no test collected) counts as a failure unless
the other session ran tests (one half may hold no slow test); 1 if both collected nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from brokerha.testing import STRIPE_ENV  # noqa: E402

TESTS = ROOT / "tests"
FIRST = ("failover", "txlog", "tls", "dtx")
NO_TESTS = 5  # pytest's exit status when nothing was collected


# pytest's options whose value is the next argument (``-k tests`` names no path)
TAKES_A_VALUE = frozenset(("-k", "-m", "-p", "-o", "-c", "-W", "--durations", "--timeout",
                           "--maxfail", "--deselect", "--ignore", "--ignore-glob",
                           "--rootdir", "--basetemp", "--confcutdir", "--junit-xml", "--tb"))


def names_a_path(args: Sequence[str]) -> bool:
    """Whether an argument is a test path (a file, a directory, a node id), not an option
    or an option's value such as ``-m slow``'s."""
    previous = ""
    for a in args:
        path = a.split("::")[0]
        if (previous not in TAKES_A_VALUE and not a.startswith("-") and path not in ("", ".")
                and (ROOT / path).exists()):
            return True
        previous = a
    return False


def halves(tests: Path = TESTS, first: Sequence[str] = FIRST) -> tuple[list[str], list[str]]:
    """The test paths of each session, relative to the project root: ``first``'s
    directories, then every other test directory and top-level test module."""
    a = [f"tests/{d}" for d in first if (tests / d).is_dir()]
    b = sorted(f"tests/{p.name}" for p in tests.iterdir()
               if p.name not in first and not p.name.startswith(("_", "."))
               and ((p.is_dir() and any(p.rglob("test_*.py")))
                    or (p.is_file() and p.name.startswith("test_") and p.suffix == ".py")))
    return a, b


def combined(codes: Sequence[int]) -> int:
    """One exit status for the sessions' own."""
    if all(c == NO_TESTS for c in codes):
        return 1
    bad = [c for c in codes if c not in (0, NO_TESTS)]
    return bad[0] if bad else 0


def stripe_env(session: int) -> dict[str, str]:
    """The environment of one of the two sessions: its own stripe of the test ports
    (``brokerha.testing.free_base_port``), so the two never start nodes on one port."""
    return {**os.environ, STRIPE_ENV: f"{session}/2"}


def main(argv: Sequence[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    if names_a_path(argv) or os.environ.get("BROKERHA_TEST_JOBS", "2") == "1":
        rc = subprocess.call([*pytest, *argv], cwd=ROOT)
        if rc == NO_TESTS:
            print("pytest collected no tests: failing on purpose", file=sys.stderr)
            return 1
        return rc
    a, b = halves()
    start = time.monotonic()
    with tempfile.NamedTemporaryFile("w+", prefix="brokerha-tests-second-half-",
                                     suffix=".log", delete=False) as log:
        print(f"tests: two sessions at once; the second ({' '.join(b)}) writes to {log.name}"
              " and is shown when it ends", flush=True)
        second = subprocess.Popen([*pytest, *argv, *b], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, env=stripe_env(1))
        try:
            first_rc = subprocess.call([*pytest, *argv, *a], cwd=ROOT, env=stripe_env(0))
            first_done = time.monotonic() - start
            second_rc = second.wait()
        except BaseException:
            second.terminate()
            second.wait()
            raise
        log.seek(0)
        print(f"\n===== second session ({' '.join(b)}) =====", flush=True)
        sys.stdout.write(log.read())
    os.unlink(log.name)
    rc = combined([first_rc, second_rc])
    print(f"\ntests: first session exit {first_rc} ({first_done:.0f} s), second exit "
          f"{second_rc}; {time.monotonic() - start:.0f} s in all", flush=True)
    if rc and NO_TESTS in (first_rc, second_rc) and first_rc == second_rc:
        print("pytest collected no tests: failing on purpose", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
