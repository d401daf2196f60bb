"""Fakes for unit tests of the runtime's wiring (the Driver, the fleets, the loops): a fake learner
and fake rollout servers whose outputs can be computed by hand. The buffer service, the rollout
workers, the fleets and the loops under test are the real ones."""

from __future__ import annotations

import threading
import types
from typing import Optional

import numpy as np

from laminar_jax.rollout.records import ServerStats
from laminar_jax.types import Trajectory

RESPONSE = [5, 6, 7]  # every fake trajectory's response (no EOS: a 'length' finish)


class FakeServer:
    """Fake of RolloutServer: a request finishes `steps` step() calls after admission with RESPONSE."""

    def __init__(self, name: str, version: int = 0, slots: int = 4, steps: int = 2):
        self.section = types.SimpleNamespace(server_id=name)
        self._version, self.slots, self.steps = version, slots, steps
        self.live: dict[str, list] = {}  # uid -> [request, steps left]
        self.completed = 0
        self.crash_in_step = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_live(self) -> int:
        return len(self.live)

    def has_work(self) -> bool:
        return bool(self.live)

    @property
    def device_ids(self) -> tuple:
        return (self.section.server_id,)  # each fake its own "device": every one is warmed

    def warmup(self) -> None:
        pass

    def stats(self, wait: bool = True) -> ServerStats:
        n = len(self.live)
        return ServerStats(self.section.server_id, self._version, n, self.slots, n, self.slots, {self._version: n}, 0.0,
                           0, None, self.completed, 0, 0, 0)

    def submit(self, request, timeout: Optional[float] = None) -> None:
        self.live[request.uid] = [request, self.steps]

    def set_params(self, version: int, params, force: bool = False, inflight: bool = False, now: bool = False) -> bool:
        assert inflight or not self.live, "a fake server swapped weights with live sequences"
        self._version = version
        return True

    def step(self) -> list[Trajectory]:
        if self.crash_in_step:
            raise RuntimeError(f"fake server {self.section.server_id} crashed in step")
        done = []
        for uid, entry in list(self.live.items()):
            entry[1] -= 1
            if entry[1] <= 0:
                r = entry[0]
                done.append(Trajectory(uid=uid, prompt_uid=r.prompt_uid, sample_index=r.sample_index,
                                       prompt_ids=np.asarray(r.prompt_ids, np.int32),
                                       response_ids=np.asarray(RESPONSE, np.int32),
                                       behaviour_logprobs=np.full(len(RESPONSE), -1.0, np.float32),
                                       version=self._version, finish_reason="length"))
                del self.live[uid]
        self.completed += len(done)
        return done

    def live_sequences(self) -> list[tuple[int, str, int]]:
        return [(i, uid, 1) for i, uid in enumerate(self.live)]

    def export_sequence(self, slot: int):
        uid = list(self.live)[slot]
        return ("fake-seq", uid, self._version, self.live.pop(uid))

    def import_sequence(self, state) -> int:
        _, uid, version, entry = state
        if version != self._version:
            raise ValueError(f"fake server {self.section.server_id} runs {self._version}, sequence is {version}")
        self.live[uid] = entry
        return len(self.live) - 1


class FakePublisher:
    """Fake of the relay plane's publisher + client: versions in memory, no weights."""

    def __init__(self):
        self.versions = [0]
        self.lock = threading.Lock()

    def publish(self, version: int, params) -> None:
        with self.lock:
            self.versions.append(version)

    # the RelayClient side
    def latest_version(self, timeout: float) -> int:
        with self.lock:
            return self.versions[-1]

    def pull(self, newer_than: int, timeout: float):
        return self.latest_version(timeout), {}

    def pull_placed(self, newer_than: int, timeout: float, place):
        version, flat = self.pull(newer_than, timeout)
        return version, place(flat)

    def close(self, timeout: float = 1.0) -> None:
        pass


class FakeWeights:
    """Fake of the Driver's weight plane."""

    def __init__(self):
        self.publisher = FakePublisher()
        self.relay_addresses = []
        self.last_stats = None

    def client(self, holder: str):
        return self.publisher

    def attach(self, learner, initial: bool) -> None:
        learner.publisher = self.publisher

    def inject_failure(self) -> str:
        return "fake-relay"

    def latest_timings(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class FakeLearner:
    """Fake of Learner: a step trains nothing, counts the trajectories and publishes version + 1.
    `checkpoints` (shared by the learners of one run) plays the checkpoint directory."""

    def __init__(self, checkpoints: dict, trained: list, fail_with: Optional[BaseException] = None):
        self.checkpoints, self.trained, self.fail_with = checkpoints, trained, fail_with
        self.version, self.publisher = 0, None
        self._running = False  # a step dispatched and not finished

    def warmup(self, n: int, max_tokens: int) -> int:
        return 0

    def step(self, trajectories, publish: bool = True) -> dict:
        return self.finish(self.dispatch(trajectories, publish=publish))

    def prepare(self, trajectories, version: int):
        return ("prepared", version, [t.uid for t in trajectories])

    def dispatch(self, trajectories, prepared=None, publish: bool = True):
        """Checks the Learner's protocol: a batch prepared for this version, one step in flight."""
        if self.fail_with is not None:
            e, self.fail_with = self.fail_with, None
            raise e
        assert prepared is None or prepared == self.prepare(trajectories, self.version), (prepared, self.version)
        assert not self._running, "dispatch before the last step was finished"
        self._running = True
        return trajectories, publish

    def finish(self, running) -> dict:
        trajectories, publish = running
        self._running = False
        if publish:  # a replayed step's batch was trained (and counted) already
            self.trained.extend(t.uid for t in trajectories)
        self.version += 1
        if publish and self.publisher is not None:
            self.publisher.publish(self.version, {})
        rewards = [t.reward for t in trajectories]
        return {"version": self.version, "reward_mean": float(np.mean(rewards)), "loss": 0.0, "step_s": 0.001,
                "staleness_mean": float(np.mean([self.version - 1 - t.version for t in trajectories]))}

    def save(self, step: int, extra: Optional[dict] = None) -> None:
        self.checkpoints[step] = (self.version, extra)

    def restore_latest(self) -> Optional[dict]:
        if not self.checkpoints:
            return None
        self.version, extra = self.checkpoints[max(self.checkpoints)]
        return extra

    def policy_params(self) -> dict:
        return {}

    def flush(self, timeout: Optional[float] = None) -> None:
        pass

    def close(self) -> None:
        pass
