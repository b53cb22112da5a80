"""Training rank 0 ending a streaming rollout pool: ``close`` must wait for every replica's ``stopped`` answer,
and the result threads must keep draining after ``close`` dropped the link's bridge (a CI run once failed when a
segment's ``finished`` arrived after ``stop``: the thread died on the dropped bridge, nobody posted the receive for
``stopped``, and the pool leader's send failed when rank 0 left)."""

import queue
import threading
import time
import types

from verl.hybrid_engine.cross_pool import PoolPlacement
from verl.workers.rollout_pool import RolloutPoolLink


class FakeBridge:
    """Rank 0's side of the bridge: each replica leader answers `stop` with a late `finished`, then `stopped`."""

    def __init__(self, placement):
        self.placement = placement
        self.inbox = {placement.rollout_rank(k, 0): queue.Queue() for k in range(placement.replicas)}
        self.sent = []
        self.received_stopped = []

    def send_object(self, command, dst):
        self.sent.append((command["op"], dst))
        if command["op"] == "stop" and dst in self.inbox:
            def answer(leader=dst):
                time.sleep(0.2)  # a segment still running when `stop` arrived
                self.inbox[leader].put({"op": "finished", "replica": 0, "groups": []})
                time.sleep(0.2)
                self.inbox[leader].put({"op": "stopped", "replica": 0, "groups": []})
            threading.Thread(target=answer, daemon=True).start()

    def recv_result(self, src, timeout=None):
        message = self.inbox[src].get(timeout=10)
        if message["op"] == "stopped":
            self.received_stopped.append(src)
        return message


def make_link(replicas, tp):
    placement = PoolPlacement(types.SimpleNamespace(world_size=2), tp, replicas)
    link = object.__new__(RolloutPoolLink)
    link.placement, link.rank = placement, 0
    link.bridge = FakeBridge(placement)
    return link


def test_close_waits_for_every_replica_to_answer_stop():
    link = make_link(replicas=2, tp=2)
    bridge = link.bridge
    link.start_stream(params=None, groups_per_segment=1, seed=0, version=0)
    errors = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        link.close()
    finally:
        threading.excepthook = previous
    assert sorted(bridge.received_stopped) == [link.placement.rollout_rank(k, 0) for k in range(2)]
    assert not any(thread.is_alive() for thread in link._receivers)
    assert errors == []
    assert link.bridge is None
    # every pool rank (both TP ranks of both replicas) was told to stop, exactly once
    assert sorted(dst for op, dst in bridge.sent if op == "stop") == [2, 3, 4, 5]
    link.close()  # idempotent
