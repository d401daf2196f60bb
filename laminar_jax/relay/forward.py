"""A relay's forwarder: one thread that sends the newest held version, chunk by chunk as it
arrives, to the next live relay of the chain (push.Downstream picks the link and skips dead ones)."""

from __future__ import annotations

import collections
import time
from typing import Any, Optional

from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.push import Downstream, NoRelayReachable, UpstreamStalled
from laminar_jax.relay.versions import HeldVersions, VersionBuf


class _BufSource:
    """ChunkSource over a VersionBuf that may still be filling (used by the forwarder)."""

    def __init__(self, held: HeldVersions, buf: VersionBuf):
        self.held, self.buf = held, buf
        self.manifest, self.chunk_bytes = buf.manifest, buf.chunk_bytes

    def ready_since(self, pos: int, timeout: float) -> list[int]:
        order = self.buf.order
        with self.held.cond:
            self.held.cond.wait_for(lambda: len(order) > pos or self.superseded()
                                    or self.held.stopping.is_set(), timeout)
            return order[pos:]

    def chunk(self, index: int) -> tuple[list[Any], dict]:
        return [self.buf.view(index)], self.buf.vouch[index]

    @property
    def signature(self) -> Optional[str]:
        return self.buf.signature

    @property
    def publish(self) -> Optional[str]:
        return self.buf.publish

    def superseded(self) -> bool:
        """Evicted, or a newer version has started arriving (the forwarder always sends the newest)."""
        with self.held.cond:
            vs = self.held.bufs
            return (vs.get(self.buf.version) is not self.buf or max(vs) > self.buf.version
                    or self.held.stopping.is_set())


class Forwarder:
    """Forwards the newest held version to ``down``; remembers what each successor was sent."""

    def __init__(self, config: RelaySection, held: HeldVersions, down: Downstream, errors: collections.deque):
        self.cfg, self.held, self.down, self.errors = config, held, down, errors
        self._delivered: dict[str, int] = {}  # successor address -> newest version delivered there

    def resend_from(self, version: int) -> None:
        """Successors hold other bytes of ``version`` and later: forward them anew (caller holds the lock)."""
        for addr, last in self._delivered.items():
            self._delivered[addr] = min(last, version - 1)

    def run(self) -> None:
        held, counters = self.held, self.held.counters
        last_ping = time.monotonic()
        while not held.stopping.is_set():
            buf = held.pinned_newest()
            try:
                lk = self.down.link() if self.down.addresses else None
                if lk is None or buf is None or self._delivered.get(lk[0], -1) >= buf.version:
                    if lk is not None and time.monotonic() - last_ping > self.cfg.heartbeat_s:
                        self.down.ping()
                        last_ping = time.monotonic()
                    with held.cond:
                        held.cond.wait(self.cfg.heartbeat_s)
                    continue
                addr, outcome = self.down.deliver(_BufSource(held, buf))
                if outcome != "superseded":
                    self._delivered[addr] = buf.version
                counters[f"forward_{outcome}"] += 1
            except (UpstreamStalled, NoRelayReachable) as e:
                self.errors.append(f"forwarder: {e}")
                held.stopping.wait(self.cfg.heartbeat_s)
            finally:
                if buf is not None:
                    held.unpin(buf)
