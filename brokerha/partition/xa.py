"""XA (``amq.dtx``) on a node running partition groups (docs/ha.md "XA over partitions").

``NodeXa`` is the ``XaResource`` a client's channel drives on such a node
(``GroupClients.check_transactions``). A branch is built on the client's node
as on any node: ``start``/``end``/``set-timeout``/``get-timeout`` are the
broker's ``DtxManager``'s, its publishes and acknowledgements go into the
``DtxBranch``. At ``prepare`` (or a one-phase ``commit``) its queues decide:

- all of one partition group this node serves now, or of none: today's local
  XA branch (``DtxManager``), unchanged;
- anything else: the branch becomes a transaction across partitions
  (``GroupClients.tx_commit``, the same split and the same refusals as a
  TX's). A one-phase commit is exactly a TX commit (``XA_OK`` on commit-ok,
  ``XA_RBROLLBACK`` and why on a refusal); a ``prepare`` runs the prepare
  round with ``xa`` set: ``XA_OK`` once every partition prepared and the
  decider holds the transaction for the TM (rule (c), ``partition/xtx.py``).

A transaction held for its TM lives in its partitions only: its ``commit``
or ``rollback`` from any node finds it (the coordinator's memory here, else
every partition's leader) and runs the decision (``NodeTransactions.
xa_finish``); ``recover`` lists the local prepared branches and every
partition's held ones (``NodeTransactions.xa_recover``: ``XAER_RMFAIL`` if a
partition did not answer, never a short list).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from brokerha.broker.dtx import XA, DtxBranch, DtxManager, State, XAError, Xid
from brokerha.broker.errors import NotImplementedByBroker
from brokerha.broker.transaction import Transaction
from brokerha.broker.tx_outcomes import COMMITTED, ROLLED_BACK, UNKNOWN
from brokerha.partition.directory import Owner

if TYPE_CHECKING:
    from brokerha.partition.member import PartitionedMember
    from brokerha.partition.transactions import HeldXa, NodeTransactions


class XaClients(Protocol):
    """What a connection's XA resource manager asks of the node's clients
    (``partition/clients.py`` ``GroupClients``, which makes one per connection)."""

    member: PartitionedMember
    transactions: NodeTransactions | None

    def group_of_queue(self, vhost: str, name: str, arguments: Mapping[str, Any] | None,
                       exclusive: bool) -> int | None: ...

    def serves_group(self, group: int) -> bool: ...

    def after_durable_served(self, callback: Callable[[], None]) -> None: ...

    def tx_commit(self, client: object, tx: Transaction,
                  answer: Callable[[bool, str], None], *,
                  xa: str | None = None) -> Transaction | None: ...


def copy_work(source: Transaction, into: Transaction) -> Transaction:
    """``into`` given ``source``'s work: its publishes, accepts and rejects (requeued or
    not), in that order -- a branch run as a TX, a TX made again with an observer."""
    for queues, message in source.publishes:
        into.publish(list(queues), message)
    if source.accepts:
        into.accept(list(source.accepts), [])
    for requeue in (False, True):
        rejects = [(q, e) for q, e, r in source.rejects if r is requeue]
        if rejects:
            into.reject(rejects, requeue)
    return into


class NodeXa:
    """The XA resource manager of one client connection on a partitioned node."""

    def __init__(self, clients: XaClients, client: object) -> None:
        self.clients = clients
        self.client = client
        self.dtx: DtxManager = clients.member.broker.dtx

    @property
    def transactions(self) -> NodeTransactions:
        transactions = self.clients.transactions
        if transactions is None or transactions.coordinator is None:
            raise NotImplementedByBroker("an XA branch across partitions on this node (no "
                                         "coordinator: its name is too long for a gtxid)")
        return transactions

    def after_durable(self, callback: Callable[[], None]) -> None:
        """``callback`` once what every group this node serves did so far is durable there
        (each group's gate and barriers, ``GroupClients.after_durable_served``): the
        answer of a verb (``amqp/dtx_control.py``), whichever group its branch was in."""
        self.clients.after_durable_served(callback)

    # -- the branch, built here --------------------------------------------------------------

    def start(self, xid: Xid, owner: object, *, join: bool = False,
              resume: bool = False) -> DtxBranch:
        return self.dtx.start(xid, owner, join=join, resume=resume)

    def end(self, xid: Xid, owner: object, *, fail: bool = False,
            suspend: bool = False) -> XA:
        return self.dtx.end(xid, owner, fail=fail, suspend=suspend)

    def forget(self, xid: Xid) -> XA:
        return self.dtx.forget(xid)  # no heuristic decision is taken across partitions

    def set_timeout(self, xid: Xid, seconds: float) -> None:
        self.dtx.set_timeout(xid, seconds)

    def get_timeout(self, xid: Xid) -> float:
        return self.dtx.get_timeout(xid)

    def local(self, branch: DtxBranch) -> bool:
        """Whether ``branch`` is today's local XA: every queue it touches is of one group
        this node serves now, or of none (not another node's exclusive queue: refused as
        ``tx_commit`` refuses it)."""
        queues = ([q for queues, _ in branch.publishes for q in queues]
                  + [q for q, _ in branch.accepts] + [q for q, _, _ in branch.rejects])
        if any(isinstance(q.exclusive_owner, Owner) for q in queues):
            return False
        groups = {self.clients.group_of_queue(q.vhost, q.name, q.arguments,
                                              q.exclusive_owner is not None) for q in queues}
        groups.discard(None)
        return len(groups) <= 1 and all(self.clients.serves_group(g)
                                        for g in groups if g is not None)

    # -- prepare and commit ------------------------------------------------------------------

    def prepare(self, xid: Xid) -> Awaitable[XA]:
        branch = self.dtx.branches.get(xid)
        if branch is None or branch.state is not State.IDLE or self.local(branch):
            return self.dtx.prepare(xid)  # its errors and answers are today's
        return self._across(branch, xa=True)

    def commit(self, xid: Xid, *, one_phase: bool = False) -> Awaitable[XA]:
        branch = self.dtx.branches.get(xid)
        if branch is not None:
            if one_phase and branch.state is State.IDLE and not self.local(branch):
                return self._across(branch, xa=False)
            return self.dtx.commit(xid, one_phase=one_phase)
        if one_phase:
            return self.dtx.commit(xid, one_phase=True)  # XAER_NOTA
        return self._finish(xid, commit=True)

    def rollback(self, xid: Xid) -> XA | Awaitable[XA]:
        if xid in self.dtx.branches:
            return self.dtx.rollback(xid)
        return self._finish(xid, commit=False)

    def recover(self) -> Awaitable[list[Xid]]:
        local = self.dtx.recover()
        transactions = self.clients.transactions
        if transactions is None or transactions.coordinator is None:
            return _done(local)
        found: asyncio.Future[list[HeldXa] | None] = asyncio.get_running_loop().create_future()
        why: list[str] = []

        def answered(held: list[HeldXa] | None, reason: str) -> None:
            why.append(reason)
            if not found.done():
                found.set_result(held)

        transactions.xa_recover(answered)

        async def listed() -> list[Xid]:
            held = await found
            if held is None:
                raise XAError(XA.ER_RMFAIL, f"recover across partitions: {why[0]}")
            xids = list(local)
            for key, _, _ in held:
                xid = Xid.from_key(key)
                if xid not in xids:
                    xids.append(xid)
            return xids

        return listed()

    # -- across partitions ---------------------------------------------------------------------

    def _across(self, branch: DtxBranch, *, xa: bool) -> Awaitable[XA]:
        """The branch as a transaction across partitions: refused (540, raised here, before
        anything is sent) as ``tx_commit`` refuses a TX; else the branch is dropped here
        (its acknowledged entries handed over, not requeued) and the rounds run."""
        self.transactions  # noqa: B018 -- raises (540) on a node with no coordinator
        tx = copy_work(branch, self.clients.member.broker.new_transaction())  # as a TX's
        answer: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()

        def answered(ok: bool, reason: str) -> None:
            if not answer.done():
                answer.set_result((ok, reason))

        try:
            local = self.clients.tx_commit(self.client, tx, answered,
                                           xa=branch.xid.key if xa else None)
        except BaseException:
            tx.rollback()
            self._drop(branch, requeue=True)  # refused whole: nothing of it stays
            raise
        if local is not None:  # cannot be: ``local`` said it spans partitions
            local.rollback()
            self._drop(branch, requeue=True)
            raise XAError(XA.ER_RMERR, f"xid {branch.xid.key}: its queues changed groups")
        self._drop(branch, requeue=False)  # the coordinator has it now

        async def decided() -> XA:
            ok, reason = await answer
            if not ok:
                raise XAError(XA.RBROLLBACK, reason)
            return XA.OK

        return decided()

    def _drop(self, branch: DtxBranch, *, requeue: bool) -> None:
        """The local branch goes (its tx-queue's ``tr`` to the backups); its acknowledged
        entries are requeued, or left acquired for the partitions' branches."""
        self.dtx.branches.pop(branch.xid, None)
        if requeue:
            branch.rollback()
        else:
            Transaction.rollback(branch)

    def _finish(self, xid: Xid, *, commit: bool) -> Awaitable[XA]:
        transactions = self.clients.transactions
        if transactions is None or transactions.coordinator is None:
            raise XAError(XA.ER_NOTA, f"unknown xid {xid.key}")
        answer: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()

        def answered(outcome: str, reason: str) -> None:
            if not answer.done():
                answer.set_result((outcome, reason))

        transactions.xa_finish(xid.key, commit, answered)

        async def finished() -> XA:
            outcome, reason = await answer
            if outcome == UNKNOWN:
                raise XAError(XA.ER_NOTA, f"unknown xid {xid.key}: {reason}")
            if outcome == COMMITTED:
                if commit:
                    return XA.OK
                raise XAError(XA.HEURCOM, f"xid {xid.key} was committed: {reason}")
            if outcome == ROLLED_BACK:
                if not commit:
                    return XA.OK
                raise XAError(XA.RBROLLBACK, f"xid {xid.key} was rolled back: {reason}")
            raise XAError(XA.ER_RMFAIL, f"xid {xid.key}: {reason}")

        return finished()


async def _done(xids: list[Xid]) -> list[Xid]:
    return xids
