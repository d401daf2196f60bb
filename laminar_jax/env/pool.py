"""EnvPool: environment calls off the rollout server's thread, each with a deadline.

Threads, not processes: an Environment holds per-episode state across calls (a process pool would
have to pin an episode to one worker and ship its state); code that must be contained runs in its
own subprocess inside the environment (python sandbox). A call past its deadline resolves as a
timeout failure at once; its hung thread is abandoned (it exits when the call returns, its answer
ignored) and a fresh thread takes its place, so a hanging environment never blocks the pool.
Every failure (exception, timeout, malformed result) is an `EnvCallResult` with ok=False: the
caller ends that episode with reward 0; the pool counts it and goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

log = logging.getLogger(__name__)


class EnvCallResult(NamedTuple):
    value: Any  # what the call returned (None on failure)
    ok: bool
    error: Optional[str]  # "timeout after 5.0 s", "ValueError: ...", ...
    latency_s: float  # from the start of the call until its answer (or its deadline)


class EnvStats(NamedTuple):
    calls: int
    failures: int
    timeouts: int
    latency_p50_s: float
    latency_p99_s: float
    in_flight: int


class _Call:
    __slots__ = ("fn", "args", "future", "start", "deadline")

    def __init__(self, fn, args, timeout_s: float):
        self.fn, self.args, self.future = fn, args, Future()
        self.start = time.monotonic()
        self.deadline = self.start + timeout_s


class EnvPool:
    """`submit(fn, *args) -> Future[EnvCallResult]`; at most `workers` calls run at once."""

    def __init__(self, workers: int = 8, timeout_s: float = 30.0, max_latencies: int = 10000):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"EnvPool: workers={workers} must be >= 1 and timeout_s={timeout_s} > 0")
        self.workers, self.timeout_s = workers, timeout_s
        self._lock = threading.Condition()
        self._queue: list[_Call] = []
        self._running: set[_Call] = set()
        self._latencies: list[float] = []
        self._max_latencies = max_latencies
        self._calls = self._failures = self._timeouts = 0
        self._closed = False
        self._watchdog: Optional[threading.Thread] = None  # runs while calls are queued or running

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("EnvPool is closed")
            call = _Call(fn, args, self.timeout_s)
            self._queue.append(call)
            self._lock.notify_all()
            self._start_ready()
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="env-pool-watchdog", daemon=True)
                self._watchdog.start()
        return call.future

    def _start_ready(self) -> None:
        """Start queued calls while fewer than `workers` run (lock held). Deadlines count from the start."""
        while self._queue and len(self._running) < self.workers:
            call = self._queue.pop(0)
            call.start = time.monotonic()
            call.deadline = call.start + self.timeout_s
            self._running.add(call)
            threading.Thread(target=self._run, args=(call,), name="env-call", daemon=True).start()

    def _run(self, call: _Call) -> None:
        try:
            value = call.fn(*call.args)
            result = EnvCallResult(value, True, None, time.monotonic() - call.start)
        except Exception as e:  # noqa: BLE001 - an environment's failure is a result, never a dead thread
            result = EnvCallResult(None, False, f"{type(e).__name__}: {e}"[:500], time.monotonic() - call.start)
        self._finish(call, result)

    def _finish(self, call: _Call, result: EnvCallResult) -> None:
        with self._lock:
            if call not in self._running:
                return  # timed out already; this late answer is ignored
            self._running.discard(call)
            self._calls += 1
            if not result.ok:
                self._failures += 1
                self._timeouts += int(result.error.startswith("timeout"))
            self._latencies.append(result.latency_s)
            del self._latencies[:-self._max_latencies]
            self._start_ready()
            self._lock.notify_all()
        call.future.set_result(result)

    def _watch(self) -> None:
        """Resolve calls past their deadline; exits when nothing is queued or running (submit restarts it)."""
        while True:
            with self._lock:
                if not self._running and not self._queue:
                    self._watchdog = None
                    return
                now = time.monotonic()
                late = [c for c in self._running if c.deadline <= now]
                wait = min((c.deadline for c in self._running), default=now + 1.0) - now
                if not late:
                    self._lock.wait(timeout=max(0.005, min(wait, 1.0)))
                    continue
            for c in late:
                log.warning("env call %s timed out after %.1f s", getattr(c.fn, "__qualname__", c.fn), self.timeout_s)
                self._finish(c, EnvCallResult(None, False, f"timeout after {self.timeout_s} s", self.timeout_s))

    def stats(self) -> EnvStats:
        with self._lock:
            lat = np.asarray(self._latencies) if self._latencies else np.zeros(1)
            return EnvStats(self._calls, self._failures, self._timeouts, float(np.percentile(lat, 50)),
                            float(np.percentile(lat, 99)), len(self._running) + len(self._queue))

    def close(self, wait_s: float = 5.0) -> None:
        """Refuse new calls; queued ones fail; running ones get until their deadline (at most wait_s)."""
        with self._lock:
            self._closed = True
            queued, self._queue = self._queue, []
            self._lock.notify_all()
        for c in queued:
            c.future.set_result(EnvCallResult(None, False, "pool closed", 0.0))
        watchdog = self._watchdog
        if watchdog is not None:
            watchdog.join(timeout=wait_s)
