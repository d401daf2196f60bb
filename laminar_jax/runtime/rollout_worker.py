"""Drives one rollout server: pull weights when the mode allows, take work, step, hand results on.

The decisions (admit? swap?) are the pure mode policies in laminar_jax.scheduler.modes; this
module only does the I/O around them.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from laminar_jax.runtime.dispatch import WorkItem, WorkQueue
from laminar_jax.scheduler.modes import ModePolicy, server_may_admit, swap_now


class InjectedFault(RuntimeError):
    """Raised on purpose by fault-injection tests and the faults benchmark."""


class Board:
    """Shared, thread-safe view of every server's version and live count, and the newest version."""

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

    def set_newest(self, v: int) -> None:
        with self._lock:
            self.newest = max(self.newest, v)

    def global_pending(self) -> bool:
        with self._lock:
            return any(v < self.newest for v, a in zip(self.versions, self.alive) if a)

    def live_counts(self) -> list[int]:
        with self._lock:
            return [n for n, a in zip(self.live, self.alive) if a]


def unflatten_params(flat: dict[str, Any], template: Any, flatten: Callable[[Any], dict]) -> Any:
    """Published flat weights -> the server's param pytree; leaves absent from `flat` keep the template's."""
    names = list(flatten(template).keys())
    leaves, treedef = jax.tree_util.tree_flatten(template)
    if len(names) != len(leaves):
        raise ValueError(f"param naming mismatch: {len(names)} names for {len(leaves)} leaves")
    new = [np.asarray(flat[n]) if n in flat else leaf for n, leaf in zip(names, leaves)]
    # One host->device copy now, instead of one per generate() call (and the relay's zero-copy
    # views may be recycled once released).
    return jax.device_put(jax.tree_util.tree_unflatten(treedef, new))


class RolloutWorker:
    """One server's loop. `lock` is held for each iteration so repack moves see a still server."""

    def __init__(self, index: int, server, client, queue: WorkQueue, policy: ModePolicy, board: Board,
                 on_complete: Callable[[Any], None], make_request: Callable[[WorkItem], Any],
                 params_from_flat: Callable[[dict], Any], timeline=None, poll_s: float = 0.05,
                 pull_timeout_s: float = 60.0):
        self.index, self.server, self.client = index, server, client
        self.queue, self.policy, self.board = queue, policy, board
        self.on_complete, self.make_request = on_complete, make_request
        self.params_from_flat = params_from_flat
        self.timeline = timeline
        self.poll_s, self.pull_timeout_s = poll_s, pull_timeout_s
        self.lock = threading.RLock()
        # uid -> work item, while live or queued here. Its own lock: a hung iteration (holding
        # `lock`) must not stop the runtime from taking this work back.
        self.assigned: dict[str, WorkItem] = {}
        self._assigned_lock = threading.Lock()
        self.killed = threading.Event()  # declared dead: its thread exits and its results are dropped
        self.crash_next = False  # fault injection: the next iteration raises (a crashed server)
        self.last_beat = time.monotonic()  # heartbeat: refreshed every iteration
        self._last_poll = 0.0
        self.swaps = 0

    def _poll_newest(self) -> None:
        now = time.monotonic()
        if now - self._last_poll >= self.poll_s:
            self._last_poll = now
            v = self.client.latest_version(timeout=self.pull_timeout_s)
            if v is not None:
                self.board.set_newest(v)

    def _maybe_swap(self) -> None:
        s = self.server
        if s.version >= self.board.newest or not swap_now(self.policy, s.num_live, self.board.live_counts()):
            return
        version, flat = self.client.pull(newer_than=s.version, timeout=self.pull_timeout_s)
        s.set_params(version, self.params_from_flat(flat))  # applied by the next step()
        self.swaps += 1

    def admitting(self) -> bool:
        """Whether the mode lets this server take new prompts now (else it drains to swap)."""
        return server_may_admit(self.policy, self.server.version, self.board.newest, self.board.global_pending())

    def _admit(self) -> None:
        s = self.server
        if not self.admitting():
            return
        st = s.stats()
        free = st.slots_total - st.slots_used - st.queue_length
        for item in self.queue.take(free) if free > 0 else []:
            self.assign(item)
            s.submit(self.make_request(item), timeout=self.pull_timeout_s)

    def iterate(self) -> bool:
        """One iteration; returns True when the server did work."""
        with self.lock:
            self.last_beat = time.monotonic()
            if self.crash_next:
                raise InjectedFault(f"injected crash of rollout server {self.server.section.server_id}")
            s = self.server
            self._poll_newest()
            self._maybe_swap()
            self._admit()
            done = s.step()
            if self.killed.is_set():
                return False  # declared dead meanwhile: its work was requeued, drop these results
            for traj in done:
                self.unassign(traj.uid)
                self.on_complete(traj)
            self.board.update(self.index, s.version, s.num_live)
            if self.timeline is not None:
                st = s.stats()
                self.timeline.sample(time.time(), st.server_id, st.slots_used, st.slots_total, s.version,
                                     st.kv_pages_used, st.kv_pages_total)
            return bool(done) or s.num_live > 0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set() and not self.killed.is_set():
            if not self.iterate():
                time.sleep(0.005)

    def assign(self, item: WorkItem) -> None:
        with self._assigned_lock:
            self.assigned[item.uid] = item

    def unassign(self, uid: str):
        with self._assigned_lock:
            return self.assigned.pop(uid, None)

    def orphaned_work(self) -> list[WorkItem]:
        """Work that was assigned here and not finished (for requeueing after a failure)."""
        with self._assigned_lock:
            items = list(self.assigned.values())
            self.assigned.clear()
            return items
