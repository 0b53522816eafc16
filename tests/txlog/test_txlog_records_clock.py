from brokerha.txlog.engine.clock import HybridCounter
from brokerha.txlog.engine.records import Operation, TxBody, TxIdGenerator, TxRecord


def test_tx_ids_are_strictly_increasing_even_when_the_clock_steps_back() -> None:
    gen = TxIdGenerator("dc1")
    ids = [gen.next(t) for t in (1000, 1000, 999, 10, 1001)]
    assert ids == sorted(ids) and len(set(ids)) == 5
    assert all(i.endswith(".dc1") for i in ids)


def test_tx_ids_survive_a_restart_through_the_persisted_last_value() -> None:
    gen = TxIdGenerator("dc1")
    first = gen.next(5000)
    again = TxIdGenerator("dc1", last=gen.last).next(100)
    assert again > first


def test_records_sort_by_timestamp_then_id() -> None:
    a = TxRecord("b", 5, "dc1", 0)
    b = TxRecord("a", 6, "dc2", 0)
    c = TxRecord("c", 5, "dc3", 0)
    assert sorted([b, c, a], key=lambda r: r.key) == [a, c, b]


def test_enqueue_only_bodies_have_no_dequeue() -> None:
    assert not TxBody("t", (Operation("enqueue", "/q", "m"),)).has_dequeue
    assert TxBody("t", (Operation("dequeue", "/q", "m"),)).has_dequeue


def test_new_timestamp_is_above_every_posted_counter_after_a_clock_step_back() -> None:
    counter = HybridCounter()
    posted = counter.for_post(1000)
    assert counter.new_timestamp(200) > posted


def test_counter_observes_peers_counters_and_timestamps() -> None:
    counter = HybridCounter()
    counter.observe(50, [70, 60])
    assert counter.for_post(10) == 70


def test_counter_resumes_above_its_reservation_after_restart() -> None:
    counter = HybridCounter(reserve_step=100)
    counter.for_post(1000)
    reserved = counter.reservation_needed()
    assert reserved is not None and reserved >= 1000
    assert counter.reservation_needed() is None  # no write until the reservation is used up
    restarted = HybridCounter.restored(reserved)
    assert restarted.new_timestamp(0) > 1000


def test_unsafe_counter_follows_the_wall_clock_back() -> None:
    counter = HybridCounter(safe=False)
    posted = counter.for_post(1000)
    assert counter.new_timestamp(200) < posted
    assert counter.reservation_needed() is None
