"""A rollout server whose pull of a newer version times out keeps running and pulls again (a
learner group that died after announcing a version publishes it only once its replacement has
replayed to it: a slow-tier Ray test lost its server to one 15-s pull while that took 29 s)."""

import numpy as np

from laminar_jax.learner.publish import flatten_params
from laminar_jax.relay.client import RelayClient
from laminar_jax.relay.store import WeightStore
from laminar_jax.runtime.fleet import params_from_flat
from laminar_jax.runtime.rollout_worker import RolloutWorker
from laminar_jax.scheduler.modes import get_policy
from tests.rollout.rollout_helpers import make_server, params_of, tiny_model


class FakeBuffer:
    """Fake of the buffer service's board and work calls: no work, `newest` as the board's newest."""

    def __init__(self):
        self.newest = 0

    def report(self, i, name, version, live):
        return {"newest": self.newest, "learner_version": self.newest, "others": []}

    def take_work(self, i, name, version, free):
        return []


def _host_flat(seed):
    return {k: np.asarray(v) for k, v in flatten_params(params_of(seed)).items()}


def test_a_timed_out_pull_leaves_the_server_running_and_the_next_iteration_swaps(tmp_path):
    store = WeightStore(str(tmp_path / "weights"))
    store.write(1, _host_flat(0))
    server = make_server(version=1)
    buffer = FakeBuffer()
    worker = RolloutWorker(0, "rollout-0", server, RelayClient([], store=store), buffer, get_policy("laminar"),
                           params_from_flat(tiny_model(0)), pull_timeout_s=0.3, poll_s=0.0)
    worker.board.set_newest(2)  # version 2 was announced; its learner died before publishing it
    assert worker.iterate() is False  # the pull timed out; the loop goes on
    assert worker.pull_timeouts == 1 and server.version == 1 and worker.swaps == 0
    assert worker.snapshot()["pull_timeouts"] == 1
    store.write(2, _host_flat(1))  # the learner publishes version 2 again
    worker.iterate()
    worker.iterate()  # pulls and swaps
    assert worker.swaps == 1 and server.version == 2 and worker.pull_timeouts == 1
