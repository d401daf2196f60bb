"""Weight prefetch: a rollout server stages the newest version while its last sequences finish.

A laminar server swaps once it has drained. Pulling only then puts the whole transfer (the relay
read or the store read, the signature checks, the host-side tree and cast) on the swap's critical
path, while the server decodes nothing. A `Prefetcher` fetches the newest announced version on a
thread of its own as soon as the server's board shows it, so that at the swap only the final copy
onto the devices is left (AsyncFlow's delayed parameter update, per server).

At most one version is staged: a fetch asks for a version newer than the staged one (the relay
answers once it has one) and the staged one is dropped when that arrives, so the swap always has
the newest version that has arrived, at once (a staged relay mapping pins that version's bytes on
the relay until then). A failed fetch is logged and counted; the swap then pulls as it would
without prefetch. Every wait is bounded, and `close` joins the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

from laminar_jax.threads import Worker

log = logging.getLogger(__name__)


class Staged(NamedTuple):
    """A fetched version waiting for its server's swap."""

    version: int
    payload: Any  # what fetch() returned for it
    fetch_s: float  # seconds its fetch took
    t_done: float  # time.monotonic() when it was staged


class Prefetcher:
    """One server's background fetch. fetch(newer_than) -> (version, payload) runs on the thread;
    announce() tells it of newer versions, take() hands the staged one to the swap."""

    def __init__(self, name: str, fetch: Callable[[int], tuple[int, Any]], retry_s: float = 1.0):
        self.name, self.fetch, self.retry_s = name, fetch, retry_s
        self._cond = threading.Condition()
        self._want = -1  # newest version announced
        self._current = -1  # the server's version: nothing at or below it is worth staging
        self._staged: Optional[Staged] = None
        self._busy = False  # a fetch is in flight
        self._closed = False
        self._retry_at = 0.0  # after a failure, no new fetch before this (monotonic)
        self._thread: Optional[Worker] = None
        self.counts = {"fetched": 0, "taken": 0, "superseded": 0, "failures": 0}
        self.last_error: Optional[str] = None

    def announce(self, newest: int, current: int) -> None:
        """The board shows ``newest``; the server runs ``current``. Starts the thread on first use."""
        with self._cond:
            if self._closed:
                return
            self._current = max(self._current, current)
            if newest > self._want:
                self._want = newest
                self._cond.notify_all()
            if self._thread is None and self._want > self._current:
                self._thread = Worker(f"{self.name}-prefetch", self._run, stop_on_failure=False).start()

    def take(self, current: int, timeout: float) -> Optional[Staged]:
        """The staged version if newer than ``current``, at once; with none staged, waiting up to
        ``timeout`` s for the fetch in flight (it is the pull the swap would make now); else None.
        Nothing is staged afterwards (a fetch of a newer version goes on, for the next swap)."""
        with self._cond:
            self._current = max(self._current, current)
            self._cond.wait_for(lambda: not self._busy or self._closed or (
                self._staged is not None and self._staged.version > current), max(0.0, timeout))
            staged, self._staged = self._staged, None
            if staged is not None and staged.version <= current:
                self.counts["superseded"] += 1
                staged = None
            if staged is not None:
                self.counts["taken"] += 1
                self._current = staged.version  # the server takes it now: not fetched again
            return staged

    def _next_floor(self) -> Optional[int]:
        """newer_than of the fetch to start now (lock held), or None if none is due."""
        if self._busy or self._closed or time.monotonic() < self._retry_at:
            return None
        have = max(self._current, self._staged.version if self._staged is not None else -1)
        return have if self._want > have else None

    def _run(self) -> None:
        while True:
            with self._cond:
                floor = None
                while floor is None and not self._closed:
                    floor = self._next_floor()
                    if floor is None:
                        # bounded so a retry after a failure is noticed without a new announcement
                        self._cond.wait(timeout=min(1.0, self.retry_s))
                if self._closed:
                    return
                self._busy = True
            t0 = time.monotonic()
            try:
                version, payload = self.fetch(floor)
            except Exception as e:  # noqa: BLE001 - logged and counted; the swap pulls itself
                with self._cond:
                    self._busy = False
                    self._retry_at = time.monotonic() + self.retry_s
                    self.counts["failures"] += 1
                    self.last_error = f"{type(e).__name__}: {e}"
                    self._cond.notify_all()
                log.warning("rollout server %s: prefetch of a version newer than %d failed (%s); the swap will "
                            "pull it itself", self.name, floor, self.last_error)
                continue
            with self._cond:
                self._busy = False
                self.counts["fetched"] += 1
                if version <= max(self._current, self._staged.version if self._staged else -1) or self._closed:
                    self.counts["superseded"] += 1  # the server swapped past it meanwhile
                else:
                    if self._staged is not None:  # the newer one replaces it
                        self.counts["superseded"] += 1
                    self._staged = Staged(int(version), payload, time.monotonic() - t0, time.monotonic())
                self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            return {**self.counts, "staged": None if self._staged is None else self._staged.version,
                    "last_error": self.last_error}

    def close(self, timeout: float) -> bool:
        """Stop the thread (a fetch in flight finishes first, within its own timeout); drops what is
        staged. Returns whether the thread ended within ``timeout`` s."""
        with self._cond:
            self._closed = True
            self._staged = None
            self._cond.notify_all()
            thread = self._thread
        if thread is None or thread.is_current():
            return True
        return thread.join(timeout)
