"""The versions a relay holds: memfd-backed buffers filled chunk by chunk, pinned while used, evicted
to keep the newest ``relay.keep_in_memory`` complete ones, and pooled for reuse once unused.

Version buffers are memfd-backed so a rollout on the same host maps them (one memcpy to pull).
Each memfd is sealed against writes by anyone but this process (F_SEAL_FUTURE_WRITE, plus
SHRINK/GROW/SEAL) as soon as it is created: a client can map it read-only and nothing else.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import mmap
import os
import threading
from typing import Callable, Optional

from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.manifest import Manifest, chunk_span, num_chunks

log = logging.getLogger("laminar_jax.relay.server")
_F_SEAL_FUTURE_WRITE = 0x10  # linux/fcntl.h (5.1+); not in every Python's fcntl module
_SEALS = (getattr(fcntl, "F_SEAL_SEAL", 1) | getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4)
          | _F_SEAL_FUTURE_WRITE)


def _sealed_memfd(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A memfd of ``size`` bytes mapped read-write here, then sealed: no other process can write
    it, resize it or map it writable (our mapping, made before the seal, stays writable, so
    buffers can be reused). Falls back to an unsealed memfd on kernels without the seals."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 2))
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_ADD_SEALS", 1033), _SEALS)
        except OSError as e:  # pre-5.1 kernel: the read-only client mapping is the only guard
            log.warning("relay: cannot seal weight buffers (%s); clients map them read-only", e)
        return fd, mm
    except BaseException:
        os.close(fd)
        raise


class VersionBuf:
    """One version's packed bytes (memfd-backed when possible), filled chunk by chunk."""

    def __init__(self, manifest: Manifest, chunk_bytes: int, backing: Optional[tuple[int, mmap.mmap]] = None):
        self.manifest, self.version, self.chunk_bytes = manifest, manifest.version, chunk_bytes
        self.total = manifest.total_bytes
        self.n = num_chunks(self.total, chunk_bytes)
        self.fd: Optional[int] = None
        if backing is not None:  # a recycled buffer: its pages are already faulted in
            self.fd, self.mm = backing
        else:
            size = max(1, self.total)
            try:
                self.fd, self.mm = _sealed_memfd(f"laminar-relay-v{self.version}", size)
            except (AttributeError, OSError):
                self.fd, self.mm = None, mmap.mmap(-1, size)
        self.have = [False] * self.n
        self.vouch: list[Optional[dict]] = [None] * self.n  # per chunk: {"crc"} or {"digest", "tag"}
        self.nhave = 0
        self.order: list[int] = []  # verified chunks in arrival order (what the forwarder walks)
        self.pins = 0  # users of the bytes: receivers, the forwarder, TCP reads, client mappings
        self.receivers = 0  # connections pushing this version right now
        self.signature: Optional[str] = None  # the learner's signature, forwarded downstream
        self.publish: Optional[str] = None  # the publish these bytes came from (forwarded downstream)
        self.evicted = False
        self.cleared = True  # False while the store has not confirmed this version (store check)
        self.counted = False  # counted in versions_in (once complete)

        self.bytes_have = 0

    @property
    def unverified(self) -> int:
        """Bytes announced but not verified yet."""
        return self.total - self.bytes_have

    @property
    def received(self) -> bool:
        """Every chunk is in and verified (pullable once also cleared by the store check)."""
        return self.nhave == self.n

    @property
    def complete(self) -> bool:
        return self.nhave == self.n and self.cleared

    def view(self, index: int) -> memoryview:
        start, stop = chunk_span(index, self.total, self.chunk_bytes)
        return memoryview(self.mm)[start:stop]

    def take_backing(self) -> Optional[tuple[int, mmap.mmap]]:
        """Hand the memfd and its mapping over for reuse (only when nothing uses the bytes)."""
        if self.fd is None:
            return None
        backing, self.fd = (self.fd, self.mm), None
        return backing

    def __del__(self, _close=os.close) -> None:  # bound early: module globals may be gone at exit
        if getattr(self, "fd", None) is not None:
            _close(self.fd)


class HeldVersions:
    """The held versions by number, under one condition variable (``cond``) that every relay thread
    waits on. Methods ending in ``_locked`` expect the caller to hold ``cond``."""

    def __init__(self, config: RelaySection, counters: collections.Counter, stopping: threading.Event):
        self.cfg, self.counters, self.stopping = config, counters, stopping
        self.bufs: dict[int, VersionBuf] = {}
        self._pool: list[tuple[int, mmap.mmap]] = []  # evicted, unpinned buffers kept warm for reuse
        self.cond = threading.Condition()

    def complete(self) -> list[int]:
        """Complete versions in memory, ascending."""
        with self.cond:
            return sorted(v for v, b in self.bufs.items() if b.complete)

    def partial(self) -> dict[int, int]:
        """Unfinished versions -> chunks held."""
        with self.cond:
            return {v: b.nhave for v, b in self.bufs.items() if not b.complete}

    def newest_complete(self) -> int:
        return max((v for v, b in self.bufs.items() if b.complete), default=-1)

    def evict_locked(self) -> None:
        """Keep the newest keep_in_memory complete versions and partial ones newer than them."""
        complete = sorted((v for v, b in self.bufs.items() if b.complete), reverse=True)
        keep = set(complete[:self.cfg.keep_in_memory])
        floor = min(keep, default=-1)
        for v in list(self.bufs):
            if v not in keep and (self.bufs[v].complete or v < floor):
                buf = self.bufs.pop(v)
                buf.evicted = True
                self.recycle_locked(buf)
                self.counters["evicted"] += 1

    def recycle_locked(self, buf: VersionBuf) -> None:
        """Return an evicted buffer's memory to the pool once nobody uses its bytes.

        Reuse matters: first-touch page faults, not copies, dominate a relay hop's CPU cost.
        """
        if buf.evicted and buf.pins == 0:
            backing = buf.take_backing()
            if backing is not None:
                self._pool.append(backing)
                while len(self._pool) > self.cfg.spare_buffers:
                    os.close(self._pool.pop(0)[0])  # its mapping goes with the last reference

    def new_buf(self, m: Manifest, chunk_bytes: int) -> VersionBuf:
        """A buffer for ``m``: a pooled one of the same size class when possible."""
        for i, (fd, mm) in enumerate(self._pool):
            if m.total_bytes <= len(mm) <= 2 * m.total_bytes + 4096:
                self.counters["buffers_reused"] += 1
                return VersionBuf(m, chunk_bytes, self._pool.pop(i))
        return VersionBuf(m, chunk_bytes)

    def unpin(self, buf: VersionBuf) -> None:
        with self.cond:
            buf.pins -= 1
            self.recycle_locked(buf)

    def pinned_complete(self, version: int) -> Optional[VersionBuf]:
        """The complete buffer of ``version``, pinned (caller unpins), or None."""
        with self.cond:
            buf = self.bufs.get(version)
            if buf is None or not buf.complete:
                return None
            buf.pins += 1
            return buf

    def pinned_newest(self) -> Optional[VersionBuf]:
        """The newest version, complete or not, pinned (caller unpins), or None. Picked and pinned
        together: an unpinned evicted buffer may be recycled."""
        with self.cond:
            buf = self.bufs[max(self.bufs)] if self.bufs else None
            if buf is not None:
                buf.pins += 1
            return buf

    def wait_for(self, pred: Callable[[], bool], wait_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: pred() or self.stopping.is_set(), max(0.0, wait_s)) and pred()

    def drop_locked(self, buf: VersionBuf, counter: str) -> bool:
        """Forget ``buf`` if it is still the one held for its version (its memory goes back once
        unpinned); counts ``counter``. False when another buffer holds that version now."""
        if self.bufs.get(buf.version) is not buf:
            return False
        del self.bufs[buf.version]
        buf.evicted = True
        self.counters[counter] += 1
        return True

    def note_complete_locked(self, buf: VersionBuf) -> None:
        if buf.complete and not buf.counted:
            buf.counted = True
            self.counters["versions_in"] += 1
            self.evict_locked()
