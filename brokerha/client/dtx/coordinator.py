"""A small two-phase-commit coordinator: brokerha (XA) + a SQL database (prepared transactions).

The coordinator's log is the only place where the outcome of a global
transaction is decided (presumed abort): a transaction whose ``commit``
record is not durably in the log is rolled back everywhere by recovery, one
whose record is there is committed everywhere. Each step that matters is
written and fsync'ed before the next one.

    coordinator = Coordinator(CoordinatorLog("tm.log"), xa, engine)
    coordinator.recover()                  # at start-up: finish in-doubt work
    with coordinator.transaction() as (db, gtrid):
        method, _, body = channel.basic_get("orders")
        db.execute(insert(orders).values(body=body))
        channel.basic_ack(method.delivery_tag)

PostgreSQL needs ``max_prepared_transactions`` > 0 for its side.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from brokerha.client.dtx.resources import XA_OK, XAException, XAResourceBase, Xid

log = logging.getLogger(__name__)

FORMAT_ID = 0x62686131  # "bha1": marks xids this coordinator owns
DB_PREFIX = "brokerha-"


class CoordinatorLog:
    """An append-only, fsync'ed JSON-lines log of commit decisions and completions."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, gtrid: str, state: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"gtrid": gtrid, "state": state}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def undecided_or_committing(self) -> dict[str, str]:
        """Last state of every transaction not yet marked done."""
        states: dict[str, str] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn last line: that decision never happened
                states[record["gtrid"]] = record["state"]
        return {g: s for g, s in states.items() if s != "done"}


class Coordinator:
    """Runs global transactions over one XA resource and one SQLAlchemy engine."""

    def __init__(self, log_: CoordinatorLog, xa: XAResourceBase, engine: Any) -> None:
        self.log = log_
        self.xa = xa
        self.engine = engine

    @staticmethod
    def xid(gtrid: str) -> Xid:
        return Xid(FORMAT_ID, bytes.fromhex(gtrid), b"brokerha")

    @staticmethod
    def db_xid(gtrid: str) -> str:
        return DB_PREFIX + gtrid

    @contextmanager
    def transaction(self) -> Iterator[tuple[Any, str]]:
        """Work inside the block is in both branches; leaving it runs two-phase commit."""
        gtrid = uuid.uuid4().hex
        xid = self.xid(gtrid)
        self.xa.start(xid)
        conn = self.engine.connect()
        db_tx = conn.begin_twophase(self.db_xid(gtrid))
        try:
            yield conn, gtrid
        except BaseException:
            self._abort(xid, db_tx, conn)
            raise
        self.xa.end(xid)
        try:
            vote = self.xa.prepare(xid)
            db_tx.prepare()
        except Exception:  # a no vote (XA_RB*) or a failure: roll back both sides
            self._abort(xid, db_tx, conn, ended=True)
            raise
        self.log.append(gtrid, "commit")  # the commit point
        self.finish(gtrid, commit=True, broker_prepared=vote == XA_OK, db_tx=db_tx)
        conn.close()

    def _abort(self, xid: Xid, db_tx: Any, conn: Any, ended: bool = False) -> None:
        try:
            if not ended:
                self.xa.end(xid, fail=True)
            self.xa.rollback(xid)
        except XAException as exc:
            log.info("broker branch %s already gone: %s", xid, exc)
        try:
            db_tx.rollback()
        finally:
            conn.close()

    def finish(self, gtrid: str, *, commit: bool, broker_prepared: bool = True,
               db_tx: Any = None) -> None:
        """Phase two on both sides, then mark the transaction done."""
        xid = self.xid(gtrid)
        if broker_prepared:
            if commit:
                self.xa.commit(xid)
            else:
                self.xa.rollback(xid)
        if db_tx is not None:
            db_tx.commit() if commit else db_tx.rollback()
        self.log.append(gtrid, "done")

    def recover(self) -> dict[str, str]:
        """Finish every in-doubt transaction the same way on both sides.

        Returns {gtrid: "committed" | "rolled back"} for what it finished.
        """
        decided = {g for g, s in self.log.undecided_or_committing().items() if s == "commit"}
        outcome: dict[str, str] = {}
        for xid in self.xa.recover():
            if xid.format_id != FORMAT_ID:
                continue
            gtrid = xid.gtrid.hex()
            if gtrid in decided:
                self.xa.commit(xid)
            else:
                self.xa.rollback(xid)
            outcome[gtrid] = "committed" if gtrid in decided else "rolled back"
        with self.engine.connect() as conn:
            for db_xid in conn.recover_twophase():
                if not str(db_xid).startswith(DB_PREFIX):
                    continue
                gtrid = str(db_xid)[len(DB_PREFIX):]
                commit = gtrid in decided
                if commit:
                    conn.commit_prepared(db_xid, recover=True)
                else:
                    conn.rollback_prepared(db_xid, recover=True)
                outcome[gtrid] = "committed" if commit else "rolled back"
        for gtrid in decided:
            self.log.append(gtrid, "done")
        log.info("coordinator recovery finished %d transaction(s)", len(outcome))
        return outcome

