"""Replication packets (codes 30-59) and the vocabulary of the events they carry.

Imported by both sides: ``brokerha.primary`` builds events, ``brokerha.backup``
applies them. An event is a named record (a ``NamedTuple`` below, one per
kind) whose first field says what it is; msgpack carries it as an array, and
``Events.from_args`` makes records of them again on the receiving side, so
both sides read fields by name; every event of a primary's log has its own sequence number, and an
``Events`` packet carries a run of consecutive ones.

=======  ==============================================================  ==========
kind     fields after the kind                                           meaning
=======  ==============================================================  ==========
``v``    vhost                                                           vhost exists
``df``   [kind, key, value JSON or None]                                 a definition changed
``ds``   [[kind, key, value JSON], ...]                                  every definition (catch-up)
``xd``   vhost, name, type, durable, auto_delete, internal, arguments   exchange declared
``xx``   vhost, name                                                     exchange deleted
``qd``   vhost, name, durable, auto_delete, arguments                    queue declared
``qx``   vhost, name                                                     queue deleted
``bd``   vhost, source, kind, destination, routing_key, arguments        binding created
``bx``   vhost, source, kind, destination, routing_key, arguments        binding deleted
``e``    vhost, queue, position, exchange, routing_key, header, body,    enqueued
         expires_in_ms (None: no expiry)
``d``    vhost, queue, [positions]                                       dequeued
``pg``   vhost, queue, below                                             purged: every entry
                                                                         below ``below``
``pr``   vhost, queue, [[first, last], ...]                              purged: the entries
                                                                         at these positions
``er``   vhost, queue, first, length, contents                           enqueued, a run:
                                                                         ``length`` messages
                                                                         at first.., no expiry
``bp``   data                                                            a part of the next
                                                                         ``e``'s (``te``'s) body
``b``    session (the Join's)                                            catch-up begins
``s``    (none)                                                          config snapshot done
``c``    seq                                                             caught up
``a``    (none)                                                          acknowledge promptly
``rj``   node                                                            join again, please
``tb``   txid, xid (None for TX)                                         tx-queue created
``te``   txid, vhost, [queues], exchange, routing_key, header, body      tx enqueue
``td``   txid, vhost, queue, [positions]                                 tx dequeue
``tp``   txid, client tx id (None)                                       tx prepare
``tc``   txid, client tx id, ops                                         tx commit
``tr``   txid, client tx id                                              tx rollback
``to``   [[txid, client tx id, outcome, at], ...]                        outcomes (catch-up)
``lr``   journal seq, record body                                        TxLog record
``ls``   journal seq, part, parts, bytes                                 TxLog snapshot
``la``   applied (count of synchronised entries)                         TxLog applied
``lb``   bytes (the global queues backed up at a split)                  TxLog split backup
``lp``   bytes (the runtime sync peers' JSON) or None (the config's)     TxLog peers
``pt``   ptid, num_replicas, partitions, [[p, [[node, state]..]]..]      partition table changed
``ps``   ptid, num_replicas, [[[node, state], ...], ...]                 partition table (catch-up)
``ck``   token                                                           check the replicas
=======  ==============================================================  ==========

A catch-up sends the messages of one queue at consecutive positions and
without expiry as runs (``er``, ``primary/replicating_subscription.py``):
``contents`` is the store's message-run format (``store/batch.py``
``pack_run``: msgpack ``[[exchange, routing_key, header, body], ...]``), so the
link carries one ``bin`` per run instead of a record and a field each, and a
backup whose queue is durable stores that same ``bytes`` as one message run
(``batch.ENQUEUED_RUN``) without packing it again.

A purge of a queue that had no acquired entry (``broker/drain.py``: its
purged positions are everything below the queue's next position, known at
once) goes as one ``pg`` instead of a ``d`` per purged position: a backup then
takes its whole copy off at once and lets go of the entries in slices, as the
primary does, its store recording one purge (``backup/backup.py``). A backup
whose copy holds a position at or above ``below`` (a copy that is not the
primary's) raises ``ReplicationError``: it joins again. A purge made while
consumers held acquired entries (their positions are not purged) goes as one
``pr`` of the purged ranges, ascending, when the queue has no priorities and
the backup's copy is known to hold few entries outside the last range
(``Primary.purged``: the ranges before the last and the acquired entries, at
most ``PURGE_RANGES_SCAN``): the backup takes the last range off whole and
scans only the rest (``ReadyList.take_ranges``), and a copy that does not hold
every purged position raises ``ReplicationError``. Any other purge goes as
``d`` events of its positions. A slice of an expiry or a length trim (64 or
more entries dropped at once off the head, ``Queue._discard``) goes as a ``pr``
too; the backup then takes the entries up to the last range off its head.

A large body travels in parts: an ``e`` (or a transaction's ``te``) whose
body is over ``BODY_PART_BYTES`` (``primary/events.py``) goes as ``bp`` events
of at most that many bytes each, then the ``e`` with an empty body; the
backup keeps the parts and applies the ``e`` with their concatenation as its
body (and the ``e``'s own body after them). They are consecutive events of
the log: any other event after a ``bp`` is a ``ReplicationError``. (A ``te``
sent again in a join's catch-up, and a ``tc``'s own ``e`` ops, within its
``TC_CONTENT_BYTES``, go whole.) So no packet, no packing
and no write of the primary holds a whole 50 MiB body: the primary sends its
outbox at most ``FLUSH_BYTES`` per backup a loop turn (``remote_backup.py``),
the rest the next turns, in order. Nothing waits for a ``bp`` (a confirm waits
for its ``e``), so a backup does not acknowledge it promptly; an
acknowledgement that covers ``bp`` events but not their ``e`` claims nothing
of the message (a backup that restarts joins again with a catch-up).

The partition table (``brokerha/cluster/partition_table.py``, docs/ha.md
"Partitions"): ``pt`` is one change decided by the table coordinator
(``brokerha/partition/coordinator.py``), the whole new rows of the partitions
it touches and the new ptid, which a node applies only at its ptid + 1; ``ps``
is the whole table at a join (the backup's becomes the primary's).

The TxLog (``brokerha/txlog/bridge/replica.py``, docs/txlog.md "Global queues in an
HA datacenter"): ``lr`` is one record of the master's journal (one engine
call's ``Persist`` changes, the journal's own bytes); ``ls`` the master's whole
durable state at a journal seq, cut in parts (a catch-up, and the master's
start on a new primary), installed once the last part arrived; ``la`` how
many synchronised entries the global queues' contents reflect, after the
queue events of those entries. A backup writes ``lr``/``ls`` into its own
journal and acknowledges only after its fsync; the master sends nothing that
depends on a record before the record is replicated (``quorum.py``). ``lb`` and
``lp`` are files of the TxLog directory a promoted node needs besides the
journal (the split backup; the sync peers an operator changed at runtime, which
replace the configuration's), written atomically on every backup; ``lp`` with
None removes the file (the configuration's peers apply).

Transactions (``brokerha/primary/tx_observer.py``, docs/ha.md "Transactions"):
``tb``/``te``/``td``/``tp`` are the transaction's tx-queue, buffered by the
backup (``brokerha/backup/tx_buffer.py``); ``tc`` carries, in one event, the
whole effect of the local commit: ``ops`` is a list of
``["r", vhost, queue, position, index, expires_in_ms]`` (enqueue of the
``index``-th ``te`` message: its content is not sent twice -- the skip set),
``e`` events (enqueues of content the tx-queue does not hold: a TX's own
publishes, which it sends only with its commit, and dead letters)
and ``d`` events (dequeues), in the order the primary applied them. A backup
applies a ``tc`` before any later event and acknowledges it once applied
whole: in one loop callback, so in one group commit of its store, up to
``COMMIT_SLICE`` entries; a bigger one a slice per loop turn, its stored
position invalid until the last (``backup/transaction_replicator.py``): no
node ever holds a proper subset of a transaction at a valid position.

``arguments`` travel as an AMQP field table (bytes, keys sorted), so whatever a
client can declare survives msgpack and compares byte for byte.

Acknowledgements: a backup may acknowledge a run of ``d`` events late
(``ha/core.py`` ``DEQUEUE_ACK_DELAY``), since nothing waits for a dequeue; the
primary may likewise send them late (``DEQUEUE_SEND_DELAY``). When
something does (a reply or confirm whose barrier lands right after dequeues:
an unroutable message's confirm, a declare that changed nothing), the primary
emits ``a``, which changes nothing on the backup and is acknowledged promptly.

``rj`` asks backup ``node`` to join again (every other backup ignores it): a
queue whose ``ha-replicate`` became ``all`` reaches it with its messages in
that join's catch-up (``Primary.replicate_changed``, docs/ha.md).

``ck`` changes nothing: each member takes its report for the check ``token`` of
its queues as they are where it applies it (``ha/check.py``, docs/ha.md
"Replicas checked"), the primary at emit, and a backup sends it back as a
``CheckReport``.

A catch-up (the primary's answer to a ``Join``) is numbered so that its ``c``
marker lands on the primary's seq at the join: the numbers before it are
private to that backup, which holds no consistent copy until the marker.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pamqp import decode, encode

from brokerha.cluster.messages import Message, packet

VHOST = "v"
DEFINITION = "df"  # a DefinitionChange.as_wire() (brokerha/broker/definitions.py)
DEFINITIONS = "ds"  # every definition at a join: the backup's become the primary's
EXCHANGE_DECLARED = "xd"
EXCHANGE_DELETED = "xx"
QUEUE_DECLARED = "qd"
QUEUE_DELETED = "qx"
BINDING_CREATED = "bd"
BINDING_DELETED = "bx"
ENQUEUED = "e"
DEQUEUED = "d"
PURGED = "pg"  # a purge of everything below a position, in one event (see above)
PURGED_RANGES = "pr"  # a purge of these positions' entries, in one event (see above)
ENQUEUED_RUN = "er"  # a run of enqueues at consecutive positions, contents packed (pack_run)
BODY_PART = "bp"  # a part of the next ``e``'s body (a large message, in parts)
CATCH_UP_BEGINS = "b"
SNAPSHOT_DONE = "s"
CAUGHT_UP = "c"
ACK_PROMPTLY = "a"  # no change; acknowledge at once (a barrier waits on dequeues)
REJOIN = "rj"  # the backup it names joins again (a queue's ha-replicate became all)
TX_BEGIN = "tb"
TX_ENQUEUE = "te"
TX_DEQUEUE = "td"
TX_PREPARE = "tp"
TX_COMMIT = "tc"
TX_ROLLBACK = "tr"
TX_OUTCOMES = "to"
TX_EVENTS = frozenset([TX_BEGIN, TX_ENQUEUE, TX_DEQUEUE, TX_PREPARE, TX_COMMIT, TX_ROLLBACK,
                       TX_OUTCOMES])
OP_REF = "r"  # a tc op: enqueue of a message the tx-queue carried
OP_REFS = "rs"  # a tc op: a run of them, consecutive positions and te events, no expiry
TXLOG_RECORD = "lr"
TXLOG_SNAPSHOT = "ls"
TXLOG_APPLIED = "la"
TXLOG_BROKER_BACKUP = "lb"  # the global queues backed up at a split (txlog/bridge/broker_state.py)
TXLOG_PEERS = "lp"  # the sync peers changed at runtime (txlog/master/driver.py PEERS_FILE)
TXLOG_EVENTS = frozenset([TXLOG_RECORD, TXLOG_SNAPSHOT, TXLOG_APPLIED, TXLOG_BROKER_BACKUP,
                          TXLOG_PEERS])
PARTITION_TABLE_CHANGED = "pt"  # a PartitionChange.as_wire() (cluster/partition_table.py)
PARTITION_TABLE = "ps"  # the whole PartitionTable.as_wire() at a join
PARTITION_EVENTS = frozenset([PARTITION_TABLE_CHANGED, PARTITION_TABLE])
GROUP_MEMBERSHIP = "pm"  # a partition group's voters and learners (partition/moves.py)
CHECK = "ck"  # check the replicas: each member reports its queues as at this seq (ha/check.py)
QUEUE_DIRECTORY_CHANGED = "qe"  # a partition's queues changed in the directory (partition/directory.py)
QUEUE_DIRECTORY = "qs"  # the whole queue directory at a join
QUEUE_DIRECTORY_EVENTS = frozenset([QUEUE_DIRECTORY_CHANGED, QUEUE_DIRECTORY])

# -- the events as named records (fields after ``kind`` as in the table above) -----------


class VhostExists(NamedTuple):
    kind: str
    vhost: str


class DefinitionChanged(NamedTuple):
    kind: str
    change: list[Any]


class DefinitionsSnapshot(NamedTuple):
    kind: str
    changes: list[list[Any]]


class ExchangeDeclared(NamedTuple):
    kind: str
    vhost: str
    name: str
    type: str
    durable: bool
    auto_delete: bool
    internal: bool
    arguments: bytes


class ExchangeDeleted(NamedTuple):
    kind: str
    vhost: str
    name: str


class QueueDeclared(NamedTuple):
    kind: str
    vhost: str
    name: str
    durable: bool
    auto_delete: bool
    arguments: bytes


class QueueDeleted(NamedTuple):
    kind: str
    vhost: str
    name: str


class BindingChanged(NamedTuple):  # bd (created) and bx (deleted)
    kind: str
    vhost: str
    source: str
    dest_kind: str
    destination: str
    routing_key: str
    arguments: bytes


class Enqueued(NamedTuple):
    kind: str
    vhost: str
    queue: str
    position: int
    exchange: str
    routing_key: str
    header: bytes
    body: bytes
    expires_in: int | None


class EnqueuedRun(NamedTuple):
    kind: str
    vhost: str
    queue: str
    first: int       # the first message's position: the run holds first .. first + length - 1
    length: int
    contents: bytes  # ``store.batch.pack_run`` of the ``length`` messages, in position order


class Dequeued(NamedTuple):
    kind: str
    vhost: str
    queue: str
    positions: list[int]


class Purged(NamedTuple):
    kind: str
    vhost: str
    queue: str
    below: int  # every entry of the queue at a position below this leaves


class PurgedRanges(NamedTuple):
    kind: str
    vhost: str
    queue: str
    ranges: list[Any]  # [[first, last], ...] ascending: the entries at these positions leave


class BodyPart(NamedTuple):
    kind: str
    data: bytes | memoryview  # the primary cuts a body without copying it


class CatchUpBegins(NamedTuple):
    kind: str
    session: int


class SnapshotDone(NamedTuple):
    kind: str


class CaughtUp(NamedTuple):
    kind: str
    seq: int       # the join's seq: live events follow from seq + 1
    valid_at: int  # the backup holds a consistent copy once it applied this seq (>= seq)


class AckPromptly(NamedTuple):
    kind: str


class Rejoin(NamedTuple):
    kind: str
    node: str


class TxBegin(NamedTuple):
    kind: str
    txid: str
    xid: str | None


class TxEnqueue(NamedTuple):
    kind: str
    txid: str
    vhost: str
    queues: list[str]
    exchange: str
    routing_key: str
    header: bytes
    body: bytes


class TxDequeue(NamedTuple):
    kind: str
    txid: str
    vhost: str
    queue: str
    positions: list[int]


class TxPrepare(NamedTuple):
    kind: str
    txid: str
    client_id: str | None


class TxCommit(NamedTuple):
    kind: str
    txid: str
    client_id: str | None
    ops: list[Any]  # OpRef(s), Enqueued and Dequeued records, in the order applied


class TxRollback(NamedTuple):
    kind: str
    txid: str
    client_id: str | None


class TxOutcomes(NamedTuple):
    kind: str
    records: list[Any]  # [txid, client tx id, outcome, at] each


class OpRef(NamedTuple):
    kind: str
    vhost: str
    queue: str
    position: int
    message: int  # the index of the tx-queue's ``te`` event that carries the content
    expires_in: int | None


class OpRefs(NamedTuple):
    """``length`` OpRefs without expiry: positions ``position``.. for te events ``message``.."""

    kind: str
    vhost: str
    queue: str
    position: int
    message: int
    length: int


class TxLogRecord(NamedTuple):
    kind: str
    seq: int
    body: bytes


class TxLogSnapshot(NamedTuple):
    kind: str
    seq: int
    part: int
    parts: int
    data: bytes


class TxLogApplied(NamedTuple):
    kind: str
    applied: int


class TxLogBrokerBackup(NamedTuple):
    kind: str
    data: bytes


class TxLogPeers(NamedTuple):
    kind: str
    data: bytes | None


class PartitionTableChanged(NamedTuple):
    kind: str
    ptid: int
    num_replicas: int
    partitions: int
    rows: list[Any]  # [[partition, [[node, state], ...]], ...]: the rows it changes


class PartitionTableSnapshot(NamedTuple):
    kind: str
    ptid: int
    num_replicas: int
    rows: list[Any]  # every row: [[node, state], ...]


class GroupMembership(NamedTuple):
    kind: str
    ptid: int  # the table's change it was made for
    voters: list[str]
    learners: list[str]


class CheckToken(NamedTuple):
    kind: str
    token: str  # names the check: the backups' reports carry it back


class DirectoryChanged(NamedTuple):
    kind: str
    partition: int
    epoch: int  # the partition leader's: a lower one than the directory's is ignored
    sync: bool  # the partition's entries whole (those not named go)
    entries: list[Any]  # [[vhost, name, entry or None], ...] (partition/directory.py)


class DirectorySnapshot(NamedTuple):
    kind: str
    epochs: list[Any]  # [[partition, epoch, synced], ...]
    entries: list[Any]  # [[vhost, name, entry], ...]


RECORDS: dict[str, Any] = {
    VHOST: VhostExists, DEFINITION: DefinitionChanged, DEFINITIONS: DefinitionsSnapshot,
    EXCHANGE_DECLARED: ExchangeDeclared, EXCHANGE_DELETED: ExchangeDeleted,
    QUEUE_DECLARED: QueueDeclared, QUEUE_DELETED: QueueDeleted, BINDING_CREATED: BindingChanged,
    BINDING_DELETED: BindingChanged, ENQUEUED: Enqueued, ENQUEUED_RUN: EnqueuedRun,
    DEQUEUED: Dequeued, PURGED: Purged, PURGED_RANGES: PurgedRanges, BODY_PART: BodyPart,
    CATCH_UP_BEGINS: CatchUpBegins, SNAPSHOT_DONE: SnapshotDone, CAUGHT_UP: CaughtUp,
    ACK_PROMPTLY: AckPromptly, REJOIN: Rejoin, TX_BEGIN: TxBegin, TX_ENQUEUE: TxEnqueue,
    TX_DEQUEUE: TxDequeue, TX_PREPARE: TxPrepare, TX_COMMIT: TxCommit, TX_ROLLBACK: TxRollback,
    TX_OUTCOMES: TxOutcomes, OP_REF: OpRef, OP_REFS: OpRefs, TXLOG_RECORD: TxLogRecord,
    TXLOG_SNAPSHOT: TxLogSnapshot, TXLOG_APPLIED: TxLogApplied,
    TXLOG_BROKER_BACKUP: TxLogBrokerBackup, TXLOG_PEERS: TxLogPeers,
    PARTITION_TABLE_CHANGED: PartitionTableChanged, PARTITION_TABLE: PartitionTableSnapshot,
    GROUP_MEMBERSHIP: GroupMembership, CHECK: CheckToken,
    QUEUE_DIRECTORY_CHANGED: DirectoryChanged, QUEUE_DIRECTORY: DirectorySnapshot,
}


_SIZES = {kind: len(record._fields) for kind, record in RECORDS.items()}
_new = tuple.__new__  # a record from a list without the NamedTuple's Python-level __new__


def as_record(event: Any) -> Any:
    """An event off the wire (a list) as its record; ``ValueError`` if it is none.

    A ``tc``'s ops become records too. On every event a backup receives: kept
    to a dict lookup, a length check and the tuple's own constructor.
    """
    try:
        kind = event[0]
        size = _SIZES[kind]
    except (TypeError, KeyError, IndexError):
        if not isinstance(event, (list, tuple)) or not event:
            raise ValueError(f"not an event: {event!r:.60}") from None
        raise ValueError(f"unknown event kind {event[0]!r:.20}") from None
    if len(event) != size:
        raise ValueError(f"event {kind!r} has {len(event)} fields, not {size}")
    if kind == TX_COMMIT:
        event = [*event[:3], [as_record(op) for op in event[3]]]
    return _new(RECORDS[kind], event)


# The queue argument holding a replicated queue's identity (the primary's
# epoch and seq when it was declared): a queue deleted and declared again under
# the same name is another queue, and its positions mean other messages.
HA_ID = "x-ha-id"


@packet(30)
class Join(Message):
    """Backup -> primary: follow me from here.

    ``pos_epoch``/``pos_seq``: the backup's last consistent position (for the
    log); ``inventory``: ``[vhost, queue, ha_id, ranges]`` per replicated queue
    it holds, ``ranges`` the ``[first, last]`` runs of positions on it;
    ``session``: unique per join, echoed by the catch-up's ``b`` event, so a
    backup that joined twice applies only the answer to its last join (the
    diff is against that join's inventory).
    """

    epoch: int
    node: str
    pos_epoch: int
    pos_seq: int
    inventory: list[Any]
    session: int


@packet(31)
class Events(Message):
    """Primary -> backup: ``events[i]`` has sequence number ``first_seq + i``."""

    ENCODE_ONCE = True  # the same packet goes to every backup that is up to date

    epoch: int
    first_seq: int
    events: list[Any]

    @classmethod
    def from_args(cls, args: list[Any]) -> Message:
        packet = super().from_args(args)
        assert isinstance(packet, Events)
        if not isinstance(packet.events, list):
            raise TypeError(f"Events.events is not a list: {packet.events!r:.60}")
        packet.events = [as_record(event) for event in packet.events]
        return packet


@packet(32)
class Ack(Message):
    """Backup -> primary: I hold every event up to ``seq`` (cumulative), durably."""

    epoch: int
    node: str
    seq: int


@packet(33)
class ResourceAlarm(Message):
    """Backup -> primary: the backup's disk alarms in force (name -> why; empty: none).

    Sent after each join and whenever they change. A ready backup must store
    everything the primary confirms, so its disk alarm blocks the primary's
    publishers as the primary's own would (``primary.backup_alarms``).
    """

    epoch: int
    node: str
    alarms: dict[str, str]


@packet(34)
class CheckReport(Message):
    """Backup -> primary: its queues as they were where it applied the ``ck`` of ``token``.

    ``caught_up``: whether its copy was consistent there (a backup still catching up
    may lack what the primary holds); ``queues``: ``QueueReport.as_wire()`` each
    (``ha/check.py``).
    """

    epoch: int
    node: str
    token: str
    caught_up: bool
    queues: list[Any]


@packet(60)
class TxVote(Message):
    """Backup -> primary: its prepare of ``txid`` failed (ok=False: Qpid's cancel).

    A yes vote is the acknowledgement of the ``tp`` event (the backup acks only
    after its store synced the prepared record), so only a no travels alone.
    """

    epoch: int
    node: str
    txid: str
    ok: bool
    reason: str


@packet(61)
class VerifyRequest(Message):
    """New primary -> backups (verification phase): which of ``txids`` did you commit?"""

    epoch: int
    txids: list[str]


@packet(62)
class VerifyReply(Message):
    """Backup -> new primary: its prepared transactions and which of the asked it committed."""

    epoch: int
    node: str
    prepared: list[str]
    committed: list[str]


class ReplicationError(Exception):
    """The stream cannot be applied (gap, unknown event): the backup joins again."""


class ConfigurationMismatch(ReplicationError):
    """This node cannot hold what its primary replicates (e.g. a TxLog without ``[txlog]``).

    Joining again would not help and acknowledging would be a lie (its
    acknowledgements count for the quorum): the node stops (fail-stop).
    """


class StaleEpoch(ReplicationError):
    """Events of a primary older than the epoch this backup follows: refused."""


def encode_table(arguments: dict[str, Any]) -> bytes:
    """Arguments as an AMQP field table, keys sorted (a stable identity)."""
    return bytes(encode.field_table(_encodable(arguments)))


def decode_table(data: bytes) -> dict[str, Any]:
    _, table = decode.field_table(bytes(data))
    return dict(table)


def _encodable(value: Any) -> Any:
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return {k: _encodable(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_encodable(v) for v in value]
    return value
