"""The in-process hand-off: versions reach servers in the publisher's process from memory, only
after the weight store has committed them, newest first, with the store as the fallback."""

import contextlib
import threading
import time

import numpy as np
import pytest

from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.handoff import Handoff, HandoffClient
from laminar_jax.relay.publisher import Publisher
from laminar_jax.relay.store import WeightStore


def _flat(v):
    return {"w": np.full((64, 8), v, np.float32), "b": np.arange(3, dtype=np.int64) + v}


def test_offers_keep_the_newest_share_memory_and_are_read_only():
    h = Handoff()
    assert h.latest() is None and h.wait_newer(-1, 0.05) is None
    a = _flat(2)
    h.offer(2, a)
    h.offer(1, _flat(1))  # an older offer arriving late is ignored
    v, flat = h.wait_newer(0, 1.0)
    assert v == 2 and h.offered == 1
    assert np.shares_memory(flat["w"], a["w"]) and not flat["w"].flags.writeable
    with pytest.raises(ValueError):
        flat["w"][0, 0] = 7.0
    assert a["w"].flags.writeable  # the offerer's own array is untouched
    assert h.wait_newer(2, 0.05) is None


def test_a_waiting_pull_wakes_when_a_newer_version_is_offered():
    h = Handoff()
    h.offer(1, _flat(1))
    threading.Timer(0.1, h.offer, args=(3, _flat(3))).start()
    t = time.monotonic()
    v, flat = h.wait_newer(1, 5.0)
    assert v == 3 and flat["b"][0] == 3 and time.monotonic() - t < 4.0


class _WatchedStore(WeightStore):
    """The real store, noting what the hand-off held while each write was in progress."""

    def __init__(self, path, handoff):
        super().__init__(path)
        self.handoff, self.seen_during_write = handoff, []

    def write(self, version, flat):
        self.seen_during_write.append(self.handoff.latest())
        time.sleep(0.05)
        return super().write(version, flat)


def test_the_publisher_hands_off_only_what_the_store_committed(tmp_path):
    h = Handoff()
    store = _WatchedStore(str(tmp_path / "weights"), h)
    with Publisher(store=store, relay_addresses=[], handoff=h) as pub:
        for v in (1, 2, 3):
            pub.publish(v, _flat(v))
            pub.flush(30)
            assert h.latest() == v == store.latest()
    assert store.seen_during_write == [None, 1, 2]  # never ahead of the store


class _HeldGcStore(WeightStore):
    """The real store whose gc waits for the test (and can fail), noting its orphan scans."""

    def __init__(self, path, keep_last=2):
        super().__init__(path, keep_last=keep_last)
        self.release, self.in_gc, self.scans, self.fail = threading.Event(), threading.Event(), [], False

    def gc(self, orphans=True):
        self.in_gc.set()
        assert self.release.wait(30)
        self.scans.append(orphans)
        if self.fail:
            raise OSError("gc: disk gone")
        return super().gc(orphans)


def test_the_hand_off_does_not_wait_for_gc_and_flush_does(tmp_path):
    h = Handoff()
    store = _HeldGcStore(str(tmp_path / "weights"))
    pub = Publisher(store=store, relay_addresses=[], handoff=h)
    try:
        pub.publish(1, _flat(1))
        assert store.in_gc.wait(30)  # committed, gc held: the servers have the version already
        assert h.latest() == 1 == store.latest()
        with pytest.raises(TimeoutError, match="gc"):
            pub.flush(0.3)  # flush means written and collected
        store.release.set()
        pub.flush(30)
        for v in range(2, 5):
            pub.publish(v, _flat(v))
            pub.flush(30)
        assert store.versions() == [3, 4]  # keep_last=2: gc ran after every version
        assert store.scans == [True, False, False, False]  # orphans looked for on the first gc only
        store.fail = True
        pub.publish(5, _flat(5))
        with pytest.raises(RuntimeError, match="disk gone"):  # a failed gc is the learner's to see
            pub.flush(30)
    finally:
        store.release.set()
        with contextlib.suppress(RuntimeError):  # the failed gc above, raised again by close's flush
            pub.close(30)


def test_client_reads_the_store_when_nothing_was_handed_off_and_names_what_it_waited_for(tmp_path):
    store = WeightStore(str(tmp_path / "weights"))
    h = Handoff()
    client = HandoffClient(h, RelayClient([], store=store), holder="server-0")
    with pytest.raises(TimeoutError, match="server-0.*newer than -1"):
        client.pull(-1, timeout=0.2)
    store.write(5, _flat(5))  # e.g. a resumed run's version, before anything was handed off
    assert client.latest_version() == 5
    v, flat = client.pull(-1, timeout=10.0)
    assert v == 5 and client.last_source == store.url and flat["b"][0] == 5
    h.offer(6, _flat(6))
    assert client.latest_version() == 6
    v, _ = client.pull(5, timeout=10.0)
    assert v == 6 and client.last_source == "handoff"
    client.close()


def test_servers_placing_the_same_way_share_one_placed_copy_per_version(tmp_path):
    h = Handoff()
    calls = []

    def place(flat):  # e.g. params_on_device: one device copy
        calls.append(flat["b"][0])
        return {k: np.array(v) for k, v in flat.items()}

    def other_place(flat):  # e.g. a server on another mesh
        return dict(flat)

    store = WeightStore(str(tmp_path / "weights"))
    clients = [HandoffClient(h, RelayClient([], store=store), holder=f"server-{i}") for i in range(3)]
    h.offer(1, _flat(1))
    got = [c.pull_placed(0, 1.0, place) for c in clients]
    assert [v for v, _ in got] == [1, 1, 1] and calls == [1]
    assert got[0][1] is got[1][1] is got[2][1]  # one copy for all three
    v, mine = clients[0].pull_placed(0, 1.0, other_place)
    assert v == 1 and mine is not got[0][1] and h.placements == 2
    h.offer(2, _flat(2))
    assert clients[1].pull_placed(1, 1.0, place)[0] == 2 and calls == [1, 2]
    # From the store (nothing newer handed off), each caller places its own.
    store.write(3, _flat(3))
    h2 = HandoffClient(Handoff(), RelayClient([], store=store))
    assert h2.pull_placed(2, 0.1, place)[0] == 3 and calls == [1, 2, 3]
