"""Version polls: one kept, authenticated connection per relay, reopened when the relay drops it."""

import time

import numpy as np

from laminar_jax.net.auth import RunKeys
from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.publisher import Publisher
from laminar_jax.relay.server import RelayServer

LEARNER = RunKeys.generate()
KEY = LEARNER.for_hosts()


def _publish(server, version, cfg):
    with Publisher(cfg, relay_addresses=[server.address], keys=LEARNER) as pub:
        pub.publish(version, {"w": np.full(1000, version, np.float32)})
        pub.flush(20)


def test_polls_share_one_connection_and_see_new_versions():
    cfg = RelaySection(io_timeout_s=5.0, heartbeat_s=0.1)
    with RelayServer(cfg, keys=KEY) as relay:
        _publish(relay, 1, cfg)
        client = RelayClient([relay.address], config=cfg, keys=KEY)
        before = relay.stats()["connections"]
        assert [client.latest_version(timeout=5) for _ in range(20)] == [1] * 20
        _publish(relay, 2, cfg)  # the publisher's own connections are counted too
        after_publish = relay.stats()["connections"]
        assert client.latest_version(timeout=5) == 2  # seen on the kept connection
        assert relay.stats()["connections"] == after_publish
        assert after_publish - before >= 1 and client.errors == []
        client.close()
        assert client.latest_version(timeout=5) == 2  # usable after close: a fresh connection
        assert relay.stats()["connections"] == after_publish + 1
        client.close()


def test_a_kept_connection_the_relay_closed_when_idle_is_reopened_without_error():
    # An io timeout of 1 s, not less: a loaded machine must not time out the polls themselves.
    cfg = RelaySection(io_timeout_s=1.0, heartbeat_s=0.1)
    with RelayServer(cfg, keys=KEY) as relay:
        _publish(relay, 3, cfg)
        client = RelayClient([relay.address], config=cfg, keys=KEY)
        assert client.latest_version(timeout=5) == 3
        n = relay.stats()["connections"]
        time.sleep(2.2)  # past the relay's io timeout: it closes the idle connection
        assert client.latest_version(timeout=5) == 3
        assert client.errors == [] and relay.stats()["connections"] == n + 1
        assert relay.stats()["conn_errors"] == []  # an idle close is not a connection error
        client.close()


def test_polls_fall_over_to_the_next_relay_when_the_first_stops():
    cfg = RelaySection(io_timeout_s=5.0, heartbeat_s=0.1)
    with RelayServer(cfg, keys=KEY) as a, RelayServer(cfg, keys=KEY) as b:
        _publish(a, 4, cfg)
        _publish(b, 5, cfg)
        client = RelayClient([a.address, b.address], config=cfg, keys=KEY)
        assert client.latest_version(timeout=5) == 4
        a_address = a.address
        a.stop()
        assert client.latest_version(timeout=2) == 5
        assert len(client.errors) == 1 and a_address in client.errors[0]
        client.close()
