"""The fleet of rollout servers as Ray actors (the Ray runtime's `Fleet`; see runtime/fleet.py).

Each actor is a `RolloutActor` (runtime/ray_actors.py). The heartbeat is the actor's `stats()`,
polled without blocking: an actor that died (crash, `ray.kill`, a lost node), whose loop raised,
whose loop went silent, or that does not answer for `scheduler.heartbeat_timeout_s` is killed and
reported once. A replacement starts asynchronously (it builds its engine and pulls the newest
version) and takes over the index when ready; one that fails to start is a failure of its own.
Weights never travel through Ray: actors pull them from their node's relay.
"""

from __future__ import annotations

import time
from typing import Optional

from laminar_jax.rollout.records import ServerStats
from laminar_jax.runtime.fleet import poll_each, sample_stats, server_name, stats_failure
from laminar_jax.scheduler.loops import Failure, mark_replaced


class RayFleet:
    def __init__(self, cfg, buffer_handle, relays: dict, store_url: str, timeline, rpc_timeout_s: float,
                 actor_options: dict, keys, buffer_name: Optional[str] = None):
        self.buffer_name = buffer_name  # actors look a restarted buffer up by this name
        self.cfg, self.buffer_handle, self.relays, self.store_url = cfg, buffer_handle, relays, store_url
        # The run's keys less the learner's private key, handed to each actor in its constructor
        # (Ray's object store; never argv or logs).
        self.keys = keys.for_hosts()
        self.timeline, self.rpc_timeout_s, self.actor_options = timeline, rpc_timeout_s, actor_options
        n = cfg.runtime.num_servers
        self.generations = [0] * n
        self.names = [server_name(i, 0) for i in range(n)]
        self.actors: list = [self._spawn(i) for i in range(n)]
        self.latest: dict[int, dict] = {}  # index -> last stats() answer
        self._polls: dict[int, list] = {}  # index -> [handle, outstanding stats ref, last answer time]
        self._replacing: dict[int, tuple] = {}  # index -> (name, handle, ready ref, t_fail, failure record)
        for name, h in zip(self.names, self.actors):
            self._get(h.ready.remote(), f"rollout actor {name} to start (build its engine, pull its weights)",
                      cfg.runtime.wait_timeout_s)

    def _spawn(self, i: int):
        import ray

        from laminar_jax.runtime.ray_actors import RolloutActor

        return ray.remote(RolloutActor).options(**self.actor_options).remote(
            self.cfg, i, self.generations[i], self.relays, self.store_url, self.buffer_handle, self.rpc_timeout_s,
            self.keys, self.buffer_name)

    def _get(self, ref, what: str, timeout: Optional[float] = None):
        from laminar_jax.runtime.ray_actors import bounded_get

        return bounded_get(ref, self.rpc_timeout_s if timeout is None else timeout, what)

    def _each(self, method: str, what: str, timeout: float) -> None:
        refs = [getattr(h, method).remote() for h in self.actors if h is not None]
        self._get(refs, what, timeout)

    # ------------------------------------------------------------------------------ Fleet
    def start(self) -> None:
        self._each("start", "the rollout actors to start their loops", self.rpc_timeout_s)

    def warmup(self) -> None:
        """Every actor compiles its engine's programs (each actor is its own process)."""
        self._each("warmup", "the rollout actors to compile their engines", self.cfg.runtime.wait_timeout_s)

    def snapshots(self) -> dict[int, dict]:
        import ray

        live = [(i, h) for i, h in enumerate(list(self.actors)) if h is not None]
        refs = [h.stats.remote() for _, h in live]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.rpc_timeout_s)
        out = {}
        for (i, _), ref in zip(live, refs):
            if ref not in ready:
                continue  # silent: the health loop deals with it; never a source or destination
            try:
                st = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            if not st["error"]:
                out[i] = st
        return out

    def server_stats(self) -> list:
        return [ServerStats(**self.latest[i]["stats"]) for i in sorted(self.latest)]

    def buffer_restarted(self, handle, buffer) -> None:
        """A new buffer actor serves: later replacements get its handle; every serving actor is
        registered with it under its current name (the new board starts at the learner's version)."""
        self.buffer_handle = handle
        for i, (name, h) in enumerate(zip(self.names, self.actors)):
            if h is not None:
                version = self.latest.get(i, {}).get("stats", {}).get("version", 0)
                buffer.register(i, name, version)

    def _handle(self, name: str):
        i = self.names.index(name) if name in self.names else None
        h = None if i is None else self.actors[i]
        if h is None:
            raise KeyError(f"rollout actor {name} is not serving (dead or replaced)")
        return h

    def export(self, name: str, uid: str, version: int):
        return self._get(self._handle(name).export_sequence.remote(uid, version), f"{name} to export sequence {uid!r}")

    def import_(self, name: str, state) -> int:
        return self._get(self._handle(name).import_sequence.remote(state), f"{name} to import a sequence")

    def poll_health(self) -> list[Failure]:
        return poll_each(self.actors, self._replacing, self._check_replacement, self._poll)

    def _fail(self, i: int, error: BaseException, tb: str) -> list[Failure]:
        import ray

        handle, self.actors[i] = self.actors[i], None
        self.latest.pop(i, None)
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        return [Failure(i, self.names[i], error, tb)]

    def _poll(self, i: int, handle) -> list[Failure]:
        import ray

        heartbeat_s, now = self.cfg.scheduler.heartbeat_timeout_s, time.monotonic()
        slot = self._polls.get(i)
        if slot is None or slot[0] is not handle:
            slot = self._polls[i] = [handle, handle.stats.remote(), now]
        ready, _ = ray.wait([slot[1]], timeout=0)
        if not ready:
            if now - slot[2] > heartbeat_s:
                return self._fail(i, TimeoutError(f"rollout actor {self.names[i]}: no answer to stats() for "
                                                  f"{now - slot[2]:.1f}s (scheduler.heartbeat_timeout_s={heartbeat_s})"), "")
            return []
        try:
            st = ray.get(ready[0])
        except ray.exceptions.RayError as e:  # RayActorError: killed, crashed, node lost
            return self._fail(i, e, "")
        slot[1], slot[2] = handle.stats.remote(), now
        bad = stats_failure(f"rollout actor {self.names[i]}", st, heartbeat_s,
                            lambda: ray.get(handle.stacks.remote(), timeout=5.0))
        if bad is not None:
            return self._fail(i, *bad)
        self.latest[i] = st
        sample_stats(self.timeline, st)
        return []

    def replace(self, i: int, record: dict, t_fail: float) -> None:
        self.generations[i] += 1
        handle = self._spawn(i)
        self._replacing[i] = (server_name(i, self.generations[i]), handle, handle.ready.remote(), t_fail, record)

    def _check_replacement(self, i: int) -> list[Failure]:
        """Install replacement i once it is ready (and start its loop); one that fails to start is
        reported as a failure of its own (the health loop tries again, within max_server_restarts)."""
        import ray

        name, handle, ref, t_fail, record = self._replacing[i]
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            limit = self.cfg.runtime.wait_timeout_s
            if time.time() - t_fail > limit:
                raise TimeoutError(f"replacement rollout actor {name} did not start within "
                                   f"runtime.wait_timeout_s={limit}s (build its engine, pull its weights)")
            return []
        del self._replacing[i]
        self.names[i], self.actors[i] = name, handle
        try:
            info = ray.get(ref)
            self._get(handle.start.remote(), f"{name} to start its loop")
        except (ray.exceptions.RayError, TimeoutError) as e:
            return self._fail(i, e, "")
        mark_replaced(record, name, info["version"], t_fail)
        return []

    def stop(self, timeout: float) -> list[str]:
        """Ask every actor to stop its loop (bounded); the names that did not."""
        import ray

        refs = {name: h.stop.remote(timeout * 0.7) for name, h in zip(self.names, self.actors) if h is not None}
        stuck = []
        for name, ref in refs.items():
            try:
                if not ray.get(ref, timeout=timeout):
                    stuck.append(name)
            except Exception:  # noqa: BLE001 - a dead actor has nothing to stop
                pass
        return stuck

    def close(self) -> None:
        import ray

        for h in [*self.actors, *[r[1] for r in self._replacing.values()]]:
            if h is not None:
                try:
                    ray.kill(h, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass

    def inject_crash(self, i: int) -> None:
        """Fault injection: actor i's worker raises at its next iteration."""
        self._get(self._live(i).inject_crash.remote(), f"{self.names[i]} to take the injected crash")

    def kill(self, i: int) -> None:
        """Fault injection: `ray.kill` actor i (as a lost process or node would)."""
        import ray

        ray.kill(self._live(i), no_restart=True)

    def _live(self, i: int):
        if self.actors[i] is None:
            raise RuntimeError(f"rollout actor {i} is being replaced; no actor to inject a fault into")
        return self.actors[i]
