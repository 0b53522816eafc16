"""What the round engine's parts see of it: the state and steps they share.

``RoundEngine`` (rounds.py) is assembled from ``ExchangeMixin``,
``MembershipMixin`` and ``VotingMixin``; each mixin types ``self`` as this
Protocol instead of importing ``RoundEngine``, so rounds.py imports its parts
and no part imports it back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from brokerha.txlog.engine.clock import HybridCounter
from brokerha.txlog.engine.config import TxLogConfig
from brokerha.txlog.engine.executor import Executor
from brokerha.txlog.engine.messages import Action, Ballot, Message, Post
from brokerha.txlog.engine.queues import IncomingQueue, SynchronisedQueue
from brokerha.txlog.engine.records import TxBody, TxIdGenerator, TxRecord
from brokerha.txlog.engine.recovery import RecoveryPlan
from brokerha.txlog.engine.rules import Rules
from brokerha.txlog.engine.state import DurableState


class Engine(Protocol):
    # state (rounds.py's __init__ and voting.py's _init_voting)
    config: TxLogConfig
    rules: Rules
    me: str
    wall: int
    durable: DurableState
    out: list[Action]
    counter: HybridCounter
    ids: TxIdGenerator
    incoming: IncomingQueue
    foreign_bodies: dict[str, TxBody]
    pending: dict[str, tuple[TxRecord, str]]
    asked: dict[str, int]
    acquired_ms: dict[str, int]
    posts: dict[str, Post]
    last_heard: dict[str, int]
    pushed: set[str]
    synced_from: dict[str, str]
    executor: Executor
    votes: dict[str, Ballot]
    vote_sent_at: int

    @property
    def sync(self) -> SynchronisedQueue: ...
    @property
    def members(self) -> frozenset[str]: ...
    @property
    def generation(self) -> int: ...
    @property
    def split(self) -> bool: ...
    @property
    def voting(self) -> bool: ...

    # steps of rounds.py
    def _persist(self, key: str, value: Any) -> None: ...
    def _send(self, peer: str, message: Message) -> None: ...
    def _reserve_counter(self) -> None: ...
    def _post_soon(self, now: int, news: bool = False) -> None: ...
    def _body(self, tx_id: str) -> TxBody | None: ...
    def _add(self, timed_out: bool, now: int) -> None: ...

    # steps of the mixins, used across them
    def _merge(self, records: Iterable[TxRecord], bodies: Iterable[TxBody], lister: str,
               now: int) -> None: ...
    def _fetch(self, peer: str, tx_ids: list[str], now: int) -> None: ...
    def _lister_of(self, tx_id: str) -> str: ...
    def _record(self, tx_id: str) -> TxRecord | None: ...
    def _drop(self, peers: set[str] | frozenset[str], now: int, reason: str) -> None: ...
    def _readmit(self, peer: str, now: int) -> None: ...
    def _start_vote(self, generation: int, now: int) -> None: ...
    def _gossip_votes(self, now: int, force: bool = False) -> None: ...
    def _vote_reply(self, peer: str, generation: int) -> None: ...
    def _decide(self, now: int) -> None: ...
    def _adopt_log(self, decision: RecoveryPlan, generation: int, now: int) -> None: ...
    def _renegotiate(self, records: tuple[TxRecord, ...], now: int) -> None: ...
    def _restart_execution(self, decision: RecoveryPlan) -> None: ...
