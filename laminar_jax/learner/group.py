"""A learner spread over several processes: one Ray actor per process, joined by `jax.distributed`.

  driver            LearnerGroup: the Learner interface the runtime uses (version, step, save,
                    restore_latest, policy_params, flush, close) as calls to every process
  LearnerProcess i  jax.distributed.initialize(coordinator, N, i), then the same `Learner` over the
                    global mesh (`cfg.mesh` spans every process's devices)

Every call that runs a collective (step, save, restore, gathering the weights) goes to all N
processes at once, with the same arguments: each process collates the same trajectories and
`place` keeps the shards it owns. Metrics come from process 0.

Weights: every process loads only its own shards of the model (model.sharded.load_model). Each
version (under learner.lora: the adapters; the frozen base is gathered once, by `lora_base`, to
the run's base store) is gathered to process 0 alone, tensor by tensor (learner/gather.py: every process sends
its shards, once; no other process builds a host copy, no device holds a whole tensor), and
process 0 hands the full copy to the publisher the runtime gives it (weight store + relay chain). Weights never
travel through Ray, except the initial (SFT warm-started) parameters the driver hands the group.

Checkpoints: orbax multi-process save/restore, every process taking part; the directory must be
one that every learner host reaches (local disk on one machine, a shared filesystem or gs://).

A process that dies or stops answering makes the whole group unusable (its peers block in
collectives): every wait is bounded, and a dead process or an exceeded wait raises
`LearnerGroupError` naming what it waited for; the runtime then kills the group and starts a new
one from the last checkpoint (`Driver._restart_learner`).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from laminar_jax.types import Trajectory


class LearnerGroupError(RuntimeError):
    """A learner process died or did not answer in time: the group must be restarted."""


def _use_gloo_on_cpu(jax) -> None:
    """CPU collectives across processes need gloo (GPU uses NCCL whatever this says)."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, KeyError, ValueError):  # renamed / default in a later jax
        pass


# ------------------------------------------------------------------------------ the actor side
class LearnerProcess:
    """One process of the learner group (plain Python; the group wraps it with `ray.remote`).

    Calls arrive in the same order at every process (the driver sends each to all of them); those
    marked *collective* block until every process has made them.
    """

    def __init__(self, cfg_json: str, index: int, num_processes: int):
        self.cfg_json, self.index, self.n = cfg_json, index, num_processes
        self.learner = None
        self.publisher = None  # process 0 only: the runtime's publisher, or an in-memory one (tests)
        self._make_publisher: Optional[Callable[[bool], Any]] = None  # process 0: attach_publisher's

    def coordinator_address(self, host: Optional[str] = None) -> str:
        """host:port for the jax.distributed coordinator (process 0's node, a free port).

        The port is free when picked and bound by the coordinator moments later: if another
        process takes it in between, the group's start fails (bounded) and says so."""
        import ray

        host = host or ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return f"{host}:{s.getsockname()[1]}"

    def start(self, coordinator: str, checkpoint_dir: Optional[str], init_params: Optional[dict],
              timeout_s: float) -> dict:
        """Collective: join jax.distributed, build the model (or load `init_params`) and the Learner."""
        import jax

        from laminar_jax.config import finalize
        from laminar_jax.learner.learner import Learner
        from laminar_jax.learner.mesh import build_mesh, sharding_of
        from laminar_jax.learner.publish import LocalPublisher
        from laminar_jax.model import build_model
        from laminar_jax.model.sharded import abstract_model
        from laminar_jax.process_settings import apply_process_settings

        _use_gloo_on_cpu(jax)
        cfg = finalize(json.loads(self.cfg_json))
        apply_process_settings(cfg)  # before this actor's JAX starts; it inherits none of the driver's
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=self.n, process_id=self.index,
                                   initialization_timeout=max(1, int(timeout_s)))
        # Every parameter straight onto its shard of the global mesh: each process reads only the
        # slices its own devices hold (model.sharded.load_model).
        model = build_model(cfg.model, sharding_of(abstract_model(cfg.model), build_mesh(cfg.mesh), cfg.mesh.rules))
        if init_params is not None:
            from laminar_jax.learner.publish import load_model_params

            load_model_params(model, init_params)
        section = dataclasses.replace(cfg.learner, checkpoint_dir=checkpoint_dir)
        self.learner = Learner(section, model, cfg.mesh, publish_dtype=cfg.rollout.dtype)
        # Processes > 0 publish nothing: they only join the gather of each version's weights.
        self.publisher = LocalPublisher(keep=1) if self.index == 0 else None
        self.learner.publisher = self.publisher
        return {"process": jax.process_index(), "devices": jax.device_count(),
                "local_devices": jax.local_device_count(), "mesh": dict(self.learner.mesh.shape),
                "lora": self.learner.lora is not None}

    def lora_base(self, share: Callable[..., str], rcfg: Any, store_url: str, adopt: bool, write: bool) -> str:
        """Collective (learner.lora): ``share(learner, rcfg, store_url, adopt, write)`` (the weight
        plane's `share_base`, handed in: the learner plane does not reach the store) puts the run's
        base in its store (process 0 writes it, gathered once) or adopts it from there, and makes its
        identity known to every process; returns the identity."""
        return share(self.learner, rcfg, store_url, adopt, write)

    def attach_publisher(self, make_publisher: Callable[[bool], Any]) -> None:
        """Process 0 publishes each version through `make_publisher(True)` (the runtime's: weight store
        and relay chain); `make_publisher(False)` gives one to the relays only."""
        if self.index != 0:
            return
        self._make_publisher = make_publisher
        self.publisher = make_publisher(True)
        self.learner.publisher = self.publisher

    def _gather_policy(self) -> Optional[dict[str, np.ndarray]]:
        """Collective: the full host copy of the policy weights, flat as published, on process 0
        (None on the others: they only send their shards, learner/gather.py)."""
        from laminar_jax.learner.gather import gather_to_root

        # In the serving dtype, as step versions are (a bf16-serving fleet refuses a float32 version);
        # under learner.lora the base with the adapters merged.
        return gather_to_root(self.learner.served_arrays())

    def host_copy_bytes(self) -> int:
        """Bytes of the host copy this process built for its last published version (0 on
        processes > 0: only process 0 receives the gather)."""
        pending = self.learner._pending
        if pending is None:
            return 0
        pending.wait_copied(self.learner.section.publish_timeout_s)  # its thread may not have copied it yet
        return int(sum(v.nbytes for v in (pending.host or {}).values()))

    def step(self, trajectories: list[Trajectory], publish: bool) -> dict:
        """Collective: one Learner.step on the batch; publishing (process 0) unless `publish` is False."""
        metrics = self.learner.step(trajectories, publish=publish)
        return {"version": self.learner.version, "metrics": metrics if self.index == 0 else None}

    def _gather_version(self) -> Optional[dict[str, np.ndarray]]:
        """Collective: the current version as published, on process 0 (None on the others): the
        policy weights, or under learner.lora the adapter version (the adapters, the base's
        identity and the scale; the identity is known once `lora_base` ran)."""
        if self.learner.lora is None:
            return self._gather_policy()
        from laminar_jax.learner.gather import gather_to_root
        from laminar_jax.learner.publish import adapters_of, flatten_params

        host = gather_to_root(adapters_of(flatten_params(self.learner.state.params["actor"])))
        return None if host is None else self.learner.lora.version(host)

    def publish_current(self, relays_only: bool, timeout_s: float) -> int:
        """Collective: gather the current version; process 0 publishes it (to the relays only when
        the store holds this version already, as on resume)."""
        host = self._gather_version()
        if self.index == 0:
            pub = self.publisher
            if relays_only:
                pub = self._make_publisher(False)
            try:
                pub.publish(self.learner.version, host)
                if relays_only:
                    pub.flush(timeout=timeout_s)
            finally:
                if relays_only:
                    pub.close()
        return self.learner.version

    def policy_params(self) -> Optional[dict]:
        """Collective: the gathered policy weights (returned by process 0 only)."""
        host = self._gather_policy()
        return host if self.index == 0 else None

    def published(self) -> Optional[tuple]:
        """Process 0's last published (version, weights) when it has no relay publisher (tests)."""
        latest = getattr(self.publisher, "latest", None)
        return latest() if callable(latest) else None

    def save(self, step: int, extra: Optional[dict]) -> None:
        """Collective: orbax multi-process save (async; `flush` waits for it)."""
        self.learner.save(step, extra=extra)

    def restore_latest(self) -> dict:
        """Collective: restore the newest checkpoint; process 0 returns its `extra`."""
        extra = self.learner.restore_latest()
        return {"version": self.learner.version, "extra": extra if self.index == 0 else None,
                "report": self.learner.restore_report if self.index == 0 else None}

    def warmup(self, *args) -> int:
        return self.learner.warmup(*args)

    def flush(self, timeout: float) -> None:
        self.learner.flush(timeout)

    def publisher_stats(self) -> Optional[dict]:
        stats = getattr(self.publisher, "stats", None)
        return dataclasses.asdict(stats()) if callable(stats) else None

    def close_publisher(self, timeout: float) -> None:
        close = getattr(self.publisher, "close", None)
        if callable(close):
            close(timeout=timeout)

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()


# ----------------------------------------------------------------------------- the driver side
class LearnerGroup:
    """`num_processes` LearnerProcess actors behaving, to the runtime, like one `Learner`.

    cfg_json: the resolved config (its learner, mesh and model sections); checkpoint_dir: shared by
    every process; actor_options: Ray options per actor (resources, scheduling, runtime_env);
    init_params: flat weights every process starts from (e.g. after the SFT warm-start; None =
    build the model from the config in each process); coordinator_host: the coordinator's address
    (None = process 0's node IP); timeout_s bounds every collective call (start, step, save, ...);
    rpc_timeout_s the small ones.
    """

    def __init__(self, cfg_json: str, num_processes: int, checkpoint_dir: Optional[str], *,
                 actor_options: Optional[dict] = None, init_params: Optional[dict] = None,
                 coordinator_host: Optional[str] = None, timeout_s: float = 600.0, rpc_timeout_s: float = 120.0,
                 name: str = "learner"):
        import ray

        if num_processes < 1:
            raise ValueError(f"LearnerGroup: num_processes={num_processes}, expected >= 1")
        self.n, self.timeout_s, self.rpc_timeout_s = num_processes, timeout_s, rpc_timeout_s
        self.version = 0
        self.restore_report: Optional[dict] = None  # process 0's, set by restore_latest (the run summary's)
        self.broken: Optional[str] = None
        cls = ray.remote(LearnerProcess)
        self.actors = [cls.options(**(actor_options or {})).remote(cfg_json, i, num_processes)
                       for i in range(num_processes)]
        self.names = [f"{name}-{i}" for i in range(num_processes)]
        try:
            coordinator = self._wait([self.actors[0].coordinator_address.remote(coordinator_host)],
                                     "learner process 0 to start and pick the jax.distributed coordinator address",
                                     self.timeout_s)[0]
            init_ref = ray.put(init_params) if init_params is not None else None
            self.info = self._all("start", "the learner processes to join jax.distributed at "
                                  f"{coordinator} and build the learner", coordinator, checkpoint_dir,
                                  init_ref, timeout_s)
        except BaseException:
            self.kill()
            raise
        self.coordinator = coordinator

    # ------------------------------------------------------------------------------ waiting
    def _all(self, method: str, what: str, *args, timeout: Optional[float] = None) -> list:
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return self._wait(refs, what, self.timeout_s if timeout is None else timeout)

    def _wait(self, refs: list, what: str, timeout: float) -> list:
        """Every ref's value; the first dead process (or an exceeded wait) raises LearnerGroupError
        at once: its peers would wait in a collective forever."""
        import ray

        if self.broken:
            raise LearnerGroupError(f"learner group is broken ({self.broken}); not waiting for {what}")
        index = {r: i for i, r in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + timeout
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [self.names[index[r]] for r in pending]
                self.broken = f"{late} did not answer within {timeout:.0f}s"
                raise LearnerGroupError(f"waited {timeout:.1f}s for {what}; no answer from {late}")
            name = self.names[index[ready[0]]]
            try:
                ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:
                # An error in one process; if a peer died meanwhile (its collective broke), that
                # is the cause: the group is restartable.
                dead = self._dead_peers(pending, index)
                self.broken = f"{name} raised"
                if dead:
                    raise LearnerGroupError(f"learner process(es) {dead} died while waiting for {what}") from e
                raise RuntimeError(f"learner process {name} failed during {what}: {e}") from e
            except ray.exceptions.RayError as e:  # the process is gone: died, killed, OOM-killed, node lost
                self.broken = f"{name} died"
                raise LearnerGroupError(f"learner process {name} died while waiting for {what}: "
                                        f"{type(e).__name__}: {e}") from e
        return ray.get(refs)

    def _dead_peers(self, pending: list, index: dict, grace_s: float = 5.0) -> list[str]:
        """Names of the processes among `pending` that die within `grace_s` (bounded)."""
        import ray

        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s) if pending else ([], [])
        dead = []
        for r in ready:
            try:
                ray.get(r)
            except ray.exceptions.RayTaskError:
                pass
            except ray.exceptions.RayError:
                dead.append(self.names[index[r]])
        return dead

    # ---------------------------------------------------------------------- Learner interface
    def step(self, trajectories: Sequence[Trajectory], publish: bool = True) -> dict:
        """One learner step on every process (the same batch); process 0's metrics."""
        return self.finish(self.dispatch(trajectories, publish=publish))

    def prepare(self, trajectories: Sequence[Trajectory], version: int):
        """The batch in Ray's object store, for the step that starts at `version` (the processes
        collate it themselves)."""
        import ray

        return ray.put(list(trajectories))

    def dispatch(self, trajectories: Sequence[Trajectory], prepared=None, publish: bool = True) -> list:
        """Start the step on every process without waiting for it; `finish` waits."""
        if self.broken:
            raise LearnerGroupError(f"learner group is broken ({self.broken}); not starting step {self.version + 1}")
        batch = prepared if prepared is not None else self.prepare(trajectories, self.version)
        return [a.step.remote(batch, publish) for a in self.actors]

    def finish(self, running: list) -> dict:
        out = self._wait(running, f"learner step {self.version + 1} on every process", self.timeout_s)
        versions = {o["version"] for o in out}
        if versions != {self.version + 1}:
            self.broken = f"versions {sorted(versions)}"
            raise LearnerGroupError(f"learner processes disagree after step {self.version + 1}: versions {versions}")
        self.version += 1
        return out[0]["metrics"]

    def attach_publisher(self, make_publisher: Callable[[bool], Any]) -> None:
        """`make_publisher` (picklable: it is sent to process 0) builds process 0's publisher
        (`LearnerProcess.attach_publisher`)."""
        self._all("attach_publisher", "learner process 0 to build its weight publisher", make_publisher,
                  timeout=self.rpc_timeout_s)

    @property
    def lora_enabled(self) -> bool:
        """learner.lora is on: versions are adapters, and `lora_base` must run before one is published."""
        return bool(self.info[0].get("lora"))

    def lora_base(self, share: Callable[..., str], rcfg: Any, store_url: str, adopt: bool = False,
                  write: bool = True) -> str:
        """learner.lora: put the frozen base in the run's base store (``<store_url>/lora_base``,
        gathered to process 0 once) or, with ``adopt`` (a resume), take it from there; every process
        then knows its identity, which each adapter version carries. Returns it. ``share``: the
        collective that does it on each process (weights.lora_base.share_base)."""
        what = f"the learner processes to {'adopt or ' if adopt else ''}write the LoRA base at {store_url}"
        return self._all("lora_base", what, share, rcfg, store_url, adopt, write)[0]

    def publish_current(self, relays_only: bool = False) -> None:
        """Publish the current version (gathered; process 0 publishes)."""
        self._all("publish_current", f"the learner processes to publish version {self.version}", relays_only,
                  self.rpc_timeout_s)

    def policy_params(self) -> dict[str, np.ndarray]:
        """Host copy of the current policy weights (gathered across processes)."""
        return self._all("policy_params", "the learner processes to gather the policy weights")[0]

    def host_copy_bytes(self) -> list[int]:
        """Per process, the bytes of its host copy of the last published version."""
        return self._all("host_copy_bytes", "the learner processes' host copy sizes", timeout=self.rpc_timeout_s)

    def published(self) -> Optional[tuple]:
        return self._wait([self.actors[0].published.remote()], "learner process 0's last published weights",
                          self.rpc_timeout_s)[0]

    def save(self, step: int, extra: Optional[dict] = None) -> None:
        import ray

        self._all("save", f"the learner processes to start checkpoint {step}", step, ray.put(extra or {}))

    def restore_latest(self) -> Optional[dict]:
        out = self._all("restore_latest", "the learner processes to restore the latest checkpoint")
        versions = {o["version"] for o in out}
        if len(versions) != 1:
            raise LearnerGroupError(f"learner processes restored different versions: {versions}")
        self.version = versions.pop()
        self.restore_report = out[0]["report"]
        return out[0]["extra"]

    def warmup(self, *args) -> int:
        return self._all("warmup", "the learner processes to compile their step", *args)[0]

    def flush(self, timeout: Optional[float] = None) -> None:
        t = timeout or self.timeout_s
        self._all("flush", "the learner processes' last publish and checkpoint", t, timeout=t + 10)

    def publisher_stats(self) -> Optional[dict]:
        return self._wait([self.actors[0].publisher_stats.remote()], "learner process 0's publisher stats",
                          self.rpc_timeout_s)[0]

    def close_publisher(self, timeout: float = 60.0) -> None:
        self._wait([self.actors[0].close_publisher.remote(timeout)], "learner process 0 to close its publisher",
                   timeout + 10)

    def close(self) -> None:
        """Flush and close every process (bounded), then end the actors."""
        try:
            if not self.broken:
                self._all("close", "the learner processes to close", timeout=self.rpc_timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """End every process now (a broken group's survivors may be stuck in a collective)."""
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.broken = self.broken or "killed"

    def kill_process(self, i: int) -> None:
        """Fault injection: `ray.kill` learner process i (as a lost host would)."""
        import ray

        ray.kill(self.actors[i], no_restart=True)
