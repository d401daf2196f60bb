"""Versions are signed by the learner alone (Ed25519): a host that holds the run's link key but not
the learner's private key cannot publish a version that a relay or a rollout server accepts."""

import hashlib
import hmac

import numpy as np
import pytest

from laminar_jax.net import auth
from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.manifest import plan_layout
from laminar_jax.relay.publisher import Publisher
from laminar_jax.relay.push import ArraysSource, push_version
from laminar_jax.relay.server import RelayServer
from laminar_jax.net.wire import AuthError, RemoteError, WireError, connect

LEARNER = auth.RunKeys.generate()
HOSTS = LEARNER.for_hosts()
# A compromised host: it holds the run's link key (every relay and rollout host does) and makes
# itself a signing key, but it does not have the learner's.
_OWN = auth.RunKeys.generate()
ROGUE = auth.RunKeys(LEARNER.link, _OWN.public, _OWN.private)
CFG = RelaySection(chunk_bytes=64 << 10, io_timeout_s=3.0, heartbeat_s=0.1)


def _flat(seed):
    return {"w": np.random.default_rng(seed).random(50_000).astype(np.float32)}


def _push(address, version, flat, signer, signature=None):
    """Push ``flat`` as ``version`` over a link authenticated with the run's link key."""
    class Source(ArraysSource):
        def __init__(self):
            super().__init__(plan_layout(flat, version), flat, CFG.chunk_bytes, signer)
            if signature is not None:
                self.signature = signature

    peer = connect(address, 2.0, 3.0, LEARNER.link)
    try:
        return push_version(peer, Source(), None, 0.1, 3.0, 1)
    finally:
        peer.close()


def test_run_keys_are_created_once_and_a_resumed_run_gets_the_same_keypair(tmp_path):
    keys = auth.run_keys(str(tmp_path))
    again = auth.run_keys(str(tmp_path))
    assert (again.link, again.public, again.private) == (keys.link, keys.public, keys.private)
    for name in (auth.KEY_FILE, auth.LEARNER_KEY_FILE):
        assert ((tmp_path / name).stat().st_mode & 0o777) == 0o600
    assert auth.load_public_key(str(tmp_path / auth.LEARNER_PUB_FILE)) == keys.public
    assert keys.private.hex() not in repr(keys) and keys.link.hex() not in repr(keys)
    assert keys.for_hosts().private is None


def test_parts_take_only_the_keys_their_role_may_hold():
    with pytest.raises(ValueError, match="for_hosts"):
        RelayServer(CFG, keys=LEARNER)
    with pytest.raises(ValueError, match="for_hosts"):
        RelayClient(["127.0.0.1:1"], config=CFG, keys=LEARNER)
    with pytest.raises(ValueError, match="private key"):
        Publisher(CFG, relay_addresses=["127.0.0.1:1"], keys=HOSTS)
    with pytest.raises(TypeError, match="RunKeys"):
        RelayServer(CFG, keys=LEARNER.link)
    with pytest.raises(ValueError, match="not the private key"):
        auth.RunKeys(LEARNER.link, LEARNER.public, ROGUE.private)


def test_a_link_key_holder_cannot_publish_to_a_relay():
    with RelayServer(CFG, keys=HOSTS) as server:
        with Publisher(CFG, relay_addresses=[server.address], keys=LEARNER) as pub:
            pub.publish(1, _flat(1))
            pub.flush(20)
        # Its own signature: refused as forged.
        with pytest.raises(RemoteError, match="forged"):
            _push(server.address, 2, _flat(2), ROGUE.signer("rogue"))
        # A MAC with the link key (how versions were signed before): refused too.
        m = plan_layout(_flat(2), 2)
        nonce = b"\0" * 8
        msg = b"laminar-version\0" + (2).to_bytes(8, "little") + nonce + m.digest().encode()
        mac_signature = nonce.hex() + ":" + hmac.new(LEARNER.link, msg, hashlib.sha256).hexdigest()
        with pytest.raises(RemoteError, match="forged"):
            _push(server.address, 2, _flat(2), ROGUE.signer("rogue"), signature=mac_signature)
        # The learner's genuine version signature over other bytes: its chunks carry the rogue's
        # signatures, not the learner's, and are refused.
        genuine = RelayClient([server.address], config=CFG, keys=HOSTS)
        peer = connect(server.address, 2.0, 3.0, LEARNER.link)
        real_sig = peer.request({"op": "pull", "newer_than": 0}, "pulled", "pull")[0]["signature"]
        peer.close()
        with pytest.raises((WireError, OSError)):
            _push(server.address, 1, {"w": np.zeros(50_000, np.float32)}, ROGUE.signer("rogue"), real_sig)
        assert server.versions_held() == [1] and server.stats()["pushes_refused"] == 2
        v, got = genuine.pull(0, timeout=5, copy=True)
        assert v == 1 and np.array_equal(got["w"], _flat(1)["w"])


@pytest.mark.parametrize("transport", ["memfd", "tcp"])
def test_a_rollout_server_refuses_versions_from_a_rogue_relay(transport):
    """A relay run by the compromised host (the link key, its own public key) takes its pushes;
    rollout clients, holding the learner's public key, refuse what it serves."""
    cfg = RelaySection(chunk_bytes=64 << 10, io_timeout_s=3.0, local_transport=transport)
    with RelayServer(cfg, keys=ROGUE.for_hosts()) as rogue_relay:
        with Publisher(cfg, relay_addresses=[rogue_relay.address], keys=ROGUE) as pub:
            pub.publish(5, _flat(5))
            pub.flush(20)
        assert rogue_relay.versions_held() == [5]
        client = RelayClient([rogue_relay.address], config=cfg, keys=HOSTS)
        with pytest.raises(TimeoutError, match="valid learner signature"):
            client.pull(0, timeout=1)
        # Even with the manifest signed by the learner, the bytes need the learner's chunk signatures.
        m = plan_layout(_flat(5), 5)
        signed = auth.sign_version(LEARNER.signer("learner"), 5, m.digest())
        h = {"op": "data", "chunk_bytes": 64 << 10, "signature": signed,
             "chunks": [[hashlib.sha256(b"x").hexdigest(), "00" * 64]] * 4}
        with pytest.raises(AuthError, match="learner signature"):
            client._read_checked(_Bytes(bytes(m.total_bytes)), h, memoryview(bytearray(m.total_bytes)), m,
                                 signed, "bytes")


class _Bytes:
    """Hands out payload bytes in order, as Peer.recv_into does from a socket."""

    name = "rogue relay"

    def __init__(self, data):
        self.data, self.pos = data, 0

    def recv_into(self, mv, what):
        mv[:] = self.data[self.pos:self.pos + mv.nbytes]
        self.pos += mv.nbytes
