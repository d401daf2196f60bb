"""A learner resumed from its checkpoint finds its version in the real weight store even when the
writer died between that version's manifest (the commit) and LATEST (weights/plane.py, attach)."""

import json

import numpy as np

from laminar_jax.config import finalize, repo_config
from laminar_jax.relay import WeightStore
from laminar_jax.net.auth import run_keys
from laminar_jax.relay.handoff import Handoff
from laminar_jax.weights.plane import WeightsPlane


class _CheckpointedLearnerFake:
    """What attach() reads of a learner: its version and its weights (pure data, no JAX)."""

    def __init__(self, version: int):
        self.version = version
        self.publisher = None

    def policy_params(self) -> dict:
        return {"w": np.full((4,), float(self.version), np.float32)}


def _plane(tmp_path) -> WeightsPlane:
    cfg = finalize(repo_config("demo", "short"))
    return WeightsPlane(cfg, str(tmp_path), [], lambda: None, lambda: "", 10.0, run_keys(str(tmp_path)), handoff=Handoff())


def _store_with(tmp_path, versions, latest_hint):
    store = WeightStore(str(tmp_path / "weights"))
    for v in versions:
        store.write(v, {"w": np.full((4,), float(v), np.float32)})
    # The writer died after the last manifest and before LATEST moved: LATEST names the one before.
    store._kv.write("LATEST", json.dumps({"version": latest_hint}).encode()).result()
    return store


def test_resume_at_a_version_committed_behind_a_stale_latest(tmp_path):
    store = _store_with(tmp_path, [1, 2, 3], latest_hint=2)
    assert store.versions() == [1, 2, 3] and store.latest() == 2  # the hint is a committed version
    assert store.newest_committed() == 3
    plane = _plane(tmp_path)
    learner = _CheckpointedLearnerFake(3)
    plane.attach(learner, initial=True)  # must not publish version 3 again (the store refuses it)
    learner.publisher.flush(timeout=30)  # re-raises a background store write that failed
    assert plane.redone_steps == 0
    assert store.versions() == [1, 2, 3]
    np.testing.assert_array_equal(store.read(3)["w"], np.full((4,), 3.0, np.float32))
    assert plane.handoff.latest() == 3  # the servers are seeded with it
    learner.publisher.publish(4, learner.policy_params())  # the next step publishes on top
    learner.publisher.flush(timeout=30)
    assert store.versions()[-1] == 4 and store.latest() == 4
    plane.close()


def test_resume_behind_the_store_retracts_versions_hidden_by_a_stale_latest(tmp_path):
    # Versions 3 and 4 were trained after the checkpoint at 2; LATEST stopped at 3.
    store = _store_with(tmp_path, [1, 2, 3, 4], latest_hint=3)
    plane = _plane(tmp_path)
    learner = _CheckpointedLearnerFake(2)
    plane.attach(learner, initial=True)
    assert plane.redone_steps == 2  # both are redone, the one LATEST did not name too
    assert store.versions() == [1, 2] and store.latest() == 2
    plane.close()
