"""The two control loops over a fleet of rollout servers, written once for threads and Ray actors.

RepackLoop: runs the pure planner (`scheduler.repack.plan_repack`) on server snapshots and carries
out its moves. A move is export (source) -> ownership handed over in the buffer -> import
(destination) of a live sequence with its KV pages; nothing is prefilled again. A failed import
goes back to the source, and a sequence that can go nowhere (both sides swapped meanwhile) is
generated again from its prompt: it ends on exactly one server, or is requeued exactly once.

HealthLoop: asks the fleet which servers died or went silent, has the buffer requeue their work,
records the failure, and starts a replacement; more than `scheduler.max_server_restarts` failures
stop the run.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple, Optional

from laminar_jax.scheduler.repack import Move, RepackParams, ServerView, plan_repack

log = logging.getLogger(__name__)


class Failure(NamedTuple):
    """A server the fleet found dead or silent (reported once)."""

    index: int
    name: str
    error: BaseException
    traceback: str


def server_view(snap: dict, prev_used: Optional[int]) -> ServerView:
    """A server snapshot (`RolloutWorker.snapshot()`) as the planner's ServerView."""
    s = snap["stats"]
    used = s["kv_pages_used"]
    return ServerView(s["server_id"], s["version"], s["kv_pages_total"], used,
                      used + 1 if prev_used is None else prev_used, tuple((u, int(p)) for u, p in snap["seqs"]),
                      draining=snap["draining"], max_live=s["slots_total"])


class RepackLoop:
    def __init__(self, fleet, buffer, section):
        self.fleet, self.buffer = fleet, buffer
        self.params = RepackParams(c_max=section.c_max, max_batch=section.max_batch)
        self.interval_s = section.repack_interval_s
        self._poke = threading.Event()
        self._prev_used: dict[str, int] = {}
        self._versions: dict[str, int] = {}
        self.moved = self.failed = self.requeued = self.plans = 0

    def poke(self) -> None:
        """Plan right away (called after each publish)."""
        self._poke.set()

    def views(self) -> list[ServerView]:
        out = []
        for snap in self.fleet.snapshots().values():
            sid = snap["stats"]["server_id"]
            out.append(server_view(snap, self._prev_used.get(sid)))
            self._prev_used[sid] = snap["stats"]["kv_pages_used"]
        self._versions = {v.server_id: v.version for v in out}
        return out

    def run_once(self) -> list[Move]:
        moves = plan_repack(self.views(), self.params)
        self.plans += 1
        for m in moves:
            self.execute(m)
        return moves

    def execute(self, move: Move) -> bool:
        uid, fleet = move.seq_uid, self.fleet
        version = self._versions.get(move.src)
        if version is None or self._versions.get(move.dst) != version:
            return False
        try:
            state = fleet.export(move.src, uid, version)
        except Exception:  # noqa: BLE001 - a dead or hung source is the health loop's business
            return False
        if state is None:
            return False  # finished, or the source swapped, since the plan was made
        if not self.buffer.move(uid, move.src, move.dst):
            return False  # the source was declared dead meanwhile: the sample is requeued already
        try:
            fleet.import_(move.dst, state)
            self.moved += 1
            return True
        except Exception:  # noqa: BLE001 - back to the source below; counted
            self.failed += 1
        if self.buffer.move(uid, move.dst, move.src):
            try:
                fleet.import_(move.src, state)
            except Exception:  # noqa: BLE001 - e.g. the source swapped versions: generate it again
                if self.buffer.requeue_uid(uid, move.src):
                    self.requeued += 1
        return False

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._poke.wait(self.interval_s)
            self._poke.clear()
            if not stop.is_set():
                self.run_once()
            time.sleep(0.01)


class HealthLoop:
    def __init__(self, fleet, buffer, section, failures: list, t0: float, poll_s: float = 0.25):
        self.fleet, self.buffer, self.section = fleet, buffer, section
        self.failures, self.t0 = failures, t0
        self.poll_s = min(poll_s, section.heartbeat_timeout_s / 4)

    def run_once(self, stop: threading.Event) -> None:
        keep_alive = getattr(self.buffer, "keep_alive", None)  # Ray: replaces a dead buffer actor
        if keep_alive is not None:
            keep_alive()
        for f in self.fleet.poll_health():
            t_fail = time.time()
            requeued = self.buffer.server_failed(f.index, f.name)
            record = {"server": f.name, "error": repr(f.error), "t": round(t_fail - self.t0, 2),
                      "requeued": requeued}
            self.failures.append(record)
            log.warning("rollout server %s died (%r); requeued %d samples\n%s", f.name, f.error, requeued,
                        f.traceback)
            limit = self.section.max_server_restarts
            if len([r for r in self.failures if "server" in r]) > limit:
                raise RuntimeError(f"more than scheduler.max_server_restarts={limit} rollout server failures; "
                                   f"last: {f.name}: {f.error!r}") from f.error
            if not stop.is_set():
                self.fleet.replace(f.index, record, t_fail)

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.poll_s):
            self.run_once(stop)


def mark_replaced(record: dict, name: str, version: int, t_fail: float) -> None:
    """Complete a failure record (in place: it is in the run's failure list) once its replacement serves."""
    record.update(replacement=name, replacement_version=version, recovery_s=round(time.time() - t_fail, 3))
