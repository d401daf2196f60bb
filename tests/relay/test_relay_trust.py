"""Relay trust: the run key, authenticated frames, signed versions, read-only shared weights and
bounded memory per peer. A bounded fuzz of hostile peers on loopback."""

import logging
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from laminar_jax.net import auth
from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.manifest import plan_layout
from laminar_jax.relay.publisher import Publisher
from laminar_jax.relay.push import ArraysSource
from laminar_jax.relay.server import RelayServer
from laminar_jax.net.wire import MAGIC, AuthError, Peer, RemoteError, WireError, connect

LEARNER = auth.RunKeys.generate()  # the learner's keys; relays and clients get HOSTS
HOSTS = LEARNER.for_hosts()
KEY = LEARNER.link
SIGNER = LEARNER.signer("test learner")
CFG = RelaySection(chunk_bytes=64 << 10, io_timeout_s=3.0, heartbeat_s=0.1)


def _flat(seed=0, n=50_000):
    return {"w": np.random.default_rng(seed).random(n).astype(np.float32), "b": np.arange(5, dtype=np.int64)}


def _published(server, flat, version=1, keys=LEARNER):
    with Publisher(CFG, relay_addresses=[server.address], keys=keys) as pub:
        pub.publish(version, flat)
        pub.flush(20)
    assert RelayClient([server.address], config=CFG, keys=keys and keys.for_hosts()).wait_for(version, 10) == version


def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- the run key
def test_run_key_is_created_once_owner_only_and_refused_when_readable_by_others(tmp_path):
    k1 = auth.run_key(str(tmp_path))
    assert len(k1) == 32 and auth.run_key(str(tmp_path)) == k1
    path = tmp_path / auth.KEY_FILE
    assert (path.stat().st_mode & 0o777) == 0o600
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="owner-only"):
        auth.run_key(str(tmp_path))


# ---- authenticated traffic
@pytest.mark.parametrize("transport", ["memfd", "tcp"])
def test_authenticated_publish_and_pull_roundtrip(transport):
    cfg = RelaySection(chunk_bytes=64 << 10, local_transport=transport)
    flat = _flat()
    with RelayServer(cfg, keys=HOSTS) as server:
        _published(server, flat)
        v, got = RelayClient([server.address], config=cfg, keys=HOSTS).pull(0, timeout=10, copy=True)
        assert v == 1
        for k in flat:
            np.testing.assert_array_equal(got[k], flat[k])
        assert server.stats().get("auth_rejected", 0) == 0


def test_peers_without_the_key_are_dropped_counted_and_logged_once(caplog):
    with RelayServer(CFG, keys=HOSTS) as server:
        _published(server, _flat())
        caplog.set_level(logging.WARNING, logger="laminar_jax.relay.server")
        for keys in (None, None, auth.RunKeys(b"x" * 32, HOSTS.public)):  # keyless twice, then a wrong key
            with pytest.raises((AuthError, WireError, OSError), match="run key|authentication|closed|lost"):
                RelayClient([server.address], config=CFG, keys=keys).pull(0, timeout=1)
        assert _wait(lambda: server.stats().get("auth_rejected", 0) >= 3)
        logged = [r for r in caplog.records if "failed authentication" in r.getMessage()]
        assert len(logged) == 1 and "127.0.0.1" in logged[0].getMessage()


def test_control_ops_without_the_key_do_nothing():
    with RelayServer(CFG, keys=HOSTS) as server:
        for op in ({"op": "stop"}, {"op": "set_successors", "addresses": ["127.0.0.1:1"]}):
            peer = connect(server.address, 2.0, 3.0)  # no key
            try:
                with pytest.raises((AuthError, WireError)):
                    peer.request(op, "ok", "a control op")
            finally:
                peer.close()
        time.sleep(0.2)
        assert not server.stopped and server.stats()["successors"] == []
        peer = connect(server.address, 2.0, 3.0, KEY)  # with the key they work
        try:
            peer.request({"op": "set_successors", "addresses": ["127.0.0.1:1"]}, "ok", "set_successors")
        finally:
            peer.close()
        assert server.stats()["successors"] == ["127.0.0.1:1"]


def _push_header(version, flat, signer, signature="auto"):
    m = plan_layout(flat, version)
    src = ArraysSource(m, flat, CFG.chunk_bytes, signer)
    h = {"op": "push", "version": version, "manifest": m.to_dict(), "chunk_bytes": CFG.chunk_bytes}
    sig = src.signature if signature == "auto" else signature
    if sig is not None:
        h["signature"] = sig
    return h, src


def test_forged_versions_are_refused_and_the_learner_keeps_reaching_rollouts():
    flat = _flat(1)
    with RelayServer(CFG, keys=HOSTS) as server:
        _published(server, flat, 1)
        forged = {"w": np.zeros(50_000, np.float32), "b": np.zeros(5, np.int64)}
        for sig in (None, "00" * 32, auth.sign_version(SIGNER, 1_000_000_001, "x")):
            peer = connect(server.address, 2.0, 3.0, KEY)  # even a key holder cannot push unsigned versions
            try:
                h, _ = _push_header(1_000_000_000, forged, SIGNER, signature=sig)
                with pytest.raises(RemoteError, match="signature"):
                    peer.request(h, "have", "forged push")
            finally:
                peer.close()
        peer = connect(server.address, 2.0, 3.0)  # and a keyless one is dropped at once
        try:
            h, _ = _push_header(1_000_000_000, forged, None)
            with pytest.raises((AuthError, WireError)):
                peer.request(h, "have", "forged push")
        finally:
            peer.close()
        assert server.versions_held() == [1] and server.stats()["partial"] == {}
        _published(server, _flat(2), 2)
        v, got = RelayClient([server.address], config=CFG, keys=HOSTS).pull(1, timeout=5, copy=True)
        assert v == 2 and np.array_equal(got["w"], _flat(2)["w"])


class _Recorder:
    """Stands in for a socket: keeps the bytes Peer.send writes, so they can be replayed."""

    def __init__(self):
        self.data = b""

    def sendall(self, b):
        self.data += bytes(b)


def _open_session(server, client_nonce):
    host, port = server.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=3)
    challenge = s.recv(20, socket.MSG_WAITALL)
    assert challenge[:4] == auth.CHALLENGE_MAGIC
    s.sendall(client_nonce)
    return s, auth.Session(KEY, challenge[4:], client_nonce, is_server=False)


def _frame(session, header):
    rec = _Recorder()
    Peer(rec, "recorder", session).send(header)
    return rec.data


def test_replayed_frames_are_refused_within_and_across_connections():
    with RelayServer(CFG, keys=HOSTS) as server:
        nonce = auth.new_nonce()
        s, session = _open_session(server, nonce)
        genuine = _frame(session, {"op": "set_successors", "addresses": ["127.0.0.1:1"]})
        s.sendall(genuine)
        Peer(s, "relay", session).expect("ok", "set_successors")
        s.close()
        assert server.stats()["successors"] == ["127.0.0.1:1"]
        server.set_successors([])
        # The same bytes (same client nonce) on a new connection: the relay's fresh nonce breaks the tag.
        host, port = server.address.rsplit(":", 1)
        s2 = socket.create_connection((host, int(port)), timeout=3)
        s2.recv(20, socket.MSG_WAITALL)
        s2.sendall(nonce + genuine)
        assert _wait(lambda: server.stats().get("auth_rejected", 0) == 1)
        s2.close()
        assert server.stats()["successors"] == []
        # Within one connection: a frame sent twice; the second fails (per-direction counter).
        s3, session = _open_session(server, auth.new_nonce())
        ping = _frame(session, {"op": "ping"})
        s3.sendall(ping + ping)
        peer = Peer(s3, "relay", session)
        assert peer.expect("pong", "pong")[0]["op"] == "pong"
        with pytest.raises((WireError, OSError)):
            peer.recv("a second pong")
        s3.close()
        assert _wait(lambda: server.stats().get("auth_rejected", 0) == 2)


# ---- read-only shared weights
_WRITER = textwrap.dedent("""
    import ctypes, sys
    import numpy as np
    from laminar_jax.relay.client import RelayClient
    from laminar_jax.relay.config import RelaySection
    from laminar_jax.net.auth import RunKeys
    addr, keys = sys.argv[1], RunKeys(*(bytes.fromhex(sys.stdin.readline().strip()) for _ in range(2)))
    v, flat = RelayClient([addr], config=RelaySection(local_transport="memfd"), keys=keys).pull(0, timeout=10)
    w = flat["w"]
    assert not w.flags.writeable
    print("mapped", flush=True)
    ctypes.memset(w.ctypes.data, 0, 64)  # write through the mapping: must fault
    print("wrote", flush=True)
""")


def test_a_client_write_through_the_shared_mapping_faults_and_weights_stay_unchanged():
    flat = _flat(3)
    with RelayServer(RelaySection(chunk_bytes=64 << 10), keys=HOSTS) as server:
        _published(server, flat)
        p = subprocess.run([sys.executable, "-c", _WRITER, server.address], input=f"{KEY.hex()}\n{HOSTS.public.hex()}\n",
                           capture_output=True, text=True, timeout=60)
        assert "mapped" in p.stdout and "wrote" not in p.stdout, p.stderr
        assert p.returncode == -11, (p.returncode, p.stderr[-2000:])  # SIGSEGV
        _, got = RelayClient([server.address], config=CFG, keys=HOSTS).pull(0, timeout=5, copy=True)
        np.testing.assert_array_equal(got["w"], flat["w"])


def test_the_memfd_itself_refuses_writes_resizes_and_writable_mappings():
    import mmap

    flat = _flat(4)
    with RelayServer(RelaySection(chunk_bytes=64 << 10), keys=HOSTS) as server:
        _published(server, flat)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(3)
        s.connect(server.unix_name)
        from laminar_jax.net.wire import client_handshake

        peer = client_handshake(s, "unix", KEY, 3.0)
        peer.request({"op": "map", "version": 1}, "mapped", "memfd")
        _, fds, _, _ = socket.recv_fds(s, 1, 1)
        fd = fds[0]
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"\0" * 8, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1)
            reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # a fresh description: same seals
            try:
                with pytest.raises(PermissionError):
                    os.pwrite(reopened, b"\0" * 8, 0)
            finally:
                os.close(reopened)
        finally:
            os.close(fd)
            peer.close()
        _, got = RelayClient([server.address], config=CFG, keys=HOSTS).pull(0, timeout=5, copy=True)
        np.testing.assert_array_equal(got["w"], flat["w"])


# ---- bounded memory per peer
def test_an_unfinished_version_is_dropped_when_its_sender_disconnects_or_stalls():
    flat = _flat(5, 400_000)  # ~1.6 MB: 25 chunks
    with RelayServer(CFG, keys=HOSTS) as server:
        for stall in (False, True):
            h, src = _push_header(7, flat, SIGNER)
            peer = connect(server.address, 2.0, 10.0, KEY)
            peer.request(h, "have", "push")
            for i in range(src.n // 2):
                segs, vouch = src.chunk(i)
                peer.send({"op": "chunk", "version": 7, "index": i, **vouch}, segs, payload_mac=False)
            assert _wait(lambda: server.stats()["partial"].get(7) == src.n // 2)
            if not stall:
                peer.close()
                assert _wait(lambda: server.stats()["partial"] == {}, 2.0)
            else:  # silent sender: dropped after io_timeout_s (3 s)
                assert _wait(lambda: server.stats()["partial"] == {}, CFG.io_timeout_s + 3)
                peer.close()
        assert server.stats()["partial_dropped"] == 2 and server.versions_held() == []


def test_announced_bytes_are_capped_per_push_and_across_peers():
    cfg = RelaySection(chunk_bytes=64 << 10, io_timeout_s=5.0, max_unverified_bytes=3 << 20)
    with RelayServer(cfg, keys=HOSTS) as server:
        big = {"w": np.zeros(1 << 20, np.float32)}  # 4 MiB > cap
        peer = connect(server.address, 2.0, 5.0, KEY)
        try:
            with pytest.raises(RemoteError, match="max_unverified_bytes"):
                peer.request(_push_header(1, big, SIGNER)[0], "have", "push")
        finally:
            peer.close()
        half = {"w": np.zeros(1 << 19, np.float32)}  # 2 MiB each: the second exceeds 3 MiB
        first = connect(server.address, 2.0, 5.0, KEY)
        second = connect(server.address, 2.0, 5.0, KEY)
        try:
            first.request(_push_header(2, half, SIGNER)[0], "have", "push")
            with pytest.raises(RemoteError, match="not yet verified"):
                second.request(_push_header(3, half, SIGNER)[0], "have", "push")
        finally:
            first.close()
            second.close()
        assert _wait(lambda: server.stats()["partial"] == {})
        assert server.stats()["pushes_refused"] == 2


# ---- bounded fuzz: hostile bytes and peers never take the relay down
@pytest.mark.parametrize("key", [LEARNER, None], ids=["keyed", "keyless"])
def test_fuzz_hostile_peers_leave_the_relay_serving(key):
    flat = _flat(6)
    rng = np.random.default_rng(0)
    cfg = RelaySection(chunk_bytes=64 << 10, io_timeout_s=2.0, max_handshakes_per_source=64)  # all reach the key check
    with RelayServer(cfg, keys=key and key.for_hosts()) as server:
        _published(server, flat, keys=key)
        host, port = server.address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=3) for _ in range(50)]
        prefixes = [struct.pack("<4sIQ", MAGIC, (1 << 32) - 1, 0), struct.pack("<4sIQ", MAGIC, 10, 1 << 63),
                    struct.pack("<4sIQ", b"LMA1", 64 << 20, 1 << 63)]
        for payload in prefixes + [bytes(rng.integers(0, 256, int(n), dtype=np.uint8)) for n in (1, 17, 4000)]:
            with socket.create_connection((host, int(port)), timeout=3) as s:
                try:
                    if key is not None:
                        s.recv(20, socket.MSG_WAITALL)
                        payload = auth.new_nonce() + payload
                    s.sendall(payload)
                    s.recv(64)
                except OSError:
                    pass
        if key is None:  # a keyless relay trusts its network; the rest is about the key
            for s in idle:
                s.close()
            assert not server.stopped and server.versions_held() == [1]
            server.check()
            return
        # Keyless versions of every op, forged push included.
        for op in ({"op": "stop"}, {"op": "set_successors", "addresses": ["127.0.0.1:9"]},
                   _push_header(10**9, flat, None)[0], {"op": "read", "version": 1}):
            peer = connect(server.address, 2.0, 2.0)
            try:
                with pytest.raises((AuthError, WireError, OSError)):
                    peer.request(op, "ok", "hostile op")
            finally:
                peer.close()
        for s in idle:
            s.close()
        assert not server.stopped and server.versions_held() == [1] and server.stats()["successors"] == []
        server.check()
        v, got = RelayClient([server.address], config=CFG, keys=HOSTS).pull(0, timeout=5, copy=True)
        assert v == 1 and np.array_equal(got["w"], flat["w"])
        assert server.stats()["auth_rejected"] >= 10


def test_chunks_need_the_learners_tag_and_corrupted_bytes_are_fetched_again():
    flat = _flat(7, 100_000)
    with RelayServer(CFG, keys=HOSTS) as server:
        h, src = _push_header(4, flat, SIGNER)
        peer = connect(server.address, 2.0, 5.0, KEY)
        try:
            peer.request(h, "have", "push")
            for i in range(src.n):
                segs, vouch = src.chunk(i)
                payload = bytearray(b"".join(bytes(s) for s in segs))
                if i == 1:
                    payload[17] ^= 0x01  # damaged in transit: its SHA-256 no longer matches
                peer.send({"op": "chunk", "version": 4, "index": i, **vouch}, [payload], payload_mac=False)
            assert peer.request({"op": "end", "version": 4}, "missing", "ack")[0]["chunks"] == [1]
            segs, vouch = src.chunk(1)
            peer.send({"op": "chunk", "version": 4, "index": 1, **vouch}, segs, payload_mac=False)
            assert peer.request({"op": "end", "version": 4}, "missing", "ack")[0]["chunks"] == []
        finally:
            peer.close()
        assert server.versions_held() == [4] and server.stats()["bad_chunks"] == 1
        # A key holder that is not the learner's publish cannot tag chunks of a version it did not sign.
        h, src = _push_header(5, flat, SIGNER)
        peer = connect(server.address, 2.0, 5.0, KEY)
        try:
            peer.request(h, "have", "push")
            segs, vouch = src.chunk(0)
            vouch = dict(vouch, tag="0" * 64)
            peer.send({"op": "chunk", "version": 5, "index": 0, **vouch}, segs, payload_mac=False)
            with pytest.raises((WireError, OSError)):
                peer.request({"op": "end", "version": 5}, "missing", "ack")
        finally:
            peer.close()
        assert _wait(lambda: server.stats()["auth_rejected"] == 1 and server.stats()["partial"] == {})
        v, got = RelayClient([server.address], config=CFG, keys=HOSTS).pull(0, timeout=5, copy=True)
        assert v == 4 and np.array_equal(got["w"], flat["w"])


def test_relay_worker_processes_get_the_key_on_stdin_or_from_the_key_file(tmp_path):
    from laminar_jax.relay.chain import start_local_chain

    flat = _flat(8)
    with start_local_chain(2, CFG, keys=HOSTS) as chain:
        for p in chain.procs:  # never in argv
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                assert KEY.hex().encode() not in f.read()
        with Publisher(CFG, relay_addresses=chain.addresses, keys=LEARNER) as pub:
            pub.publish(1, flat)
            pub.flush(20)
        last = RelayClient([chain.addresses[-1]], config=CFG, keys=HOSTS)
        assert last.wait_for(1, 20) == 1
        _, got = last.pull(0, timeout=5, copy=True)
        assert np.array_equal(got["w"], flat["w"])
        with pytest.raises((AuthError, WireError)):
            RelayClient([chain.addresses[0]], config=CFG).wait_for(1, 1)
    key = auth.run_keys(str(tmp_path)).link  # the worker reads learner.pub beside the key file
    p = subprocess.Popen([sys.executable, "-m", "laminar_jax.relay.worker", "--port", "0", "--key-file",
                          str(tmp_path / auth.KEY_FILE), "--parent-pid", str(os.getpid())],
                         stdout=subprocess.PIPE, text=True)
    try:
        import json

        addr = json.loads(p.stdout.readline())["address"]
        peer = connect(addr, 2.0, 3.0, key)
        try:
            assert peer.request({"op": "ping"}, "pong", "ping")[0]["op"] == "pong"
        finally:
            peer.close()
    finally:
        p.terminate()
        p.wait(10)
        p.stdout.close()


def test_tcp_pulls_check_every_chunk_against_the_learners_tags():
    flat = _flat(9, 100_000)
    with RelayServer(CFG, keys=HOSTS) as server:
        _published(server, flat)
        client = RelayClient([server.address], config=CFG, keys=HOSTS)
        peer = connect(server.address, 2.0, 5.0, KEY)
        try:
            h, _ = peer.request({"op": "pull", "newer_than": 0}, "pulled", "pull")
            from laminar_jax.relay.manifest import Manifest

            m = Manifest.from_dict(h["manifest"], "test")
            peer.send({"op": "read", "version": 1, "offset": 0, "nbytes": m.total_bytes})
            d, plen = peer.expect("data", "bytes")
            assert d.get("pm") == 0 and len(d["chunks"]) > 1  # vouched for by chunk tags, not a wire tag
            buf = bytearray(plen)
            peer.recv_into(memoryview(buf), "bytes")
        finally:
            peer.close()
        check = lambda data, sig: client._read_checked(FakePeer(data), d, memoryview(bytearray(plen)), m, sig, "bytes")
        check(bytes(buf), h["signature"])  # intact: passes
        buf[plen // 2] ^= 0x40
        with pytest.raises(AuthError, match="does not match its signed digest"):
            check(bytes(buf), h["signature"])
        with pytest.raises(AuthError, match="without valid chunk tags"):
            check(bytes(buf), auth.sign_version(SIGNER, 1, m.digest()))


class FakePeer:
    """Hands out recorded payload bytes in order (what Peer.recv_into does with a socket)."""

    name = "relay"

    def __init__(self, data):
        self.data, self.pos = data, 0

    def recv_into(self, mv, what):
        mv[:] = self.data[self.pos:self.pos + mv.nbytes]
        self.pos += mv.nbytes


# ---- versions come from the store's manifests too
def _signed_push(server, version, flat):
    """A push the relay's key vouches for (e.g. a replayed or stray learner push), delivered whole."""
    from laminar_jax.relay.push import push_version

    m = plan_layout(flat, version)
    peer = connect(server.address, 2.0, 3.0, KEY)
    try:
        return push_version(peer, ArraysSource(m, flat, CFG.chunk_bytes, SIGNER), None, 0.1, 3.0, 1)
    finally:
        peer.close()


def test_relay_refuses_a_version_the_store_does_not_commit(tmp_path):
    from laminar_jax.relay.store import WeightStore

    cfg = RelaySection(chunk_bytes=64 << 10, io_timeout_s=3.0, heartbeat_s=0.1, store_url=str(tmp_path / "w"),
                       store_check_s=1.0)
    store = WeightStore(cfg.store_url)
    with RelayServer(cfg, keys=HOSTS) as server:
        with Publisher(cfg, store=store, relay_addresses=[server.address], keys=LEARNER) as pub:
            pub.publish(1, _flat(1))
            pub.flush(20)
        assert RelayClient([server.address], config=cfg, keys=HOSTS).wait_for(1, 10) == 1  # stored: served
        assert server.stats()["store_cleared"] == 1
        # Signed, fully delivered, but never committed to the store: never served, then dropped.
        assert _signed_push(server, 7, _flat(7)) == "delivered"
        assert _wait(lambda: server.stats().get("store_refused", 0) == 1, 10)
        assert server.versions_held() == [1] and 7 not in server.stats()["partial"]
        # Older than the store's newest and absent there: refused without waiting out store_check_s.
        t0 = time.monotonic()
        assert _signed_push(server, 0, _flat(0)) == "delivered"
        assert _wait(lambda: server.stats().get("store_refused", 0) == 2, 10)
        assert time.monotonic() - t0 < cfg.store_check_s
        # In the store, but with another layout: refused.
        store.write(2, _flat(2))
        assert _signed_push(server, 2, _flat(2, n=1000)) == "delivered"
        assert _wait(lambda: server.stats().get("store_refused", 0) == 3, 10)
        assert any("another layout" in e for e in server.stats()["conn_errors"])
        # A push that arrives before its store commit is held back, then served once committed.
        assert _signed_push(server, 3, _flat(3)) == "delivered"
        time.sleep(0.2)
        assert server.versions_held() == [1]
        store.write(3, _flat(3))
        v, got = RelayClient([server.address], config=cfg, keys=HOSTS).pull(1, timeout=5, copy=True)
        assert v == 3 and np.array_equal(got["w"], _flat(3)["w"])
        assert server.stats()["store_refused"] == 3


def test_a_version_signed_again_by_a_restarted_learner_is_compared_by_its_tagged_digests():
    """The same bytes under a new signature are kept (a restarted learner's republish is not a
    conflict); a vouch without the new publish's learner tag is refused; other bytes replace."""
    from laminar_jax.relay.push import push_version

    flat, other = _flat(1), _flat(2)
    with RelayServer(CFG, keys=HOSTS) as server:
        _published(server, flat)
        assert _signed_push(server, 1, flat) == "skipped"
        assert server.stats()["republished_same"] == 1

        class UntaggedVouches(ArraysSource):  # a sender holding a valid signature but not the key
            def chunk(self, index):
                segs, vouch = super().chunk(index)
                return segs, {"digest": vouch["digest"], "tag": "0" * 64}

        peer = connect(server.address, 2.0, 3.0, KEY)
        try:
            with pytest.raises((WireError, OSError)):
                push_version(peer, UntaggedVouches(plan_layout(other, 1), other, CFG.chunk_bytes, SIGNER),
                             None, 0.1, 3.0, 1)
        finally:
            peer.close()
        assert server.stats().get("republished_replaced", 0) == 0
        v, got = RelayClient([server.address], config=CFG, keys=HOSTS).pull(0, timeout=5, copy=True)
        assert v == 1 and np.array_equal(got["w"], flat["w"])

        assert _signed_push(server, 1, other) == "delivered"
        assert server.stats()["republished_replaced"] == 1
        v, got = RelayClient([server.address], config=CFG, keys=HOSTS).pull(0, timeout=5, copy=True)
        assert v == 1 and np.array_equal(got["w"], other["w"])
