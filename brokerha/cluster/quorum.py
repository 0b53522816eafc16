"""When is something the primary did safe to confirm? One rule, used everywhere.

The primary numbers every replicated event with a sequence number (its log
index). An event at ``seq`` is *replicated* when

1. every guarded backup (a ready backup, or one catching up behind a QueueGuard:
   anything published after it subscribed waits for it too) has acknowledged
   ``seq`` -- so "every ready backup holds the data" (architecture.md), and no
   backup becomes ready with a gap; and
2. a majority of the datacenter's configured nodes, the primary included, holds
   it -- so any majority that elects the next primary contains a node with it,
   and that node votes only for a candidate at least as advanced (election.py).

A backup that owes an acknowledgement past ``backup_timeout`` (or, sending
nothing at all while another backup is heard, past ``backup_unheard_timeout``)
leaves the guarded set (logged, shown in status), and comes back once it
acknowledged everything that may have been confirmed meanwhile
(``Primary.tick``, ``Primary._readmit``); it cannot leave the majority count, so
a primary that lost its majority confirms nothing. Leaving the guarded set only
stops confirms waiting for *every* backup: rule 2 alone decides then.

Nothing is replicated, not even seq 0, before a majority acknowledged
something of this primary: its state at seq 0 is what it inherited, which it
may hold alone (it was elected ahead of voters that lack its last events). A
new primary therefore answers nothing that rests on that state (an XA
recover, an outcome, a declare-ok) until its backups caught up, as a Raft
leader commits an entry of its own term before serving (found by the
transaction simulation: a TM read a commit only the new primary held, and the
next election lost it).

The primary and the deterministic simulation both call ``replicated_seq``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def majority(members: int) -> int:
    """Votes (or copies) needed out of ``members`` configured nodes."""
    return members // 2 + 1


def replicated_seq(primary_seq: int, acked: Mapping[str, int], guarded: Collection[str],
                   members: int) -> int:
    """The highest sequence number that is replicated by the rule above.

    ``primary_seq``: what the primary itself holds durably; ``acked``: each
    connected backup's cumulative acknowledgement; ``guarded``: the backups
    every event must reach; ``members``: configured nodes in the datacenter.
    """
    limit = primary_seq
    for node in guarded:
        limit = min(limit, acked.get(node, 0))
    need = majority(members) - 1  # backups besides the primary
    if need <= 0:
        return limit
    copies = sorted((min(seq, primary_seq) for seq in acked.values()), reverse=True)
    if len(copies) < need:
        return -1  # not even the inherited state (seq 0) is on a majority yet
    return min(limit, copies[need - 1])
