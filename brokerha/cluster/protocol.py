"""The cluster link's wire protocol, sans-I/O: bytes in, packets and bytes out.

Nothing here touches a socket, so every rule (magic, framing, identification,
authentication) is tested byte by byte without a network; ``cluster.link``
only moves bytes. The layout follows seed 004 (NEO): a raw magic compared
before anything is decoded, so a stray HTTP client or an AMQP client on the
wrong port never reaches msgpack; then length-prefixed msgpack packets
``[msg_id, code, args]``.

Identification (the acceptor answers each step or refuses with ``Error``)::

    dialer                                   acceptor
    MAGIC, Identify(cluster, node, nonce) ->
                                          <- MAGIC, Challenge(node, nonce, proof)
    Authenticate(proof)                   ->
                                          <- Welcome(node)

Each proof is HMAC-SHA256 under the shared secret over the direction, the
cluster, both names and both fresh nonces: both sides prove they know the
secret, a proof is bound to one connection (replaying it fails) and to one
direction (reflecting the acceptor's proof back fails).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from brokerha.cluster.messages import REGISTRY, Error, ErrorCode, Message, packet

# the link's format: peers of another version are refused at the handshake (the magic).
# 2: the ``bp`` body-part event (a large body in parts) and the ``er`` run of enqueues
# (cluster/replication.py), which a node of version 1 cannot apply; 3: a node running
# partition groups (node/ha_groups.py) sends every packet through its GroupMux
# (partition/mux.py: ``Grouped``, ``Heartbeats``, ``HeartbeatAcks``, codes 20-22), which
# a node of version 2 does not know (an unknown packet code: the link fails at the first);
# 4: the ``ck`` event (a replica check, ha/check.py) and its ``CheckReport`` (code 34),
# which a backup of version 3 cannot apply (an unknown event: it would join again and again);
# 5: a partitioned node forwards its clients' publishes (partition/forwarding.py: ``Forward``,
# ``Forwarded``, ``ForwardError``, ``LeaderNotice``, codes 23-26), unknown to version 4;
# 6: remote consumers (partition/remote_consumer.py, codes 40-47), unknown to version 5;
# 9: transactions across partitions (partition/transactions.py ``XtxToPartition``,
# ``XtxToNode``, codes 63-64), unknown to version 8;
# 10: declarations from any node (partition/declarations.py ``MetaRequest``, ``MetaReply``,
# codes 50-51), unknown to version 9;
# 11: a large body forwarded or delivered in parts (partition/forward.py ``ForwardPart``,
# code 27; partition/remote_consumer.py ``DeliverPart``, code 48), unknown to version 10;
# 12: a remote consume answered ``Attached`` (code 49), a consumer's ``Credit`` (code 57),
# ``GetReply`` with the get's ``message_count`` (partition/remote_consumer.py), unknown to
# (or misread by) version 11;
# 13: the ``pg`` event (a purge in one event, cluster/replication.py), which a backup of
# version 12 cannot apply (an unknown event: it would join again at every purge);
# 14: the ``pr`` event (a purge made while entries were acquired, in one event), unknown
# to version 13
VERSION = 14
MAGIC = b"BRKRHA" + VERSION.to_bytes(2, "big")
MAX_PACKET = 64 * 1024 * 1024
HANDSHAKE_MAX_PACKET = 64 * 1024  # a handshake's packets: names, a nonce, a proof
NONCE_SIZE = 16
_HEADER = struct.Struct(">I")
_PROOF_LABEL = b"brokerha-cluster-proof-v1"


class ProtocolError(Exception):
    """The peer broke the protocol; ``code`` is the ErrorCode to answer with.

    ``decoded`` holds the good packets that preceded the bad one in the same
    feed, so the caller can still process them before closing (seed 004).
    """

    def __init__(self, reason: str, code: str = ErrorCode.PROTOCOL,
                 decoded: list[tuple[int, Message]] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.decoded = decoded or []


# -- link packets (codes 1-9) ----------------------------------------------------------


@packet(1)
class Identify(Message):
    """Dialer -> acceptor, first packet: who I am and my fresh nonce."""

    cluster: str
    node: str
    nonce: bytes


@packet(2)
class Challenge(Message):
    """Acceptor -> dialer: my name, my nonce, and my proof that I know the secret."""

    node: str
    nonce: bytes
    proof: bytes


@packet(3)
class Authenticate(Message):
    """Dialer -> acceptor: my proof that I know the secret."""

    proof: bytes


@packet(4)
class Welcome(Message):
    """Acceptor -> dialer: identified; the link is established."""

    node: str


@packet(5)
class Ping(Message):
    """Keeps an idle link observably alive; consumed by the link layer."""


# -- framing ---------------------------------------------------------------------------


_ARRAY_OF_3 = b"\x93"  # msgpack: a fixarray of 3 ([msg_id, code, args])
_PACKED_ARGS = "_packed_args"  # where an ENCODE_ONCE message keeps its packed args


class PacketCodec:
    """Length-prefixed msgpack packets; one per direction of a connection.

    ``feed`` buffers partial packets across calls. Decoding stops at the
    first bad packet: after a ProtocolError the codec is not used again.
    """

    def __init__(self, max_packet: int = MAX_PACKET) -> None:
        self.max_packet = max_packet
        # what ``feed`` keeps between calls: the packet being received, made at its
        # size when its header arrived and filled as its bytes come (``_have`` of
        # them), or a few bytes short of a header (or what a ``limit`` left)
        self._part: bytearray | None = None
        self._have = 0
        self._buf = bytearray()
        self._packer = msgpack.Packer(use_bin_type=True)
        self._fields: dict[type[Message], tuple[str, ...] | None] = {}

    # decoding

    def feed(self, data: bytes, limit: int | None = None) -> list[tuple[int, Message]]:
        """Decode the complete packets buffered so far (at most ``limit``).

        Each byte is copied at most once: complete packets are decoded where they
        arrived; a packet split over reads is copied into a buffer of its own size.
        (A buffer that grew by the reads and lost the decoded packets at its front
        could be reallocated and copied over and over: 870 against 5,300 MB/s in
        process for 1 MiB packets in 256 KiB reads; issue 33.)
        """
        out: list[tuple[int, Message]] = []
        try:
            rest: bytes | memoryview = data
            part = self._part
            if part is not None:
                have, size = self._have, len(part)
                take = min(size - have, len(data))
                if take == len(data):
                    part[have:have + take] = data
                else:
                    view = memoryview(data)
                    part[have:have + take] = view[:take]
                    rest = view[take:]
                self._have = have + take
                if have + take < size:
                    return out
                self._part = None
                out.append(self._decode(part))
                if take == len(data):
                    return out
            if self._buf:
                self._buf += rest
                rest = bytes(self._buf)
                self._buf.clear()
            self._split(rest, out, limit)
        except ProtocolError as exc:
            exc.decoded = out
            raise
        return out

    def _split(self, data: bytes | memoryview, out: list[tuple[int, Message]], limit: int | None) -> None:
        """Decode ``data``'s complete packets into ``out``; keep the rest."""
        pos = 0
        end = len(data)
        view = memoryview(data)  # msgpack decodes in place: no copy of a packet
        try:
            while end - pos >= 4 and (limit is None or len(out) < limit):
                (size,) = _HEADER.unpack_from(data, pos)
                if size > self.max_packet:
                    raise ProtocolError(f"packet of {size} bytes exceeds the limit of "
                                        f"{self.max_packet}")
                if end - pos - 4 < size:
                    part = self._part = bytearray(size)
                    have = self._have = end - pos - 4
                    part[:have] = view[pos + 4:end]
                    pos = end
                    break
                packet = view[pos + 4:pos + 4 + size]
                try:
                    out.append(self._decode(packet))
                finally:
                    packet.release()  # also when an error's traceback still holds it
                pos += 4 + size
            if pos < end:
                self._buf += view[pos:end]
        finally:
            view.release()

    def leftover(self) -> bytes:
        """The bytes buffered but not decoded yet (handed on after the handshake)."""
        part = self._part
        if part is not None:
            return _HEADER.pack(len(part)) + bytes(part[:self._have])
        return bytes(self._buf)

    @staticmethod
    def _decode(body: bytes | bytearray | memoryview) -> tuple[int, Message]:
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"malformed msgpack: {exc}") from None
        if not isinstance(obj, list) or len(obj) != 3:
            raise ProtocolError(f"packet is not [msg_id, code, args]: {obj!r:.60}")
        msg_id, code, args = obj
        if type(msg_id) is not int or msg_id < 0 or type(code) is not int:
            raise ProtocolError(f"bad packet header: msg_id {msg_id!r:.20}, code {code!r:.20}")
        cls = REGISTRY.get(code)
        if cls is None:
            raise ProtocolError(f"unknown packet code {code}")
        try:
            return msg_id, cls.from_args(args)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"bad {cls.__name__}: {exc}") from None

    # encoding

    def encode(self, msg_id: int, message: Message) -> bytes:
        """One packet: a single msgpack call, then the length prefix."""
        return b"".join(self.encode_parts(msg_id, message))

    def encode_parts(self, msg_id: int, message: Message) -> list[bytes]:
        """One packet as the pieces to write together (``writelines``: no join).

        A message marked ``ENCODE_ONCE`` has its args packed the first time and
        kept on it: the same events sent to two backups are packed once, and
        only the packet's head (length, msg_id, code) differs.
        """
        packer = self._packer
        if not message.ENCODE_ONCE:
            body: bytes = packer.pack([msg_id, message.CODE, self._args(message)])
            self._check_size(message, len(body))
            return [_HEADER.pack(len(body)), body]
        kept = message.__dict__
        args: bytes | None = kept.get(_PACKED_ARGS)
        if args is None:
            args = kept[_PACKED_ARGS] = packer.pack(self._args(message))
        head = _ARRAY_OF_3 + packer.pack(msg_id) + packer.pack(message.CODE)
        size = len(head) + len(args)
        self._check_size(message, size)
        return [_HEADER.pack(size) + head, args]

    def encode_many(self, packets: Iterable[tuple[int, Message]]) -> list[bytes]:
        """Several packets as pieces for one ``writelines`` (one syscall)."""
        return [part for msg_id, message in packets
                for part in self.encode_parts(msg_id, message)]

    def _check_size(self, message: Message, size: int) -> None:
        if size > self.max_packet:
            raise ValueError(f"{type(message).__name__} of {size} bytes exceeds the "
                             f"packet limit of {self.max_packet}")

    def _args(self, message: Message) -> list[Any]:
        # Message.to_args walks dataclasses.fields on every call; the field
        # names are cached per class unless a class overrides to_args.
        cls = type(message)
        try:
            names = self._fields[cls]
        except KeyError:
            names = self._fields[cls] = (
                tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
                if cls.to_args is Message.to_args else None)
        if names is None:
            return message.to_args()
        return [getattr(message, name) for name in names]


# -- identification --------------------------------------------------------------------


@dataclass
class Established:
    """The peer is identified and authenticated; ``leftover`` is for the PacketCodec."""

    peer: str
    leftover: bytes = b""


@dataclass
class Refused:
    """The link is refused; ``reason`` is the one log line. The caller closes."""

    reason: str
    code: str = ErrorCode.REFUSED


@dataclass
class Step:
    """What one ``receive`` produced: bytes to send, and the outcome once there is one."""

    out: bytes = b""
    outcome: Established | Refused | None = None


class State(enum.Enum):
    AWAIT_MAGIC = "await-magic"
    AWAIT_IDENTIFY = "await-identify"
    AWAIT_CHALLENGE = "await-challenge"
    AWAIT_AUTHENTICATE = "await-authenticate"
    AWAIT_WELCOME = "await-welcome"
    ESTABLISHED = "established"
    REFUSED = "refused"


# The transition table: in each state, the one packet the peer may send next
# (an Error from the peer is accepted in any of them and ends the handshake).
EXPECTED: dict[State, type[Message]] = {
    State.AWAIT_IDENTIFY: Identify,
    State.AWAIT_CHALLENGE: Challenge,
    State.AWAIT_AUTHENTICATE: Authenticate,
    State.AWAIT_WELCOME: Welcome,
}


def proof(secret: bytes, direction: str, cluster: str, dialer: str, acceptor: str,
          dialer_nonce: bytes, acceptor_nonce: bytes) -> bytes:
    """HMAC-SHA256 over length-prefixed parts, so no two tuples share an encoding."""
    mac = hmac.new(secret, _PROOF_LABEL, hashlib.sha256)
    for part in (direction.encode(), cluster.encode(), dialer.encode(), acceptor.encode(),
                 dialer_nonce, acceptor_nonce):
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


class _Refuse(Exception):
    """Internal: end the handshake with ``reason``; ``answer`` says whether to send Error."""

    def __init__(self, reason: str, code: str = ErrorCode.REFUSED, answer: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.code, self.answer = reason, code, answer


class _Handshake:
    """Shared machinery: raw magic check, one packet at a time, the state table."""

    after_magic: State

    def __init__(self, cluster: str, me: str, secret: bytes, nonce: bytes | None,
                 max_packet: int) -> None:
        self.cluster = cluster
        self.me = me
        self.secret = secret
        self.nonce = os.urandom(NONCE_SIZE) if nonce is None else nonce
        self.state = State.AWAIT_MAGIC
        self._magic = bytearray()
        # its packets are small (before the peer is known, a header may not make the
        # codec hold a buffer of ``max_packet``)
        self._codec = PacketCodec(min(max_packet, HANDSHAKE_MAX_PACKET))
        self._msg_id = 0

    def start(self) -> bytes:
        """The bytes to send as soon as the connection is up."""
        return b""

    def receive(self, data: bytes) -> Step:
        """Consume bytes from the peer; the outcome is set once the handshake is over."""
        if self.state in (State.ESTABLISHED, State.REFUSED):
            raise RuntimeError(f"handshake is over ({self.state.value})")
        out: list[bytes] = []
        try:
            if self.state is State.AWAIT_MAGIC:
                data = self._check_magic(data, out)
                if self.state is State.AWAIT_MAGIC:
                    return Step(b"".join(out))
            try:
                packets = self._codec.feed(data, limit=1)
                while packets:
                    msg_id, msg = packets[0]
                    outcome = self._dispatch(msg_id, msg, out)
                    if outcome is not None:
                        self.state = State.ESTABLISHED
                        return Step(b"".join(out),
                                    Established(outcome, self._codec.leftover()))
                    packets = self._codec.feed(b"", limit=1)
            except ProtocolError as exc:
                raise _Refuse(exc.reason, exc.code) from None
        except _Refuse as refusal:
            self.state = State.REFUSED
            if refusal.answer:
                out.append(self._codec.encode(self._msg_id, Error(refusal.code, refusal.reason)))
            return Step(b"".join(out), Refused(refusal.reason, refusal.code))
        return Step(b"".join(out))

    def _check_magic(self, data: bytes, out: list[bytes]) -> bytes:
        """Compare raw bytes as they come: a mismatch is known before any decoding."""
        need = len(MAGIC) - len(self._magic)
        self._magic += data[:need]
        got = bytes(self._magic)
        head = min(len(got), len(MAGIC) - 2)
        if got[:head] != MAGIC[:head]:
            raise _Refuse(f"wrong magic: {got!r}", answer=False)
        if len(got) < len(MAGIC):
            return b""
        if got != MAGIC:
            version = int.from_bytes(got[-2:], "big")
            raise _Refuse(f"protocol version {version} is not ours ({VERSION})", answer=False)
        self.state = self.after_magic
        self._after_magic(out)
        return data[need:]

    def _after_magic(self, out: list[bytes]) -> None:
        pass

    def _dispatch(self, msg_id: int, msg: Message, out: list[bytes]) -> str | None:
        self._msg_id = msg_id
        if isinstance(msg, Error):
            # the fields as msgpack gave them: any peer may send an Error before it has
            # identified itself, and the compiled module would check them against
            # Error's ``str`` annotations (a TypeError, not a refusal)
            reason: object = getattr(msg, "message")  # noqa: B009
            code: object = getattr(msg, "code")  # noqa: B009
            raise _Refuse(f"refused by {self._peer_label()}: {_printable(reason)}",
                          _printable(code), answer=False)
        expected = EXPECTED.get(self.state)
        if expected is None or type(msg) is not expected:
            raise ProtocolError(f"unexpected {type(msg).__name__} while in {self.state.value}")
        return self._on_packet(msg, out)

    def _on_packet(self, msg: Any, out: list[bytes]) -> str | None:
        raise NotImplementedError

    def _peer_label(self) -> str:
        return "the peer"

    def _send(self, out: list[bytes], msg: Message) -> None:
        out.append(self._codec.encode(self._msg_id, msg))


def _printable(text: object, limit: int = 300) -> str:
    """The peer's words go into our log: one line, bounded, no control characters."""
    return "".join(c if c.isprintable() else "?" for c in str(text)[:limit])


def _check_types(msg: Message, **types: type) -> None:
    for name, kind in types.items():
        if not isinstance(getattr(msg, name), kind):
            raise ProtocolError(f"bad {type(msg).__name__}: {name} is not {kind.__name__}")


def _check_nonce(msg: Message) -> None:
    nonce = getattr(msg, "nonce")  # noqa: B009 - the message classes differ
    if not isinstance(nonce, bytes) or not NONCE_SIZE <= len(nonce) <= 64:
        raise ProtocolError(f"bad {type(msg).__name__}: nonce must be {NONCE_SIZE}-64 bytes")


class Dialer(_Handshake):
    """The connecting side: it knows whom it dialed and checks that node answers."""

    after_magic = State.AWAIT_CHALLENGE

    def __init__(self, cluster: str, me: str, peer_expected: str, secret: bytes,
                 nonce: bytes | None = None, max_packet: int = MAX_PACKET) -> None:
        super().__init__(cluster, me, secret, nonce, max_packet)
        self.peer_expected = peer_expected

    def start(self) -> bytes:
        return MAGIC + self._codec.encode(0, Identify(self.cluster, self.me, self.nonce))

    def _peer_label(self) -> str:
        return f"node {self.peer_expected!r}"

    def _on_packet(self, msg: Any, out: list[bytes]) -> str | None:
        if isinstance(msg, Challenge):
            _check_types(msg, node=str, proof=bytes)
            _check_nonce(msg)
            if msg.node != self.peer_expected:
                raise _Refuse(f"dialed node {self.peer_expected!r} but node {msg.node!r} "
                              f"answered")
            expected = proof(self.secret, "acceptor", self.cluster, self.me, msg.node,
                             self.nonce, msg.nonce)
            if not hmac.compare_digest(msg.proof, expected):
                raise _Refuse(f"bad secret from node {msg.node!r}")
            self._send(out, Authenticate(proof(self.secret, "dialer", self.cluster, self.me,
                                               msg.node, self.nonce, msg.nonce)))
            self.state = State.AWAIT_WELCOME
            return None
        assert isinstance(msg, Welcome)
        _check_types(msg, node=str)
        if msg.node != self.peer_expected:
            raise ProtocolError(f"Welcome from {msg.node!r:.40}, not {self.peer_expected!r}")
        return self.peer_expected


class Acceptor(_Handshake):
    """The listening side: checks the cluster name, the peer list and the proof."""

    after_magic = State.AWAIT_IDENTIFY

    def __init__(self, cluster: str, me: str, peers: set[str] | frozenset[str], secret: bytes,
                 nonce: bytes | None = None, max_packet: int = MAX_PACKET) -> None:
        super().__init__(cluster, me, secret, nonce, max_packet)
        self.peers = peers
        self.peer: str | None = None
        self._peer_nonce = b""

    def _after_magic(self, out: list[bytes]) -> None:
        # our magic goes out only once theirs matched: a scanner learns nothing
        out.append(MAGIC)

    def _peer_label(self) -> str:
        return f"node {self.peer!r}" if self.peer else "the peer"

    def _on_packet(self, msg: Any, out: list[bytes]) -> str | None:
        if isinstance(msg, Identify):
            _check_types(msg, cluster=str, node=str)
            _check_nonce(msg)
            if msg.cluster != self.cluster:
                raise _Refuse(f"node {msg.node!r} of cluster {msg.cluster!r} is not of "
                              f"cluster {self.cluster!r}")
            if msg.node not in self.peers:
                raise _Refuse(f"node {msg.node!r} is not a configured peer of {self.me!r}")
            self.peer, self._peer_nonce = msg.node, msg.nonce
            self._send(out, Challenge(self.me, self.nonce, proof(
                self.secret, "acceptor", self.cluster, msg.node, self.me, msg.nonce,
                self.nonce)))
            self.state = State.AWAIT_AUTHENTICATE
            return None
        assert isinstance(msg, Authenticate) and self.peer is not None
        _check_types(msg, proof=bytes)
        expected = proof(self.secret, "dialer", self.cluster, self.peer, self.me,
                         self._peer_nonce, self.nonce)
        if not hmac.compare_digest(msg.proof, expected):
            raise _Refuse(f"bad secret from node {self.peer!r}")
        self._send(out, Welcome(self.me))
        return self.peer
