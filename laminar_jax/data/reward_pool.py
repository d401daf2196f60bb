"""Scoring rewards off the learner's critical path, in worker processes (or threads) with deadlines.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot stop one hung call (there is no
public way to kill a single worker), and one crashed worker breaks the whole executor. Here each
worker is a subprocess speaking JSON lines (no pickle), so a call past its deadline kills and
replaces just that worker. A timeout, an exception in the scorer, or a dead worker each score
0.0, are counted in ``stats()`` and logged; the run goes on.

Process workers run the scorer in their main thread, which math_verify's signal-based timeouts
need. They are all started by the pool's dispatcher thread, which lives as long as the pool: a
worker dies with that thread (PR_SET_PDEATHSIG), so a killed run leaves no worker behind. A
reward that is not a finite float32 (1e300, inf, nan) is a failure scoring 0.0; ``failures``
counts every failed reward (errors, timeouts, crashes, bad requests). ``mode="thread"`` suits scorers that release the GIL; a hung thread cannot be killed, so it
is abandoned (it exits when its call returns) and a fresh thread takes its place.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, NamedTuple, Optional, Sequence

from laminar_jax.data.reward_worker import _score, check_reward
from laminar_jax.data.rewards import load_registry
from laminar_jax.threads import Worker

log = logging.getLogger(__name__)
DEFAULT_REGISTRY = "laminar_jax.data.rewards:default_registry"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RewardResult(NamedTuple):
    reward: float
    ok: bool
    error: Optional[str]
    latency_s: float  # from dispatch to a worker until its answer (queueing excluded)


class _Task:
    __slots__ = ("id", "request", "line", "future", "started", "deadline")

    def __init__(self, tid: int, request: dict, line: str):
        self.id, self.request, self.line = tid, request, line
        self.future: Future = Future()
        self.started, self.deadline = 0.0, float("inf")


class _ProcWorker:
    """One subprocess; a reader thread turns its stdout lines into pool callbacks."""

    def __init__(self, pool: "RewardPool"):
        env = dict(os.environ)
        paths = [_REPO_ROOT, *pool.pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        cmd = [sys.executable, "-m", "laminar_jax.data.reward_worker", pool.registry_spec, str(os.getpid())]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, encoding="utf-8", bufsize=1
        )
        self.pid = self.proc.pid
        self.ready, self.dead, self.fatal, self.read_error = False, False, None, None
        self.task: Optional[_Task] = None
        self.born = time.monotonic()
        self._pool = pool
        threading.Thread(target=self._read, name=f"reward-worker-{self.pid}", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                self._pool._on_message(self, json.loads(line))
        except Exception:  # a garbled line counts as a dead worker, recorded with its traceback
            self.read_error = traceback.format_exc()
            self.kill()
        finally:
            self._pool._on_exit(self)

    def send(self, task: _Task) -> None:
        try:
            self.proc.stdin.write(task.line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.dead = True  # the dispatcher fails the task as a crash on its next pass

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.stdin.close()
        except (OSError, BrokenPipeError):
            pass

    def stop(self, wait_s: float) -> None:
        try:
            self.proc.stdin.close()  # EOF: the worker exits after its current call
            self.proc.wait(timeout=wait_s)
        except (OSError, BrokenPipeError, subprocess.TimeoutExpired):
            self.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.error("reward worker %d did not exit after SIGKILL", self.pid)

    def exit_code(self, wait_s: float = 0.0) -> Optional[int]:
        try:
            return self.proc.wait(timeout=wait_s) if wait_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None


class _ThreadWorker:
    """One thread scoring with the pool's in-process registry."""

    def __init__(self, pool: "RewardPool"):
        self.pid = None
        self.ready, self.dead, self.fatal, self.read_error = False, False, None, None
        self.task: Optional[_Task] = None
        self.born = time.monotonic()
        self._pool, self._inbox = pool, queue.Queue()
        threading.Thread(target=self._loop, name="reward-thread", daemon=True).start()

    def _loop(self) -> None:
        for error in self._pool._registry.warm_up():  # once per registry; other threads wait on its lock
            log.warning("reward thread: %s", error)
        self._pool._on_message(self, {"ready": True})
        while True:
            request = self._inbox.get()
            if request is None:
                return
            self._pool._on_message(self, _score(self._pool._registry, request))

    def send(self, task: _Task) -> None:
        self._inbox.put(task.request)

    def kill(self) -> None:
        self._inbox.put(None)  # a hung call keeps its thread until it returns; its answer is ignored

    def stop(self, wait_s: float) -> None:
        self.kill()

    def exit_code(self, wait_s: float = 0.0) -> Optional[int]:
        return None


class RewardPool:
    """``submit(data_source, response, ground_truth, extra_info) -> Future[RewardResult]``.

    Futures always resolve (never raise): failures give ``RewardResult(0.0, False, error, ...)``.
    ``check()`` re-raises a dispatcher failure or an unloadable registry; ``submit`` calls it.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        registry_spec: str = DEFAULT_REGISTRY,
        mode: str = "process",
        start_timeout_s: float = 60.0,
        pythonpath: Sequence[str] = (),
    ):
        if num_workers < 1 or timeout_s <= 0 or mode not in ("process", "thread"):
            raise ValueError(f"RewardPool(num_workers={num_workers}, timeout_s={timeout_s}, mode={mode!r}): bad args")
        self.num_workers, self.timeout_s, self.mode = num_workers, timeout_s, mode
        self.registry_spec, self.start_timeout_s, self.pythonpath = registry_spec, start_timeout_s, tuple(pythonpath)
        self._registry = load_registry(registry_spec) if mode == "thread" else None
        self._cond = threading.Condition(threading.RLock())
        self._pending: collections.deque[_Task] = collections.deque()
        self._next_id = 0
        self._closing = False
        self._error: Optional[str] = None
        self._stats = dict.fromkeys(
            ("submitted", "completed", "ok", "errors", "timeouts", "crashes", "restarts", "bad_requests"), 0
        )
        self._latency_sum = 0.0
        self._latency_max = 0.0
        self._workers: list = []
        started = threading.Event()
        # Not stop_on_failure: the pool's owner learns of a dead dispatcher through check().
        self._thread = Worker("reward-pool", lambda: self._run(started), stop_on_failure=False).start()
        if not started.wait(self.start_timeout_s):  # spawning is quick; the workers' readiness is not awaited
            raise RuntimeError(f"RewardPool: workers not spawned within {self.start_timeout_s}s")
        self.check()

    # ---- public API --------------------------------------------------------------------------

    def submit(self, data_source: str, response: str, ground_truth: Any, extra_info: Any = None) -> "Future":
        self.check()
        request = {"data_source": data_source, "response": response, "ground_truth": ground_truth}
        request["extra_info"] = extra_info or {}
        with self._cond:
            self.check()
            if self._closing:
                raise RuntimeError("RewardPool.submit after close()")
            task_id, self._next_id = self._next_id, self._next_id + 1
            self._stats["submitted"] += 1
            try:
                line = json.dumps({"id": task_id, **request})
            except (TypeError, ValueError) as e:
                self._stats["bad_requests"] += 1
                fut: Future = Future()
                fut.set_result(RewardResult(0.0, False, f"request is not JSON-serialisable: {e}", 0.0))
                log.warning("reward for %s not scored: %s", data_source, e)
                return fut
            task = _Task(task_id, {"id": task_id, **request}, line)
            self._pending.append(task)
            self._cond.notify_all()
        return task.future

    def score(self, data_source: str, response: str, ground_truth: Any, extra_info: Any = None) -> RewardResult:
        """Blocking convenience wrapper (waits at most the deadline plus start-up time)."""
        fut = self.submit(data_source, response, ground_truth, extra_info)
        return fut.result(timeout=self.timeout_s + self.start_timeout_s + 30)

    def check(self) -> None:
        """Re-raise a dead dispatcher (with its traceback) or an unrecoverable pool failure."""
        self._thread.check()
        if self._error is not None:
            raise RuntimeError(f"RewardPool failed: {self._error}")

    @property
    def failures(self) -> int:
        """Rewards that failed (each scored 0.0): scorer errors incl. non-float32 rewards, timeouts,
        crashed workers, unserialisable requests. What a run summary reports."""
        with self._cond:
            s = self._stats
            return s["errors"] + s["timeouts"] + s["crashes"] + s["bad_requests"]

    def worker_pids(self) -> list[Optional[int]]:
        with self._cond:
            return [w.pid for w in self._workers]

    def stats(self) -> dict:
        with self._cond:
            out = dict(self._stats)
            out["pending"] = len(self._pending)
            out["in_flight"] = sum(w.task is not None for w in self._workers)
            out["mean_latency_s"] = self._latency_sum / max(1, out["completed"])
            out["max_latency_s"] = self._latency_max
            return out

    def close(self, wait_s: float = 2.0) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            doomed = list(self._pending) + [w.task for w in self._workers if w.task is not None]
            self._pending.clear()
            workers, self._workers = self._workers, []
            self._cond.notify_all()
        self._thread.join(timeout=10)
        for task in doomed:
            self._resolve(task, RewardResult(0.0, False, "reward pool closed", 0.0))
        for w in workers:
            w.stop(wait_s)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- worker callbacks (reader / scorer threads) ------------------------------------------

    def _spawn(self):
        return _ProcWorker(self) if self.mode == "process" else _ThreadWorker(self)

    def _on_message(self, worker, msg: dict) -> None:
        done = None
        with self._cond:
            if "fatal" in msg:
                worker.fatal = msg["fatal"]
            elif msg.get("ready"):
                worker.ready = True
            elif worker.task is not None and msg.get("id") == worker.task.id and worker in self._workers:
                task, worker.task = worker.task, None
                latency = time.monotonic() - task.started
                ok, reward, error = bool(msg.get("ok")), 0.0, msg.get("error")
                if ok:
                    try:  # a worker's number is checked here too: the summary must stay valid JSON
                        reward = check_reward(float(msg["reward"]))
                    except (TypeError, ValueError, KeyError) as e:
                        ok, reward, error = False, 0.0, f"{type(e).__name__}: {e}"
                done = (task, RewardResult(reward, ok, error, latency))
                self._count(done[1], "ok" if ok else "errors")
            self._cond.notify_all()
        if done:
            if not done[1].ok:
                log.warning("reward for %s failed: %s", done[0].request["data_source"], done[1].error)
            self._resolve(*done)

    def _on_exit(self, worker) -> None:
        with self._cond:
            worker.dead = True
            self._cond.notify_all()

    # ---- dispatcher ----------------------------------------------------------------------------

    def _count(self, result: RewardResult, kind: str) -> None:
        self._stats["completed"] += 1
        self._stats[kind] += 1
        self._latency_sum += result.latency_s
        self._latency_max = max(self._latency_max, result.latency_s)

    @staticmethod
    def _resolve(task: _Task, result: RewardResult) -> None:
        if not task.future.done():
            task.future.set_result(result)

    def _run(self, started: threading.Event) -> None:
        try:
            # Workers are spawned by this thread only: PR_SET_PDEATHSIG ties them to it.
            with self._cond:
                self._workers = [self._spawn() for _ in range(self.num_workers)]
            started.set()
            while True:
                with self._cond:
                    if self._closing:
                        return
                    done = self._tick(time.monotonic())
                    if not done:
                        self._cond.wait(timeout=self._wait_s())
                for task, result in done:
                    log.warning("reward for %s failed: %s", task.request["data_source"], result.error)
                    self._resolve(task, result)
                if self._error is not None:  # unrecoverable (registry cannot load): stop the workers
                    with self._cond:
                        workers = list(self._workers)
                    for w in workers:
                        w.stop(0.5)
                    return
        except BaseException:
            # The Worker keeps the traceback for check(); nothing waits forever on this pool's futures.
            started.set()
            log.error("reward pool dispatcher died", exc_info=True)
            with self._cond:
                doomed = list(self._pending) + [w.task for w in self._workers if w.task is not None]
                self._pending.clear()
            for task in doomed:
                self._resolve(task, RewardResult(0.0, False, "reward pool dispatcher died", 0.0))
            raise

    def _wait_s(self) -> float:
        deadlines = [w.task.deadline for w in self._workers if w.task is not None]
        deadlines += [w.born + self.start_timeout_s for w in self._workers if not w.ready]
        return max(0.0, min(deadlines, default=time.monotonic() + 1.0) - time.monotonic()) + 0.005

    def _tick(self, now: float) -> list:
        """Replace dead / overdue workers, then hand queued tasks to idle ones. Caller holds the lock."""
        done = []
        for i, w in enumerate(self._workers):
            failure = None
            if w.fatal is not None:
                self._fail_all(w.fatal, done)
                return done
            if w.dead or w.exit_code() is not None:
                failure = ("crashes", f"reward worker {w.pid} exited (code {w.exit_code(wait_s=0.2)})")
                if w.read_error:
                    failure = ("crashes", f"reward worker {w.pid} sent a bad reply: {w.read_error[-500:]}")
            elif w.task is not None and now >= w.task.deadline:
                failure = ("timeouts", f"reward timed out after {self.timeout_s}s (worker {w.pid} replaced)")
            elif not w.ready and now - w.born > self.start_timeout_s:
                self._fail_all(f"reward worker did not start within {self.start_timeout_s}s", done)
                return done
            if failure is None:
                continue
            kind, message = failure
            if w.task is not None:
                result = RewardResult(0.0, False, message, now - w.task.started)
                self._count(result, kind)
                done.append((w.task, result))
                w.task = None
            w.kill()
            self._workers[i] = self._spawn()
            self._stats["restarts"] += 1
        for w in self._workers:
            if self._pending and w.ready and w.task is None and not w.dead:
                task = self._pending.popleft()
                task.started, task.deadline = now, now + self.timeout_s
                w.task = task
                w.send(task)
        return done

    def _fail_all(self, message: str, done: list) -> None:
        self._error = message
        log.error("reward pool stopped: %s", message)
        for task in list(self._pending) + [w.task for w in self._workers if w.task is not None]:
            done.append((task, RewardResult(0.0, False, message, 0.0)))
        self._pending.clear()
        for w in self._workers:
            w.task = None
