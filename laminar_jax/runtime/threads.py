"""Worker threads that never die silently (JetStream's JetThread idea).

A worker's exception is recorded with its traceback; ``Supervisor.check()`` re-raises the first
failure in the owner's thread, and the stop event tells every other worker to finish.
"""

from __future__ import annotations

import threading
import traceback
from typing import Callable, Optional


class WorkerFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(self):
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._failure: Optional[tuple[str, BaseException, str]] = None
        self._threads: list[threading.Thread] = []

    def spawn(self, name: str, fn: Callable[[], None]) -> threading.Thread:
        def body():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - recorded and re-raised by check()
                with self._lock:
                    if self._failure is None:
                        self._failure = (name, e, traceback.format_exc())
                self.stop.set()

        t = threading.Thread(target=body, name=name, daemon=True)
        self._threads.append(t)
        t.start()
        return t

    def spawn_isolated(self, name: str, fn: Callable[[], None],
                       on_error: Callable[[BaseException, str], None]) -> threading.Thread:
        """A worker whose failure is handled by `on_error(exc, traceback)` (fault isolation, e.g. a
        rollout server is replaced); only if `on_error` itself raises does the run stop."""

        def guarded():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to on_error with its traceback
                on_error(e, traceback.format_exc())

        return self.spawn(name, guarded)

    def check(self) -> None:
        """Re-raise the first worker failure, naming the worker and carrying its traceback."""
        with self._lock:
            failure = self._failure
        if failure is not None:
            name, exc, tb = failure
            raise WorkerFailed(f"worker {name!r} died: {exc!r}\n{tb}") from exc

    def join(self, timeout: float) -> list[str]:
        """Stop and join all workers; returns the names of those still alive after `timeout`."""
        self.stop.set()
        for t in self._threads:
            t.join(timeout)
        return [t.name for t in self._threads if t.is_alive()]
