"""In-process weight hand-off: rollout servers in the publisher's own process take each version
from its memory, once the weight store has committed it, instead of through a relay.

Why: in a local run every server shares the learner's process, so a relay round trip per version
(the publisher's push with its SHA-256 and HMAC passes, then per server a poll, an authenticated
pull and a mapping) moves bytes that are already in this process. The store write stays: it is
what a resumed run and a replaced server read, and a version is handed out only after it, so a
trajectory is never stamped with a version the store could lose (the same rule relays follow with
``relay.store_check_s``).

``Handoff`` holds the newest offered version (read-only host arrays, shared, never copied);
``HandoffClient`` gives it the interface rollout workers use on a ``RelayClient``
(``latest_version``, ``pull``, ``close``) and falls back to the store for what the hand-off does
not hold (a version older than the newest is never asked for: servers only move forward).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import numpy as np


class Handoff:
    """The newest committed version, held in memory. Thread-safe; offers may arrive out of order
    (older ones are ignored)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._version: Optional[int] = None
        self._flat: Optional[dict] = None
        self.offered = 0  # versions accepted (diagnostics)

    def offer(self, version: int, flat: dict) -> None:
        """Hold ``flat`` ({name: host array}) as ``version`` if it is newer than what is held.
        The arrays are made read-only views: every server shares them."""
        views = {}
        for name, a in flat.items():
            v = np.asarray(a).view()
            v.flags.writeable = False
            views[name] = v
        with self._cond:
            if self._version is not None and version <= self._version:
                return
            self._version, self._flat = version, views
            self.offered += 1
            self._cond.notify_all()

    def latest(self) -> Optional[int]:
        with self._cond:
            return self._version

    def wait_newer(self, newer_than: int, timeout: float) -> Optional[tuple[int, dict]]:
        """(version, flat) of the held version once it is > newer_than; None after ``timeout`` s."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._version is not None and self._version > newer_than,
                                       max(0.0, timeout)):
                return None
            return self._version, self._flat


class HandoffClient:
    """A rollout server's weight source in a run with a hand-off: the hand-off first, the store
    (``fallback``: a RelayClient with the store and no relays) for what it does not hold."""

    def __init__(self, handoff: Handoff, fallback: Any, holder: str = ""):
        self.handoff, self.fallback, self.holder = handoff, fallback, holder
        self.last_source: Optional[str] = None
        self.errors: list[str] = []

    def latest_version(self, timeout: float = 5.0) -> Optional[int]:
        """The newest version handed off, else the store's newest; no I/O while the hand-off holds one."""
        v = self.handoff.latest()
        return v if v is not None else self.fallback.latest_version(timeout)

    def pull(self, newer_than: int = -1, timeout: float = 60.0) -> tuple[int, dict]:
        """(version, flat read-only host arrays) of the newest version > newer_than, waiting up to
        ``timeout`` s for the hand-off, then reading the store; TimeoutError names what it waited for."""
        deadline = time.monotonic() + timeout
        got = self.handoff.wait_newer(newer_than, timeout)
        if got is not None:
            self.last_source = "handoff"
            return got
        try:
            version, flat = self.fallback.pull(newer_than, timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError as e:
            raise TimeoutError(f"{self.holder or 'rollout server'}: no version newer than {newer_than} was handed "
                               f"off within {timeout}s, nor in the store ({e})") from None
        self.last_source = self.fallback.last_source
        return version, flat

    def close(self) -> None:
        self.fallback.close()
