"""DTX: XA transaction branches, as a state machine the broker drives.

Each branch (identified by an XA xid) is a Transaction whose phases the
transaction manager calls separately: start/end associate channels with it,
prepare makes it durable and votes, commit/rollback finish it. The rules and
error codes are X/Open XA's (and Qpid's dtx class): an illegal verb raises
XAError with the code the TM expects; ``tick`` times branches out.

A prepared branch is written to the store before prepare answers XA_OK, and
comes back after a restart in the prepared state (``restore_prepared``), to be
listed by ``recover`` and finished by the TM.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from brokerha.broker.transaction import Transaction
from brokerha.broker.tx_outcomes import group_of, in_group

if TYPE_CHECKING:
    from brokerha.broker.message import Entry
    from brokerha.broker.observers import TransactionObserverFactory
    from brokerha.broker.queue import Queue

log = logging.getLogger(__name__)


class XA(enum.IntEnum):
    """XA return codes (xa.h)."""

    OK = 0
    RDONLY = 3
    HEURHAZ = 8
    HEURCOM = 7
    HEURRB = 6
    HEURMIX = 5
    RBROLLBACK = 100
    RBTIMEOUT = 106
    ER_RMERR = -3
    ER_NOTA = -4
    ER_INVAL = -5
    ER_PROTO = -6
    ER_RMFAIL = -7
    ER_DUPID = -8

    @property
    def label(self) -> str:
        return ("XAER_" + self.name[3:]) if self.name.startswith("ER_") else "XA_" + self.name


class XAError(Exception):
    def __init__(self, code: XA, text: str) -> None:
        super().__init__(f"{code.label}: {text}")
        self.code = code
        self.text = text


@dataclass(frozen=True)
class Xid:
    format_id: int
    gtrid: bytes
    bqual: bytes = b""

    def __post_init__(self) -> None:
        if len(self.gtrid) > 64 or len(self.bqual) > 64 or not self.gtrid:
            raise XAError(XA.ER_INVAL, "gtrid must be 1-64 bytes and bqual at most 64 bytes")

    @property
    def key(self) -> str:
        """A stable text form, for logs and the store."""
        return f"{self.format_id}:{self.gtrid.hex()}:{self.bqual.hex()}"

    @classmethod
    def from_key(cls, key: str) -> Xid:
        fmt, gtrid, bqual = key.split(":")
        return cls(int(fmt), bytes.fromhex(gtrid), bytes.fromhex(bqual))


# An XA format id of brokerha's own: a branch of a transaction across partitions
# (``brokerha/partition/xtx.py``), whose xid carries all a new primary needs to resolve it:
# gtrid the gtxid, bqual ``<partition>/<decider>/<participants>``.
XTX_FORMAT = 0x78747831  # "xtx1"
_XTX_BQUAL = re.compile(rb"\d+/\d+/\d+(,\d+)*")


def xtx_txid(partition: int, gtxid: str) -> str:
    """The name of partition ``partition``'s branch of ``gtxid``: its transaction id, its
    tx-queue's and its outcome record's, the same on every node of the partition's group
    (group ``partition + 1``, ``tx_outcomes.group_of``)."""
    return in_group(partition + 1, f"xtx:{gtxid}")


def is_xtx_txid(txid: str) -> bool:
    """Whether ``txid`` names a cross-partition branch (``xtx_txid``)."""
    return group_of(txid) > 0 and txid.partition("/")[2].startswith("xtx:")


def xtx_partition(xid: Xid) -> int | None:
    """The partition of a cross-partition branch's xid, None for any other xid."""
    if xid.format_id != XTX_FORMAT or not _XTX_BQUAL.fullmatch(xid.bqual) \
            or not xid.gtrid.isascii():
        return None  # a TM's xid of that format: not ours
    return int(xid.bqual.split(b"/", 1)[0])


class State(enum.Enum):
    ACTIVE = "active"  # associated with at least one channel
    SUSPENDED = "suspended"
    IDLE = "idle"  # ended with success, not yet prepared
    ROLLBACK_ONLY = "rollback-only"  # ended with fail, or timed out
    PREPARED = "prepared"
    HEURISTIC_COMMIT = "heuristic-commit"
    HEURISTIC_ROLLBACK = "heuristic-rollback"


class DtxBranch(Transaction):
    """One XA branch: a Transaction with an xid, a state and a deadline."""

    def __init__(self, xid: Xid, factories: list[TransactionObserverFactory], now: float,
                 timeout: float, on_outcome: Any = None) -> None:
        # before the observers are created: they name the tx-queue by the xid, and a
        # prepared branch (restored, adopted) is set PREPARED only after this
        self.xid = xid
        self.state = State.ACTIVE
        partition = xtx_partition(xid)
        super().__init__(f"dtx:{xid.key}" if partition is None else xtx_txid(partition, xid.gtrid.decode()),
                         factories, on_outcome=on_outcome)
        # the replication group whose log holds the branch (broker/placement.py): a
        # cross-partition branch's is in its name; another's is set by the scoped HA
        # primary that replicates it (None: no group's yet, or an unpartitioned node)
        self.group: int | None = None if partition is None else group_of(self.id)
        self.associated: set[object] = set()
        self.started = now
        self.timeout = timeout
        self.rollback_reason = XA.RBROLLBACK
        self.preparing = False  # a prepare (or one-phase commit) awaits its votes

    def rollback(self) -> None:
        """Discard the work; dequeued entries the branch held go back to their queues."""
        accepted = [(q, e) for q, e in self.accepts] + [(q, e) for q, e, _ in self.rejects]
        super().rollback()
        for queue, entry in accepted:
            queue.requeue(entry)


Persist = Callable[[DtxBranch, Callable[[], None]], None]


class XaResource(Protocol):
    """What the ``amq.dtx`` verbs (``amqp/dtx_control.py``) drive: a broker's
    ``DtxManager``, or on a node running partition groups its ``partition/xa.py``
    ``NodeXa``, whose ``rollback`` and ``recover`` may have to ask other nodes (an
    awaitable then)."""

    def start(self, xid: Xid, owner: object, *, join: bool = False,
              resume: bool = False) -> DtxBranch: ...

    def end(self, xid: Xid, owner: object, *, fail: bool = False,
            suspend: bool = False) -> XA: ...

    def prepare(self, xid: Xid) -> Awaitable[XA]: ...

    def commit(self, xid: Xid, *, one_phase: bool = False) -> Awaitable[XA]: ...

    def rollback(self, xid: Xid) -> XA | Awaitable[XA]: ...

    def recover(self) -> list[Xid] | Awaitable[list[Xid]]: ...

    def forget(self, xid: Xid) -> XA: ...

    def set_timeout(self, xid: Xid, seconds: float) -> None: ...

    def get_timeout(self, xid: Xid) -> float: ...


class DtxManager:
    """All branches of one broker (XA resource manager)."""

    def __init__(self, factories: list[TransactionObserverFactory], clock: Callable[[], float],
                 *, default_timeout: float = 0.0, max_timeout: float = 3600.0) -> None:
        self.factories = factories
        self.clock = clock
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout
        self.branches: dict[Xid, DtxBranch] = {}
        # store hooks: persist a prepared branch (then call back), forget a finished one
        self.persist_prepared: Persist = lambda branch, done: done()
        self.forget_prepared: Callable[[Xid], None] = lambda xid: None
        self.on_outcome: Any = None  # Broker._record_outcome

    def _branch(self, xid: Xid) -> DtxBranch:
        branch = self.branches.get(xid)
        if branch is None:
            raise XAError(XA.ER_NOTA, f"unknown xid {xid.key}")
        return branch

    # -- association -------------------------------------------------------------------

    def start(self, xid: Xid, owner: object, *, join: bool = False,
              resume: bool = False) -> DtxBranch:
        if join and resume:
            raise XAError(XA.ER_INVAL, "join and resume are exclusive")
        branch = self.branches.get(xid)
        if not (join or resume):
            if branch is not None:
                raise XAError(XA.ER_DUPID, f"xid {xid.key} already known")
            branch = DtxBranch(xid, self.factories, self.clock(), self.default_timeout,
                               self.on_outcome)
            self.branches[xid] = branch
        elif branch is None:
            raise XAError(XA.ER_NOTA, f"unknown xid {xid.key}")
        elif resume and branch.state is not State.SUSPENDED:
            raise XAError(XA.ER_PROTO, f"xid {xid.key} is {branch.state.value}, not suspended")
        elif join and branch.state not in (State.ACTIVE, State.IDLE):
            raise XAError(XA.ER_PROTO, f"cannot join xid {xid.key} in state {branch.state.value}")
        if branch.state is State.ROLLBACK_ONLY:
            raise XAError(branch.rollback_reason, f"xid {xid.key} is marked rollback-only")
        branch.associated.add(owner)
        branch.state = State.ACTIVE
        return branch

    def end(self, xid: Xid, owner: object, *, fail: bool = False,
            suspend: bool = False) -> XA:
        if fail and suspend:
            raise XAError(XA.ER_INVAL, "fail and suspend are exclusive")
        branch = self._branch(xid)
        if owner not in branch.associated:
            raise XAError(XA.ER_PROTO, f"xid {xid.key} is not associated with this channel")
        branch.associated.discard(owner)
        if branch.state is State.ROLLBACK_ONLY:
            return branch.rollback_reason
        if fail:
            self._mark_rollback_only(branch, XA.RBROLLBACK)
            return XA.RBROLLBACK
        if suspend:
            branch.state = State.SUSPENDED
        elif not branch.associated:
            branch.state = State.IDLE
        return XA.OK

    def owner_gone(self, owner: object) -> None:
        """A channel closed while associated: its branches can only roll back."""
        for branch in list(self.branches.values()):
            if owner in branch.associated:
                branch.associated.discard(owner)
                if branch.state in (State.ACTIVE, State.SUSPENDED):
                    self._mark_rollback_only(branch, XA.RBROLLBACK)

    def _mark_rollback_only(self, branch: DtxBranch, reason: XA) -> None:
        branch.state = State.ROLLBACK_ONLY
        branch.rollback_reason = reason

    # -- completion ---------------------------------------------------------------------

    def _finish_rollback_only(self, branch: DtxBranch) -> XA:
        branch.rollback()
        del self.branches[branch.xid]
        return branch.rollback_reason

    async def _prepare(self, branch: DtxBranch) -> bool:
        """The branch's prepare round; XAER_RMFAIL if the branch was taken away meanwhile.

        On an HA node that stopped being the primary while the votes came in,
        the branch is no longer this node's to finish (``drop_unprepared``, or
        a new primary's catch-up replaced the state): the TM asks the new
        primary's ``recover``.
        """
        branch.preparing = True
        try:
            ok = await branch.prepare()
        finally:
            branch.preparing = False
        if self.branches.get(branch.xid) is not branch:
            raise XAError(XA.ER_RMFAIL, f"xid {branch.xid.key} was lost while it prepared: "
                                     "this node no longer serves it")
        return ok

    async def prepare(self, xid: Xid) -> XA:
        branch = self._branch(xid)
        if branch.state is State.ROLLBACK_ONLY:
            return self._finish_rollback_only(branch)
        if branch.state is not State.IDLE:
            raise XAError(XA.ER_PROTO, f"cannot prepare xid {xid.key} in state {branch.state.value}")
        if branch.empty:
            branch.rollback()
            del self.branches[xid]
            return XA.RDONLY
        if not await self._prepare(branch):
            return self._finish_rollback_only(branch)
        # durable before the TM hears XA_OK: after a crash, recover must list it
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def durable() -> None:
            if not written.done():
                written.set_result(None)
        self.persist_prepared(branch, durable)
        await written
        if self.branches.get(xid) is not branch:
            # taken away while its record was written (this node stopped being the HA
            # primary: primary_stopped rolled it back): the record goes too, or a restart
            # would bring back, prepared, a branch whose work is gone
            self.forget_prepared(xid)
            raise XAError(XA.ER_RMFAIL, f"xid {xid.key} was lost while it prepared: this "
                                        "node no longer serves it")
        branch.state = State.PREPARED
        return XA.OK

    async def commit(self, xid: Xid, *, one_phase: bool = False) -> XA:
        branch = self._branch(xid)
        heuristic = self._heuristic(branch)
        if heuristic is not None:
            return heuristic
        if branch.state is State.ROLLBACK_ONLY:
            return self._finish_rollback_only(branch)
        if one_phase:
            if branch.state is not State.IDLE:
                raise XAError(XA.ER_PROTO,
                              f"one-phase commit of xid {xid.key} in state {branch.state.value}")
            if branch.observers and not await self._prepare(branch):
                return self._finish_rollback_only(branch)
        elif branch.state is not State.PREPARED:
            raise XAError(XA.ER_PROTO, f"two-phase commit of xid {xid.key} that is not prepared")
        self._commit(branch, forget=not one_phase)
        return XA.OK

    def commit_prepared(self, xid: Xid) -> None:
        """The two-phase commit of a PREPARED branch, in this loop callback (``commit``
        awaits nothing on that path; a caller that is no coroutine calls this)."""
        branch = self._branch(xid)
        if branch.state is not State.PREPARED:
            raise XAError(XA.ER_PROTO, f"two-phase commit of xid {xid.key} that is not prepared")
        self._commit(branch, forget=True)

    def _commit(self, branch: DtxBranch, *, forget: bool) -> None:
        del self.branches[branch.xid]
        branch.commit_prepared()
        if forget:
            self.forget_prepared(branch.xid)

    def rollback(self, xid: Xid) -> XA:
        branch = self._branch(xid)
        heuristic = self._heuristic(branch)
        if heuristic is not None:
            return heuristic
        if branch.state is State.ACTIVE:
            raise XAError(XA.ER_PROTO, f"xid {xid.key} is still associated with a channel")
        was_prepared = branch.state is State.PREPARED
        del self.branches[xid]
        branch.rollback()
        if was_prepared:
            self.forget_prepared(xid)
        return XA.OK

    def primary_stopped(self, group: int | None = None) -> list[Xid]:
        """This node stopped being the HA primary: its branches lose what bound them to it.

        ``group``: a partitioned node's replication group whose primary stopped
        (``DtxBranch.group``); only that group's branches are touched, the
        other groups' primaries on this node keep theirs. None: every branch
        (an unpartitioned node's one primary).

        A branch that is not prepared is rolled back: nothing of it was
        replicated (a branch is replicated from its prepare on), so no later
        primary has it, this node included if it is elected again; its held
        entries go back to their queues now, before a new primary's catch-up
        copies them, and its TM gets XAER_NOTA. A branch whose prepare awaits
        its votes is left to that prepare, which the stopped primary fails.
        A prepared branch keeps its record but drops its observers (they were
        the stopped primary's): the verification of this node's next primary
        role gives it new ones, so its commit replicates as a transaction.
        Returns the branches rolled back.
        """
        dropped = []
        for xid, branch in list(self.branches.items()):
            if group is not None and branch.group != group:
                continue
            if branch.state is State.PREPARED:
                branch.observers = []
            elif not branch.preparing and branch.state not in (State.HEURISTIC_COMMIT,
                                                                 State.HEURISTIC_ROLLBACK):
                del self.branches[xid]
                branch.rollback()
                dropped.append(xid)
        return dropped

    def _heuristic(self, branch: DtxBranch) -> XA | None:
        if branch.state is State.HEURISTIC_COMMIT:
            return XA.HEURCOM
        if branch.state is State.HEURISTIC_ROLLBACK:
            return XA.HEURRB
        return None

    def decide(self, xid: Xid, commit: bool) -> None:
        """An operator finishes an in-doubt branch unilaterally (a heuristic outcome).

        The TM learns it through XA_HEURCOM / XA_HEURRB and must then forget the branch.
        """
        branch = self._branch(xid)
        if branch.state is not State.PREPARED:
            raise XAError(XA.ER_PROTO, f"only a prepared branch can be decided, xid {xid.key}")
        if commit:
            branch.commit_prepared()
            branch.state = State.HEURISTIC_COMMIT
        else:
            branch.rollback()
            branch.state = State.HEURISTIC_ROLLBACK
        log.warning("xid %s decided by operator: heuristic %s", xid.key,
                    "commit" if commit else "rollback")

    def forget(self, xid: Xid) -> XA:
        branch = self._branch(xid)
        if self._heuristic(branch) is None:
            raise XAError(XA.ER_PROTO, f"xid {xid.key} was not completed heuristically")
        del self.branches[xid]
        self.forget_prepared(xid)
        return XA.OK

    def recover(self) -> list[Xid]:
        """In-doubt branches: prepared, or completed heuristically and not yet forgotten.

        Not the branches of transactions across partitions (``XTX_FORMAT``): no TM
        decides them, their decision partition does (``partition/xtx.py``).
        """
        return [b.xid for b in self.branches.values()
                if b.state in (State.PREPARED, State.HEURISTIC_COMMIT, State.HEURISTIC_ROLLBACK)
                and xtx_partition(b.xid) is None]

    # -- timeouts ----------------------------------------------------------------------------

    def set_timeout(self, xid: Xid, seconds: float) -> None:
        if seconds < 0 or seconds > self.max_timeout:
            raise XAError(XA.ER_INVAL, f"timeout must be between 0 and {self.max_timeout} s")
        branch = self._branch(xid)
        branch.timeout = seconds
        branch.started = self.clock()

    def get_timeout(self, xid: Xid) -> float:
        return self._branch(xid).timeout

    def tick(self, now: float) -> None:
        """Branches not prepared within their timeout can only roll back (XA_RBTIMEOUT)."""
        for branch in list(self.branches.values()):
            if (branch.timeout and now - branch.started > branch.timeout
                    and branch.state in (State.ACTIVE, State.SUSPENDED, State.IDLE)):
                log.info("xid %s timed out after %.1f s", branch.xid.key, branch.timeout)
                self._mark_rollback_only(branch, XA.RBTIMEOUT)

    # -- recovery ------------------------------------------------------------------------------

    def restore_prepared(self, xid: Xid, publishes: list[tuple[list[Queue], Any]],
                         accepts: list[tuple[Queue, Entry]]) -> DtxBranch:
        """A branch the store kept across a restart: prepared, holding its entries."""
        branch = DtxBranch(xid, [], self.clock(), 0.0, self.on_outcome)
        branch.publishes.extend(publishes)
        branch.accepts.extend(accepts)
        branch.prepare_started = True
        branch.state = State.PREPARED
        branch.observers = [o for f in self.factories
                            if (o := f.create(branch)) is not None]
        self.branches[xid] = branch
        return branch
