"""One rollout server hosted in a process of its own: the Ray rollout actor's and the child
process's common body (runtime/ray_actors.py, runtime/process_fleet.py).

It builds the SAME `RolloutWorker` + `RolloutServer` the local runtime runs in threads, pulls its
first weights from the relays (the weight store behind them), runs the worker's loop in a
supervised thread once started, and answers the fleet's calls: stats (the heartbeat), export and
import of live sequences for repack, stacks of a hung loop, fault injection, stop. `buffer` is the
buffer service as the caller's transport reaches it (a Ray actor behind `RemoteBuffer`, or a pipe).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Optional, Sequence

from laminar_jax.compile_cache import COMPILE_EVENTS
from laminar_jax.threads import Worker


def check_memory(cfg, mesh, model, name: str) -> None:
    """This server's devices (its engine mesh's, else the default device) against the memory plan's
    share of one server (placement_memory.check_server_devices; a ConfigError when one does not fit)."""
    import jax

    from laminar_jax.placement_memory import check_server_devices

    devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
    check_server_devices(cfg, devices, model.cfg, f"rollout server {name}")


def _lora_base(cfg, store_url: Optional[str], model):
    """learner.lora: the base this server merges adapter versions into, read once from the run's
    base store (weights/lora_base.py); None otherwise."""
    if not cfg.learner.lora.enabled:
        return None
    from flax import nnx

    from laminar_jax.weights.lora_base import read_base

    if not store_url:
        raise ValueError("learner.lora: a rollout host reads the base from the weight store, and has no store URL")
    return read_base(cfg.relay, store_url, nnx.split(model)[1], cfg.rollout.dtype)


class RolloutHost:
    def __init__(self, cfg, index: int, generation: int, addresses: Sequence[str], store_url: Optional[str],
                 buffer, keys, mesh=None, board_sync_s: float = 0.05):
        """addresses: the relays to pull from, nearest first; mesh: the engine's (None: the default device)."""
        from laminar_jax.model import load_tokenizer
        from laminar_jax.model.sharded import abstract_model
        from laminar_jax.relay import RelayClient, WeightStore
        from laminar_jax.rollout import make_engine
        from laminar_jax.rollout.server import RolloutServer
        from laminar_jax.runtime.fleet import params_from_flat, server_section
        from laminar_jax.runtime.rollout_worker import RolloutWorker, episode_feed, pull_timeout
        from laminar_jax.scheduler.modes import get_policy

        section = server_section(cfg, index, generation)
        self.name = name = section.server_id
        # Shapes only (nnx.eval_shape): the engine is built from them and holds just the pulled
        # version, which it owns and streams each later one into (params_from_flat).
        model = abstract_model(cfg.model)
        check_memory(cfg, mesh, model, name)  # before the engine allocates its pool or compiles
        store = WeightStore.from_config(cfg.relay, store_url) if store_url else None
        client = RelayClient(list(addresses), store=store, config=cfg.relay, holder=name, keys=keys)
        engine, _ = make_engine(model, section, mesh=mesh)
        from_flat = params_from_flat(model, engine, cfg.rollout.dtype, base=_lora_base(cfg, store_url, model))
        version, flat = client.pull(newer_than=-1, timeout=pull_timeout(cfg))
        policy = get_policy(cfg.runtime.mode, cfg.scheduler.repack, cfg.scheduler.admit_lag)
        # Multi-turn episodes (env.enabled): this host's own EnvPool and environments, in its process.
        episodes = episode_feed(cfg, load_tokenizer(cfg.model.tokenizer), buffer.episode_record)
        self.worker = RolloutWorker(index, name, RolloutServer(engine, from_flat(flat), version=version), client,
                                    buffer, policy, from_flat, pull_timeout_s=pull_timeout(cfg),
                                    board_sync_s=board_sync_s, episodes=episodes, prefetch=cfg.rollout.prefetch,
                                    prefetch_device=cfg.rollout.prefetch_device)
        buffer.register(index, name, version)
        self._loop = Worker(f"{name}-worker", self._run, stop_on_failure=False)
        self.compiles = 0

    def _run(self) -> None:
        self.worker.run(self._loop.stop)

    def ready(self) -> dict:
        return {"name": self.name, "version": self.worker.server.version,
                "devices": [str(d) for d in self.worker.server.engine.devices]}

    def warmup(self) -> None:
        """Compile the engine's programs; from here on, count what still compiles (0 when the
        warm-up covered every shape the loop meets; `stats()['compiles']`)."""
        import jax

        self.worker.server.warmup()
        jax.monitoring.register_event_duration_secs_listener(self._count_compile)

    def _count_compile(self, event: str, duration: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:  # a load from the persistent cache is a program the warm-up missed too
            self.compiles += 1

    def start(self) -> None:
        self.worker.last_beat = time.monotonic()  # silent through the warm-up is not dead
        if not self._loop.alive and self._loop.error is None:
            self._loop.start()

    def stats(self) -> dict:
        """Heartbeat + the scheduler's view (RolloutWorker.snapshot) + the loop's traceback if it died."""
        out = {**self.worker.snapshot(), "error": self._loop.traceback or None, "compiles": self.compiles,
               "swap_log": self.worker.take_swaps()}
        episodes = self.worker.episodes
        if episodes is not None:  # the env figures the driver's timeline and summary show
            with self.worker.lock:
                out["env"] = {"waiting": self.worker.server.waiting_in_slots(),
                              "stats": episodes.driver.stats()._asdict()}
        return out

    def export_sequence(self, uid: str, version: int):
        return self.worker.export_sequence(uid, version, portable=True)  # episodes keep their envs in-process

    def import_sequence(self, state) -> int:
        return self.worker.import_sequence(state)

    def stacks(self) -> str:
        """Every thread's Python stack (what a hung worker is stuck on, for the failure log)."""
        names = {t.ident: t.name for t in threading.enumerate()}
        return "\n".join(f"--- thread {names.get(tid, tid)}\n" + "".join(traceback.format_stack(frame))
                         for tid, frame in sys._current_frames().items())

    def inject_crash(self) -> None:
        """Fault injection: the worker's next iteration raises (a crashed server)."""
        self.worker.crash_next = True

    def stop(self, timeout: float = 30.0) -> bool:
        self._loop.stop.set()
        joined = self._loop.join(timeout)
        return self.worker.close(timeout) and joined  # the prefetch thread; the kept version-poll connections
