"""A relay's store check: with a weight store (``relay.store_url``, ``relay.store_check_s`` > 0) a
pushed version becomes pullable only once the store has committed the same version with the same
layout, so a version number cannot run ahead of what the learner wrote. Chunks are received and
forwarded meanwhile (the store write and the push run side by side); a version the store does not
commit within ``store_check_s``, or already replaced by newer ones, is dropped and counted
(``store_refused``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Optional

from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.versions import HeldVersions, VersionBuf

log = logging.getLogger("laminar_jax.relay.server")


class StoreCheck:
    """Clears or drops pushed versions against ``store`` (None: no check, every version is clear)."""

    def __init__(self, config: RelaySection, held: HeldVersions, store: Any, errors: collections.deque, name: str):
        self.cfg, self.held, self.store, self.errors, self.name = config, held, store, errors, name

    @property
    def active(self) -> bool:
        return self.store is not None and self.cfg.store_check_s > 0

    def start(self, buf: VersionBuf) -> None:
        """Start ``buf``'s store check (caller holds the lock and has pinned ``buf`` for it);
        without a thread to run it, the version is dropped at once, as one the store did not confirm."""
        try:
            threading.Thread(target=self._run, args=(buf,), daemon=True,
                             name=f"relay-store-check-v{buf.version}").start()
        except RuntimeError as e:
            buf.pins -= 1
            self.held.bufs.pop(buf.version, None)
            buf.evicted = True
            self.held.counters["store_refused"] += 1
            self.errors.append(f"store check: version {buf.version}: no thread to run it: {e}")
            log.warning("relay %s: dropped version %d: cannot start its store check: %s", self.name,
                        buf.version, e)

    def _run(self, buf: VersionBuf) -> None:
        """Clear ``buf`` once the store holds its version with the same layout; drop it if the store
        has another layout, has moved past it without it, or does not commit it in time."""
        held = self.held
        try:
            try:
                verdict = self._verdict(buf)
            except Exception as e:  # noqa: BLE001 - an unreadable store clears nothing; say why
                verdict = f"version {buf.version}: store check failed: {type(e).__name__}: {e}"
            with held.cond:
                if verdict is None:
                    buf.cleared = True
                    held.counters["store_cleared"] += 1
                    held.note_complete_locked(buf)
                elif held.drop_locked(buf, "store_refused"):
                    self.errors.append(f"store check: {verdict}")
                    log.warning("relay %s: dropped %s", self.name, verdict)
                held.cond.notify_all()
        finally:
            held.unpin(buf)

    def _verdict(self, buf: VersionBuf) -> Optional[str]:
        """None when the store has committed ``buf``'s version with its layout, else why not."""
        from laminar_jax.relay.store import VersionNotFound

        v, deadline, pause = buf.version, time.monotonic() + self.cfg.store_check_s, 0.01
        while True:
            if buf.evicted or self.held.stopping.is_set():
                return f"version {v}: evicted or stopping before the store check ended"
            try:
                if self.store.manifest(v).layout_digest() == buf.manifest.layout_digest():
                    return None
                return f"version {v}: the weight store holds another layout for this version"
            except VersionNotFound:
                pass
            newest = self.store.latest()
            if newest is not None and newest > v:
                return f"version {v}: not in the weight store, which has moved on to version {newest}"
            if time.monotonic() > deadline:
                return (f"version {v}: not committed to the weight store within relay.store_check_s="
                        f"{self.cfg.store_check_s}s (newest there: {newest})")
            self.held.stopping.wait(pause)
            pause = min(2 * pause, 0.25)
