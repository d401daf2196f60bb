"""Rollout and relay actors of the Ray runtime.

`RolloutActor` hosts the SAME `RolloutWorker` + `RolloutServer` as the local runtime (the same mode
policy calls: `swap_now`, `server_may_admit`), in a thread of its own; only the worker's queue,
board and completion callback are thin proxies to the buffer actor. `RelayActor` runs one
`RelayServer` (TCP, bound to `relay.host`) on its node. Both classes are plain Python; the runtime
wraps them with `ray.remote`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import traceback
from typing import Optional

import numpy as np

from laminar_jax.runtime.ray_buffer import item_from_dict, traj_to_dict


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class RelayActor:
    """One relay server per node; rollout actors on that node pull from it (memfd when local)."""

    def __init__(self, cfg_json: str):
        from laminar_jax.config import finalize
        from laminar_jax.relay import RelayServer

        self.server = RelayServer(finalize(json.loads(cfg_json)).relay).start()

    def address(self) -> str:
        """host:port others reach it at (a wildcard bind advertises the node's IP)."""
        import ray

        host, _, port = self.server.address.rpartition(":")
        if host in ("0.0.0.0", "::", ""):
            host = ray.util.get_node_ip_address()
        return f"{host}:{port}"

    def node_id(self) -> str:
        return _node_id()

    def set_successors(self, addresses: list[str]) -> None:
        self.server.set_successors(addresses)

    def check(self) -> dict:
        self.server.check()
        return self.server.stats()

    def stop(self) -> None:
        self.server.stop()


class _BoardProxy:
    """The worker's `Board`, backed by the buffer actor's authoritative board.

    Its own entry is local truth; the others' versions and live counts are refreshed at most every
    `sync_s` (and at once when this server's version changes). A lagging view never breaks a
    contract: the buffer re-checks admission when work is taken, and a server swaps only with no
    live sequence of its own.
    """

    def __init__(self, buffer, index: int, name: str, version: int, timeout_s: float, sync_s: float = 0.05):
        self.buffer, self.index, self.name = buffer, index, name
        self.timeout_s, self.sync_s = timeout_s, sync_s
        self.newest = self.learner_version = version
        self._mine = (version, 0)
        self._others: list[tuple[int, int]] = []
        self._last_sync = 0.0

    def sync(self) -> None:
        import ray

        view = ray.get(self.buffer.report.remote(self.index, self.name, *self._mine), timeout=self.timeout_s)
        self.newest = max(self.newest, view["newest"])
        self.learner_version = view["learner_version"]
        self._others = [tuple(x) for x in view["others"]]
        self._last_sync = time.monotonic()

    def update(self, i: int, version: int, live: int) -> None:
        changed = version != self._mine[0]
        self._mine = (version, live)
        if changed or time.monotonic() - self._last_sync >= self.sync_s:
            self.sync()

    def set_newest(self, v: int) -> None:
        self.newest = max(self.newest, v)

    def global_pending(self) -> bool:
        return any(v < self.newest for v, _ in [self._mine, *self._others])

    def live_counts(self) -> list[int]:
        return [n for _, n in [self._mine, *self._others]]


class _QueueProxy:
    """The worker's `WorkQueue`: takes work from the buffer actor, which records this server as owner."""

    def __init__(self, buffer, index: int, name: str, timeout_s: float):
        self.buffer, self.index, self.name, self.timeout_s = buffer, index, name, timeout_s
        self.server = None  # set once the server exists: its version goes with each request

    def take(self, n: int, timeout: float = 0.0):
        import ray

        ref = self.buffer.take_work.remote(self.index, self.name, self.server.version, n)
        try:
            return [item_from_dict(d) for d in ray.get(ref, timeout=self.timeout_s)]
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{self.name}: buffer actor did not answer take_work within {self.timeout_s}s") from None


class RolloutActor:
    """One rollout server: a `RolloutWorker` looping in a thread, plus the calls the driver makes
    (stats/heartbeat, export/import of live sequences for repack, fault injection, stop)."""

    def __init__(self, cfg_json: str, index: int, name: str, relays: dict, store_url: Optional[str], buffer,
                 seed: int, rpc_timeout_s: float):
        from flax import nnx

        from laminar_jax.config import finalize
        from laminar_jax.learner.publish import flatten_params
        from laminar_jax.model import build_model
        from laminar_jax.relay import RelayClient, WeightStore
        from laminar_jax.rollout import make_engine
        from laminar_jax.rollout.server import RolloutServer
        from laminar_jax.runtime.rollout_worker import RolloutWorker, unflatten_params
        from laminar_jax.scheduler.modes import get_policy

        cfg = finalize(json.loads(cfg_json))
        self.name, self.index = name, index
        # Its own node's relay first (a local pull maps the relay's memory), the others after.
        here = _node_id()
        addresses = [a for n, a in relays.items() if n == here] + [a for n, a in relays.items() if n != here]
        store = WeightStore(store_url, keep_last=cfg.relay.keep_last) if store_url else None
        client = RelayClient(addresses, store=store, config=cfg.relay, holder=name)
        # Below the heartbeat timeout: a relay that missed a version (the server knows of it from the
        # board) is waited on this long, then the pull falls back to the weight store.
        pull_timeout = min(cfg.runtime.wait_timeout_s, 120.0, cfg.scheduler.heartbeat_timeout_s / 2)
        model = build_model(cfg.model)  # a template: every weight is replaced by the pulled version
        section = dataclasses.replace(cfg.rollout, server_id=name, seed=seed)
        engine, _ = make_engine(model, section)
        _, template = nnx.split(model)

        def from_flat(flat):
            return unflatten_params(flat, template=template, flatten=flatten_params)

        version, flat = client.pull(newer_than=-1, timeout=pull_timeout)
        server = RolloutServer(engine, from_flat(flat), version=version)
        self.board = _BoardProxy(buffer, index, name, version, rpc_timeout_s)
        queue = _QueueProxy(buffer, index, name, rpc_timeout_s)
        queue.server = server
        self.buffer, self.rpc_timeout_s = buffer, rpc_timeout_s
        policy = get_policy(cfg.runtime.mode, cfg.scheduler.repack, cfg.scheduler.admit_lag)
        self.worker = RolloutWorker(index, server, client, queue, policy, self.board, self._on_complete,
                                    _make_request, from_flat, timeline=None, pull_timeout_s=pull_timeout)
        import ray

        ray.get(buffer.register.remote(index, name, version), timeout=rpc_timeout_s)
        self.dropped = 0
        self._stop = threading.Event()
        self._error: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name=f"{name}-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.worker.run(self._stop)
        except BaseException:  # noqa: BLE001 - reported by stats(); the driver replaces this actor
            self._error = traceback.format_exc()

    def _on_complete(self, traj) -> None:
        import ray

        ref = self.buffer.complete.remote(self.name, traj_to_dict(traj))
        try:
            if not ray.get(ref, timeout=self.rpc_timeout_s):
                self.dropped += 1  # no longer ours (declared dead meanwhile): the buffer dropped it
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{self.name}: buffer actor did not accept trajectory {traj.uid!r} "
                               f"within {self.rpc_timeout_s}s") from None

    # ---------------------------------------------------------------------------- driver calls
    def ready(self) -> dict:
        return {"name": self.name, "version": self.worker.server.version, "node": _node_id()}

    def stats(self) -> dict:
        """Heartbeat + what the scheduler weighs: ServerStats, live sequences with their KV pages,
        the worker's silence, and the traceback if its loop died."""
        s = self.worker.server
        return {"stats": dataclasses.asdict(s.stats()), "seqs": [(uid, pages) for _, uid, pages in s.live_sequences()],
                "beat_age": time.monotonic() - self.worker.last_beat, "error": self._error,
                "swaps": self.worker.swaps, "dropped": self.dropped, "draining": not self.worker.admitting()}

    def export_sequence(self, uid: str, version: int) -> Optional[bytes]:
        """Take live sequence `uid` out as bytes (`SequenceState.to_bytes`); None if it finished,
        or if this server no longer runs `version` (the planner's snapshot is stale)."""
        with self.worker.lock:
            s = self.worker.server
            slot = {u: i for i, u, _ in s.live_sequences()}.get(uid)
            if slot is None or s.version != version:
                return None
            return s.export_sequence(slot).to_bytes()

    def import_sequence(self, data: bytes) -> int:
        """Continue a moved sequence here; raises (VersionMismatchError, NoFreeSlotError, ...) if it cannot."""
        from laminar_jax.rollout.records import SequenceState

        with self.worker.lock:
            return self.worker.server.import_sequence(SequenceState.from_bytes(data))

    def stacks(self) -> str:
        """Every thread's Python stack (what a hung worker is stuck on, for the failure log)."""
        import sys

        names = {t.ident: t.name for t in threading.enumerate()}
        return "\n".join(f"--- thread {names.get(tid, tid)}\n" + "".join(traceback.format_stack(frame))
                         for tid, frame in sys._current_frames().items())

    def inject_crash(self) -> None:
        """Fault injection: the worker's next iteration raises (a crashed server)."""
        self.worker.crash_next = True

    def stop(self, timeout: float = 30.0) -> bool:
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _make_request(it):
    from laminar_jax.rollout.records import Request

    return Request(uid=it.uid, prompt_ids=np.asarray(it.prompt_ids, np.int32), prompt_uid=it.prompt_uid,
                   sample_index=it.sample_index, seed=it.seed, data_source=it.data_source,
                   ground_truth=it.ground_truth)
