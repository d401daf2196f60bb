"""The board: the buffer service's authoritative view of the servers' versions and live counts.

Rollout workers read it through `buffer.report` (their `BoardView`, runtime/rollout_worker.py);
the buffer re-checks admission with it when work is taken.
"""

from __future__ import annotations

import threading


class Board:
    """The authoritative view (held by the buffer service) of every server's version and live
    count, the newest published version and the learner's version. Thread-safe."""

    def __init__(self, n: int, version: int):
        self._lock = threading.Lock()
        self.versions = [version] * n
        self.live = [0] * n
        self.alive = [True] * n
        self.newest = version
        self.learner_version = version

    def update(self, i: int, version: int, live: int) -> None:
        with self._lock:
            self.versions[i], self.live[i] = version, live

    def revive(self, i: int, version: int) -> None:
        with self._lock:
            self.alive[i] = True
            self.versions[i], self.live[i] = version, 0

    def retire(self, i: int) -> None:
        with self._lock:
            self.alive[i], self.live[i] = False, 0

    def set_newest(self, v: int) -> None:
        with self._lock:
            self.newest = max(self.newest, v)

    def set_learner_version(self, v: int) -> None:
        with self._lock:
            self.learner_version = v

    def global_pending(self) -> bool:
        with self._lock:
            return any(v < self.newest for v, a in zip(self.versions, self.alive) if a)

    def view(self, i: int) -> dict:
        """What server i needs of the others (plain data)."""
        with self._lock:
            return {"newest": self.newest, "learner_version": self.learner_version,
                    "others": [(v, n) for j, (v, n, a) in enumerate(zip(self.versions, self.live, self.alive))
                               if a and j != i]}
