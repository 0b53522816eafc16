"""Differential, through aio-pika and kombu: the same calls against RabbitMQ 3.10 and brokerha.

test_replies.py compares pika's view of each reply; these cases are written
the way aio-pika (aiormq) and kombu (py-amqp) users write them, and compare
what the application sees: the value returned, or the exception's class and
the broker's code and text. Besides the rows of the issue this covers the
behaviours that differed in those libraries' own suites, which turned out
to be the clients' own timing, not the broker: closing a connection while
publishes with confirms are in flight (the one publish caught mid-close gets
ConnectionClosed or a bare Exception, in either order against either broker),
the connection's ``closing`` future after the broker closes it, a kombu
consumer whose message is acknowledged from another thread, and a consumer
whose queue is deleted under it (basic.cancel from the broker: py-amqp raises
ConsumerCancelled, against RabbitMQ too). Skipped when rabbitmq-server
is not installed.
"""

from __future__ import annotations

import asyncio
import re
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120)]


def normalize(text: str, suffix: str) -> str:
    return re.sub(r"0x[0-9a-f]+", "0x", text.replace(suffix, "<s>"))


def described(exc: BaseException) -> str:
    """An exception as the application sees it: class, and code and text when the broker sent them.

    py-amqp's exceptions carry them as attributes (a consumer cancelled by the
    broker only names its method: its tag is a per-process counter).
    """
    name = type(exc).__name__
    if name == "ConsumerCancelled":
        return f"{name} {getattr(exc, 'method_name', '')}"
    if hasattr(exc, "reply_code"):
        parts = (exc.reply_code, exc.reply_text, getattr(exc, "method_name", ""))  # type: ignore[attr-defined]
        return f"{name} {' '.join(str(p) for p in parts if p)}"
    args = [a for a in getattr(exc, "args", ()) if isinstance(a, int | str)]
    return f"{name} {' '.join(str(a) for a in args)}".strip()


# ---- aio-pika -----------------------------------------------------------------------

AioCase = Callable[[Any, str], Awaitable[str]]


async def _aio_utf8_round_trip(conn: Any, s: str) -> str:
    import aio_pika

    ch = await conn.channel()
    ex = await ch.declare_exchange(f"échange{s}", aio_pika.ExchangeType.TOPIC, auto_delete=True)
    q = await ch.declare_queue(f"file ☕{s}", auto_delete=True)
    await q.bind(ex, "clé.#")
    await ex.publish(aio_pika.Message(b"caf\xc3\xa9", headers={"clé": "valeur ✓"}), "clé.un")
    msg = await q.get(timeout=5)
    await msg.ack()
    await q.unbind(ex, "clé.#")
    await q.unbind(ex, "clé.#")  # idempotent
    return f"ok {msg.body.decode()} {msg.headers['clé']} {msg.routing_key}"


async def _aio_passive_missing(conn: Any, s: str) -> str:
    ch = await conn.channel()
    await ch.declare_queue(f"nq{s}", passive=True)
    return "ok"


async def _aio_exclusive_elsewhere(conn: Any, s: str) -> str:
    import aio_pika

    holder = await aio_pika.connect(conn.url)
    try:
        await (await holder.channel()).declare_queue(f"ex{s}", exclusive=True)
        ch = await conn.channel()
        await ch.declare_queue(f"ex{s}", durable=False)
        return "ok"
    finally:
        await holder.close()


async def _aio_delete_if_unused(conn: Any, s: str) -> str:
    ch = await conn.channel()
    q = await ch.declare_queue(f"iu{s}", auto_delete=False)
    tag = await q.consume(lambda m: asyncio.sleep(0))
    try:
        await (await conn.channel()).queue_delete(f"iu{s}", if_unused=True)
        return "ok"
    finally:
        await q.cancel(tag)
        await (await conn.channel()).queue_delete(f"iu{s}")


async def _aio_close_while_publishing(conn: Any, s: str) -> str:
    """Publishes with confirms in flight when the application closes the connection."""
    import aio_pika

    ch = await conn.channel(publisher_confirms=True)
    q = await ch.declare_queue(f"cp{s}", auto_delete=False)
    pending = [asyncio.ensure_future(ch.default_exchange.publish(aio_pika.Message(b"x" * 512),
                                                                 q.name))
               for _ in range(200)]
    await asyncio.sleep(0)
    await conn.close()
    results = await asyncio.gather(*pending, return_exceptions=True)
    # which exception the one publish caught mid-close gets (ConnectionClosed or a bare
    # Exception) depends on the client's own task order, against either broker alike
    kinds = {"closing" if type(r).__name__ in ("ConnectionClosed", "Exception") else
             type(r).__name__ for r in results if isinstance(r, BaseException)}
    check = await aio_pika.connect(conn.url)
    try:
        declared = await (await check.channel()).declare_queue(f"cp{s}", passive=True)
        held = declared.declaration_result.message_count
        await (await check.channel()).queue_delete(f"cp{s}")
    finally:
        await check.close()
    confirmed = sum(1 for r in results if not isinstance(r, BaseException))
    # what may differ with timing: how many made it; what must not: a confirmed one missing
    return (f"closed={conn.is_closed} errors={sorted(kinds) or 'none'} "
            f"confirmed<=held={confirmed <= held}")


async def _aio_closing_after_broker_close(conn: Any, s: str) -> str:
    """The broker closes the connection (540 for immediate): ``closing`` and the close callbacks."""
    seen: list[str] = []
    conn.close_callbacks.add(lambda _c, exc: seen.append(described(exc) if exc else "none"))
    ch = await conn.channel()
    channel = await ch.get_underlay_channel()
    await channel.basic_publish(b"x", routing_key="nowhere", immediate=True)
    try:
        await asyncio.wait_for(conn.transport.connection.closing, 5)
        state = "closing resolved"
    except Exception as exc:  # noqa: BLE001 - the outcome is compared
        state = f"closing raised {described(exc)}"
    for _ in range(50):
        if seen:
            break
        await asyncio.sleep(0.05)
    return f"{state}; callback {seen}"


AIO_CASES: dict[str, AioCase] = {
    "UTF-8 exchange, queue, key and header round trip": _aio_utf8_round_trip,
    "passive declare of a missing queue": _aio_passive_missing,
    "declare of another connection's exclusive queue": _aio_exclusive_elsewhere,
    "queue.delete if-unused of a consumed queue": _aio_delete_if_unused,
    "connection closed while publishes with confirms are in flight": _aio_close_while_publishing,
    "the closing future after the broker closed the connection": _aio_closing_after_broker_close,
}


def aio_outcome(url: str, case: AioCase, suffix: str) -> str:
    import aio_pika

    async def run() -> str:
        conn = await aio_pika.connect(url)
        try:
            return await case(conn, suffix)
        except Exception as exc:  # noqa: BLE001 - the outcome is compared
            return described(exc)
        finally:
            if not conn.is_closed:
                await conn.close()

    return asyncio.run(run())


@pytest.mark.parametrize("case", sorted(AIO_CASES))
def test_aio_pika_sees_what_it_sees_on_rabbitmq(case: str, rabbitmq_url: str,
                                                brokerha_url: str) -> None:
    suffix = f"-{uuid.uuid4().hex[:8]}"
    expected = normalize(aio_outcome(rabbitmq_url, AIO_CASES[case], suffix), suffix)
    got = normalize(aio_outcome(brokerha_url, AIO_CASES[case], suffix), suffix)
    assert got == expected


# ---- kombu (py-amqp) ----------------------------------------------------------------

KombuCase = Callable[[Any, str], str]


def _kombu_simple_queue_utf8(conn: Any, s: str) -> str:
    with conn.SimpleQueue(f"simple é{s}") as q:
        q.put({"clé": "valeur ✓"})
        msg = q.get(timeout=5)
        msg.ack()
        q.consumer.cancel()
        q.queue.delete()
        return f"ok {msg.payload}"


def _kombu_ack_from_another_thread(conn: Any, s: str) -> str:
    """drain_events on this thread, ack on another: the message is gone afterwards."""
    from kombu import Consumer, Producer, Queue

    queue = Queue(f"th{s}", routing_key=f"th{s}", auto_delete=False)
    got: list[Any] = []
    with conn.channel() as ch:
        queue(ch).declare()
        Producer(ch).publish({"hello": "thread"}, routing_key=f"th{s}")
        with Consumer(ch, [queue], callbacks=[lambda body, m: got.append(m)], accept=["json"]):
            conn.drain_events(timeout=5)
            acker = threading.Thread(target=got[0].ack)
            acker.start()
            acker.join(5)
            try:
                conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass
        left = queue(ch).queue_declare(passive=True).message_count
        queue(ch).delete()
    return f"acked={got[0].acknowledged} left={left}"


def _kombu_queue_deleted_under_consumer(conn: Any, s: str) -> str:
    """Another connection deletes the queue: the broker cancels the consumer (basic.cancel)."""
    from kombu import Connection, Consumer, Queue

    queue = Queue(f"dc{s}", auto_delete=False)
    with conn.channel() as ch, Consumer(ch, [queue], callbacks=[lambda b, m: m.ack()]):
        with Connection(conn.as_uri(include_password=True)) as other:
            queue(other.default_channel).delete()
        try:
            conn.drain_events(timeout=2)
            return "no cancel"
        except Exception as exc:  # noqa: BLE001 - the outcome is compared
            return described(exc)


def _kombu_mandatory_return(conn: Any, s: str) -> str:
    from kombu import Exchange, Producer

    returned: list[str] = []
    ex = Exchange(f"rx é{s}", "direct", auto_delete=True)
    with conn.channel() as ch:
        producer = Producer(ch, ex, on_return=lambda exc, *a: returned.append(described(exc)))
        ex(ch).declare()
        producer.publish({"n": 1}, routing_key="nowhere", mandatory=True)
        try:
            conn.drain_events(timeout=2)
        except TimeoutError:
            pass
    return f"returned {returned}"


def _kombu_redeclare_other_durability(conn: Any, s: str) -> str:
    from kombu import Queue

    with conn.channel() as ch:
        Queue(f"rd{s}", durable=False, auto_delete=True)(ch).declare()
        Queue(f"rd{s}", durable=True, auto_delete=True)(ch).declare()
    return "ok"


KOMBU_CASES: dict[str, KombuCase] = {
    "SimpleQueue put/get with a UTF-8 name and payload": _kombu_simple_queue_utf8,
    "a message acknowledged from another thread": _kombu_ack_from_another_thread,
    "the queue deleted under a consumer": _kombu_queue_deleted_under_consumer,
    "a mandatory publish to no queue is returned": _kombu_mandatory_return,
    "a queue redeclared with another durability": _kombu_redeclare_other_durability,
}


def kombu_outcome(url: str, case: KombuCase, suffix: str) -> str:
    from kombu import Connection

    with Connection(url.replace("amqp://", "pyamqp://"), connect_timeout=5) as conn:
        try:
            return case(conn, suffix)
        except Exception as exc:  # noqa: BLE001 - the outcome is compared
            return described(exc)


@pytest.mark.parametrize("case", sorted(KOMBU_CASES))
def test_kombu_sees_what_it_sees_on_rabbitmq(case: str, rabbitmq_url: str,
                                             brokerha_url: str) -> None:
    suffix = f"-{uuid.uuid4().hex[:8]}"
    expected = normalize(kombu_outcome(rabbitmq_url, KOMBU_CASES[case], suffix), suffix)
    got = normalize(kombu_outcome(brokerha_url, KOMBU_CASES[case], suffix), suffix)
    assert got == expected
