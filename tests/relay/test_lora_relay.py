"""Adapter versions through the relay tier as they are: a real relay with the run's keys carries only
the adapter bytes, the base identity arrives intact, and (being one of the version's signed tensors)
a host without the learner's key cannot swap in another identity."""

from __future__ import annotations

import numpy as np
import pytest

from laminar_jax.learner.publish import AdapterPublisher
from laminar_jax.model.lora_version import BASE_ID, adapter_version, base_identity, read_adapter_version
from laminar_jax.net.wire import RemoteError
from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.publisher import Publisher
from laminar_jax.relay.server import RelayServer
from tests.relay.test_relay_signing import CFG, HOSTS, LEARNER, ROGUE, _push  # the run's keys and a rogue host
BASE = {"layers.self_attn.q_proj.weight": np.ones((2, 64, 64), np.float32)}
BASE_ID_HEX = base_identity(BASE)


def _adapters(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"layers.self_attn.q_proj.lora_a": rng.random((2, 8, 64), dtype=np.float32),
            "layers.self_attn.q_proj.lora_b": rng.random((2, 64, 8), dtype=np.float32)}


def test_adapter_versions_cross_a_relay_with_their_base_identity():
    with RelayServer(CFG, keys=HOSTS) as server:
        client = RelayClient([server.address], config=CFG, keys=HOSTS)
        with Publisher(CFG, relay_addresses=[server.address], keys=LEARNER) as pub:
            AdapterPublisher(pub, BASE_ID_HEX, 2.0).publish(1, _adapters(1))
            pub.flush(20)
            assert pub.stats().bytes_per_version == sum(a.nbytes for a in _adapters(1).values()) + 32 + 4
        v, got = client.pull(0, timeout=5, copy=True)
        assert v == 1
        version = read_adapter_version(got)
        assert version.base_id == BASE_ID_HEX and version.scale == 2.0
        for name, a in _adapters(1).items():
            np.testing.assert_array_equal(got[name], a)
        # Another identity under the same adapters, signed by a host without the learner's key: refused.
        forged = adapter_version(_adapters(1), base_identity({"x": np.zeros(3, np.float32)}), 2.0)
        assert bytes(forged[BASE_ID]).hex() != BASE_ID_HEX
        with pytest.raises(RemoteError, match="forged"):
            _push(server.address, 2, forged, ROGUE.signer("rogue"))
        assert server.versions_held() == [1]
        client.close()
