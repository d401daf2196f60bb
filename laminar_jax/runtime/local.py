"""The `local` runtime: every role in one process (one machine, one GPU, Colab, CI).

The Driver runs the learner in the calling thread; the buffer service is called in-process; the
rollout servers are a `ThreadFleet`; weights reach them through an in-memory hand-off once the
store has each version (relay.local_handoff), or an in-process `RelayServer`. With
runtime.server_processes the servers are child processes instead (a `ProcessFleet`), which pull
through that relay. Every thread is a
supervised `Worker`: a rollout server's failure is isolated (replaced by the health loop), any
other failure stops the run with its traceback.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from laminar_jax.config import Config
from laminar_jax.buffer.service import BufferService
from laminar_jax.runtime.driver import Driver
from laminar_jax.runtime.fleet import ThreadFleet
from laminar_jax.monitor.sink import Monitor
from laminar_jax.runtime.parts import learner_models, relays_checking_store, resolve, rpc_timeout, run_with
from laminar_jax.weights.plane import WeightsPlane


def _relay(cfg: Config, keys) -> tuple:
    """The in-process relay: (its address, stop, kill-for-fault-injection)."""
    from laminar_jax.relay import RelayServer

    relay = RelayServer(cfg.relay, keys=keys.for_hosts())
    relay.start()
    address = relay.address

    def kill() -> str:
        relay.stop()
        return address

    return address, relay.stop, kill


def _weights_plane(cfg: Config, run_dir: str, keys) -> WeightsPlane:
    """With relay.local_handoff (every server is in this process): the store and an in-memory
    hand-off, no relay. Otherwise, or with servers in their own processes, the in-process relay,
    which servers pull through."""
    if not cfg.relay.local_handoff or cfg.runtime.server_processes:
        address, stop_relay, kill_relay = _relay(relays_checking_store(cfg, run_dir), keys)
        return WeightsPlane(cfg, run_dir, [address], stop_relay, kill_relay, rpc_timeout(cfg), keys)
    from laminar_jax.relay.handoff import Handoff

    def no_relay() -> str:
        raise RuntimeError("relay fault injection: this local run has no relay (relay.local_handoff=True "
                           "hands versions to the servers in memory); set relay.local_handoff=False")

    return WeightsPlane(cfg, run_dir, [], lambda: None, no_relay, rpc_timeout(cfg), keys, handoff=Handoff())


def LocalRun(cfg: Config, run_dir: str, stop: Optional[threading.Event] = None) -> Driver:
    """Build every plane of a local run from the config; `.run()` trains and returns the summary."""
    from laminar_jax.learner.config import DEFAULT_RULES
    from laminar_jax.learner.learner import Learner
    from laminar_jax.model.precision import cast_floating
    from laminar_jax.model.sharded import abstract_model
    from laminar_jax.net.auth import run_keys
    from laminar_jax.weights.host import host_params

    cfg, resuming = resolve(cfg, run_dir)
    monitor = Monitor(cfg, run_dir, time.time())
    # Shapes only: the placement check, the servers' engines and the weight naming need no weights.
    abstract = abstract_model(cfg.model)
    cfg, layout, learner_mesh, server_devices = place_roles(cfg, run_dir, abstract, monitor.phase)
    monitor.phase(f"loading the model ({cfg.model.path or cfg.model.preset}) onto the learner's devices")
    # The Learner is handed a Mesh, so it maps parameters with DEFAULT_RULES: the model is loaded the same way.
    next_model, sft_losses = learner_models(cfg, learner_mesh, DEFAULT_RULES, monitor.phase,
                                            bool(cfg.runtime.sft_warmup_steps and not resuming))

    def make_learner() -> Learner:
        return Learner(cfg.learner, next_model(), learner_mesh, publish_dtype=cfg.rollout.dtype)

    learner = make_learner()
    extra = learner.restore_latest()
    if extra:
        monitor.phase(f"resumed from the checkpoint at learner version {learner.version}")
    buffer = BufferService(cfg, learner.version, extra["runtime"] if extra else None)
    keys = run_keys(run_dir)  # the same on resume: the run dir keeps them
    weights = _weights_plane(cfg, run_dir, keys)
    weights.attach(learner, initial=True)
    monitor.phase(f"starting {cfg.runtime.num_servers} rollout servers")
    # Servers start from the learner's (possibly restored) weights, exactly as published: a host
    # copy, which each server places on its own devices, each device receiving only its shard.
    if cfg.runtime.server_processes:
        fleet = _process_fleet(cfg, buffer, weights, keys.for_hosts(), monitor)
    else:
        # in the serving dtype throughout, the value head (not published) included: no recompile at a swap
        base = None
        if learner.lora is not None:  # every server merges the adapter versions into this base
            from laminar_jax.rollout.server import HostWeights
            from laminar_jax.weights.lora_base import ServedBase

            base = ServedBase(learner.lora.base(), nnx_params(abstract), cfg.rollout.dtype)
            host = HostWeights(base.tree, lora=base.delta(learner.published_params()))
        else:
            host = cast_floating(host_params(learner.policy_params(), nnx_params(abstract)), cfg.rollout.dtype)
        fleet = ThreadFleet.build(cfg, abstract, buffer, weights, monitor.timeline, learner.version, host,
                                  server_devices, base=base)
    return Driver(cfg, run_dir, learner=learner, make_learner=make_learner, buffer=buffer, fleet=fleet,
                  weights=weights, monitor=monitor, stop=stop, sft_losses=sft_losses, resumed=bool(extra),
                  summary_extra=lambda d: {"placement": layout, "weights": d.weights.path()})


def _process_fleet(cfg: Config, buffer, weights: WeightsPlane, keys, monitor):
    """runtime.server_processes: the servers as child processes pulling from the in-process relay;
    their CPU counts in the run's cores-busy figure."""
    import jax

    from laminar_jax.configlib import ConfigError
    from laminar_jax.runtime.process_fleet import ProcessFleet

    if jax.default_backend() != "cpu" or cfg.placement.rollout_tp != 1:
        raise ConfigError(f"runtime.server_processes=True runs each server on its own process's CPU device "
                          f"(backend here: {jax.default_backend()}, placement.rollout_tp="
                          f"{cfg.placement.rollout_tp}); on accelerators use runtime.kind='ray', which gives each "
                          "rollout actor its own devices")
    fleet = ProcessFleet(cfg, buffer, weights.relay_addresses, weights.store_url, keys, monitor.timeline,
                         rpc_timeout(cfg))
    monitor.cpu_sources.append(fleet.cpu_s)
    return fleet


def place_roles(cfg: Config, run_dir: str, model, phase) -> tuple:
    """(cfg with the derived server count, the layout as JSON, the learner's mesh, each server's
    devices) from the placement section and this process's devices (``model`` may be abstract);
    fails at start when a device cannot hold its share. The layout is recorded in config.json and shown once."""
    import jax

    from laminar_jax.config import save_config
    from laminar_jax.learner.mesh import build_mesh
    from laminar_jax.placement import realise
    from laminar_jax.placement_memory import check_devices

    devices = jax.devices()
    cfg, layout = realise(cfg, devices)
    check_devices(cfg, layout, devices, model.cfg)  # the memory plan against each device's budget
    record = {**layout.to_json(), "rollout_tp": cfg.placement.rollout_tp, "colocate": cfg.placement.colocate}
    save_config(cfg, run_dir, record)
    phase(f"placement: learner on devices {record['learner']}, rollout servers on {record['servers']}"
          f"{' (colocated)' if cfg.placement.colocate else ''}")
    mesh = build_mesh(cfg.mesh, [devices[i] for i in layout.learner])
    return cfg, record, mesh, [[devices[i] for i in s] for s in layout.servers]


def nnx_params(model):
    from flax import nnx

    return nnx.split(model)[1]


def run_local(cfg: Config) -> dict:
    return run_with(LocalRun, cfg)
