"""The Driver: the learner loop, written once for every runtime.

It trains until `runtime.total_steps` (or `max_wall_s`, or a stop request), checkpoints, restarts a
dead learner from its checkpoint and replays, and shuts every plane down. It talks only to:

  buffer   the buffer service (`get_batch`, `set_learner_version`, `snapshot`, `stats`, ...), in-process
           or a Ray actor behind `RemoteBuffer`;
  fleet    the rollout servers (`start / warmup / snapshots / export / import_ / poll_health /
           replace / stop / close`), threads (`ThreadFleet`) or Ray actors (`RayFleet`);
  weights  the weight plane (store, relays, publisher; `attach(learner)`);
  monitor  the metrics sink, fed plain `RunStats` records.

The repack loop and the health loop (scheduler/loops.py) run beside it as supervised workers, over
the same interfaces. Which transport carries the calls is chosen once, by the runtime that builds
the Driver (runtime/local.py, runtime/ray_runtime.py); the Driver never knows it.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable, Optional, Sequence

from laminar_jax.eval.schedule import Evaluation
from laminar_jax.monitor import profile
from laminar_jax.scheduler.loops import HealthLoop, RepackLoop
from laminar_jax.monitor.sink import RunStats
from laminar_jax.runtime.rollout_worker import InjectedFault
from laminar_jax.scheduler.modes import get_policy
from laminar_jax.threads import WorkerGroup

log = logging.getLogger(__name__)


def close_all(closers: Sequence[Callable[[], None]]) -> list[BaseException]:
    """Call every closer (cleanup must reach every plane); return the errors met, in order."""
    errors: list[BaseException] = []
    for close in closers:
        try:
            close()
        except BaseException as e:  # noqa: BLE001 - collected; the caller decides which to raise
            errors.append(e)
    return errors


def abandon(learner) -> None:
    """End a learner that died (a group's survivors may sit in a collective: kill them)."""
    close = getattr(learner, "kill", None) or learner.close
    try:
        close()
    except Exception:  # noqa: BLE001 - the old learner is gone either way
        pass


class Driver:
    """Built by a runtime from its parts; `run()` trains and returns the summary dict.

    make_learner: builds a fresh learner (same model, mesh, checkpoint dir) for a restart.
    learner_failures: the exceptions that mean "the learner died" (restart + replay), not "stop".
    closers: the runtime's own cleanup after every plane is closed (e.g. shutting Ray down).
    summary_extra: the runtime's own section of the summary.
    """

    def __init__(self, cfg, run_dir: str, *, learner, make_learner: Callable[[], object], buffer, fleet, weights,
                 monitor, stop=None, learner_failures: tuple = (InjectedFault,), sft_losses: Sequence[float] = (),
                 resumed: bool = False, closers: Sequence[Callable[[], None]] = (),
                 summary_extra: Optional[Callable[["Driver"], dict]] = None):
        self.cfg, self.run_dir = cfg, run_dir
        self.learner, self.make_learner, self.learner_failures = learner, make_learner, learner_failures
        self.buffer, self.fleet, self.weights, self.monitor = buffer, fleet, weights, monitor
        self.sft_losses, self.closers, self.summary_extra = list(sft_losses), list(closers), summary_extra
        self.sup = WorkerGroup(stop)
        self.failures: list[dict] = []
        self.on_step_hooks: list = []  # called with the new learner version after each step
        self._replay: list = []  # trajectory batches trained since the last checkpoint
        self._crash_learner = False
        self._ahead: Optional[tuple] = None  # (trajectories, prepared) taken while the last step computed
        self._unrecorded: Optional[tuple] = None  # (metrics, trajectories) of a step the monitor has not heard of
        self._last_ckpt = learner.version if resumed else None
        # Checkpoint steps that did not restore, moved aside (at the start and at learner restarts).
        self.damaged_checkpoints: list[dict] = _damaged(learner)
        self.redispatched = buffer.ready()
        self.buffer_stats = buffer.stats()
        policy = get_policy(cfg.runtime.mode, cfg.scheduler.repack, cfg.scheduler.admit_lag)
        self.repacker = RepackLoop(fleet, buffer, cfg.scheduler) if policy.repack else None
        self.health = HealthLoop(fleet, buffer, cfg.scheduler, self.failures, monitor.t0)
        # Eval rounds on the rollout servers (None without runtime.eval_every / eval_before_train).
        self.evals = Evaluation.maybe(cfg, buffer, monitor.on_eval)
        self.t_rl = time.time()
        self.profiler: Optional[profile.Profiler] = None  # runtime.profile: CPU-time accounting of the RL window

    # ----------------------------------------------------------------------------------- run
    def _warm_up(self) -> None:
        """Compile the learner's programs for every batch shape a step can take (unless
        learner.compile_ahead='none'), and the servers' engine programs, before the RL clock
        starts: steady-state throughput is what the run reports, and a mid-run compile stalls its
        plane for seconds."""
        rt, t0 = self.cfg.runtime, time.time()
        if self.cfg.learner.compile_ahead == "all":
            self.monitor.phase("compiling the learner's programs (every batch shape a step can take)")
        n = self.learner.warmup(rt.prompts_per_step * rt.samples_per_prompt, self.cfg.rollout.max_total_len)
        ahead = f"compiled {n} learner batch shapes" if self.cfg.learner.compile_ahead == "all" else \
            "learner programs compile when a step first needs them (learner.compile_ahead='none')"
        self.monitor.phase(f"{ahead}; compiling the rollout engines' programs")
        self.fleet.warmup()
        log.info("compiled learner and engine programs in %.1fs", time.time() - t0)

    def run(self) -> dict:
        self._warm_up()
        self.fleet.start()
        self.monitor.phase(f"{len(self.fleet.names)} rollout servers up; RL starts at learner version "
                           f"{self.learner.version} of {self.cfg.runtime.total_steps}")
        self.sup.spawn("health", functools.partial(self.health.run, self.sup.stop))
        if self.repacker is not None:
            self.sup.spawn("scheduler", functools.partial(self.repacker.run, self.sup.stop))
        rt = self.cfg.runtime
        self.t_rl = time.time()
        stopped_early = False
        self._start_profile()
        try:
            if self.evals is not None:
                self.evals.begin(self.learner.version)
            while self.learner.version < rt.total_steps:
                # A batch taken ahead is trained whatever else says stop: its prompts are consumed.
                trajs, prepared = self._ahead or (None, None)
                self._ahead = None
                if trajs is None:
                    if self._out_of_time():
                        stopped_early = True
                        break
                    try:
                        trajs = self._next_batch()  # prompts marked consumed
                    except InterruptedError:
                        stopped_early = True
                        break
                self._train_on(trajs, prepared)
            self._record()
            self._end_evals(stopped_early)
        except BaseException:
            self._stop_profile()
            try:
                self._record()  # the last finished step's metrics line, if the monitor can still take it
            except Exception:  # noqa: BLE001 - the error that stopped the run is the one to raise
                log.exception("could not record the last step's metrics")
            self._shutdown(clean=False)
            raise
        self._stop_profile()
        self._shutdown(clean=True)
        return self.summary(stopped_early)

    def _start_profile(self) -> None:
        if self.cfg.runtime.profile:
            profile.instrument_learner(self.learner)  # after warm-up: it lowers the learner's jitted passes
            self.profiler = profile.Profiler().start()

    def _stop_profile(self) -> None:
        if self.profiler is not None and profile.active() is self.profiler:
            self.profiler.stop()

    def _next_batch(self) -> list:
        """Block (bounded) for the next batch (the samples' Trajectory records), re-checking every
        worker's health while waiting."""
        rt = self.cfg.runtime
        deadline = time.monotonic() + rt.wait_timeout_s
        while True:
            self.sup.check()
            if self.sup.stop.is_set():
                raise InterruptedError("stop requested")
            out = self.buffer.get_batch(rt.prompts_per_step, self.learner.version, 0.5)
            if out is not None:
                self.monitor.duplicates += out["duplicates"]
                return out["rows"]
            if time.monotonic() > deadline:
                b = self.buffer.stats()
                raise TimeoutError(
                    f"learner waited runtime.wait_timeout_s={rt.wait_timeout_s}s for {rt.prompts_per_step} "
                    f"complete groups; ready={b['ready_groups']}, queued={b['queue']}, owned={b['owned']}, "
                    f"servers={self.fleet.server_stats()}")

    def _out_of_time(self) -> bool:
        wall = self.cfg.runtime.max_wall_s
        return wall is not None and time.time() - self.t_rl > wall

    def _checkpoint_after(self, version: int) -> bool:
        every = self.cfg.runtime.checkpoint_every
        return bool(every) and version % every == 0

    def _train_on(self, trajs: list, prepared=None) -> None:
        metrics = self._learner_step(trajs, prepared)
        self._replay.append(trajs)
        # Servers learn of the new version from the hand-off or the relays (pulls wait for it); only then may
        # dispatch run ahead: no prompt is admitted under a version the mode says is superseded.
        self.buffer.set_learner_version(self.learner.version)
        self.monitor.on_publish(time.time(), self.learner.version)
        if self.repacker is not None:
            self.repacker.poke()
        self._unrecorded = (metrics, trajs)  # the monitor hears of it while the next step computes
        if self.evals is not None:
            self.evals.after_step(self.learner.version)
        if self._checkpoint_after(self.learner.version):
            self._checkpoint()
        for hook in list(self.on_step_hooks):
            hook(self.learner.version)

    def _while_computing(self, next_version: int) -> None:
        """Host work done while a dispatched step computes: the step before it goes to the monitor,
        and the next batch, if the buffer has it now, is taken and prepared for `next_version`."""
        self._record()
        rt = self.cfg.runtime
        # Not before a checkpoint: its buffer snapshot would count the batch consumed while the saved
        # learner has not trained it, and a resume from it would never train those prompts.
        if self._ahead is not None or next_version >= rt.total_steps or self.sup.stop.is_set() \
                or self._out_of_time() or self._checkpoint_after(next_version):
            return
        out = self.buffer.get_batch(rt.prompts_per_step, next_version, 0.0)
        if out is None:
            return
        self.monitor.duplicates += out["duplicates"]
        trajs = out["rows"]
        with profile.phase("learner.host"):
            self._ahead = (trajs, self.learner.prepare(trajs, next_version))

    def _record(self) -> None:
        """The last finished step's metrics to the monitor (metrics.jsonl, TensorBoard, the console)."""
        if self._unrecorded is not None:
            (metrics, trajs), self._unrecorded = self._unrecorded, None
            self.buffer_stats = self.buffer.stats()
            self.monitor.on_step(metrics, trajs, self.stats())

    def _end_evals(self, stopped_early: bool) -> None:
        """Collect the eval rounds: wait (bounded) for those in flight after a full run; a stopped
        run records only the finished ones."""
        if self.evals is None:
            return
        self.evals.collect()
        if stopped_early:
            return
        if self.evals.in_flight or self.evals.pending_since is not None:
            self.monitor.phase("training done; waiting for the eval rounds in flight")
        self.evals.finish(self.learner.version, self.cfg.runtime.wait_timeout_s, self.sup.stop)

    def _checkpoint(self) -> None:
        if self._last_ckpt == self.learner.version:
            return  # this version is saved already (periodic save, then the final one)
        self.learner.save(self.learner.version, extra={"runtime": self.buffer.snapshot()})
        self._last_ckpt = self.learner.version
        self._replay.clear()  # batches up to here live in the checkpoint

    # ----------------------------------------------------------------------- learner failures
    def _learner_step(self, trajs, prepared=None) -> dict:
        """One learner step, its computation overlapped with `_while_computing`; if the learner dies,
        restart it from its checkpoint (rollouts keep generating meanwhile), replay the batches
        trained since then, and train this batch."""
        try:
            if self._crash_learner:
                self._crash_learner = False
                raise InjectedFault("injected learner crash")
            with profile.phase("learner.host"):
                running = self.learner.dispatch(trajs, prepared)
            self._while_computing(self.learner.version + 1)
            with profile.phase("learner.host"):
                return self.learner.finish(running)
        except self.learner_failures as e:
            t_fail = time.time()
            log.warning("learner died (%r); restarting from its checkpoint", e)
            self._restart_learner()
            if self._ahead is not None:
                self._ahead = (self._ahead[0], None)  # prepared by the dead learner: the new one collates it
            metrics = self.learner.step(trajs)
            self.failures.append({"learner": repr(e), "t": round(t_fail - self.monitor.t0, 2),
                                  "replayed_steps": len(self._replay), "recovery_s": round(time.time() - t_fail, 3)})
            return metrics

    def _restart_learner(self) -> None:
        """A fresh learner from the last checkpoint, brought back to the version it died at by
        replaying the batches trained since (deterministic: the same versions, bit for bit, which
        the relays already hold; nothing is published again)."""
        old = self.learner
        abandon(old)
        fresh = self.make_learner()
        try:
            fresh.restore_latest()
            self.damaged_checkpoints += _damaged(fresh)
            for batch in self._replay:
                fresh.step(batch, publish=False)
            if fresh.version != old.version:
                raise RuntimeError(f"learner restart reached version {fresh.version}, expected {old.version}")
            self.weights.attach(fresh, initial=False)
        except BaseException:
            abandon(fresh)
            raise
        self.learner = fresh

    def inject_learner_crash(self) -> None:
        """Fault injection: the learner dies at its next step."""
        self._crash_learner = True

    def inject_relay_failure(self) -> None:
        """Fault injection: the (master) relay dies; servers fall back to the weight store."""
        self.failures.append({"relay": self.weights.inject_failure(), "t": round(time.time() - self.monitor.t0, 2)})

    # --------------------------------------------------------------------------- the end
    def stats(self) -> RunStats:
        return RunStats(t0=self.monitor.t0, t_rl=self.t_rl, learner_version=int(self.learner.version),
                        servers=self.fleet.server_stats(), buffer=self.buffer_stats, failures=list(self.failures),
                        repack_moves=self.repacker.moved if self.repacker else 0, redispatched=self.redispatched,
                        sft_losses=self.sft_losses, publish=self.weights.latest_timings())

    def summary(self, stopped_early: bool) -> dict:
        s = self.monitor.summary(self.stats(), stopped_early)
        # A resume: which checkpoint was restored (damaged newer ones skipped), and how many steps a
        # run that died after that checkpoint had trained and this one trained again.
        s["restore"] = getattr(self.learner, "restore_report", None)
        s["redone_steps"] = getattr(self.weights, "redone_steps", 0)
        s["damaged_checkpoints"] = list(self.damaged_checkpoints)  # {step, error, moved_to} each
        if self.profiler is not None:
            s["profile"] = self.profiler.report(self.monitor.trained_tokens,
                                                int(self.buffer_stats.get("generated_tokens", 0)))
        pub = self.weights.last_stats  # the publisher's, kept when it closed
        s["publish_bytes_per_version"] = getattr(pub, "bytes_per_version", None) or None
        if self.summary_extra is not None:
            s.update(self.summary_extra(self))
        return s

    def _shutdown(self, clean: bool) -> None:
        """Stop every loop and server; checkpoint only after a clean stop (a failed run resumes
        from the last good checkpoint, and a wedged worker may hold the dispatcher's lock)."""
        failed = None
        try:
            self.sup.check()
        except Exception as e:  # noqa: BLE001 - re-raised below after cleanup
            failed = e
        stuck = self.sup.join(timeout=30) + self.fleet.stop(timeout=15.0)
        errors: list[BaseException] = []
        try:
            if clean and failed is None and not stuck:
                self._checkpoint()
            if clean:
                self.learner.flush(timeout=120)
                self.buffer_stats = self.buffer.stats()
        except BaseException as e:  # noqa: BLE001 - cleanup first, then raise
            errors.append(e)
        errors += close_all([self.weights.close, self.buffer.close, self.fleet.close, self.learner.close,
                             self.monitor.close, *self.closers])
        if not clean:
            return  # the caller re-raises the error that stopped the run
        if failed is not None:
            raise failed
        if stuck:
            raise RuntimeError(f"workers did not stop within their timeouts: {stuck}")
        if errors:
            raise errors[0]


def _damaged(learner) -> list[dict]:
    """The checkpoint steps `learner`'s restore moved aside ({step, error, moved_to} each)."""
    return list((getattr(learner, "restore_report", None) or {}).get("skipped", []))
