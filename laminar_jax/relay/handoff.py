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
(``latest_version``, ``pull``, ``pull_placed``, ``close``) and falls back to the store for what the hand-off does
not hold (a version older than the newest is never asked for: servers only move forward).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import numpy as np


class Handoff:
    """The newest committed version, held in memory. Thread-safe; offers may arrive out of order
    (older ones are ignored)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._version: Optional[int] = None
        self._flat: Optional[dict] = None
        self.offered = 0  # versions accepted (diagnostics)
        self._place_lock = threading.Lock()
        self._placed: dict[Any, tuple[int, Any]] = {}  # placement function -> (version, its result)
        self.placements = 0  # place() calls made (diagnostics: one per version and function)

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

    def placed(self, version: int, flat: dict, place: Callable[[dict], Any]) -> Any:
        """place(flat) for ``version``, computed once per placement function and shared by every
        caller passing the same function: servers on the same devices then run on one copy of the
        weights (one host-to-device copy per version, and on an accelerator one copy in memory,
        instead of one per server). Only the newest version's result is kept per function."""
        with self._place_lock:  # a second server waits for the first one's copy, then reuses it
            held = self._placed.get(place)
            if held is not None and held[0] == version:
                return held[1]
            params = place(flat)
            self.placements += 1
            if held is None or held[0] < version:
                self._placed[place] = (version, params)
            return params


class HandoffClient:
    """A rollout server's weight source in a run with a hand-off: the hand-off first, the store
    (``fallback``: a RelayClient with the store and no relays) for what it does not hold."""

    def __init__(self, handoff: Handoff, fallback: Any, holder: str = ""):
        self.handoff, self.fallback, self.holder = handoff, fallback, holder
        self.last_source: Optional[str] = None  # "handoff", or where the store fallback read from

    def latest_version(self, timeout: float = 5.0) -> Optional[int]:
        """The newest version handed off, else the store's newest; no I/O while the hand-off holds one."""
        v = self.handoff.latest()
        return v if v is not None else self.fallback.latest_version(timeout)

    def pull(self, newer_than: int = -1, timeout: float = 60.0) -> tuple[int, dict]:
        """(version, flat read-only host arrays) of the newest version > newer_than, waiting up to
        ``timeout`` s for the hand-off, then reading the store; TimeoutError names what it waited for."""
        got = self.handoff.wait_newer(newer_than, timeout)
        if got is not None:
            self.last_source = "handoff"
            return got
        return self._from_store(newer_than, timeout)

    def pull_placed(self, newer_than: int, timeout: float, place: Callable[[dict], Any]) -> tuple[int, Any]:
        """pull(), then ``place`` (flat -> the server's params): from the hand-off, shared with the
        other servers that place the same way (Handoff.placed); from the store, this caller's own."""
        version, flat = self.pull(newer_than, timeout)
        return version, self.placed(version, flat, place, self.last_source)

    def placed(self, version: int, flat: dict, place: Callable[[dict], Any], source: Optional[str]) -> Any:
        """place(flat) of a version pulled earlier from ``source`` (a pull's last_source): shared
        with the other servers that place the same way when it came from the hand-off."""
        if source == "handoff":
            return self.handoff.placed(version, flat, place)
        return place(flat)

    def _from_store(self, newer_than: int, waited: float) -> tuple[int, dict]:
        """One look at the store after the hand-off had nothing newer for ``waited`` s."""
        try:
            version, flat = self.fallback.pull(newer_than, timeout=0.0)
        except TimeoutError as e:
            raise TimeoutError(f"{self.holder or 'rollout server'}: no version newer than {newer_than} was handed "
                               f"off within {waited}s, nor in the store ({e})") from None
        self.last_source = self.fallback.last_source
        return version, flat

    def close(self) -> None:
        self.fallback.close()
