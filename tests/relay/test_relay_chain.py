"""Relay processes on loopback: chain delivery, failover, checksums, fallbacks, publisher policy."""

import os
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from laminar_jax.relay.chain import start_local_chain
from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.manifest import plan_layout
from laminar_jax.relay.publisher import Publisher
from laminar_jax.relay.push import ArraysSource
from laminar_jax.relay.server import RelayServer
from laminar_jax.relay.store import WeightStore
from laminar_jax.net.wire import connect
from tests.subprocess_env import child_env

CFG = RelaySection(chunk_bytes=256 << 10, io_timeout_s=20.0)


def _params(seed: int, mb: float = 2.0) -> dict:
    """A small model-like pytree: f32 matrices, a bf16 matrix with every bit pattern, a scalar."""
    rng = np.random.default_rng(seed)
    n = int(mb * (1 << 20) / 4 / 256)
    return {"layers": [{"w": rng.standard_normal((n // 4, 256), dtype=np.float32),
                        "b": rng.standard_normal(256, dtype=np.float32)} for _ in range(4)],
            "bf16": rng.integers(0, 2**16, (129, 31), dtype=np.uint16).view(ml_dtypes.bfloat16),
            "step": np.array(seed, np.int32)}


def _host_flat(tree) -> dict:
    from laminar_jax.relay.flat import flatten_tree
    return {k: np.array(v) for k, v in flatten_tree(tree).items()}


def _assert_bits(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert got[k].tobytes() == want[k].tobytes(), k


@pytest.mark.parametrize("n", [1, 2, 4])
def test_chain_delivers_bit_identical_versions(tmp_path, n):
    store = WeightStore(str(tmp_path / "store"))
    p1, p2 = _params(1), _params(2)
    with start_local_chain(n, CFG) as chain, Publisher(CFG, store, chain.addresses) as pub:
        pub.publish(1, {"layers": [{k: jnp.asarray(v) for k, v in d.items()} for d in p1["layers"]],
                        "bf16": jnp.asarray(p1["bf16"]), "step": jnp.asarray(p1["step"])})  # jax leaves
        pub.publish(2, p2)  # numpy leaves
        pub.flush(60)
        want = _host_flat(p2)
        for i, addr in enumerate(chain.addresses):
            client = RelayClient([addr], config=CFG)
            assert client.wait_for(2, 30) == 2
            version, got = client.pull(newer_than=1, timeout=10)
            assert version == 2
            _assert_bits(got, want)
        tcp = RelayClient([chain.addresses[-1]], config=RelaySection(local_transport="tcp"))
        version, got = tcp.pull(newer_than=0, timeout=10)
        assert version == 2
        _assert_bits(got, want)
        _assert_bits(store.read(2), want)
        assert pub.stats().relayed >= 1 and pub.stats().stored >= 1


def test_killing_a_middle_relay_mid_transfer_still_reaches_every_survivor():
    cfg = RelaySection(chunk_bytes=256 << 10, link_rate_bytes_per_s=16 << 20, link_burst_bytes=256 << 10,
                       io_timeout_s=20.0, dead_retry_s=60.0)
    params = _params(7, mb=24.0)  # ~1.5 s per link at 16 MB/s; hops overlap
    with start_local_chain(4, cfg) as chain, Publisher(cfg, relay_addresses=chain.addresses) as pub:
        pub.publish(1, params)
        deadline = time.monotonic() + 30
        while chain.versions(1)["partial"].get("1", 0) < 8:
            assert time.monotonic() < deadline, "relay 1 never started receiving"
            time.sleep(0.01)
        assert 1 not in chain.versions(3)["complete"]  # truly mid-transfer
        chain.kill(1)
        for i in (0, 2, 3):
            assert RelayClient([chain.addresses[i]], config=cfg).wait_for(1, 30) == 1
        _, got = RelayClient([chain.addresses[3]], config=cfg).pull(0, timeout=10)
        _assert_bits(got, _host_flat(params))
        # The rebuilt chain carries the next version too.
        pub.publish(2, _params(8, mb=1.0))
        for i in (0, 2, 3):
            assert RelayClient([chain.addresses[i]], config=cfg).wait_for(2, 30) == 2


def test_a_chunk_with_a_bad_checksum_is_fetched_again():
    flat = _host_flat(_params(3, mb=1.0))
    m = plan_layout(flat, 5)
    src = ArraysSource(m, flat, CFG.chunk_bytes)
    with RelayServer(CFG) as server:
        peer = connect(server.address, 2.0, 10.0)
        try:
            have, _ = peer.request({"op": "push", "version": 5, "manifest": m.to_dict(),
                                    "chunk_bytes": CFG.chunk_bytes}, "have", "handshake")
            assert have["chunks"] == [] and not have["complete"]
            for i in range(src.n):
                segs, vouch = src.chunk(i)
                payload = bytearray(b"".join(bytes(s) for s in segs))
                if i == 1:
                    payload[17] ^= 0x01  # corrupted on the wire; crc is of the good bytes
                peer.send({"op": "chunk", "version": 5, "index": i, **vouch}, [payload])
            missing, _ = peer.request({"op": "end", "version": 5}, "missing", "ack")
            assert missing["chunks"] == [1]
            assert server.versions_held() == []
            segs, vouch = src.chunk(1)
            peer.send({"op": "chunk", "version": 5, "index": 1, **vouch}, segs)
            missing, _ = peer.request({"op": "end", "version": 5}, "missing", "ack")
            assert missing["chunks"] == []
        finally:
            peer.close()
        assert server.versions_held() == [5] and server.stats()["bad_chunks"] == 1
        version, got = RelayClient([server.address], config=CFG).pull(-1, timeout=5)
        assert version == 5
        _assert_bits(got, flat)


def test_pull_falls_back_to_another_relay_then_to_the_store(tmp_path):
    store = WeightStore(str(tmp_path / "store"))
    with start_local_chain(2, CFG) as chain, Publisher(CFG, store, chain.addresses) as pub:
        pub.publish(1, _params(1))
        pub.flush(60)
        RelayClient([chain.addresses[1]], config=CFG).wait_for(1, 30)
        want = _host_flat(_params(1))
        client = RelayClient(chain.addresses, store=store, config=CFG)
        chain.kill(0)
        version, got = client.pull(-1, timeout=10)
        assert (version, client.last_source) == (1, chain.addresses[1])
        _assert_bits(got, want)
        chain.kill(1)
        version, got = client.pull(-1, timeout=10)
        assert (version, client.last_source) == (1, store.url)
        _assert_bits(got, want)
        with pytest.raises(TimeoutError) as e:
            client.pull(newer_than=1, timeout=0.5)
        msg = str(e.value)
        assert "newer_than=1" in msg and chain.addresses[0] in msg and chain.addresses[1] in msg
        assert store.url in msg


def test_pull_timeout_names_the_relay_and_version():
    with RelayServer(CFG) as server:
        client = RelayClient([server.address], config=CFG)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            client.pull(newer_than=5, timeout=0.3)
        assert time.monotonic() - t0 < 5
        assert server.address in str(e.value) and "newer than 5" in str(e.value)
        assert client.latest_version(2) is None


def test_relay_keeps_only_the_newest_versions_in_memory():
    cfg = RelaySection(chunk_bytes=64 << 10, keep_in_memory=2)
    with RelayServer(cfg) as server, Publisher(cfg, relay_addresses=[server.address]) as pub:
        for v in range(1, 5):
            pub.publish(v, _params(v, mb=0.5))
            pub.flush(30)
        assert server.versions_held() == [3, 4]
        version, got = RelayClient([server.address], config=cfg).pull(2, timeout=5)
        assert version == 4
        _assert_bits(got, _host_flat(_params(4, mb=0.5)))


def test_publisher_supersedes_unsent_versions_and_delivers_the_newest():
    cfg = RelaySection(chunk_bytes=64 << 10, link_rate_bytes_per_s=8 << 20, link_burst_bytes=64 << 10,
                       max_inflight_versions=1)
    with RelayServer(cfg) as server, Publisher(cfg, relay_addresses=[server.address]) as pub:
        for v in range(1, 7):  # each push takes ~0.25 s; publishes come far faster
            pub.publish(v, _params(v, mb=2.0))
            assert len(pub._pending) <= cfg.max_inflight_versions
        pub.flush(60)
        s = pub.stats()
        assert s.published == 6 and s.superseded >= 3 and s.relayed + s.superseded == 6
        assert server.versions_held()[-1] == 6
        _, got = RelayClient([server.address], config=cfg).pull(5, timeout=5)
        _assert_bits(got, _host_flat(_params(6, mb=2.0)))


def test_publisher_reraises_a_background_failure(tmp_path):
    store = WeightStore(str(tmp_path / "store"))
    store.write(10, {"w": np.zeros(2, np.float32)})
    pub = Publisher(RelaySection(), store=store)
    pub.publish(3, {"w": np.ones(2, np.float32)})
    with pytest.raises(RuntimeError, match="version 3 must be > newest committed version 10"):
        pub.flush(30)
    with pytest.raises(RuntimeError, match="background failure"):
        pub.publish(4, {"w": np.ones(2, np.float32)})
    fresh = Publisher(RelaySection(), store=store)
    fresh.publish(11, {"w": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="must be an int > last version 11"):
        fresh.publish(11, {"w": np.ones(2, np.float32)})
    fresh.close(30)
    assert store.versions() == [10, 11]


_SHARDED = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from laminar_jax.relay.config import RelaySection
    from laminar_jax.relay.server import RelayServer
    from laminar_jax.relay.publisher import Publisher
    from laminar_jax.relay.client import RelayClient
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    params = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32), "b": np.arange(32, dtype=np.float32)}
    shardings = {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P("model"))}
    cfg = RelaySection(chunk_bytes=4096)
    with RelayServer(cfg) as server, Publisher(cfg, relay_addresses=[server.address]) as pub:
        pub.publish(1, {"net": params})
        pub.flush(30)
        version, got = RelayClient([server.address], config=cfg).pull(0, 10, shardings={"net": shardings})
    assert version == 1 and set(got) == {"net"}
    for k in params:
        a = got["net"][k]
        assert isinstance(a, jax.Array) and a.sharding == shardings[k], (k, a.sharding)
        assert len(a.addressable_shards) == 8
        np.testing.assert_array_equal(np.asarray(a), params[k])
    print("SHARDED_OK")
""")


def test_pull_reshards_onto_the_rollout_devices():
    out = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True, timeout=120,
                         env=child_env(JAX_PLATFORMS="cpu"))
    assert "SHARDED_OK" in out.stdout, out.stderr[-3000:]


def test_zero_copy_pull_pins_relay_memory_until_released():
    cfg = RelaySection(chunk_bytes=64 << 10, keep_in_memory=1)
    with RelayServer(cfg) as server, Publisher(cfg, relay_addresses=[server.address]) as pub:
        client = RelayClient([server.address], config=cfg)
        pub.publish(1, _params(1, mb=0.5))
        pub.flush(30)
        _, held = client.pull(-1, timeout=5)  # read-only views of the relay's memfd
        assert not next(iter(held.values())).flags.writeable
        for v in range(2, 6):
            pub.publish(v, _params(v, mb=0.5))
            pub.flush(30)
        _assert_bits(held, _host_flat(_params(1, mb=0.5)))  # never recycled while mapped
        reused_before = server.stats().get("buffers_reused", 0)
        assert reused_before >= 2  # versions 2..5 cycle through pooled buffers
        del held  # the client closes its unix connection; the relay then unpins and recycles the buffer
        deadline = time.monotonic() + 10
        while server.stats().get("unmaps", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.stats().get("unmaps", 0) == 1
        for v in range(6, 9):
            pub.publish(v, _params(v, mb=0.5))
            pub.flush(30)
        assert server.stats()["buffers_reused"] >= reused_before + 3
        _, got = client.pull(7, timeout=5, copy=True)
        assert next(iter(got.values())).flags.writeable
        _assert_bits(got, _host_flat(_params(8, mb=0.5)))


def test_publisher_reconnects_a_link_the_relay_closed_while_idle():
    """The relay drops a connection silent for io_timeout_s; the publisher's next push must not
    count that relay as dead (the run's first publish after a long warm-up hit this)."""
    cfg = RelaySection(chunk_bytes=64 << 10, io_timeout_s=1.0, heartbeat_s=0.1)
    with RelayServer(cfg) as server, Publisher(cfg, relay_addresses=[server.address]) as pub:
        pub.publish(1, _params(1, mb=0.2))
        pub.flush(30)
        time.sleep(2.2)  # > io_timeout_s: the relay closes the idle link
        pub.publish(2, _params(2, mb=0.2))
        pub.flush(30)
        assert pub.stats().relay_failures == ()
        assert 2 in server.versions_held()
        version, got = RelayClient([server.address], config=cfg).pull(1, timeout=5)
        assert version == 2
        _assert_bits(got, _host_flat(_params(2, mb=0.2)))


def _wait_until(pred, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_version_published_again_is_kept_when_equal_and_replaced_down_the_chain_when_not():
    """A restarted learner publishes its last versions again, each under a new publish id. The same
    bytes are kept without a transfer; other bytes replace the held ones on every relay."""
    cfg = RelaySection(chunk_bytes=64 << 10, io_timeout_s=5.0, heartbeat_s=0.1)
    first, other = _params(1, mb=0.5), _params(2, mb=0.5)
    with RelayServer(cfg) as tail, RelayServer(cfg, successors=[tail.address]) as head:
        def publish(params):
            with Publisher(cfg, relay_addresses=[head.address]) as pub:
                pub.publish(1, params)
                pub.flush(30)
                return pub.stats()

        publish(first)
        assert RelayClient([tail.address], config=cfg).wait_for(1, 10) == 1
        chunks_in = head.stats()["chunks_in"]
        stats = publish(first)  # the same bytes, another publish
        assert stats.relay_failures == () and stats.relayed == 1
        assert head.stats()["republished_same"] == 1 and head.stats()["chunks_in"] == chunks_in
        stats = publish(other)  # version 1 again, other bytes: replaces it here and on the successor
        assert stats.relay_failures == ()
        assert head.stats()["republished_replaced"] == 1
        assert _wait_until(lambda: tail.stats().get("republished_replaced", 0) == 1)
        for relay in (head, tail):
            assert RelayClient([relay.address], config=cfg).wait_for(1, 10) == 1
            version, got = RelayClient([relay.address], config=cfg).pull(0, timeout=5, copy=True)
            assert version == 1
            _assert_bits(got, _host_flat(other))
