"""The safety and liveness properties the simulation checks (design/txlog-safety.md).

* S1 prefix: two masters of the same generation that have not dropped each
  other hold synchronised queues where one is a prefix of the other;
* S2 no loss: no acquired transaction disappears from every master (a
  transaction renegotiated after a split lives on as its ``replay_of`` successor);
* S3 no duplicate: no id twice in a synchronised queue, and never both a
  transaction and its renegotiated copy;
* L convergence: once healed, every synchronised queue is equal and complete.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from brokerha.txlog.engine.queues import SynchronisedQueue
from brokerha.txlog.engine.state import DurableState


def is_prefix_pair(a: SynchronisedQueue, b: SynchronisedQueue) -> bool:
    short, long = (a, b) if len(a) <= len(b) else (b, a)
    return long.digest_at(len(short)) == short.merge_base().digest


def check_prefix(states: Mapping[str, DurableState], changed: Iterable[str]) -> str | None:
    """S1 for every pair involving a master whose queue changed."""
    for m in changed:
        a = states[m]
        for n, b in states.items():
            if n == m or a.generation != b.generation:
                continue
            if n not in a.members or m not in b.members:
                continue
            if not is_prefix_pair(a.sync, b.sync):
                return f"S1 prefix: {m} and {n} diverged ({len(a.sync)} vs {len(b.sync)} entries)"
    return None


def check_no_duplicate(states: Mapping[str, DurableState], changed: Iterable[str]) -> str | None:
    """S3: ids unique, and no transaction next to its own renegotiated copy."""
    for m in changed:
        sync = states[m].sync
        ids = sync.ids()
        if len(set(ids)) != len(ids):
            return f"S3 duplicate: an id appears twice in {m}'s synchronised queue"
        for record in sync.records():
            if record.replay_of and sync.contains(record.replay_of):
                return f"S3 duplicate: {m} holds {record.replay_of} and its replay {record.tx_id}"
    return None


def check_no_loss(created: Iterable[str], holders: Iterable[set[str]], replaced: Mapping[str, str]) -> str | None:
    """S2: every acquired id (or the replay that replaced it) is held by some master."""
    held: set[str] = set().union(*holders)
    for tx_id in created:
        current = tx_id
        while current not in held and current in replaced:
            current = replaced[current]
        if current not in held:
            return f"S2 loss: transaction {tx_id} is held by no master"
    return None


def converged(states: Mapping[str, DurableState], created: Iterable[str], replaced: Mapping[str, str]) -> str | None:
    """L: None when every queue is equal and holds every transaction; else why not."""
    bases = {m: s.sync.merge_base() for m, s in states.items()}
    if len({(b.length, b.digest) for b in bases.values()}) != 1:
        return "queues differ: " + ", ".join(f"{m}={b.length}" for m, b in sorted(bases.items()))
    any_state = next(iter(states.values()))
    held = set(any_state.sync.ids())
    for tx_id in created:
        current = tx_id
        while current not in held and current in replaced:
            current = replaced[current]
        if current not in held:
            return f"transaction {tx_id} not synchronised"
    return None
