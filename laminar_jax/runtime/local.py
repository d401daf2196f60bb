"""The `local` runtime: learner, relay, rollout servers, buffer and scheduler as threads in one process.

The embedded default (one machine, one GPU, Colab, CI). The learner runs in the calling thread;
every other role is a supervised worker thread whose failure stops the run with its traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import threading
import time
from typing import Optional

import numpy as np

from laminar_jax.buffer import BufferTimeout, DuplicatePrompt, ExperienceStore, PromptLedger, select_fifo
from laminar_jax.config import Config, resolve_run_dir, save_config
from laminar_jax.runtime.dispatch import Dispatcher, WorkItem, WorkQueue
from laminar_jax.runtime.monitor import Monitor
from laminar_jax.runtime.rollout_worker import Board, InjectedFault, RolloutWorker, unflatten_params
from laminar_jax.runtime.threads import Supervisor
from laminar_jax.runtime.timeline import Timeline
from laminar_jax.scheduler.modes import get_policy
from laminar_jax.types import Trajectory

log = logging.getLogger(__name__)

REQUIRED = ("response_ids", "behaviour_logprobs", "version", "reward")


def _rows_to_trajectories(rows: list[dict]) -> list[Trajectory]:
    return [Trajectory(uid=r["uid"], prompt_uid=r["prompt_uid"], sample_index=int(r["sample_index"]),
                       prompt_ids=np.asarray(r["prompt_ids"], np.int32),
                       response_ids=np.asarray(r["response_ids"], np.int32),
                       behaviour_logprobs=np.asarray(r["behaviour_logprobs"], np.float32),
                       version=int(r["version"]), finish_reason=r.get("finish_reason", "eos"),
                       reward=float(r["reward"])) for r in rows]


class _NoPublish:
    """Publisher for replayed learner steps: their versions are already published."""

    def publish(self, version: int, params) -> None:
        pass


class LocalRun:
    """Builds every plane from the config; `run()` trains and returns the summary dict."""

    # What `_learner_step` treats as a dead learner: restart it from its checkpoint and replay.
    LEARNER_FAILURES: tuple = (InjectedFault,)

    def __init__(self, cfg: Config, run_dir: str, stop: Optional[threading.Event] = None):
        from laminar_jax.data import RewardPool, build_prompt_source
        from laminar_jax.learner.learner import Learner
        from laminar_jax.model import build_model, load_tokenizer

        self.cfg, self.run_dir = cfg, run_dir
        rt = cfg.runtime
        self.sup = Supervisor()
        if stop is not None:
            self.sup.stop = stop
        self.policy = get_policy(rt.mode, cfg.scheduler.repack, cfg.scheduler.admit_lag)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.model = build_model(cfg.model)
        self.source = build_prompt_source(cfg.data, self.tokenizer)
        self.sft_losses: list[float] = []
        ckpt_dir = cfg.learner.checkpoint_dir or os.path.join(run_dir, "checkpoints")
        if "://" not in ckpt_dir:
            ckpt_dir = os.path.abspath(ckpt_dir)  # orbax refuses relative paths; gs:// etc. pass through
        resuming = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
        if rt.sft_warmup_steps and not resuming:
            self._sft_warmup()
        lsec = dataclasses.replace(cfg.learner, checkpoint_dir=ckpt_dir, total_steps=rt.total_steps)
        self.learner = Learner(lsec, self.model, cfg.mesh)
        self.extra = self.learner.restore_latest()
        self.ledger, self.store = PromptLedger(), ExperienceStore(group_size=rt.samples_per_prompt)
        self.queue = WorkQueue()
        self.dispatcher = Dispatcher(self.source, self.ledger, self.store, self.queue, self.policy,
                                     rt.prompts_per_step, rt.samples_per_prompt, rt.max_staleness,
                                     cfg.seed, max_queued_prompts=max(rt.prompts_per_step, 2 * rt.num_servers),
                                     max_inflight_batches=rt.max_inflight_batches)
        self.redispatched = 0
        if self.extra:
            self.redispatched = self.dispatcher.restore(self.extra["runtime"], REQUIRED)
        self.rewards = RewardPool(cfg.data.reward_workers, cfg.data.reward_timeout_s, cfg.data.reward_registry,
                                  mode=cfg.data.reward_mode)
        self.t0 = time.time()
        self.timeline = Timeline(self.t0)
        self._build_weights_plane()
        self._build_servers()
        self.monitor = Monitor(cfg, run_dir, self)
        self.on_step_hooks: list = []  # called with the new learner version after each step
        self._replay: list = []  # trajectory batches trained since the last checkpoint
        self._crash_learner = False
        self._last_ckpt = self.learner.version if self.extra else None

    # ---------------------------------------------------------------------------- construction
    def _sft_warmup(self) -> None:
        from laminar_jax.data.synthetic_skew import sft_examples
        from laminar_jax.runtime.sft import sft_warmup

        if self.cfg.data.source != "synthetic_skew":
            raise ValueError("runtime.sft_warmup_steps > 0 needs data.source='synthetic_skew' "
                             f"(got {self.cfg.data.source!r}); warm-start other tasks offline")
        tok = self.tokenizer
        pairs = []
        for prompt, response in sft_examples(2048, seed=self.cfg.seed + 1):
            p = ([tok.bos_id] if tok.bos_id is not None and self.cfg.data.add_bos else []) + tok.encode(prompt)
            pairs.append((p, tok.encode(response) + [tok.eos_id]))
        self.sft_losses = sft_warmup(self.model, pairs, self.cfg.runtime.sft_warmup_steps, self.cfg.runtime.sft_lr,
                                     seed=self.cfg.seed)

    def _build_weights_plane(self) -> None:
        from laminar_jax.relay import Publisher, RelayServer, WeightStore
        from laminar_jax.relay.auth import run_key

        rcfg = self.cfg.relay
        store_url = rcfg.store_url or os.path.join(self.run_dir, "weights")
        self.weight_store = WeightStore(store_url, keep_last=rcfg.keep_last)
        self.relay_key = run_key(self.run_dir)
        self.relay = RelayServer(rcfg, key=self.relay_key)
        self.relay.start()
        # A resumed learner re-publishes the numbers after its checkpoint with new weights.
        self.weight_store.retract_newer_than(self.learner.version)
        self.publisher = Publisher(rcfg, store=self.weight_store, relay_addresses=[self.relay.address],
                                   key=self.relay_key)
        if self.weight_store.latest() != self.learner.version:
            self.publisher.publish(self.learner.version, self.learner.policy_params())
        self.learner.publisher = self.publisher
        self.publish_times = [(time.time(), self.learner.version)]

    def _build_servers(self) -> None:
        from flax import nnx

        from laminar_jax.learner.publish import flatten_params

        rt = self.cfg.runtime
        v0 = self.learner.version
        _, template = nnx.split(self.model)
        self._from_flat = functools.partial(unflatten_params, template=template, flatten=flatten_params)
        self.board = Board(rt.num_servers, v0)
        self.failures: list[dict] = []
        self._fail_lock = threading.Lock()
        # Servers start from the learner's (possibly restored) weights, exactly as published as v0.
        params0 = self._from_flat(self.learner.policy_params())
        self.workers: list[RolloutWorker] = [self._make_worker(i, v0, params0) for i in range(rt.num_servers)]

    def _make_worker(self, i: int, version: int, params, generation: int = 0) -> RolloutWorker:
        from laminar_jax.relay import RelayClient
        from laminar_jax.rollout import make_engine
        from laminar_jax.rollout.records import Request
        from laminar_jax.rollout.server import RolloutServer

        def make_request(it: WorkItem) -> Request:
            return Request(uid=it.uid, prompt_ids=np.asarray(it.prompt_ids, np.int32), prompt_uid=it.prompt_uid,
                           sample_index=it.sample_index, seed=it.seed, data_source=it.data_source,
                           ground_truth=it.ground_truth)

        name = f"rollout-{i}" if generation == 0 else f"rollout-{i}.{generation}"
        section = dataclasses.replace(self.cfg.rollout, server_id=name, seed=self.cfg.seed + 17 * i + generation)
        engine, _ = make_engine(self.model, section)
        client = RelayClient([self.relay.address], store=self.weight_store, config=self.cfg.relay,
                             key=self.relay_key)
        return RolloutWorker(i, RolloutServer(engine, params, version=version), client, self.queue, self.policy,
                             self.board, self._on_complete, make_request, self._from_flat, timeline=self.timeline,
                             pull_timeout_s=min(self.cfg.runtime.wait_timeout_s, 120.0))

    # --------------------------------------------------------------------------- fault isolation
    def _spawn_worker(self, w: RolloutWorker) -> None:
        self.sup.spawn_isolated(w.server.section.server_id, functools.partial(w.run, self.sup.stop),
                                functools.partial(self._on_server_failure, w))

    def _on_server_failure(self, w: RolloutWorker, exc: BaseException, tb: str) -> None:
        """A rollout server died (or stopped answering): requeue its unfinished work, which is
        regenerated from the prompt under one version, and start a replacement. Training goes on."""
        t_fail = time.time()
        with self._fail_lock:
            if w.killed.is_set() and any(f.get("server") == w.server.section.server_id for f in self.failures):
                return  # already handled (a hung worker that finally raised)
            w.killed.set()
            requeued = w.orphaned_work()
            self.dispatcher.requeue(requeued)
            record = {"server": w.server.section.server_id, "error": repr(exc), "t": round(t_fail - self.t0, 2),
                      "requeued": len(requeued)}
            self.failures.append(record)
            log.warning("rollout server %s died (%r); requeued %d samples\n%s", record["server"], exc,
                        len(requeued), tb)
            limit = self.cfg.scheduler.max_server_restarts
            if len([f for f in self.failures if "server" in f]) > limit:
                raise RuntimeError(f"more than scheduler.max_server_restarts={limit} rollout server failures; "
                                   f"last: {record['server']}: {exc!r}") from exc
            if self.sup.stop.is_set():
                return
            version, flat = w.client.pull(newer_than=-1, timeout=min(self.cfg.runtime.wait_timeout_s, 120.0))
            generation = sum(1 for f in self.failures if f.get("server", "").split(".")[0] == f"rollout-{w.index}")
            fresh = self._make_worker(w.index, version, self._from_flat(flat), generation)
            self.workers[w.index] = fresh
            self.board.update(w.index, version, 0)
            record["recovery_s"] = round(time.time() - t_fail, 3)
        self._spawn_worker(fresh)

    def _health_loop(self) -> None:
        """Heartbeats: a rollout worker silent for scheduler.heartbeat_timeout_s is declared dead."""
        timeout = self.cfg.scheduler.heartbeat_timeout_s
        while not self.sup.stop.wait(min(1.0, timeout / 4)):
            now = time.monotonic()
            for w in list(self.workers):
                if not w.killed.is_set() and now - w.last_beat > timeout:
                    self._on_server_failure(w, TimeoutError(
                        f"rollout server {w.server.section.server_id}: no heartbeat for {now - w.last_beat:.1f}s "
                        f"(scheduler.heartbeat_timeout_s={timeout})"), "")

    def inject_server_crash(self, i: int) -> None:
        """Fault injection: rollout server i crashes at its next iteration (tests, bench faults)."""
        self.workers[i].crash_next = True

    def inject_relay_failure(self) -> None:
        """Fault injection: the relay dies; servers fall back to the weight store."""
        address = self.relay.address
        self.relay.stop()
        self.failures.append({"relay": address, "t": round(time.time() - self.t0, 2)})

    # ------------------------------------------------------------------------------ data flow
    def _on_complete(self, traj: Trajectory) -> None:
        """A server finished a trajectory: store its fields now, score it off the critical path."""
        start = self.dispatcher.enqueued_at.pop(traj.uid, None)
        self.monitor.on_trajectory(len(traj.response_ids), None if start is None else time.monotonic() - start)
        self.store.put_many(traj.uid, {"response_ids": traj.response_ids,
                                       "behaviour_logprobs": traj.behaviour_logprobs,
                                       "finish_reason": traj.finish_reason})
        text = self.tokenizer.decode([t for t in traj.response_ids.tolist() if t != self.tokenizer.eos_id])
        row = self.store.row(traj.uid)
        fut = self.rewards.submit(traj.data_source or row.get("data_source", ""), text, traj.ground_truth,
                                  row.get("extra_info"))
        uid, version = traj.uid, traj.version
        # 'version' is written last with the reward, so a row is never ready before it is scored.
        fut.add_done_callback(lambda f: self.store.put_many(uid, {"reward": f.result().reward, "version": version}))

    def _select(self, dropped: list):
        b = self.cfg.buffer

        def select(groups, n):
            sel = select_fifo(groups, n, self.learner.version, b.max_staleness, b.on_stale)
            dropped.extend(sel.drop)
            return sel

        return select

    def _next_batch(self) -> list[dict]:
        """Block (bounded) for the next batch, re-checking every worker's health while waiting."""
        rt = self.cfg.runtime
        deadline = time.monotonic() + rt.wait_timeout_s
        while True:
            self.sup.check()
            self.rewards.check()
            if self.sup.stop.is_set():
                raise InterruptedError("stop requested")
            dropped: list = []
            try:
                rows = self.store.get("learner", rt.prompts_per_step, REQUIRED, timeout=0.5,
                                      select=self._select(dropped))
            except BufferTimeout:
                rows = None
            for g in dropped:
                self.ledger.drop(g.group)
            if rows is not None:
                return rows
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"learner waited runtime.wait_timeout_s={rt.wait_timeout_s}s for {rt.prompts_per_step} "
                    f"complete groups; ready={self.store.ready_groups('learner', REQUIRED)}, "
                    f"queued={len(self.queue)}, servers={[w.server.stats() for w in self.workers]}")

    # ----------------------------------------------------------------------------------- loops
    def _dispatch_loop(self) -> None:
        while not self.sup.stop.is_set():
            self.dispatcher.pump(self.board.learner_version)
            time.sleep(0.01)

    def _warm_up(self) -> None:
        """Compile the learner's programs for every sequence bucket a batch can reach, and one
        engine's (the servers share compiled programs), before the RL clock starts: steady-state
        throughput is what the run reports, and a mid-run compile stalls its plane for seconds."""
        rt = self.cfg.runtime
        t0 = time.time()
        self.learner.warmup(rt.prompts_per_step * rt.samples_per_prompt, self.cfg.rollout.max_total_len)
        if self.workers:
            self.workers[0].server.warmup()
        log.info("compiled learner and engine programs in %.1fs", time.time() - t0)

    def run(self) -> dict:
        self._warm_up()
        for w in self.workers:
            self._spawn_worker(w)
        self.sup.spawn("dispatcher", self._dispatch_loop)
        self.sup.spawn("health", self._health_loop)
        if self.policy.repack:
            from laminar_jax.runtime.repack import RepackLoop

            self.repacker = RepackLoop(self.workers, self.cfg.scheduler, self.board)
            self.sup.spawn("scheduler", functools.partial(self.repacker.run, self.sup.stop))
        else:
            self.repacker = None
        return self._train_loop()

    def _train_loop(self) -> dict:
        """The learner loop shared by both runtimes: train until total_steps, max_wall_s or a stop
        request; shut every plane down (checkpointing only after a clean stop); return the summary."""
        rt = self.cfg.runtime
        self.t_rl = time.time()
        stopped_early = False
        try:
            while self.learner.version < rt.total_steps:
                if rt.max_wall_s is not None and time.time() - self.t_rl > rt.max_wall_s:
                    stopped_early = True
                    break
                try:
                    rows = self._next_batch()
                except InterruptedError:
                    stopped_early = True
                    break
                self._train_on(rows)
        except BaseException:
            self._shutdown(clean=False)
            raise
        self._shutdown(clean=True)
        return self.summary(stopped_early)

    def summary(self, stopped_early: bool) -> dict:
        return self.monitor.summary(stopped_early)

    def _train_on(self, rows: list[dict]) -> None:
        trajs = _rows_to_trajectories(rows)
        for uid in sorted({t.prompt_uid for t in trajs}):
            try:
                self.ledger.consume(uid)
            except DuplicatePrompt:
                self.monitor.duplicates += 1
        metrics = self._learner_step(trajs)
        self._replay.append(trajs)
        # Servers learn of the new version from here (the relay delivers it; pulls wait for it),
        # and only then may dispatch run ahead: no prompt is admitted under a version the mode
        # says is already superseded.
        self.board.set_newest(self.learner.version)
        self.board.learner_version = self.learner.version
        self.publish_times.append((time.time(), self.learner.version))
        self.timeline.publish(time.time(), self.learner.version)
        if self.repacker is not None:
            self.repacker.poke()
        self.store.evict_consumed(["learner"])
        self.monitor.on_step(metrics, trajs)
        every = self.cfg.runtime.checkpoint_every
        if every and self.learner.version % every == 0:
            self._checkpoint()
        for hook in list(self.on_step_hooks):
            hook(self.learner.version)

    def _checkpoint(self) -> None:
        if self._last_ckpt == self.learner.version:
            return  # this version is saved already (periodic save, then the final one)
        self.learner.save(self.learner.version, extra={"runtime": self.dispatcher.snapshot()})
        self._last_ckpt = self.learner.version
        self._replay.clear()  # batches up to here live in the checkpoint

    def _learner_step(self, trajs) -> dict:
        """One learner step; if the learner dies, restart it from its checkpoint (rollouts keep
        generating meanwhile), replay the batches trained since then, and train this batch."""
        try:
            if self._crash_learner:
                self._crash_learner = False
                raise InjectedFault("injected learner crash")
            return self.learner.step(trajs)
        except self.LEARNER_FAILURES as e:
            t_fail = time.time()
            log.warning("learner died (%r); restarting from its checkpoint", e)
            self._restart_learner()
            metrics = self.learner.step(trajs)
            self.failures.append({"learner": repr(e), "t": round(t_fail - self.t0, 2),
                                  "replayed_steps": len(self._replay),
                                  "recovery_s": round(time.time() - t_fail, 3)})
            return metrics

    def _restart_learner(self) -> None:
        """A fresh learner from the last checkpoint, brought back to the version it died at by
        replaying the batches it trained since (deterministic: the same versions, bit for bit, which
        the relays already hold; nothing is published again)."""
        from laminar_jax.learner.learner import Learner

        old = self.learner
        try:
            old.close()
        except Exception:  # noqa: BLE001 - the old learner is gone either way
            pass
        fresh = Learner(old.section, self.model, self.cfg.mesh)
        fresh.restore_latest()
        for batch in self._replay:
            fresh.step(batch, publisher=_NoPublish())
        if fresh.version != old.version:
            raise RuntimeError(f"learner restart reached version {fresh.version}, expected {old.version}")
        fresh.publisher = self.publisher
        self.learner = fresh

    def inject_learner_crash(self) -> None:
        """Fault injection: the learner dies at its next step."""
        self._crash_learner = True

    def _shutdown(self, clean: bool) -> None:
        """Stop every worker; checkpoint only after a clean stop (a failed run resumes from the last
        good checkpoint, and a wedged worker may hold the dispatcher's lock)."""
        failed = None
        try:
            self.sup.check()
        except Exception as e:  # noqa: BLE001 - re-raised below after cleanup
            failed = e
        self.sup.stop.set()
        stuck = self.sup.join(timeout=30)
        if clean and failed is None and not stuck:
            self._checkpoint()
        try:
            if clean:
                self.learner.flush(timeout=120)
        finally:
            for close in (self.publisher.close, self.relay.stop, self.rewards.close, self.learner.close,
                          self.monitor.close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - cleanup must reach every plane; first error wins below
                    if clean and failed is None:
                        raise
        if not clean:
            return  # the caller re-raises the error that stopped the run
        if failed is not None:
            raise failed
        if stuck:
            raise RuntimeError(f"workers did not stop within 30s: {stuck}")


def run_local(cfg: Config) -> dict:
    return run_with(LocalRun, cfg)


def run_with(run_cls, cfg: Config) -> dict:
    """Write the run directory, run `run_cls(cfg, run_dir, stop)` with SIGTERM/SIGINT mapped to a
    clean stop (checkpoint, resumable), then write and print the summary."""
    run_dir = resolve_run_dir(cfg)
    save_config(cfg, run_dir)
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # SIGTERM/SIGINT: finish the current step, checkpoint, exit; a later run resumes from there.
        # A second signal falls through to the previous handler (e.g. KeyboardInterrupt).
        def on_signal(signum, frame):
            if stop.is_set() and callable(previous.get(signum)):
                previous[signum](signum, frame)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        summary = run_cls(cfg, run_dir, stop).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return summary
