"""relay.max_unverified_bytes derives from the model's size when a run starts (runtime/parts.py)."""

import numpy as np
import pytest
from flax import nnx

from laminar_jax.config import ConfigError, finalize, repo_config
from laminar_jax.relay.config import STANDALONE_UNVERIFIED_BYTES, UNVERIFIED_VERSIONS, RelaySection


def _demo(**relay):
    c = repo_config("demo", "short")
    for k, v in relay.items():
        setattr(c.relay, k, v)
    return finalize(c)


def test_the_run_derives_the_cap_from_one_version_of_the_model(tmp_path):
    from laminar_jax.learner.publish import flatten_params
    from laminar_jax.model import build_model
    from laminar_jax.runtime.parts import relays_checking_store, version_bytes

    cfg = _demo()
    assert cfg.relay.max_unverified_bytes == 0
    published = flatten_params(nnx.state(build_model(cfg.model)))  # what the learner publishes
    one = sum(np.asarray(x).nbytes for x in published.values())
    assert version_bytes(cfg) == one
    relay = relays_checking_store(cfg, str(tmp_path)).relay
    assert relay.max_unverified_bytes == relay.unverified_cap == int(UNVERIFIED_VERSIONS * one)
    assert relay.unverified_cap < STANDALONE_UNVERIFIED_BYTES  # the fixed 64 GiB is gone for a run
    assert RelaySection().unverified_cap == STANDALONE_UNVERIFIED_BYTES  # a relay outside a run


def test_a_set_cap_below_one_version_names_the_key(tmp_path):
    from laminar_jax.runtime.parts import relays_checking_store

    assert relays_checking_store(_demo(max_unverified_bytes=1 << 40), str(tmp_path)).relay.max_unverified_bytes \
        == 1 << 40
    with pytest.raises(ConfigError, match=r"relay\.max_unverified_bytes=4096 is below one weight version"):
        relays_checking_store(_demo(max_unverified_bytes=4096), str(tmp_path))
