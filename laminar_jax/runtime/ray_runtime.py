"""The `ray` runtime: the roles of the local runtime as Ray actors.

  driver (this process)  learner (+ SFT warm-start, checkpoints, publisher), health loop, repack;
                         with runtime.learner_processes > 1 the learner is a LearnerGroup instead:
  LearnerProcess x P     one jax.distributed process each, one global mesh (runtime/ray_learner.py)
  BufferActor            prompt source, ledger, experience store, dispatcher, work queue, rewards,
                         the board, and which server owns each sample (runtime/ray_buffer.py)
  RolloutActor x N       one RolloutServer driven by the same RolloutWorker as the local runtime
  RelayActor x nodes     one RelayServer per node, chained master-first (runtime/ray_rollout.py)

Fault handling maps onto the local runtime's: a rollout actor that dies (crash, `ray.kill`, a lost
node) or stops answering for `scheduler.heartbeat_timeout_s` is killed, the buffer requeues the
samples it owned (its late results are dropped), and a replacement actor pulls the newest version
and takes over its index. Every wait is bounded and its error names what it waited for.

Actor method calls carry plain data (dicts of numpy arrays / str / int), serialised by Ray inside
the cluster; weights travel through the relays and the weight store, never through Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Optional

from laminar_jax.config import Config
from laminar_jax.configlib import to_json
from laminar_jax.rollout.records import ServerStats
from laminar_jax.runtime.local import LocalRun, _rows_to_trajectories
from laminar_jax.runtime.monitor import Monitor
from laminar_jax.runtime.ray_learner import GroupPublisherProxy, LearnerGroup, LearnerGroupError, model_params
from laminar_jax.runtime.repack import RepackLoop
from laminar_jax.runtime.rollout_worker import InjectedFault
from laminar_jax.runtime.threads import Supervisor
from laminar_jax.runtime.timeline import Timeline
from laminar_jax.scheduler.modes import get_policy

log = logging.getLogger(__name__)

# Ray resources per role. Rollout actors also ask for one GPU when the cluster has GPUs, learner
# processes runtime.learner_gpus_per_process; the buffer and relays are light (threads waiting on
# sockets and locks) and take no CPU slot.
ROLE_RESOURCES = {"rollout": {"num_cpus": 1}, "learner": {"num_cpus": 1}, "buffer": {"num_cpus": 0},
                  "relay": {"num_cpus": 0}}
HEALTH_POLL_S = 0.25
BUFFER_CONCURRENCY = 32  # threads of the buffer actor: the learner's wait + every server's calls


def role_options(role: str, cluster_gpus: float, gpus: int = 1) -> dict:
    """Ray actor options of a role: ROLE_RESOURCES, plus `gpus` GPUs per rollout actor or learner
    process on GPU clusters."""
    opts = dict(ROLE_RESOURCES[role])
    if role in ("rollout", "learner") and cluster_gpus >= 1 and gpus:
        opts["num_gpus"] = gpus
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


def _remote(cls, role: str, cluster_gpus: float, **options):
    import ray

    return ray.remote(cls).options(**role_options(role, cluster_gpus), **options)


def _node_affinity(node_id: str, soft: bool):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)


class _Polled:
    """What the monitor reads of a rollout actor: its last polled stats (no call on the hot path)."""

    def __init__(self, stats: ServerStats):
        self._stats = stats

    @property
    def version(self) -> int:
        return self._stats.version

    def stats(self) -> ServerStats:
        return self._stats


class _Facade:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class RayMonitor(Monitor):
    def lost_prompts(self) -> int:
        return int(self.run.buffer_stats["lost_prompts"])


class RayRepackLoop(RepackLoop):
    """The local RepackLoop's planning on actor snapshots; a move is export (bytes) -> import on the
    destination, the buffer's ownership moving with it; a failed import goes back to the source,
    and a sequence that can go nowhere is generated again from its prompt."""

    def __init__(self, run: "RayRun"):
        super().__init__([], run.cfg.scheduler, None)
        self.owner = run
        self._by_id: dict = {}
        self.requeued = 0

    def views(self):
        import ray

        from laminar_jax.scheduler.repack import ServerView

        handles = [h for h in list(self.owner.actors) if h is not None]
        refs = [h.stats.remote() for h in handles]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.owner.rpc_timeout_s)
        out, by_id = [], {}
        for h, ref in zip(handles, refs):
            if ref not in ready:
                continue  # silent: the health loop deals with it; never a source or destination
            try:
                st = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            if st["error"]:
                continue
            s = st["stats"]
            sid, used = s["server_id"], s["kv_pages_used"]
            out.append(ServerView(sid, s["version"], s["kv_pages_total"], used, self._prev_used.get(sid, used + 1),
                                  tuple((u, int(p)) for u, p in st["seqs"]),
                                  draining=st["draining"], max_live=s["slots_total"]))
            self._prev_used[sid] = used
            by_id[sid] = (h, s["version"])
        self._by_id = by_id
        return out

    def execute(self, move) -> bool:
        run, uid = self.owner, move.seq_uid
        src, dst = self._by_id.get(move.src), self._by_id.get(move.dst)
        if src is None or dst is None or src[1] != dst[1]:
            return False
        try:
            data = run._get(src[0].export_sequence.remote(uid, src[1]), f"{move.src} to export sequence {uid!r}")
        except Exception:  # noqa: BLE001 - a dead/hung source is the health loop's business
            return False
        if data is None:
            return False  # finished, or the source swapped, since the plan was made
        if not run._get(run.buffer.move.remote(uid, move.src, move.dst), f"the buffer to move {uid!r}"):
            return False  # the source was declared dead meanwhile: the sample is requeued already
        try:
            run._get(dst[0].import_sequence.remote(data), f"{move.dst} to import sequence {uid!r}")
            self.moved += 1
            return True
        except Exception:  # noqa: BLE001 - back to the source below; counted
            self.failed += 1
        if run._get(run.buffer.move.remote(uid, move.dst, move.src), f"the buffer to move {uid!r} back"):
            try:
                run._get(src[0].import_sequence.remote(data), f"{move.src} to re-import {uid!r}")
            except Exception:  # noqa: BLE001 - e.g. the source swapped versions: regenerate it
                if run._get(run.buffer.requeue_uid.remote(uid, move.src), f"the buffer to requeue {uid!r}"):
                    self.requeued += 1
        return False


class _BufferSnapshot:
    """`dispatcher.snapshot()` for LocalRun._checkpoint: the buffer actor's consistent snapshot."""

    def __init__(self, run: "RayRun"):
        self.run = run

    def snapshot(self) -> dict:
        return self.run._get(self.run.buffer.snapshot.remote(), "the buffer actor's checkpoint snapshot")


class RayRun(LocalRun):
    """Builds the actors and the learner from the config; `run()` trains and returns the summary.

    Reuses LocalRun's learner side (SFT warm-start, learner restart + replay, checkpoints) and
    replaces everything that crossed threads with actor calls. With runtime.learner_processes > 1
    `self.learner` is a LearnerGroup (the same calls, run by every learner process), and a dead
    learner process takes the learner-crash path: the group restarts from its checkpoint.
    """

    # A dead learner process surfaces as LearnerGroupError: restart the group and replay.
    LEARNER_FAILURES = (InjectedFault, LearnerGroupError)

    def __init__(self, cfg: Config, run_dir: str, stop: Optional[threading.Event] = None):
        import ray

        from laminar_jax.model import build_model, load_tokenizer

        self.cfg, self.run_dir = cfg, run_dir
        rt = cfg.runtime
        self.sup = Supervisor()
        if stop is not None:
            self.sup.stop = stop
        self.policy = get_policy(rt.mode, cfg.scheduler.repack, cfg.scheduler.admit_lag)
        self.rpc_timeout_s = min(rt.wait_timeout_s, 120.0)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.sft_losses: list[float] = []
        self._ckpt_dir, resuming = _checkpoint_dir(cfg.learner.checkpoint_dir, run_dir)
        sft = bool(rt.sft_warmup_steps and not resuming)
        # A learner group's processes build their own model; the driver needs one only to train
        # in-process or to warm it up (the group then starts from these weights).
        self.model = build_model(cfg.model) if rt.learner_processes == 1 or sft else None
        self._init_params = None
        if sft:
            self._sft_warmup()
            if rt.learner_processes > 1:
                self._init_params = model_params(self.model)
        self._learner_generation = 0
        self.learner = None
        self.failures: list[dict] = []
        self._fail_lock = threading.RLock()
        self.actors: list = []
        self.relay_actors: dict = {}
        self.buffer = None
        self.publisher = None
        self._publisher_stats = None
        self.started_cluster = connect(rt)
        self.buffer_stats: dict = {"queue": 0, "ledger": {}, "lost_prompts": 0}
        try:
            self._gpus = float(ray.cluster_resources().get("GPU", 0))
            self.cfg_json = to_json(cfg)
            self.learner = self._make_learner()
            self.extra = self.learner.restore_latest()
            here = ray.get_runtime_context().get_node_id()
            self.buffer = _remote(_buffer_cls(), "buffer", self._gpus, max_concurrency=BUFFER_CONCURRENCY,
                                  scheduling_strategy=_node_affinity(here, soft=True)).remote(
                self.cfg_json, self.learner.version, self.extra["runtime"] if self.extra else None)
            self.redispatched = self._get(self.buffer.ready.remote(), "the buffer actor to start")
            self.dispatcher = _BufferSnapshot(self)
            self.t0 = time.time()
            self.timeline = Timeline(self.t0)
            self._build_weights_plane()
            self._build_servers()
        except BaseException:
            self._teardown(closing=(self.learner.close,) if self.learner is not None else ())
            raise
        self.monitor = RayMonitor(cfg, run_dir, self)
        self.on_step_hooks: list = []
        self._replay: list = []
        self._crash_learner = False
        self._last_ckpt = self.learner.version if self.extra else None
        self.repacker = None

    # ------------------------------------------------------------------------------ learner
    def _make_learner(self):
        """The in-driver Learner, or (runtime.learner_processes > 1) a LearnerGroup of actors."""
        import ray

        from laminar_jax.learner.learner import Learner

        rt = self.cfg.runtime
        lsec = dataclasses.replace(self.cfg.learner, checkpoint_dir=self._ckpt_dir, total_steps=rt.total_steps)
        if rt.learner_processes == 1:
            return Learner(lsec, self.model, self.cfg.mesh)
        one_node = len([n for n in ray.nodes() if n.get("Alive")]) == 1
        options = role_options("learner", self._gpus, rt.learner_gpus_per_process)
        if rt.learner_resource:
            options["resources"] = {rt.learner_resource: 1}
        return LearnerGroup(self.cfg_json, rt.learner_processes, self._ckpt_dir, actor_options=options,
                            init_params=self._init_params, coordinator_host="127.0.0.1" if one_node else None,
                            timeout_s=rt.wait_timeout_s, rpc_timeout_s=self.rpc_timeout_s,
                            name="learner" if not self._learner_generation else f"learner.{self._learner_generation}")

    def _restart_learner(self) -> None:
        """As LocalRun's (fresh learner from the last checkpoint, replay, nothing published again),
        for a learner group: every process is ended (survivors block in collectives) and a new
        group starts; process 0 publishes the current version again only if it never reached the
        weight store (the old process 0 died before writing it)."""
        if not isinstance(self.learner, LearnerGroup):
            return super()._restart_learner()
        old = self.learner
        old.kill()
        self._learner_generation += 1
        fresh = self._make_learner()
        try:
            fresh.restore_latest()
            for batch in self._replay:
                fresh.step(batch, publish=False)
            if fresh.version != old.version:
                raise RuntimeError(f"learner restart reached version {fresh.version}, expected {old.version}")
            fresh.attach_publisher(self.store_url, list(self.relay_addresses.values()))
            if self.weight_store.latest() != fresh.version:
                fresh.publish_current()
        except BaseException:
            fresh.kill()
            raise
        self.learner = fresh

    def kill_learner_process(self, i: int) -> None:
        """Fault injection: `ray.kill` learner process i (runtime.learner_processes > 1)."""
        if not isinstance(self.learner, LearnerGroup):
            raise RuntimeError("runtime.learner_processes=1: the learner is the driver process")
        self.learner.kill_process(i)

    # ------------------------------------------------------------------------------ helpers
    def _get(self, ref, what: str, timeout: Optional[float] = None):
        """ray.get, bounded; the error names what it waited for."""
        import ray

        t = self.rpc_timeout_s if timeout is None else timeout
        try:
            return ray.get(ref, timeout=t)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"ray runtime waited {t:.1f}s for {what}") from None

    @property
    def workers(self) -> list:
        """Per rollout index, its last polled stats (what Monitor reads as `w.server`)."""
        return [_Facade(server=_Polled(ServerStats(**self.latest[i]["stats"]))) for i in sorted(self.latest)]

    @property
    def queue(self):
        return _Len(self.buffer_stats.get("queue", 0))

    @property
    def ledger(self):
        return _Facade(summary=lambda: dict(self.buffer_stats["ledger"]))

    # ------------------------------------------------------------------------ construction
    def _build_weights_plane(self) -> None:
        import ray

        from laminar_jax.relay import Publisher, WeightStore

        rcfg = self.cfg.relay
        self.store_url = rcfg.store_url or os.path.join(self.run_dir, "weights")
        self.weight_store = WeightStore(self.store_url, keep_last=rcfg.keep_last)
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        cls = ray.remote(_relay_cls())
        for node in nodes:  # one relay per node
            self.relay_actors[node] = cls.options(**role_options("relay", self._gpus),
                                                  scheduling_strategy=_node_affinity(node, soft=False)
                                                  ).remote(self.cfg_json)
        self.relay_addresses = {node: self._get(a.address.remote(), f"the relay actor on node {node} to start")
                                for node, a in self.relay_actors.items()}
        chain = list(self.relay_addresses.values())
        for i, a in enumerate(self.relay_actors.values()):  # master first; each forwards down the chain
            self._get(a.set_successors.remote(chain[i + 1:]), "a relay actor to take its successors")
        # A resumed learner re-publishes the numbers after its checkpoint with new weights.
        self.weight_store.retract_newer_than(self.learner.version)
        if isinstance(self.learner, LearnerGroup):  # process 0 publishes; weights skip the driver
            self.learner.attach_publisher(self.store_url, chain)
            self.learner.publish_current(relays_only=self.weight_store.latest() == self.learner.version)
            self.publisher = GroupPublisherProxy(self)
            self.publish_times = [(time.time(), self.learner.version)]
            return
        self.publisher = Publisher(rcfg, store=self.weight_store, relay_addresses=chain)
        if self.weight_store.latest() != self.learner.version:
            self.publisher.publish(self.learner.version, self.learner.policy_params())
        else:  # stored already (resume): put it on the relays too, where new actors pull it from
            seed_pub = Publisher(rcfg, store=None, relay_addresses=chain)
            try:
                seed_pub.publish(self.learner.version, self.learner.policy_params())
                seed_pub.flush(timeout=self.rpc_timeout_s)
            finally:
                seed_pub.close()
        self.learner.publisher = self.publisher
        self.publish_times = [(time.time(), self.learner.version)]

    def _spawn_actor(self, i: int, generation: int):
        name = f"rollout-{i}" if generation == 0 else f"rollout-{i}.{generation}"
        handle = _remote(_rollout_cls(), "rollout", self._gpus).remote(
            self.cfg_json, i, name, self.relay_addresses, self.store_url, self.buffer,
            self.cfg.seed + 17 * i + generation, self.rpc_timeout_s)
        return name, handle

    def _build_servers(self) -> None:
        n = self.cfg.runtime.num_servers
        spawned = [self._spawn_actor(i, 0) for i in range(n)]
        self.names = [name for name, _ in spawned]
        self.actors = [h for _, h in spawned]
        self.generations = [0] * n
        self.latest: dict[int, dict] = {}
        for name, h in spawned:
            self._get(h.ready.remote(), f"rollout actor {name} to start (build its engine, pull its weights)",
                      timeout=self.cfg.runtime.wait_timeout_s)
        self._polls: dict[int, list] = {}  # index -> [handle, outstanding stats ref, last answer time]
        self._replacing: dict[int, tuple] = {}  # index -> (name, handle, ready ref, t_fail, failure record)

    # ------------------------------------------------------------------------- fault handling
    def _on_server_failure(self, i: int, handle, exc: BaseException, tb: str) -> None:
        """Rollout actor i died or stopped answering: kill it, requeue the samples it owned, start
        a replacement (which pulls the newest version). Training goes on meanwhile; the health loop
        keeps watching the other actors while the replacement starts."""
        import ray

        t_fail = time.time()
        with self._fail_lock:
            if handle is not self.actors[i]:
                return  # already handled
            name = self.names[i]
            self.actors[i] = None
            self.latest.pop(i, None)
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            requeued = self._get(self.buffer.server_failed.remote(i, name), f"the buffer to requeue {name}'s work")
            record = {"server": name, "error": repr(exc), "t": round(t_fail - self.t0, 2), "requeued": requeued}
            self.failures.append(record)
            log.warning("rollout actor %s died (%r); requeued %d samples\n%s", name, exc, requeued, tb)
            self._check_restart_limit(name, exc)
            if not self.sup.stop.is_set():
                self._start_replacement(i, record, t_fail)

    def _check_restart_limit(self, name: str, exc: BaseException) -> None:
        limit = self.cfg.scheduler.max_server_restarts
        if len([f for f in self.failures if "server" in f]) > limit:
            raise RuntimeError(f"more than scheduler.max_server_restarts={limit} rollout server failures; "
                               f"last: {name}: {exc!r}") from exc

    def _start_replacement(self, i: int, record: dict, t_fail: float) -> None:
        self.generations[i] += 1
        name, handle = self._spawn_actor(i, self.generations[i])
        self._replacing[i] = (name, handle, handle.ready.remote(), t_fail, record)

    def _check_replacement(self, i: int) -> None:
        """Install replacement i once it is ready; a replacement that fails to start counts as a
        failure of its own and is tried again (bounded by scheduler.max_server_restarts)."""
        import ray

        name, handle, ref, t_fail, record = self._replacing[i]
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            limit = self.cfg.runtime.wait_timeout_s
            if time.time() - t_fail > limit:
                raise TimeoutError(f"replacement rollout actor {name} did not start within "
                                   f"runtime.wait_timeout_s={limit}s (build its engine, pull its weights)")
            return
        del self._replacing[i]
        try:
            info = ray.get(ref)
        except ray.exceptions.RayError as e:
            ray.kill(handle, no_restart=True)
            again = {"server": name, "error": repr(e), "t": round(time.time() - self.t0, 2), "requeued": 0}
            with self._fail_lock:
                self.failures.append(again)
                self._check_restart_limit(name, e)
                if not self.sup.stop.is_set():
                    self._start_replacement(i, again, time.time())
            return
        with self._fail_lock:
            self.names[i], self.actors[i] = name, handle
            record["replacement"] = name
            record["replacement_version"] = info["version"]
            record["recovery_s"] = round(time.time() - t_fail, 3)

    def _poll_server(self, i: int, handle, heartbeat_s: float) -> None:
        import ray

        now = time.monotonic()
        slot = self._polls.get(i)
        if slot is None or slot[0] is not handle:
            slot = self._polls[i] = [handle, handle.stats.remote(), now]
        ready, _ = ray.wait([slot[1]], timeout=0)
        if not ready:
            if now - slot[2] > heartbeat_s:
                self._on_server_failure(i, handle, TimeoutError(
                    f"rollout actor {self.names[i]}: no answer to stats() for {now - slot[2]:.1f}s "
                    f"(scheduler.heartbeat_timeout_s={heartbeat_s})"), "")
            return
        try:
            st = ray.get(ready[0])
        except ray.exceptions.RayError as e:  # RayActorError: killed, crashed, node lost
            self._on_server_failure(i, handle, e, "")
            return
        slot[1], slot[2] = handle.stats.remote(), now
        if st["error"]:
            self._on_server_failure(i, handle, RuntimeError(f"rollout actor {self.names[i]}: worker loop died"),
                                    st["error"])
        elif st["beat_age"] > heartbeat_s:
            try:  # what it is stuck on, for the log
                stacks = ray.get(handle.stacks.remote(), timeout=5.0)
            except Exception as e:  # noqa: BLE001 - the failure is handled either way
                stacks = f"(no stacks: {e!r})"
            self._on_server_failure(i, handle, TimeoutError(
                f"rollout server {self.names[i]}: no heartbeat for {st['beat_age']:.1f}s "
                f"(scheduler.heartbeat_timeout_s={heartbeat_s})"), stacks)
        else:
            self.latest[i] = st
            s = st["stats"]
            self.timeline.sample(time.time(), s["server_id"], s["slots_used"], s["slots_total"], s["version"])

    def _health_loop(self) -> None:
        """Heartbeats of every rollout actor (its stats double as the monitor's and timeline's view)."""
        heartbeat_s = self.cfg.scheduler.heartbeat_timeout_s
        while not self.sup.stop.wait(HEALTH_POLL_S):
            for i, handle in enumerate(list(self.actors)):
                if self.sup.stop.is_set():
                    return
                if i in self._replacing:
                    self._check_replacement(i)
                elif handle is not None:
                    self._poll_server(i, handle, heartbeat_s)

    def _live_actor(self, i: int):
        h = self.actors[i]
        if h is None:
            raise RuntimeError(f"rollout actor {i} is being replaced; no actor to inject a fault into")
        return h

    def inject_server_crash(self, i: int) -> None:
        """Fault injection: rollout actor i's worker raises at its next iteration."""
        self._live_actor(i)
        self._get(self.actors[i].inject_crash.remote(), f"{self.names[i]} to take the injected crash")

    def kill_server(self, i: int) -> None:
        """Fault injection: `ray.kill` rollout actor i (as a lost process or node would)."""
        import ray

        ray.kill(self._live_actor(i), no_restart=True)

    def inject_relay_failure(self) -> None:
        """Fault injection: the master relay actor dies; the publisher and clients go on without it."""
        import ray

        node, actor = next(iter(self.relay_actors.items()))
        ray.kill(actor, no_restart=True)
        self.failures.append({"relay": self.relay_addresses[node], "t": round(time.time() - self.t0, 2)})

    # -------------------------------------------------------------------------------- the run
    def _next_batch(self) -> list[dict]:
        rt = self.cfg.runtime
        deadline = time.monotonic() + rt.wait_timeout_s
        while True:
            self.sup.check()
            if self.sup.stop.is_set():
                raise InterruptedError("stop requested")
            out = self._get(self.buffer.get_batch.remote(rt.prompts_per_step, self.learner.version, 0.5),
                            "the buffer actor's get_batch", timeout=0.5 + self.rpc_timeout_s)
            if out is not None:
                self.monitor.duplicates += out["duplicates"]
                return out["rows"]
            if time.monotonic() > deadline:
                stats = self._get(self.buffer.stats.remote(), "the buffer actor's stats")
                raise TimeoutError(
                    f"learner waited runtime.wait_timeout_s={rt.wait_timeout_s}s for {rt.prompts_per_step} "
                    f"complete groups; buffer={stats}, servers={[self.latest[i]['stats'] for i in self.latest]}")

    def run(self) -> dict:
        self.sup.spawn("health", self._health_loop)
        if self.policy.repack:
            self.repacker = RayRepackLoop(self)
            self.sup.spawn("scheduler", lambda: self.repacker.run(self.sup.stop))
        return self._train_loop()

    def summary(self, stopped_early: bool) -> dict:
        s = self.monitor.summary(stopped_early)
        # Completions land in the buffer actor: the generation-side figures come from there.
        gen = self.buffer_stats.get("generated_tokens", 0)
        s["gen_tokens_per_s"] = round(gen / max(s["rl_wall_s"], 1e-9), 2) if gen else None
        for k in ("latency_p50_s", "latency_p99_s"):
            v = self.buffer_stats.get(k)
            s[k] = None if v is None else round(float(v), 4)
        s["ray"] = {"address": self.cfg.runtime.address or "local", "rollout_actors": sum(h is not None for h in self.actors),
                    "learner_processes": self.cfg.runtime.learner_processes,
                    "relays": list(self.relay_addresses.values()),
                    "requeued_samples": self.buffer_stats.get("requeued", 0),
                    "dropped_late_results": self.buffer_stats.get("dropped_late_results", 0),
                    "repack_failed_moves": getattr(self.repacker, "failed", 0) if self.repacker else 0,
                    "publisher_relay_failures": list(self._publisher_stats.relay_failures)
                    if self._publisher_stats is not None else None}
        return s

    def _train_on(self, rows: list[dict]) -> None:
        trajs = _rows_to_trajectories(rows)  # their prompts were marked consumed by get_batch
        metrics = self._learner_step(trajs)
        self._replay.append(trajs)
        # Servers learn of the new version from the relays; only then may dispatch run ahead.
        self.buffer_stats = self._get(self.buffer.set_learner_version.remote(self.learner.version),
                                      "the buffer actor to take the new learner version")
        self.publish_times.append((time.time(), self.learner.version))
        self.timeline.publish(time.time(), self.learner.version)
        if self.repacker is not None:
            self.repacker.poke()
        self.monitor.on_step(metrics, trajs)
        every = self.cfg.runtime.checkpoint_every
        if every and self.learner.version % every == 0:
            self._checkpoint()
        for hook in list(self.on_step_hooks):
            hook(self.learner.version)

    def _stop_actors(self) -> list[str]:
        """Ask every rollout actor to stop its loop (bounded); returns the names that did not."""
        import ray

        refs = {name: h.stop.remote(10.0) for name, h in zip(self.names, self.actors) if h is not None}
        stuck = []
        for name, ref in refs.items():
            try:
                if not ray.get(ref, timeout=15.0):
                    stuck.append(name)
            except Exception:  # noqa: BLE001 - a dead actor has nothing to stop
                pass
        return stuck

    def _shutdown(self, clean: bool) -> None:
        """Stop the loops and actors; checkpoint only after a clean stop; tear the actors down (and
        the cluster, if this run started it)."""
        failed = None
        try:
            self.sup.check()
        except Exception as e:  # noqa: BLE001 - re-raised below after cleanup
            failed = e
        self.sup.stop.set()
        stuck = self.sup.join(timeout=30) + self._stop_actors()
        try:
            if clean and failed is None and not stuck:
                self._checkpoint()
            if clean:
                self.learner.flush(timeout=120)
                self.buffer_stats = self._get(self.buffer.stats.remote(), "the buffer actor's final stats")
        except BaseException:
            self._teardown()
            raise
        errors = self._teardown(closing=(self.learner.close, self.monitor.close))
        if not clean:
            return  # the caller re-raises the error that stopped the run
        if failed is not None:
            raise failed
        if stuck:
            raise RuntimeError(f"workers did not stop within their timeouts: {stuck}")
        if errors:
            raise errors[0]

    def _teardown(self, closing=()) -> list[BaseException]:
        """Close the publisher, the buffer and every actor; shut the cluster down if we started it.
        Reaches every part; returns the errors met."""
        import ray

        errors: list[BaseException] = []

        def attempt(fn):
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - cleanup must reach every part
                errors.append(e)

        if self.publisher is not None:
            try:
                self._publisher_stats = self.publisher.stats()
            except Exception:  # noqa: BLE001 - diagnostics only
                pass
            attempt(self.publisher.close)
        if self.buffer is not None:
            attempt(lambda: self._get(self.buffer.close.remote(), "the buffer actor to close", timeout=30))
        pending = [r[1] for r in getattr(self, "_replacing", {}).values()]
        for h in [*self.actors, *pending, *self.relay_actors.values(), *([self.buffer] if self.buffer else [])]:
            if h is None:
                continue
            attempt(lambda h=h: ray.kill(h, no_restart=True))
        for fn in closing:
            attempt(fn)
        if self.started_cluster:
            attempt(ray.shutdown)
            self.started_cluster = False
        return errors


class _Len:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def _checkpoint_dir(configured: Optional[str], run_dir: str) -> tuple[str, bool]:
    """(checkpoint dir, whether it holds a checkpoint). URLs (gs://...) are kept as given; local
    paths are made absolute (orbax refuses relative ones)."""
    path = configured or os.path.join(run_dir, "checkpoints")
    if "://" not in path:
        path = os.path.abspath(path)
        return path, os.path.isdir(path) and any(n.isdigit() for n in os.listdir(path))
    from etils import epath

    p = epath.Path(path)
    return path, p.exists() and any(c.name.isdigit() for c in p.iterdir())


def _buffer_cls():
    from laminar_jax.runtime.ray_buffer import BufferActor

    return BufferActor


def _rollout_cls():
    from laminar_jax.runtime.ray_rollout import RolloutActor

    return RolloutActor


def _relay_cls():
    from laminar_jax.runtime.ray_rollout import RelayActor

    return RelayActor


def run_ray(cfg: Config) -> dict:
    """`run(cfg)` for runtime.kind='ray': as run_local, with SIGTERM/SIGINT -> checkpoint and stop."""
    from laminar_jax.runtime.local import run_with

    return run_with(RayRun, cfg)
