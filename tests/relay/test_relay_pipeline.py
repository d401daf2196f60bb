"""Chunk size choice, forwarding in arrival order, and the publisher's stall path (no needless copies)."""

import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.flat import start_host_copies
from laminar_jax.relay.manifest import (chunk_segments, chunk_span, choose_chunk_bytes, first_array,
                                        num_chunks, plan_layout)
from laminar_jax.relay.publisher import Publisher, chunk_bytes_for, is_immutable
from laminar_jax.relay.push import ArraysSource
from laminar_jax.relay.server import RelayServer
from laminar_jax.relay.store import GcReport
from laminar_jax.net.wire import connect

MB = 1 << 20


def test_chunk_size_follows_the_link_rate_and_the_version_size():
    # Rate-limited link: one chunk crosses a link in chunk_time_s (200 MB/s * 5 ms = 1 MiB).
    assert choose_chunk_bytes(512 * MB, 32 * MB, 256 << 10, 200 * MB, 0.005, 64) == 1 * MB
    # Unlimited link: about pipeline_chunks chunks per version, capped by the largest chunk.
    assert choose_chunk_bytes(128 * MB, 32 * MB, 256 << 10, 0, 0.005, 64) == 2 * MB
    assert choose_chunk_bytes(4096 * MB, 32 * MB, 256 << 10, 0, 0.005, 64) == 32 * MB
    # A small version or a slow link never goes below the smallest chunk...
    assert choose_chunk_bytes(1 * MB, 32 * MB, 256 << 10, 0, 0.005, 64) == 256 << 10
    assert choose_chunk_bytes(512 * MB, 32 * MB, 256 << 10, 1 * MB, 0.005, 64) == 256 << 10
    # ...unless the largest chunk is smaller still (chunk_bytes always caps).
    assert choose_chunk_bytes(512 * MB, 64 << 10, 256 << 10, 0, 0.005, 64) == 64 << 10
    # Page multiples: odd rates round up to 4 KiB.
    c = choose_chunk_bytes(512 * MB, 32 * MB, 4096, 123_457_000, 0.005, 64)
    assert c % 4096 == 0 and 123_457_000 * 0.005 <= c < 123_457_000 * 0.005 + 4096


def test_publisher_cuts_versions_into_the_chosen_chunks():
    cfg = RelaySection(chunk_bytes=32 * MB, min_chunk_bytes=64 << 10, link_rate_bytes_per_s=64 * MB,
                       link_burst_bytes=1 * MB, chunk_time_s=0.002, pipeline_chunks=4)
    flat = {"w": np.arange(1 << 20, dtype=np.float32)}  # 4 MiB
    want = chunk_bytes_for(cfg, 4 * MB)
    assert want == (64 * MB * 2 // 1000 + 4095) // 4096 * 4096  # the rate rule: ~131 KiB
    with RelayServer(cfg) as server, Publisher(cfg, relay_addresses=[server.address]) as pub:
        pub.publish(1, flat)
        pub.flush(30)
        peer = connect(server.address, 2.0, 10.0)
        try:
            h, _ = peer.request({"op": "pull", "newer_than": 0, "wait_s": 5}, "pulled", "version 1")
        finally:
            peer.close()
        assert h["chunk_bytes"] == want
        _, got = RelayClient([server.address], config=cfg).pull(0, timeout=5, copy=True)
        np.testing.assert_array_equal(got["w"], flat["w"])


def test_chunk_segments_from_the_first_array_hint_match_a_full_scan():
    rng = np.random.default_rng(0)
    flat = {f"a{i}": rng.random(int(n), dtype=np.float32) for i, n in enumerate(rng.integers(0, 3000, 40))}
    m = plan_layout(flat, 1)
    pairs = [(e, flat[e.name]) for e in m.entries]
    offsets = [e.offset for e in m.entries]
    for chunk in (4096, 10_000, 65536):
        for i in range(num_chunks(m.total_bytes, chunk)):
            start, stop = chunk_span(i, m.total_bytes, chunk)
            fast = b"".join(bytes(s) for s in chunk_segments(pairs, start, stop, first_array(offsets, start)))
            assert fast == b"".join(bytes(s) for s in chunk_segments(pairs, start, stop))
    assert first_array(offsets, 0) == 0 and first_array([0, 64, 64, 128], 64) == 2


def test_relay_forwards_chunks_in_arrival_order_even_out_of_order():
    """Chunks reach relay A out of order (and one twice); A forwards each as it verifies it, and B
    ends bit-identical. Exercises the arrival log the forwarder walks."""
    cfg = RelaySection(chunk_bytes=64 << 10, io_timeout_s=20.0)
    flat = {"w": np.random.default_rng(1).random(100_000).astype(np.float32),
            "b": np.arange(7, dtype=np.int64)}
    m = plan_layout(flat, 3)
    src = ArraysSource(m, flat, cfg.chunk_bytes)
    order = list(range(src.n))[::-1]
    order.insert(2, order[0])  # a duplicate: ignored, never forwarded twice
    with RelayServer(cfg) as b, RelayServer(cfg, successors=[b.address]) as a:
        peer = connect(a.address, 2.0, 10.0)
        try:
            peer.request({"op": "push", "version": 3, "manifest": m.to_dict(), "chunk_bytes": cfg.chunk_bytes},
                         "have", "handshake")
            for i in order:
                segs, vouch = src.chunk(i)
                peer.send({"op": "chunk", "version": 3, "index": i, **vouch}, segs)
            missing, _ = peer.request({"op": "end", "version": 3}, "missing", "ack")
            assert missing["chunks"] == []
        finally:
            peer.close()
        assert RelayClient([b.address], config=cfg).wait_for(3, 20) == 3
        _, got = RelayClient([b.address], config=cfg).pull(2, timeout=5, copy=True)
        for k in flat:
            assert got[k].tobytes() == flat[k].tobytes()
        assert b.stats()["chunks_in"] == src.n  # each chunk crossed the second link once
        a.check()
        b.check()


def test_only_arrays_nobody_can_change_count_as_immutable():
    rw = np.ones(4)
    assert not is_immutable(rw)
    view = rw[1:]
    view.flags.writeable = False
    assert not is_immutable(view)  # read-only view of writeable memory: the owner may still write
    owned = np.ones(4)
    owned.flags.writeable = False
    assert is_immutable(owned)
    assert is_immutable(np.frombuffer(b"abcdefgh", np.uint8))
    assert not is_immutable(np.frombuffer(bytearray(8), np.uint8))
    assert is_immutable(np.asarray(jnp.arange(6.0)))  # a jax array's host view


class FakeStore:
    """Records what the publisher writes (pure publisher policy under test, no files)."""

    def __init__(self):
        self.written: dict[int, dict] = {}

    def write(self, version, flat):
        self.written[version] = dict(flat)

    def gc(self, orphans=True):
        return GcReport((), (), ())


def test_publisher_copies_writeable_arrays_and_takes_immutable_ones_by_reference():
    store = FakeStore()
    rw = np.arange(8, dtype=np.float32)
    ro = np.arange(8, dtype=np.float32) * 2
    ro.flags.writeable = False
    jx = jnp.arange(8, dtype=jnp.float32) * 3
    with Publisher(RelaySection(), store=store) as pub:
        pub.publish(1, {"rw": rw, "ro": ro, "jx": jx})
        rw[:] = -1  # the caller may reuse its buffer once publish() returns
        pub.flush(30)
    got = store.written[1]
    np.testing.assert_array_equal(got["rw"], np.arange(8, dtype=np.float32))
    assert not np.shares_memory(got["rw"], rw)
    assert np.shares_memory(got["ro"], ro)  # no second host copy of weights nobody can change
    np.testing.assert_array_equal(got["jx"], np.arange(8, dtype=np.float32) * 3)
    got = start_host_copies([jx, rw])  # CPU backend: np.asarray is a view, no copy to start
    assert got[0] is jx and got[1] is rw


def test_pinned_host_copies_hold_the_values_in_host_memory():
    # The accelerator path of start_host_copies, run on the CPU's own pinned host memory.
    import jax
    from laminar_jax.naming import pinned_host_sharding

    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    y = jnp.ones((5,), jnp.bfloat16)
    shardings = [pinned_host_sharding(a.sharding) for a in (x, y)]
    got = jax.device_put([x, y], shardings)  # as start_host_copies does with a GPU's arrays
    assert [g.sharding.memory_kind for g in got] == ["pinned_host"] * 2
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(y))
    assert all(a is b for a, b in zip(start_host_copies(got), got))  # in host memory: no copy
    assert isinstance(jax.device_get(got[0]), np.ndarray)


class _SlowLeaf:
    """An array-like whose host copy blocks until released (a slow device-to-host copy)."""

    shape, dtype = (4,), np.dtype(np.float32)

    def __init__(self, release: threading.Event):
        self.release = release

    def __array__(self, dtype=None, copy=None):
        assert self.release.wait(30)
        return np.zeros(4, np.float32)


def test_a_version_overtaken_during_its_host_copy_is_superseded_not_sent_after_the_newer():
    store = FakeStore()
    release = threading.Event()
    with Publisher(RelaySection(), store=store) as pub:
        errors = []
        t = threading.Thread(target=lambda: _catch(errors, pub.publish, 1, {"w": _SlowLeaf(release)}))
        t.start()
        deadline = time.monotonic() + 30
        while pub._last_version < 1:  # version 1 reserved its number, its copy is in flight
            assert time.monotonic() < deadline, "publish(1) never reserved its version"
            t.join(0.01)
        pub.publish(2, {"w": np.ones(4, np.float32)})
        pub.flush(30)
        release.set()
        t.join(30)
        pub.flush(30)
        assert errors == []
        with pytest.raises(ValueError, match="must be an int > last version 2"):
            pub.publish(2, {"w": np.ones(4, np.float32)})
        s = pub.stats()
    assert sorted(store.written) == [2] and s.published == 2 and s.superseded == 1


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - surfaced by the test's assertion
        errors.append(e)


_OWNER = """
import sys, time
sys.path.insert(0, {root!r})
from laminar_jax.relay.chain import start_local_chain
chain = start_local_chain(2)
print(" ".join(str(p.pid) for p in chain.procs), flush=True)
time.sleep(60)
"""


def test_relay_workers_exit_when_their_owner_dies_without_cleanup():
    import os
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    owner = subprocess.Popen([sys.executable, "-c", _OWNER.format(root=root)], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(x) for x in owner.stdout.readline().split()]
        assert len(pids) == 2
        owner.send_signal(signal.SIGKILL)  # no atexit, no LocalChain.stop(): as when OOM-killed
        owner.wait(10)
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in pids if _running(p)]
        assert alive == [], f"relay workers {alive} outlived their owner"
    finally:
        owner.kill()
        owner.stdout.close()
        for p in pids:  # never leave a relay behind, even when the assertion failed
            if _running(p):
                os.kill(p, signal.SIGKILL)


def _running(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
