"""The one supervised-thread primitive: threads that never die silently (JetStream's JetThread idea).

A `Worker` runs `fn()` in a named daemon thread. If `fn` raises, the exception is kept with its
traceback, the shared `stop` event is set (when the worker was given one to stop on failure), and
`check()` re-raises it in whichever thread asks, naming the worker and carrying the traceback.
A `WorkerGroup` is the set of workers one owner starts, stops and checks together.
"""

from __future__ import annotations

import threading
import traceback
from typing import Callable, Optional


class WorkerFailed(RuntimeError):
    """A supervised worker thread raised; the message carries its name and traceback."""


class Worker:
    """`Worker(name, fn, stop)`: run `fn` in a thread; keep its failure for `check()`.

    stop: the event `fn` watches to finish; with `stop_on_failure` a failure sets it, so the other
    workers of the same owner finish too (a failure then stops the whole owner, not just this thread).
    """

    def __init__(self, name: str, fn: Callable[[], None], stop: Optional[threading.Event] = None,
                 stop_on_failure: bool = True):
        self.name, self.fn = name, fn
        self.stop = stop if stop is not None else threading.Event()
        self.stop_on_failure = stop_on_failure
        self.error: Optional[BaseException] = None
        self.traceback = ""
        self._thread = threading.Thread(target=self._body, name=name, daemon=True)

    def start(self) -> "Worker":
        self._thread.start()
        return self

    def _body(self) -> None:
        try:
            self.fn()
        except BaseException as e:  # noqa: BLE001 - kept and re-raised by check() in the owner's thread
            self.traceback = traceback.format_exc()
            self.error = e
            if self.stop_on_failure:
                self.stop.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def is_current(self) -> bool:
        """Whether the caller runs in this worker's thread (it cannot join itself)."""
        return self._thread is threading.current_thread()

    def check(self) -> None:
        """Re-raise this worker's failure (if any), naming it and carrying its traceback."""
        if self.error is not None:
            raise WorkerFailed(f"worker {self.name!r} died: {self.error!r}\n{self.traceback}") from self.error

    def join(self, timeout: float) -> bool:
        """Wait (bounded) for the thread to end; True if it did."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()


class WorkerGroup:
    """The workers of one owner: one stop event, the first failure re-raised by `check()`."""

    def __init__(self, stop: Optional[threading.Event] = None):
        self.stop = stop if stop is not None else threading.Event()
        self.workers: list[Worker] = []

    def spawn(self, name: str, fn: Callable[[], None]) -> Worker:
        w = Worker(name, fn, self.stop)
        self.workers.append(w)
        return w.start()

    def check(self) -> None:
        for w in list(self.workers):
            w.check()

    def join(self, timeout: float) -> list[str]:
        """Stop every worker and join them; the names of those still alive after `timeout`."""
        self.stop.set()
        return [w.name for w in list(self.workers) if not w.join(timeout)]
