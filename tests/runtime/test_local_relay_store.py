"""The local runtime's in-process relay checks pushes against the run's weight store, like Ray's relays:
a version signed with the learner's key but never written by the learner to `<run_dir>/weights` is not served."""

import dataclasses

import numpy as np
import pytest

from laminar_jax.config import finalize, repo_config
from laminar_jax.net.auth import run_keys
from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.publisher import Publisher
from laminar_jax.relay.store import WeightStore
from laminar_jax.runtime.local import _relay
from laminar_jax.runtime.parts import relays_checking_store


def _flat(seed):
    return {"w": np.random.default_rng(seed).random(20_000).astype(np.float32)}


def test_local_relay_serves_only_versions_the_run_store_committed(tmp_path):
    c = repo_config("demo", "short")
    c.relay.store_check_s = 1.0
    cfg = finalize(c)
    run_dir = str(tmp_path / "run")
    keys = run_keys(run_dir)
    relay_cfg = relays_checking_store(cfg, run_dir)
    assert relay_cfg.relay.store_url == str(tmp_path / "run" / "weights")
    address, stop, _ = _relay(relay_cfg, keys)
    try:
        client = RelayClient([address], config=relay_cfg.relay, keys=keys.for_hosts())
        store = WeightStore(relay_cfg.relay.store_url)
        with Publisher(relay_cfg.relay, store=store, relay_addresses=[address], keys=keys) as pub:
            pub.publish(1, _flat(1))
            pub.flush(20)
        assert client.wait_for(1, 10) == 1  # the learner's own publish: stored, then served
        # Signed by the learner's key, pushed to the relay, but not in the run's store: never served.
        no_store = dataclasses.replace(relay_cfg.relay, store_url="")
        with Publisher(no_store, store=None, relay_addresses=[address], keys=keys) as stray:
            stray.publish(2, _flat(2))
            stray.flush(20)
        with pytest.raises(TimeoutError):
            client.wait_for(2, 2.0)
    finally:
        stop()
