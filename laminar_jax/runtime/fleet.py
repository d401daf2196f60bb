"""The fleet of rollout servers as threads of this process (the local runtime's `Fleet`).

Every server is a `RolloutWorker` (the same loop a Ray rollout actor runs) in a supervised thread,
calling the in-process buffer service directly. The servers share compiled programs, so warming
one up warms them all. A server whose thread raised, or whose loop went silent for
`scheduler.heartbeat_timeout_s`, is reported once by `poll_health`; `replace` starts a new one on
the newest published version.

The Fleet interface (both implementations): start, warmup, snapshots, server_stats, export,
import_, poll_health, replace, stop, close, inject_crash, kill.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Callable, Optional

from laminar_jax.scheduler.loops import Failure, mark_replaced
from laminar_jax.runtime.rollout_worker import RolloutWorker, episode_feed, pull_timeout
from laminar_jax.weights.host import host_params, params_on_device
from laminar_jax.scheduler.modes import get_policy
from laminar_jax.threads import Worker


def server_name(i: int, generation: int) -> str:
    """rollout-i, and rollout-i.g for the g-th replacement of server i."""
    return f"rollout-{i}" if generation == 0 else f"rollout-{i}.{generation}"


def sample_stats(timeline, st: dict) -> None:
    """Put a server's stats() answer (a rollout host in another process) on the run's timeline."""
    s = st["stats"]
    timeline.sample(time.time(), s["server_id"], s["slots_used"], s["slots_total"], s["version"],
                    s["kv_pages_used"], s["kv_pages_total"])
    for t, stall, version, staged in st.get("swap_log", ()):  # swaps since the last poll (take_swaps)
        timeline.swap(t, s["server_id"], stall, version, staged)
    if st.get("env") is not None:  # multi-turn episodes: slots waiting on environments, env figures
        from laminar_jax.env.driver import DriverStats

        timeline.sample_waiting(s["server_id"], st["env"]["waiting"], DriverStats(**st["env"]["stats"]))


def stats_failure(who: str, st: dict, heartbeat_s: float,
                  stacks: Callable[[], str]) -> Optional[tuple[BaseException, str]]:
    """Judge a remote server's stats() answer the one way both remote fleets do: its loop died
    (with the worker's traceback), or its heartbeat is older than `heartbeat_s` (with what it is
    stuck on, from `stacks`); None if it is healthy."""
    if st["error"]:
        return RuntimeError(f"{who}: worker loop died"), st["error"]
    if st["beat_age"] > heartbeat_s:
        try:  # what it is stuck on, for the log
            tb = stacks()
        except Exception as e:  # noqa: BLE001 - the failure is reported either way
            tb = f"(no stacks: {e!r})"
        return TimeoutError(f"{who}: no heartbeat for {st['beat_age']:.1f}s "
                            f"(scheduler.heartbeat_timeout_s={heartbeat_s})"), tb
    return None


def poll_each(handles: list, replacing: dict, check_replacement: Callable[[int], list],
              poll: Callable[[int, object], list]) -> list[Failure]:
    """One health pass over a remote fleet: a slot being replaced is checked for its replacement,
    a live one polled, a dead one (None, already reported) skipped."""
    out: list[Failure] = []
    for i, handle in enumerate(list(handles)):
        if i in replacing:
            out += check_replacement(i)
        elif handle is not None:
            out += poll(i, handle)
    return out


def server_section(cfg, i: int, generation: int):
    """The rollout section of server i's `generation`-th incarnation: its name and its own seed."""
    return dataclasses.replace(cfg.rollout, server_id=server_name(i, generation), seed=cfg.seed + 17 * i + generation)


def params_from_flat(model, engine=None, dtype=None, stream: bool = True, base=None):
    """flat published weights -> what a server built on ``model`` (abstract or not) swaps to.

    dtype: the serving dtype (rollout.dtype): a version in another dtype is refused, naming both,
    and the leaves a version does not carry (a value head) are cast to it too, so every version
    gives the engine's programs the same argument types.
    stream: the server owns its weights; the result is HostWeights, streamed onto its devices at the
    swap tensor by tensor, each old buffer deleted first (ParamPlacement.swap), so a swap never
    holds two versions on a device. Otherwise (servers sharing one copy on the default device)
    the weights are placed now, one device copy per version for all of them (Handoff.placed).
    base: a LoRA run's ServedBase (weights/lora_base.py): versions are adapters merged into it.
    """
    if base is not None:
        from laminar_jax.weights.lora_base import lora_params_from_flat

        return lora_params_from_flat(base, engine, stream)
    from flax import nnx

    from laminar_jax.model.precision import cast_floating, check_served_dtype
    from laminar_jax.rollout.server import HostWeights

    _, template = nnx.split(model)

    def host(flat):
        if "lora.base_sha256" in flat:  # model/lora_version.BASE_ID
            raise ValueError("weight version: an adapter version (LoRA), but this server holds no base "
                             "(learner.lora is off in its config)")
        if dtype is None:
            return host_params(flat, template)
        check_served_dtype(flat, dtype)
        return cast_floating(host_params(flat, template), dtype)

    if stream:
        def to_host(flat):
            return HostWeights(host(flat))

        to_host.on_host = True  # host work only: a prefetch runs it while the server drains
        return to_host
    if engine is None or engine.mesh is None:
        if dtype is None:
            return functools.partial(params_on_device, template=template)
        import jax

        return lambda flat: jax.device_put(host(flat))
    return lambda flat: engine.placement.place(host(flat))


def server_mesh(devices):
    """The engine mesh of a server on ``devices`` (None: the default device, the single-device path)."""
    import jax

    from laminar_jax.rollout.tp import tp_mesh

    if devices is None or (len(devices) == 1 and devices[0] == jax.devices()[0]):
        return None
    return tp_mesh(devices)


def server_factory(cfg, model, buffer, weights, timeline, devices=None, base=None):
    """make(i, generation, version, flat_or_params) -> a RolloutWorker for server i of a local run.

    model: the policy's (abstract) model: its graph and shapes. devices: per server index, the jax
    devices its engine runs on (placement); None = the default device. A server alone on its
    devices owns its weights and streams each swap into place; servers sharing the default device
    share one placed copy per version instead. base: a LoRA run's ServedBase (weights/lora_base.py).
    """
    from laminar_jax.rollout import make_engine
    from laminar_jax.rollout.server import HostWeights, RolloutServer

    policy = get_policy(cfg.runtime.mode, cfg.scheduler.repack, cfg.scheduler.admit_lag)
    # one function: the hand-off places once for all servers sharing the default device
    shared = params_from_flat(model, dtype=cfg.rollout.dtype, stream=False, base=base)
    n = cfg.runtime.num_servers
    on_default_device = n if devices is None else sum(server_mesh(d) is None for d in devices)

    def make(i: int, generation: int, version: int, params) -> RolloutWorker:
        section = server_section(cfg, i, generation)
        name = section.server_id
        engine, _ = make_engine(model, section, mesh=server_mesh(None if devices is None else devices[i]))
        on_default = engine.mesh is None and on_default_device > 1  # other servers run there too
        if isinstance(params, HostWeights) and on_default:
            params = params.tree if params.lora is None else _merged(base, params.lora)
        if not isinstance(params, HostWeights):
            params = engine.placement.place(params)  # host leaves: each device gets its shard (device arrays: kept)
        episodes = episode_feed(cfg, buffer.tokenizer, buffer.episode_record)  # None unless env.enabled
        worker = RolloutWorker(i, name, RolloutServer(engine, params, version=version), weights.client(name),
                               buffer, policy,
                               shared if on_default else params_from_flat(model, engine, cfg.rollout.dtype, base=base),
                               pull_timeout_s=pull_timeout(cfg), timeline=timeline, episodes=episodes,
                               prefetch=cfg.rollout.prefetch, prefetch_device=cfg.rollout.prefetch_device)
        buffer.register(i, name, version)
        return worker

    return make


def _merged(base, delta):
    """A LoRA version for servers sharing the default device: the base placed once, merged."""
    import jax

    from laminar_jax.rollout.lora_merge import merged_tree

    return merged_tree(base.placed(jax.device_put), delta)


class ThreadFleet:
    """workers: the running RolloutWorkers (index i at position i); make: `server_factory`'s
    function, for replacements (None: a fleet that cannot replace, as in unit tests)."""

    def __init__(self, workers: list[RolloutWorker], make: Optional[Callable] = None,
                 heartbeat_timeout_s: float = 30.0):
        self.workers, self.make, self.heartbeat_timeout_s = list(workers), make, heartbeat_timeout_s
        self._stop = threading.Event()
        self._threads: dict[int, Worker] = {}
        self.generations = [0] * len(self.workers)

    @classmethod
    def build(cls, cfg, model, buffer, weights, timeline, version: int, params, devices=None,
              base=None) -> "ThreadFleet":
        make = server_factory(cfg, model, buffer, weights, timeline, devices, base)
        workers = [make(i, 0, version, params) for i in range(cfg.runtime.num_servers)]
        return cls(workers, make, cfg.scheduler.heartbeat_timeout_s)

    def _spawn(self, w: RolloutWorker) -> None:
        # Not stop_on_failure: a dead server is the health loop's to replace, not a reason to stop.
        self._threads[w.index] = Worker(w.name, functools.partial(w.run, self._stop), stop_on_failure=False).start()

    # ------------------------------------------------------------------------------ Fleet
    @property
    def names(self) -> list[str]:
        return [w.name for w in self.workers]

    def start(self) -> None:
        for w in self.workers:
            w.last_beat = time.monotonic()  # silent through the warm-up is not dead
            self._spawn(w)

    def warmup(self) -> None:
        # Engines on the same devices share compiled programs: warm one per device group.
        seen = set()
        for w in self.workers:
            key = w.server.device_ids
            if key not in seen:
                seen.add(key)
                w.server.warmup()

    def _live(self) -> list[RolloutWorker]:
        return [w for w in list(self.workers) if not w.killed.is_set()]

    def snapshots(self) -> dict[int, dict]:
        return {w.index: w.snapshot() for w in self._live()}

    def server_stats(self) -> list:
        # Not waiting on a server mid-step: the Driver asks while its learner step computes.
        return [w.server.stats(wait=False) for w in list(self.workers)]

    def _by_name(self, name: str) -> Optional[RolloutWorker]:
        return next((w for w in self._live() if w.name == name), None)

    def export(self, name: str, uid: str, version: int):
        w = self._by_name(name)
        return None if w is None else w.export_sequence(uid, version)

    def import_(self, name: str, state) -> int:
        w = self._by_name(name)
        if w is None:
            raise KeyError(f"rollout server {name} is not serving (dead or replaced)")
        return w.import_sequence(state)

    def poll_health(self) -> list[Failure]:
        timeout, now, out = self.heartbeat_timeout_s, time.monotonic(), []
        for w in self._live():
            thread = self._threads.get(w.index)
            if thread is not None and thread.error is not None:
                out.append(Failure(w.index, w.name, thread.error, thread.traceback))
            elif now - w.last_beat > timeout:
                out.append(Failure(w.index, w.name, TimeoutError(
                    f"rollout server {w.name}: no heartbeat for {now - w.last_beat:.1f}s "
                    f"(scheduler.heartbeat_timeout_s={timeout})"), ""))
            else:
                continue
            w.killed.set()  # reported once; its loop exits and anything it still returns is dropped
        return out

    def replace(self, i: int, record: dict, t_fail: float) -> None:
        from laminar_jax.rollout.server import HostWeights

        old = self.workers[i]
        version, params = old.client.pull_placed(-1, old.pull_timeout_s, old.params_from_flat)
        old.close(timeout=0.0)  # its prefetch thread (ends after a fetch in flight) and kept poll connections
        thread = self._threads.get(i)
        if isinstance(params, HostWeights) and (thread is None or not thread.alive):
            # The dead server owned its weights: freed before its successor's are placed, so its
            # devices never hold two versions (a hung thread may still run on them: kept).
            old.server.release_params()
        self.generations[i] += 1
        fresh = self.make(i, self.generations[i], version, params)
        self.workers[i] = fresh
        self._spawn(fresh)
        mark_replaced(record, fresh.name, version, t_fail)

    def stop(self, timeout: float) -> list[str]:
        self._stop.set()
        alive = [t.name for t in list(self._threads.values()) if not t.join(timeout)]
        return alive + [f"{w.name}-prefetch" for w in list(self.workers) if not w.close(timeout)]

    def close(self) -> None:
        # Threads end with stop(); the engines go with the process; the relay clients' kept
        # version-poll connections are closed here, not left to the relays' idle timeout.
        for w in self.workers:
            w.close(timeout=0.0)  # stopped already (stop() joined their prefetch threads)

    def inject_crash(self, i: int) -> None:
        """Fault injection: server i raises at its next iteration."""
        self.workers[i].crash_next = True

    kill = inject_crash  # a thread cannot be killed from outside: crashing it is the same failure
