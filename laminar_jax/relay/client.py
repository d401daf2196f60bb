"""Rollout side: pull the newest weights from the local relay, other relays, or the store.

A relay on the same host hands over its memfd over an abstract unix socket, so a pull costs one
``mmap`` plus one memcpy (or none: with shardings, ``jax.device_put`` reads the mapping directly).
A remote relay streams the bytes over TCP. Every wait is bounded and its error names the relay
and version waited for.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from laminar_jax.net import auth
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.manifest import Manifest, views
from laminar_jax.relay.store import VersionNotFound
from laminar_jax.net.wire import AuthError, Peer, RemoteError, WireError, client_handshake, connect


class RelayClient:
    """Pulls versions; ``addresses`` in preference order (local relay first)."""

    def __init__(self, addresses: Sequence[str], store: Any = None, config: RelaySection = RelaySection(),
                 holder: Optional[str] = None, keys: Optional[auth.RunKeys] = None):
        """``keys``: the run's keys without the private one (auth.run_keys(...).for_hosts()): the link
        key authenticates connections, the learner's public key checks every version and chunk.
        None talks to relays that run without keys."""
        self.addresses, self.store, self.cfg = tuple(addresses), store, config
        keys = auth.check_keys(keys, "RelayClient")
        self.key = keys and keys.link
        self._verifier = None if keys is None else keys.verifier()
        self.holder = holder or f"client-{socket.gethostname()}-{os.getpid()}"
        self.last_source: Optional[str] = None  # where the last pull came from (relay address or store URL)
        self.errors: list[str] = []  # relay errors met by the last call
        # Version polls reuse one authenticated connection per relay: a rollout server polls every
        # ~50 ms, and a fresh connection (TCP connect, nonce exchange, a relay thread) per poll cost
        # ~0.6 CPU-ms, ten times the request itself. A lock: the client may be shared by threads.
        self._poll_peers: dict[str, Peer] = {}
        self._poll_lock = threading.Lock()

    # ---- public API
    def pull(self, newer_than: int = -1, timeout: float = 60.0, shardings: Any = None,
             like: Any = None, copy: bool = False) -> tuple[int, Any]:
        """(version, params) for the newest version > newer_than, waiting up to ``timeout`` s.

        params: flat {name: np.ndarray}. From a relay on this host these are read-only views of
        the relay's memory (zero-copy; the relay keeps those bytes unchanged while they live),
        or private copies with ``copy=True``. With ``shardings`` (a {name: Sharding} dict or a
        pytree of Shardings): jax arrays placed by ``jax.device_put``, in the shardings'
        structure. With ``like`` (a template pytree): rebuilt in that structure.
        """
        deadline = time.monotonic() + timeout
        self.errors = []
        # Each relay gets a slice of the wait, then the store is checked: a relay that is alive but
        # never receives the version (its upstream push failed) must not hold the caller for the
        # whole timeout while the store already has it.
        slice_s = max(0.5, min(5.0, timeout / 4))
        while True:
            relay_alive = False
            for addr in self.addresses:
                wait = max(0.0, min(slice_s, deadline - time.monotonic()))
                try:
                    version, flat, owned = self._pull_relay(addr, newer_than, wait)
                except RemoteError as e:
                    self.errors.append(str(e))
                    relay_alive = True
                    continue
                except (OSError, WireError) as e:
                    self.errors.append(f"relay {addr}: {e}")
                    continue
                self.last_source = addr
                return version, self._place(flat, owned or not copy, shardings, like)
            got = self._pull_store(newer_than, deadline, poll=not relay_alive)
            if got is not None:
                return got[0], self._place(got[1], True, shardings, like)
            if time.monotonic() >= deadline or (not relay_alive and self.store is None):
                break
        store = f" or store {self.store.url}" if self.store is not None else ""
        raise TimeoutError(f"pull(newer_than={newer_than}): no newer version within {timeout}s from relays "
                           f"{list(self.addresses)}{store}; errors: {self.errors}")

    def pull_placed(self, newer_than: int, timeout: float, place: Callable[[dict], Any]) -> tuple[int, Any]:
        """pull() of flat host arrays, then ``place`` (flat -> the caller's params, e.g. on its devices)."""
        version, flat = self.pull(newer_than, timeout=timeout)
        return version, self.placed(version, flat, place, self.last_source)

    @staticmethod
    def placed(version: int, flat: dict, place: Callable[[dict], Any], source: Optional[str] = None) -> Any:
        """place(flat) of a version pulled earlier (a prefetch places it at the swap); ``source``
        is the pull's last_source (the hand-off client shares placements by it)."""
        return place(flat)

    def latest_version(self, timeout: float = 5.0) -> Optional[int]:
        """Newest complete version at the first reachable relay, else the store's LATEST."""
        self.errors = []
        with self._poll_lock:
            for addr in self.addresses:
                try:
                    h = self._poll(addr, timeout)
                    return max(h["complete"], default=None)
                except (OSError, WireError, RemoteError) as e:
                    self.errors.append(f"relay {addr}: {e}")
        return self.store.latest() if self.store is not None else None

    def _poll(self, addr: str, timeout: float) -> dict:
        """One 'versions' request on the kept connection to ``addr``. A kept connection the relay
        has closed meanwhile (idle past its io timeout, or a restart) fails on first use: it is
        dropped and the request retried once on a fresh connection, whose failure is the relay's."""
        for fresh in (False, True):
            peer = self._poll_peers.pop(addr, None)
            if peer is None:
                fresh = True
                peer = connect(addr, min(timeout, self.cfg.connect_timeout_s), timeout, self.key)
            try:
                peer.settimeout(timeout)
                h, _ = peer.request({"op": "versions"}, "versions", "its version list")
            except (OSError, WireError) as e:
                peer.close()
                if fresh:
                    raise
                continue
            except BaseException:
                peer.close()
                raise
            self._poll_peers[addr] = peer
            return h
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the kept poll connections (pulls hold none); the client stays usable."""
        with self._poll_lock:
            peers, self._poll_peers = list(self._poll_peers.values()), {}
        for peer in peers:
            peer.close()

    def wait_for(self, version: int, timeout: float, address: Optional[str] = None) -> int:
        """Block until ``address`` (default: the first relay) holds ``version`` or newer."""
        addr = address or self.addresses[0]
        peer = connect(addr, self.cfg.connect_timeout_s, timeout + self.cfg.io_timeout_s, self.key)
        try:
            h, _ = peer.request({"op": "wait", "version": version, "wait_s": timeout}, "ready",
                                f"version {version} to be complete")
        except RemoteError as e:
            raise TimeoutError(f"relay {addr}: version {version} not complete within {timeout}s ({e})") from None
        finally:
            peer.close()
        return int(h["version"])

    # ---- relay paths
    def _pull_relay(self, addr: str, newer_than: int, wait: float) -> tuple[int, dict, bool]:
        for attempt in range(3):  # the version may be evicted between 'pull' and 'map'/'read'
            peer = connect(addr, self.cfg.connect_timeout_s, self.cfg.io_timeout_s + wait, self.key)
            try:
                h, _ = peer.request({"op": "pull", "newer_than": newer_than, "wait_s": wait}, "pulled",
                                    f"a version newer than {newer_than}")
                m = Manifest.from_dict(h["manifest"], f"manifest of version {h.get('version')} from relay {addr}")
                if self.key is not None and not auth.verify_version(self._verifier, m.version, m.digest(),
                                                                    h.get("signature")):
                    raise AuthError(f"relay {addr}: version {m.version} lacks a valid learner signature")
                peer.settimeout(self.cfg.io_timeout_s)
                try:
                    flat = None
                    if self.cfg.local_transport == "memfd" and h.get("unix"):
                        flat = self._map_local(addr, h["unix"], m)
                    if flat is not None:
                        return m.version, flat, False
                    return m.version, self._read_tcp(peer, m, h.get("signature")), True
                except RemoteError as e:
                    if e.kind != "gone" or attempt == 2:
                        raise
            finally:
                peer.close()
        raise AssertionError("unreachable")

    def _map_local(self, addr: str, unix_name: str, m: Manifest) -> Optional[dict]:
        """Map the relay's memfd if it lives on this host; None if it does not."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.cfg.io_timeout_s)
        try:
            s.connect(unix_name)
        except OSError:
            s.close()
            return None
        try:
            peer = client_handshake(s, f"relay {addr} (unix)", self.key, self.cfg.connect_timeout_s)
        except BaseException:
            s.close()
            raise
        try:
            h, _ = peer.request({"op": "map", "version": m.version}, "mapped", f"the memfd of version {m.version}")
            _, fds, _, _ = socket.recv_fds(s, 1, 1)
            if not fds:
                raise WireError(f"{peer.name}: no file descriptor came with version {m.version}")
            try:
                mm = mmap.mmap(fds[0], max(1, m.total_bytes), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ)
            finally:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            peer.close()
            raise
        # The relay pins these bytes until this connection closes: close it when the mapping dies.
        weakref.finalize(mm, peer.close)
        return views(mm, m)

    def _read_tcp(self, peer: Peer, m: Manifest, signature: Optional[str] = None) -> dict:
        buf = np.empty(m.total_bytes, np.uint8)
        peer.send({"op": "read", "version": m.version, "offset": 0, "nbytes": m.total_bytes})
        h, plen = peer.expect("data", f"bytes of version {m.version}")
        if plen != m.total_bytes:
            raise WireError(f"{peer.name}: sent {plen} bytes for version {m.version}, expected {m.total_bytes}")
        what = f"{m.total_bytes} bytes of version {m.version}"
        if h.get("pm") == 0:  # no wire tag on the payload: the learner's chunk tags must vouch for it
            self._read_checked(peer, h, memoryview(buf), m, signature, what)
        else:
            peer.recv_into(memoryview(buf), what)
        return views(buf, m)

    def _read_checked(self, peer: Peer, h: dict, mv: memoryview, m: Manifest, signature: Optional[str],
                      what: str) -> None:
        """Read the payload chunk by chunk; each chunk's learner signature and SHA-256 are checked
        on other threads while the next ones arrive, so the checks overlap the transfer."""
        from laminar_jax.relay.manifest import chunk_span

        chunk_bytes, chunks = self._chunk_tags(peer.name, h, m, signature)
        spans = [chunk_span(i, m.total_bytes, chunk_bytes) for i in range(len(chunks))]

        def check(i: int) -> Optional[str]:
            digest, tag = chunks[i]
            if not auth.verify_chunk(self._verifier, signature, i, digest, tag):
                return f"chunk {i} of version {m.version} has no valid learner signature"
            if hashlib.sha256(mv[spans[i][0]:spans[i][1]]).hexdigest() != digest:
                return f"chunk {i} of version {m.version} does not match its signed digest"
            return None

        # hashlib and OpenSSL release the GIL: chunks are checked on other cores while this thread reads
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1, len(chunks)) or 1) as pool:
            futures = []
            for i, (start, stop) in enumerate(spans):
                peer.recv_into(mv[start:stop], what)
                futures.append(pool.submit(check, i))
            for fut in futures:
                problem = fut.result()
                if problem is not None:
                    raise AuthError(f"{peer.name}: {problem}")

    def _chunk_tags(self, name: str, h: dict, m: Manifest, signature: Optional[str]) -> tuple[int, list]:
        """(chunk_bytes, [[digest, tag], ...]) from a data header, its shape checked (the tags are
        checked as the chunks arrive)."""
        from laminar_jax.relay.manifest import num_chunks

        chunk_bytes, chunks = int(h.get("chunk_bytes", 0)), h.get("chunks")
        if (self._verifier is None or h.get("signature") != signature or chunk_bytes < 1
                or not isinstance(chunks, list) or len(chunks) != num_chunks(m.total_bytes, chunk_bytes)
                or not all(isinstance(pair, list) and len(pair) == 2 for pair in chunks)):
            raise AuthError(f"{name}: bytes of version {m.version} come without valid chunk tags")
        return chunk_bytes, chunks

    # ---- store path
    def _pull_store(self, newer_than: int, deadline: float, poll: bool) -> Optional[tuple[int, dict]]:
        """Read the store's newest version if newer; keep polling until the deadline when ``poll``."""
        if self.store is None:
            return None
        while True:
            v = self.store.latest()
            if v is not None and v > newer_than:
                try:
                    with self.store.lease(v, self.holder):
                        flat = self.store.read(v)
                except VersionNotFound:  # collected between latest() and the lease, or a dangling LATEST
                    if time.monotonic() >= deadline:
                        return None
                    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                    continue
                self.last_source = self.store.url
                return v, flat
            left = deadline - time.monotonic()
            if not poll or left <= 0:
                return None
            time.sleep(min(0.1, left))

    # ---- placement
    @staticmethod
    def _place(flat: dict, owned: bool, shardings: Any, like: Any) -> Any:
        from laminar_jax.relay.flat import tree_items, unflatten_like

        if shardings is None:
            out = flat if owned else {k: np.array(a) for k, a in flat.items()}
            return out if like is None else unflatten_like(out, like)
        import jax

        if isinstance(shardings, Mapping) and all(isinstance(k, str) for k in shardings) and (
                set(shardings) & set(flat)):
            names = list(shardings)
            if set(names) != set(flat):
                raise KeyError(f"pull: shardings name {len(names)} weights, the version has {len(flat)}; "
                               f"missing e.g. {sorted(set(flat) - set(names))[:3]}")
            placed = jax.device_put([flat[n] for n in names], [shardings[n] for n in names])
            return dict(zip(names, placed))
        items = tree_items(shardings)
        missing = [n for n, _ in items if n not in flat]
        if missing:
            raise KeyError(f"pull: weights {missing[:3]} named by the shardings tree are not in the version")
        placed = jax.device_put([flat[n] for n, _ in items], [s for _, s in items])
        return unflatten_like(dict(zip([n for n, _ in items], placed)), shardings)
