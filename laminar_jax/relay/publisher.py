"""Learner side: ``publish(version, params)`` takes a host copy and returns; the rest is background.

The caller's stall is the device-to-host copy and nothing more: device leaves get all their
copies started before the first is awaited (none on the CPU backend, where ``np.asarray`` is a
zero-copy view), and host arrays nobody can change (read-only all the way down, such as
``np.asarray`` of a ``jax.Array``) are taken by reference, not copied.

The background worker writes the version to the store and pushes it to the master relay (the
first live one of ``relay_addresses``) at the same time. Memory is bounded: at most
``max_inflight_versions`` host copies wait; a newer publish supersedes the oldest waiting one,
and the worker always takes the newest waiting version (older waiting ones are dropped). Several
threads may publish at once (e.g. one per learner step): a version whose host copy completes
after a newer one was queued or taken is superseded, never sent after it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.manifest import choose_chunk_bytes, contiguous, plan_layout
from laminar_jax.relay.push import ArraysSource, Downstream, NoRelayReachable
from laminar_jax.relay.ratelimit import make_limiter
from laminar_jax.threads import Worker

log = logging.getLogger(__name__)


def is_immutable(a: np.ndarray) -> bool:
    """True when nobody can change ``a``'s bytes: it and every array it views are read-only, and
    the memory at the bottom is a read-only buffer or owned by a read-only array (what
    ``np.asarray(jax.Array)`` returns, and read-only mappings). Such arrays need no defensive copy."""
    x: Any = a
    while isinstance(x, np.ndarray):
        if x.flags.writeable:
            return False
        x = x.base
    if x is None:
        return True
    try:
        return memoryview(x).readonly
    except TypeError:  # not a buffer: unknown owner, assume it may change
        return False


def chunk_bytes_for(cfg: RelaySection, total_bytes: int) -> int:
    """The chunk size the publisher cuts a version of ``total_bytes`` into (see choose_chunk_bytes)."""
    return choose_chunk_bytes(total_bytes, cfg.chunk_bytes, cfg.min_chunk_bytes, cfg.link_rate_bytes_per_s,
                              cfg.chunk_time_s, cfg.pipeline_chunks)


class _Job(NamedTuple):
    version: int
    host: dict  # name -> host np.ndarray, owned by the job
    t_publish: float  # perf_counter at publish() entry


@dataclasses.dataclass(frozen=True)
class PublisherStats:
    """Counters and timings; ``timings[v]`` holds seconds after publish(v) was called."""

    published: int
    superseded: int
    stored: int
    relayed: int
    relay_failures: tuple[str, ...]
    last_stall_s: float
    max_stall_s: float
    timings: dict  # version -> {"stall": s, "store_visible": s, "relay_visible": s}
    bytes_per_version: int = 0  # the newest published version's bytes (a LoRA run's: its adapters)


class Publisher:
    def __init__(self, config: RelaySection = RelaySection(), store: Any = None,
                 relay_addresses: Optional[Sequence[str]] = None, copy_numpy: bool = True,
                 keys: Any = None, handoff: Any = None):
        """``store``: a WeightStore (default: built from config.store_url, if set).
        ``copy_numpy``: copy numpy leaves (the caller may mutate them after publish returns).
        ``keys``: the run's keys (auth.run_keys, with the learner's private key): the link key
        authenticates the connections, the private key signs each version and chunk.
        ``handoff``: a relay.handoff.Handoff that gets each version's host copy once the store
        has committed it (at once without a store), for rollout servers in this process."""
        from laminar_jax.net.auth import check_keys
        from laminar_jax.relay.store import WeightStore

        config.validate("relay")
        keys = check_keys(keys, "Publisher", signing=True)
        self.cfg, self.copy_numpy = config, copy_numpy
        self._signer = None if keys is None else keys.signer("Publisher")
        self.store = store if store is not None else (WeightStore.from_config(config) if config.store_url else None)
        addrs = tuple(config.relay_addresses if relay_addresses is None else relay_addresses)
        self.handoff = handoff
        if self.store is None and not addrs and handoff is None:
            raise ValueError("Publisher: neither a store (relay.store_url) nor relay.relay_addresses configured")
        limiter = make_limiter(config.link_rate_bytes_per_s, config.link_burst_bytes)
        self._down = Downstream(config, addrs, limiter, "publisher", key=keys and keys.link) if addrs else None
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._busy: Optional[int] = None
        self._closed = False
        self._errors: list[str] = []
        self._last_version = -1  # newest number handed to publish()
        self._newest_queued = -1  # newest version queued (or taken by the worker)
        self._counts = collections.Counter()
        self._stalls: list[float] = []
        self._relay_failures: list[str] = []
        self._timings: dict[int, dict] = {}
        self._last_bytes = 0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="publisher-store")
        # Per-version failures are recorded in _errors and the loop goes on; the Worker keeps a
        # failure of the loop itself.
        self._thread = Worker("publisher", self._run, stop_on_failure=False).start()

    # ---- learner-facing
    def publish(self, version: int, params: Any) -> float:
        """Take a host copy of ``params`` (pytree of jax or numpy arrays, or a flat dict) and
        queue it as ``version``; returns the seconds this call blocked."""
        from laminar_jax.relay.flat import start_host_copies, tree_items

        t0 = time.perf_counter()
        self.check()
        if self._closed:
            raise RuntimeError("Publisher.publish: publisher is closed")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"Publisher.publish(version={version!r}): must be an int > last version "
                             f"{self._last_version}")
        with self._cond:  # reserve the number first: concurrent publishers keep versions increasing
            if version <= self._last_version:
                raise ValueError(f"Publisher.publish(version={version!r}): must be an int > last version "
                                 f"{self._last_version}")
            self._last_version = version
        items = tree_items(params)
        leaves = start_host_copies([leaf for _, leaf in items])
        host = {name: self._host_copy(name, leaf) for (name, _), leaf in zip(items, leaves)}
        self._last_bytes = sum(int(a.nbytes) for a in host.values())
        with self._cond:
            self._counts["published"] += 1
            if version < self._newest_queued:  # a newer one overtook this copy: it supersedes it
                self._counts["superseded"] += 1
            else:
                self._newest_queued = version
                self._pending.append(_Job(version, host, t0))
                while len(self._pending) > self.cfg.max_inflight_versions:
                    self._pending.pop(0)
                    self._counts["superseded"] += 1
                self._cond.notify_all()
        stall = time.perf_counter() - t0
        self._stalls = (self._stalls + [stall])[-256:]
        self._timings[version] = {"stall": stall}
        for old in sorted(self._timings)[:-256]:  # bounded history
            del self._timings[old]
        return stall

    def _host_copy(self, name: str, leaf: Any) -> np.ndarray:
        if isinstance(leaf, np.ndarray):
            if self.copy_numpy and not is_immutable(leaf):
                return leaf.copy(order="C")
            return contiguous(leaf)
        a = np.asarray(leaf)  # jax.Array: waits for its copy_to_host_async; immutable on host
        if a.dtype == object:
            raise TypeError(f"Publisher.publish: leaf {name!r} of type {type(leaf).__name__} is not an array")
        return contiguous(a)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued version is written/pushed (or superseded) and the store's gc
        after it has run; re-raise failures."""
        deadline = time.monotonic() + timeout
        with self._cond:
            ok = self._cond.wait_for(lambda: not self._pending and self._busy is None, timeout)
            left = [j.version for j in self._pending] + ([self._busy] if self._busy is not None else [])
        if ok and self.store is not None:
            try:  # the I/O thread runs in order: once this no-op has run, every gc before it has
                self._io.submit(lambda: None).result(max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                ok, left = False, ["the store's gc"]
            except RuntimeError:  # the I/O thread is shut down (closed): nothing is left to run
                pass
        self.check()
        if not ok:
            raise TimeoutError(f"Publisher.flush: versions {left} still in flight after {timeout}s")

    def close(self, timeout: float = 60.0) -> None:
        try:
            if not self._closed:
                self.flush(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(timeout)
            self._io.shutdown(wait=False)
            if self._down:
                self._down.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self) -> None:
        """Re-raise the first background failure (store write, or a push with no store to fall back on)."""
        self._thread.check()
        if self._errors:
            raise RuntimeError(f"Publisher background failure:\n{self._errors[0]}")

    def stats(self) -> PublisherStats:
        c = self._counts
        return PublisherStats(c["published"], c["superseded"], c["stored"], c["relayed"],
                              tuple(self._relay_failures[-10:]), self._stalls[-1] if self._stalls else 0.0,
                              max(self._stalls, default=0.0), {k: dict(v) for k, v in self._timings.items()},
                              self._last_bytes)

    # ---- background
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                job = self._pending.pop()  # newest; older waiting versions are superseded
                self._counts["superseded"] += len(self._pending)
                self._pending.clear()
                self._busy = job.version
            try:
                self._process(job)
            except BaseException:  # noqa: BLE001 - recorded; check() re-raises in the learner
                self._errors.append(traceback.format_exc())
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _process(self, job: _Job) -> None:
        t = self._timings.setdefault(job.version, {})
        stored = self._io.submit(self._write_store, job, t) if self.store is not None else None
        if self._down is not None:
            manifest = plan_layout(job.host, job.version)
            try:
                chunk = chunk_bytes_for(self.cfg, manifest.total_bytes)
                self._down.deliver(ArraysSource(manifest, job.host, chunk, self._signer))
                t["relay_visible"] = time.perf_counter() - job.t_publish
                self._counts["relayed"] += 1
            except NoRelayReachable as e:
                self._relay_failures.append(str(e))
                if stored is None:
                    raise
        if stored is not None:
            stored.result()
        if self.handoff is not None:  # committed (when there is a store): servers in this process may take it
            self.handoff.offer(job.version, job.host)
        if stored is not None and self.cfg.gc_on_publish:
            # After the hand-off, not before it: servers do not wait for old versions to be deleted.
            # Same single I/O thread as the writes, so gc and the next write never overlap.
            self._io.submit(self._gc).add_done_callback(self._record_failure)

    def _write_store(self, job: _Job, t: dict) -> None:
        self.store.write(job.version, job.host)
        t["store_visible"] = time.perf_counter() - job.t_publish
        self._counts["stored"] += 1

    # Orphaned data (a writer killed mid-version) is looked for on the first gc and every this many.
    ORPHAN_SCAN_EVERY = 32

    def _gc(self) -> None:
        report = self.store.gc(orphans=self._counts["gc"] % self.ORPHAN_SCAN_EVERY == 0)
        if report.unreadable:
            log.warning("%s: manifests of versions %s do not parse; their data was kept (remove them by hand)",
                        self.store.url, list(report.unreadable))
        self._counts["gc"] += 1

    def _record_failure(self, future) -> None:
        e = future.exception()
        if e is not None:
            self._errors.append("".join(traceback.format_exception(type(e), e, e.__traceback__)))
