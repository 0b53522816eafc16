"""A backup's queues keep no time of their own; a primary's do.

Message TTL and ``x-expires`` run from ``VirtualHost.tick`` over the vhost's
``timed_queues``. On a backup the primary's dequeue and delete events are
authoritative (a backup that expired messages by its own clock would disagree
with the primary about what a queue holds), so its queues are taken off that
set; a promoted node puts them back, counting ``x-expires`` from the promotion.
Their vhosts are marked ``following`` meanwhile, so that a policy that
gives a queue a TTL or a lower limit (``broker/policy_effects.py``) starts no
timer and trims nothing there either; on a partitioned node, which leads some
groups' queues and follows others' on the same vhosts, the followed queues are
marked one by one (``VirtualHost.followed``).
"""

from __future__ import annotations

from brokerha.broker.broker import Broker
from brokerha.broker.placement import GroupScope
from brokerha.broker.queue import Queue
from brokerha.broker.vhost import VirtualHost


def hold_timers(vhost: VirtualHost, queue: Queue) -> None:
    vhost.following = True
    vhost.timed_queues.discard(queue)


def hold_all_timers(broker: Broker) -> None:
    for vhost in broker.vhosts.values():
        vhost.following = True
        vhost.timed_queues.clear()


def resume_timers(broker: Broker, now: float) -> None:
    for vhost in broker.vhosts.values():
        vhost.following = False
        for queue in vhost.queues.values():
            if queue.has_timers and queue not in vhost.timed_queues:
                queue.last_used = now
                vhost.timed_queues.add(queue)


def hold_queue_timers(vhost: VirtualHost, queue: Queue) -> None:
    """``hold_timers`` for one queue only (``VirtualHost.followed``): a partitioned node's
    vhost may hold queues of a group this node leads beside those it follows."""
    vhost.followed.add(queue)
    vhost.timed_queues.discard(queue)


def hold_scope_timers(broker: Broker, scope: GroupScope) -> None:
    """``hold_all_timers`` for one replication group's queues (a partitioned node, where
    other groups' queues on the same vhosts may be this node's as a primary): followed
    per queue, the vhosts' ``following`` left alone."""
    for vhost in broker.vhosts.values():
        for queue in [q for q in vhost.queues.values() if scope.queues(q)]:
            hold_queue_timers(vhost, queue)


def resume_scope_timers(broker: Broker, scope: GroupScope, now: float) -> None:
    """``resume_timers`` for one replication group's queues."""
    for vhost in broker.vhosts.values():
        for queue in vhost.queues.values():
            if not scope.queues(queue):
                continue
            vhost.followed.discard(queue)
            if queue.has_timers and queue not in vhost.timed_queues:
                queue.last_used = now
                vhost.timed_queues.add(queue)
