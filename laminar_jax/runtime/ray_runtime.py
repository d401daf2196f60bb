"""The `ray` runtime: the same Driver, with its buffer, servers and relays as Ray actors.

  driver (this process)  the Driver: learner (+ SFT warm-start, checkpoints, publisher), health and
                         repack loops; with runtime.learner_processes > 1 the learner is a
  LearnerProcess x P     LearnerGroup: one jax.distributed process each (learner/group.py)
  BufferService          one actor: the same class the local runtime calls in-process
  RolloutActor x N       the RayFleet: one RolloutWorker + RolloutServer each (runtime/ray_actors.py)
  RelayActor x nodes     one RelayServer per node, chained master-first

Actor calls carry plain data (Trajectory records, EvalItems, SequenceState, dicts of numpy arrays),
serialised by Ray inside the cluster; weights travel through the relays and the weight store.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from typing import Optional

from laminar_jax.config import Config
from laminar_jax.runtime.driver import Driver, close_all
from laminar_jax.monitor.sink import Monitor
from laminar_jax.runtime.parts import learner_models, relays_checking_store, resolve, rpc_timeout, run_with, sft_warmup
from laminar_jax.runtime.ray_actors import RelayActor
from laminar_jax.runtime.ray_fleet import RayFleet
from laminar_jax.learner.publish import model_params
from laminar_jax.learner.group import LearnerGroup, LearnerGroupError
from laminar_jax.runtime.rollout_worker import InjectedFault
from laminar_jax.weights.plane import WeightsPlane

BUFFER_CONCURRENCY = 32  # threads of the buffer actor: the learner's wait + every server's calls


def role_options(role: str, cluster_gpus: float, gpus: int = 1) -> dict:
    """Ray actor options of a role. Rollout actors and learner processes take a CPU slot (and
    `gpus` GPUs on GPU clusters: placement.rollout_tp for a rollout actor); the buffer and relays
    are threads waiting on sockets and locks. On a cluster without GPUs a rollout actor of TP > 1
    runs its engine over that many host-CPU devices (XLA's forced device count)."""
    opts = {"num_cpus": 1 if role in ("rollout", "learner") else 0}
    if role in ("rollout", "learner") and cluster_gpus >= 1 and gpus:
        opts["num_gpus"] = gpus
    elif role == "rollout" and gpus > 1:
        opts["runtime_env"] = {"env_vars": {"XLA_FLAGS": f"--xla_force_host_platform_device_count={gpus}"}}
    return opts


def connect(rt) -> bool:
    """Join `runtime.address` or start a local cluster; True if this call started (and owns) it.

    Actors import laminar_jax from this checkout: its root goes on their PYTHONPATH (on a multi-host
    cluster the same path must hold the same code on every host, or the package must be installed).
    """
    import ray

    if ray.is_initialized():
        return False  # the caller's cluster (and theirs to shut down)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    for k in ("JAX_PLATFORMS", "LAMINAR_LOG"):
        if k in os.environ:
            env[k] = os.environ[k]
    if rt.address:
        ray.init(address=rt.address, runtime_env={"env_vars": env})
    else:
        # A slot per rollout actor (and learner process) and one spare, so a replacement can
        # start before the dead actor's slot is given back.
        learners = rt.learner_processes if rt.learner_processes > 1 else 0
        ray.init(num_cpus=rt.num_servers + learners + 1, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env})
    return True


def _node_affinity(node_id: str, soft: bool):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)


def _start_relays(cfg: Config, gpus: float, timeout_s: float, keys) -> dict:
    """One relay actor per alive node, chained master-first: {node: (actor, address)}."""
    import ray

    out = {}
    cls = ray.remote(RelayActor)
    for node in [n["NodeID"] for n in ray.nodes() if n.get("Alive")]:
        actor = cls.options(**role_options("relay", gpus), scheduling_strategy=_node_affinity(node, soft=False)
                            ).remote(cfg, keys.for_hosts())
        out[node] = (actor, ray.get(actor.address.remote(), timeout=timeout_s))
    chain = [a for _, a in out.values()]
    for i, (actor, _) in enumerate(out.values()):  # each forwards down the chain
        ray.get(actor.set_successors.remote(chain[i + 1:]), timeout=timeout_s)
    return out


def _spawn_buffer(cfg: Config, gpus: float, name: str, timeout_s: float, learner_version: int,
                  restore: Optional[dict], trained: list) -> tuple:
    """A buffer actor named `name` on the driver's node, ready: (handle, prompts re-dispatched).
    A replacement may find the dead actor's name not yet released: it retries (bounded)."""
    import ray

    from laminar_jax.buffer.service import BufferService
    from laminar_jax.runtime.ray_actors import bounded_get

    here = ray.get_runtime_context().get_node_id()
    cls = ray.remote(BufferService).options(**role_options("buffer", gpus), max_concurrency=BUFFER_CONCURRENCY,
                                            name=name, scheduling_strategy=_node_affinity(here, soft=True))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            handle = cls.remote(cfg, learner_version, restore, trained)
            break
        except ValueError:  # the name is still held by the dead actor
            if time.monotonic() > deadline:
                raise TimeoutError(f"the buffer actor's name {name!r} was not released within {timeout_s:.1f}s")
            time.sleep(0.05)
    return handle, bounded_get(handle.ready.remote(), timeout_s, "the buffer actor to start")


def _kill_relay(actor, address: str) -> str:
    """Fault injection: kill a relay actor; its address goes into the failure record."""
    import ray

    ray.kill(actor, no_restart=True)
    return address


def _learner_factory(cfg: Config, next_model, init_params, gpus: float):
    """make_learner(): the in-driver Learner on ``next_model()``, or (runtime.learner_processes > 1)
    a LearnerGroup."""
    import ray

    from laminar_jax.configlib import to_json
    from laminar_jax.learner.learner import Learner

    rt, generation = cfg.runtime, [0]

    def make():
        if rt.learner_processes == 1:
            return Learner(cfg.learner, next_model(), cfg.mesh, publish_dtype=cfg.rollout.dtype)
        one_node = len([n for n in ray.nodes() if n.get("Alive")]) == 1
        options = role_options("learner", gpus, rt.learner_gpus_per_process)
        if rt.learner_resource:
            options["resources"] = {rt.learner_resource: 1}
        name = "learner" if not generation[0] else f"learner.{generation[0]}"
        generation[0] += 1
        return LearnerGroup(to_json(cfg), rt.learner_processes, cfg.learner.checkpoint_dir, actor_options=options,
                            init_params=init_params, coordinator_host="127.0.0.1" if one_node else None,
                            timeout_s=rt.wait_timeout_s, rpc_timeout_s=rpc_timeout(cfg), name=name)

    return make


def RayRun(cfg: Config, run_dir: str, stop: Optional[threading.Event] = None) -> Driver:
    """Build the actors and the learner from the config; `.run()` trains and returns the summary."""
    import ray

    from laminar_jax.learner.mesh import build_mesh
    from laminar_jax.model import build_model, load_tokenizer
    from laminar_jax.net.auth import run_keys
    from laminar_jax.runtime.ray_buffer import RestartingBuffer

    cfg, resuming = resolve(cfg, run_dir)
    rt, rpc = cfg.runtime, rpc_timeout(cfg)
    monitor = Monitor(cfg, run_dir, time.time())
    sft = bool(rt.sft_warmup_steps and not resuming)
    # A learner group's processes load their own model onto their shards; the driver loads one
    # only to train in-process (onto the learner mesh's shards, learner_models) or to warm a group
    # up (the group then starts from those weights, handed over as one host copy).
    next_model, sft_losses, init_params = None, [], None
    if rt.learner_processes == 1:
        next_model, sft_losses = learner_models(cfg, build_mesh(cfg.mesh), cfg.mesh.rules, monitor.phase, sft)
    elif sft:
        model = build_model(cfg.model)
        sft_losses = sft_warmup(cfg, model, load_tokenizer(cfg.model.tokenizer), monitor.phase)
        init_params = model_params(model)
        del model
    monitor.phase("connecting to Ray" if rt.address else "starting a local Ray cluster")
    started = connect(rt)
    built: list = []  # what to tear down if the build fails
    try:
        gpus = float(ray.cluster_resources().get("GPU", 0))
        make_learner = _learner_factory(cfg, next_model, init_params, gpus)
        learner = make_learner()
        built.append(learner.close)
        extra = learner.restore_latest()
        # A named actor: rollout actors find its replacement by name if it dies (runtime/ray_buffer.py).
        buffer_name = f"laminar-buffer-{uuid.uuid4().hex[:12]}"
        spawn = functools.partial(_spawn_buffer, cfg, gpus, buffer_name, rpc)
        restore = extra["runtime"] if extra else None
        handle, _ = spawn(learner.version, restore, [])
        buffer = RestartingBuffer(handle, rpc, spawn, learner.version, restore, cfg.scheduler.max_server_restarts,
                                  t0=monitor.t0)
        built.append(lambda: ray.kill(buffer.handle, no_restart=True))
        keys = run_keys(run_dir)  # the same on resume: the run dir keeps them
        relays = _start_relays(relays_checking_store(cfg, run_dir), gpus, rpc, keys)
        built += [lambda a=a: ray.kill(a, no_restart=True) for a, _ in relays.values()]
        master = next(iter(relays.values()))
        weights = WeightsPlane(cfg, run_dir, [a for _, a in relays.values()],
                               stop_relays=lambda: close_all([lambda a=a: ray.kill(a, no_restart=True)
                                                              for a, _ in relays.values()]),
                               kill_master=functools.partial(_kill_relay, *master),
                               rpc_timeout_s=rpc, keys=keys)
        weights.attach(learner, initial=True)
        monitor.phase(f"starting {rt.num_servers} rollout actors")
        fleet = RayFleet(cfg, handle, {n: a for n, (_, a) in relays.items()}, weights.store_url, monitor.timeline,
                         rpc, role_options("rollout", gpus, cfg.placement.rollout_tp), keys, buffer_name)
        buffer.on_restart = fleet.buffer_restarted
    except BaseException:
        close_all([*reversed(built), monitor.close, *([ray.shutdown] if started else [])])
        raise
    closers = [lambda: ray.kill(buffer.handle, no_restart=True), *([ray.shutdown] if started else [])]
    driver = Driver(cfg, run_dir, learner=learner, make_learner=make_learner, buffer=buffer, fleet=fleet,
                    weights=weights, monitor=monitor, stop=stop, learner_failures=(InjectedFault, LearnerGroupError),
                    sft_losses=sft_losses, resumed=bool(extra), closers=closers, summary_extra=_ray_summary)
    buffer.failures = driver.failures  # a buffer restart is reported with the run's other failures
    return driver


def _ray_summary(driver: Driver) -> dict:
    b, pub = driver.buffer_stats, driver.weights.last_stats
    return {"ray": {"address": driver.cfg.runtime.address or "local",
                    "rollout_actors": sum(h is not None for h in driver.fleet.actors),
                    "learner_processes": driver.cfg.runtime.learner_processes,
                    "relays": list(driver.weights.relay_addresses),
                    "requeued_samples": b.get("requeued", 0),
                    "buffer_restarts": len(driver.buffer.restarts),
                    "dropped_late_results": b.get("dropped_late_results", 0),
                    "repack_failed_moves": driver.repacker.failed if driver.repacker else 0,
                    "publisher_relay_failures": list(pub.relay_failures) if pub is not None else None}}


def run_ray(cfg: Config) -> dict:
    """`run(cfg)` for runtime.kind='ray': as run_local, with SIGTERM/SIGINT -> checkpoint and stop."""
    return run_with(RayRun, cfg)
