"""The SIGKILL soak of issue 32, bounded: benchmarks/sigkill_soak.py's code under ``-m slow``.

Three real nodes with the shipped election timing, one pika publisher over all
URLs (TX of 10 persistent messages, or confirms), a queue nothing consumes;
the primary SIGKILLed and restarted a few times, then every node stopped and
its SQLite store read: every committed transaction (or confirmed message) is
on the final primary, nothing is partial, duplicated or held without having
been committed. The default suite's short version of this is
``test_tx_failover.py`` (two kills, every store read).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from sigkill_soak import SoakConfig, report, run_soak  # noqa: E402

pytestmark = pytest.mark.timeout(900)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tx", "confirm"])
def test_sigkill_soak_keeps_every_committed_unit_on_the_final_primary(mode: str) -> None:
    out = io.StringIO()
    result = run_soak(SoakConfig(mode=mode, kills=4, interval=3.0, seed=7,
                                 min_queue=40_000 if mode == "tx" else 15_000,
                                 max_time=400.0, settle_timeout=120.0), out)
    text = out.getvalue() + "\n" + report(result)
    print(text)
    assert len(result.kills) == 4, text
    assert result.committed > 100 and result.reconnects >= 4, text
    assert result.missing_on_final == 0, text
    assert result.partial == 0, text
    assert result.violations == 0, text
