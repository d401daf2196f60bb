"""Relay server: one per rollout host. Holds the newest versions in host memory, forwards them
chunk by chunk to the next live relay of its chain, and serves pulls.

Requests (see wire.py for framing, push.py for the push sub-protocol):

    hello                              -> hello {relay_id, pid, address, unix, complete}
    ping                               -> pong
    versions                           -> versions {complete, partial}
    pull {newer_than, wait_s}          -> pulled {version, manifest, chunk_bytes, unix} | error timeout
    wait {version, wait_s}             -> ready {version} | error timeout
    read {version, offset, nbytes}     -> data + bytes
    map {version}  (unix socket only)  -> mapped {version, total_bytes}, then the memfd over SCM_RIGHTS
    set_successors {addresses}         -> ok
    stop                               -> ok, then the server stops

Version buffers are memfd-backed so a rollout on the same host maps them (one memcpy to pull).
Each memfd is sealed against writes by anyone but this process (F_SEAL_FUTURE_WRITE, plus
SHRINK/GROW/SEAL) as soon as it is created: a client can map it read-only and nothing else.

With the run's keys (``keys=``, auth.RunKeys without the private key) every connection is
authenticated with the link key (wire.py, auth.py): a peer without it is dropped at its first
message, counted in ``stats()["auth_rejected"]`` and logged once per address; every handshake
runs on one thread under one deadline and caps (gate.py). Pushes must carry the learner's
Ed25519 signature over the version and manifest digest, and each chunk its signed SHA-256.
A push is refused when its announced size, added to the bytes announced but not yet verified
by all unfinished pushes, exceeds ``max_unverified_bytes``; an unfinished version is dropped
(its memory freed) when its sender disconnects or stays silent past ``io_timeout_s``.

With a weight store (``relay.store_url``, ``relay.store_check_s`` > 0) a pushed version becomes
pullable only once the store has committed the same version with the same layout: a version
number cannot run ahead of what the learner wrote. Chunks are received and forwarded meanwhile
(the store write and the push run side by side); a version the store does not commit within
``store_check_s``, or already replaced by newer ones, is dropped and counted (``store_refused``).
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import logging
import mmap
import os
import socket
import threading
import time
import uuid
from typing import Any, Optional, Sequence

from laminar_jax.net import auth
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.manifest import Manifest, ManifestError, chunk_span, crc32_of, num_chunks
from laminar_jax.relay.push import Downstream, NoRelayReachable, UpstreamStalled
from laminar_jax.relay.ratelimit import make_limiter
from laminar_jax.relay.gate import HandshakeGate
from laminar_jax.net.wire import AuthError, IdleTimeout, Peer, PeerClosed, WireError, error_frame
from laminar_jax.threads import Worker

log = logging.getLogger(__name__)
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


class _BufSource:
    """ChunkSource over a VersionBuf that may still be filling (used by the forwarder)."""

    def __init__(self, server: "RelayServer", buf: VersionBuf):
        self.server, self.buf = server, buf
        self.manifest, self.chunk_bytes = buf.manifest, buf.chunk_bytes

    def ready_since(self, pos: int, timeout: float) -> list[int]:
        order = self.buf.order
        with self.server._cond:
            self.server._cond.wait_for(lambda: len(order) > pos or self.superseded()
                                       or self.server._stopping.is_set(), timeout)
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
        with self.server._cond:
            vs = self.server._versions
            return (vs.get(self.buf.version) is not self.buf or max(vs) > self.buf.version
                    or self.server._stopping.is_set())


class RelayServer:
    """See the module docstring. ``start()`` binds ``cfg.host:port`` (ephemeral when 0)."""

    def __init__(self, config: RelaySection = RelaySection(), successors: Sequence[str] = (),
                 port: Optional[int] = None, keys: Optional[auth.RunKeys] = None, store: Any = None):
        """``store``: the WeightStore pushes are checked against (default: built from
        ``config.store_url`` at start() when ``config.store_check_s`` > 0; None without a store)."""
        config.validate("relay")
        self._store = store
        keys = auth.check_keys(keys, "RelayServer")
        self.cfg, self._key = config, keys and keys.link
        self._verifier = None if keys is None else keys.verifier()  # the learner's public key
        self._rejected_from: set[str] = set()  # addresses already logged for failing authentication
        self.relay_id = uuid.uuid4().hex
        self.unix_name = f"\0laminar-relay-{self.relay_id}"
        self._port = config.base_port if port is None else port
        self._versions: dict[int, VersionBuf] = {}
        self._pool: list[tuple[int, mmap.mmap]] = []  # evicted, unpinned buffers kept warm for reuse
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._threads: list[Worker] = []
        self._conns: set[socket.socket] = set()
        self._conn_errors: collections.deque[str] = collections.deque(maxlen=20)
        self._delivered: dict[str, int] = {}
        self._down = Downstream(config, successors, make_limiter(config.link_rate_bytes_per_s,
                                                                 config.link_burst_bytes), "relay forwarder",
                                key=self._key)
        self._tcp: Optional[socket.socket] = None
        self._unix: Optional[socket.socket] = None
        self.counters = collections.Counter()
        self._gate = HandshakeGate(config, self._key, self._admit, self._reject, self.counters,
                                   f"relay {self.relay_id[:8]}")

    # ---- lifecycle
    @property
    def address(self) -> str:
        if self._tcp is None:
            raise RuntimeError("RelayServer.address: call start() first")
        host, port = self._tcp.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> "RelayServer":
        if self._store is None and self.cfg.store_url and self.cfg.store_check_s > 0:
            from laminar_jax.relay.store import WeightStore

            self._store = WeightStore.from_config(self.cfg)
        self._tcp = socket.create_server((self.cfg.host, self._port), backlog=64)
        try:
            self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._unix.bind(self.unix_name)
            self._unix.listen(64)
        except (AttributeError, OSError):
            self._unix = None  # no abstract unix sockets here: local pulls use TCP
        self._gate.add_listener(self._tcp, "tcp")
        if self._unix is not None:
            self._gate.add_listener(self._unix, "unix")
        self._spawn(self._gate.run, self._stopping)
        self._spawn(self._forward_loop)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        for s in [self._tcp, self._unix, *list(self._conns)]:
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self._down.close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if not t.is_current():
                t.join(max(0.0, deadline - time.monotonic()))

    @property
    def stopped(self) -> bool:
        return self._stopping.is_set()

    def __enter__(self) -> "RelayServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def check(self) -> None:
        """Re-raise the first failure of a server thread (accept loop or forwarder), unless the
        server is stopping: closing its sockets ends those loops with errors."""
        if not self._stopping.is_set():
            for t in list(self._threads):
                t.check()

    def _spawn(self, fn, *args, daemon_name: str = "") -> Worker:
        worker = Worker(f"relay-{fn.__name__}", lambda: fn(*args), stop_on_failure=False)
        self._threads.append(worker)
        return worker.start()

    # ---- state
    def set_successors(self, addresses: Sequence[str]) -> None:
        with self._cond:
            self._down.set_addresses(addresses)
            self._cond.notify_all()

    def versions_held(self) -> list[int]:
        """Complete versions in memory, ascending."""
        with self._cond:
            return sorted(v for v, b in self._versions.items() if b.complete)

    def stats(self) -> dict:
        with self._cond:
            partial = {v: b.nhave for v, b in self._versions.items() if not b.complete}
        return {"complete": self.versions_held(), "partial": partial, "successors": list(self._down.addresses),
                "link_switches": self._down.switches, "link_errors": list(self._down.errors),
                "conn_errors": list(self._conn_errors), **self.counters}

    def _newest_complete(self) -> int:
        return max((v for v, b in self._versions.items() if b.complete), default=-1)

    def _evict_locked(self) -> None:
        """Keep the newest keep_in_memory complete versions and partial ones newer than them."""
        complete = sorted((v for v, b in self._versions.items() if b.complete), reverse=True)
        keep = set(complete[:self.cfg.keep_in_memory])
        floor = min(keep, default=-1)
        for v in list(self._versions):
            if v not in keep and (self._versions[v].complete or v < floor):
                buf = self._versions.pop(v)
                buf.evicted = True
                self._recycle_locked(buf)
                self.counters["evicted"] += 1

    def _recycle_locked(self, buf: VersionBuf) -> None:
        """Return an evicted buffer's memory to the pool once nobody uses its bytes.

        Reuse matters: first-touch page faults, not copies, dominate a relay hop's CPU cost.
        """
        if buf.evicted and buf.pins == 0:
            backing = buf.take_backing()
            if backing is not None:
                self._pool.append(backing)
                while len(self._pool) > self.cfg.spare_buffers:
                    os.close(self._pool.pop(0)[0])  # its mapping goes with the last reference

    def _new_buf(self, m: Manifest, chunk_bytes: int) -> VersionBuf:
        """A buffer for ``m``: a pooled one of the same size class when possible."""
        for i, (fd, mm) in enumerate(self._pool):
            if m.total_bytes <= len(mm) <= 2 * m.total_bytes + 4096:
                self.counters["buffers_reused"] += 1
                return VersionBuf(m, chunk_bytes, self._pool.pop(i))
        return VersionBuf(m, chunk_bytes)

    def _pin(self, buf: VersionBuf) -> None:
        with self._cond:
            buf.pins += 1

    def _unpin(self, buf: VersionBuf) -> None:
        with self._cond:
            buf.pins -= 1
            self._recycle_locked(buf)

    # ---- serving authenticated connections (the gate runs every handshake: gate.py)
    def _admit(self, peer: Peer, kind: str, source: str, first: tuple[dict, int]) -> None:
        """Give a connection whose handshake succeeded its thread, if one is free (max_connections)."""
        with self._cond:
            full = len(self._conns) >= self.cfg.max_connections
            if not full:
                self._conns.add(peer.sock)
        if full:
            self.counters["connections_refused"] += 1
            try:
                peer.send(error_frame("busy", f"relay serves relay.max_connections={self.cfg.max_connections} "
                                              f"connections already; retry later"))
            finally:
                peer.close()
            return
        try:
            threading.Thread(target=self._serve, args=(peer, kind, source, first), daemon=True,
                             name="relay-conn").start()
        except BaseException:
            with self._cond:
                self._conns.discard(peer.sock)
            self.counters["thread_start_failed"] += 1
            raise  # the gate logs it, closes the connection and goes on

    def _reject(self, source: str, err: BaseException) -> None:
        """Count a peer that failed authentication; log it once per address (a scanner must not
        flood the log)."""
        with self._cond:
            self.counters["auth_rejected"] += 1
            first = source not in self._rejected_from
            if first and len(self._rejected_from) < 4096:
                self._rejected_from.add(source)
        if first:
            log.warning("relay %s: dropped a connection from %s that failed authentication: %s "
                        "(further ones from this address are only counted)", self.relay_id[:8], source, err)

    def _serve(self, peer: Peer, kind: str, source: str, first: Optional[tuple[dict, int]]) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    header, plen = first if first is not None else peer.recv("a request")
                    first = None
                except PeerClosed:
                    return  # clean close between requests
                except IdleTimeout:
                    return  # a kept connection (a client's version polls) idle past io_timeout_s: not an error
                handler = getattr(self, f"_op_{header['op']}", None)
                if handler is None or (header["op"] == "map" and kind != "unix"):
                    peer.discard(plen, f"payload of unknown op {header['op']!r}")
                    peer.send(error_frame("bad_request", f"unknown op {header['op']!r} on a {kind} connection"))
                    continue
                if handler(peer, header, plen) is True:
                    return
        except AuthError as e:  # an authenticated peer sent a bad tag later on: tampering
            self._reject(source, e)
        except (OSError, WireError, ManifestError, ValueError, KeyError, TypeError) as e:
            if not self._stopping.is_set():
                self._conn_errors.append(f"{peer.name}: {type(e).__name__}: {e}")
        finally:
            with self._cond:
                self._conns.discard(peer.sock)
            peer.close()

    # ---- simple ops
    def _op_hello(self, peer: Peer, h: dict, plen: int) -> None:
        peer.send({"op": "hello", "relay_id": self.relay_id, "pid": os.getpid(), "address": self.address,
                   "unix": self.unix_name if self._unix else None, "complete": self.versions_held()})

    def _op_ping(self, peer: Peer, h: dict, plen: int) -> None:
        peer.send({"op": "pong"})

    def _op_versions(self, peer: Peer, h: dict, plen: int) -> None:
        s = self.stats()
        peer.send({"op": "versions", "complete": s["complete"], "partial": {str(k): v for k, v in s["partial"].items()}})

    def _op_set_successors(self, peer: Peer, h: dict, plen: int) -> None:
        addrs = h.get("addresses")
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            peer.send(error_frame("bad_request", f"set_successors.addresses={addrs!r}: must be a list of 'host:port'"))
            return
        self.set_successors(addrs)
        peer.send({"op": "ok"})

    def _op_stop(self, peer: Peer, h: dict, plen: int) -> None:
        peer.send({"op": "ok"})
        try:
            threading.Thread(target=self.stop, daemon=True, name="relay-stop").start()
        except RuntimeError:  # no thread to spare: stop from here (this connection's thread is not joined)
            self.stop(0.0)

    # ---- serving pulls
    def _wait_for(self, pred, wait_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: pred() or self._stopping.is_set(), max(0.0, wait_s)) and pred()

    def _op_pull(self, peer: Peer, h: dict, plen: int) -> None:
        newer, wait_s = int(h.get("newer_than", -1)), float(h.get("wait_s", 0.0))
        if not self._wait_for(lambda: self._newest_complete() > newer, wait_s):
            peer.send(error_frame("timeout", f"no version newer than {newer} within {wait_s:.3g}s "
                                             f"(holding {self.versions_held()})"))
            return
        with self._cond:
            buf = self._versions[self._newest_complete()]
        self.counters["pulls"] += 1
        peer.send({"op": "pulled", "version": buf.version, "manifest": buf.manifest.to_dict(),
                   "chunk_bytes": buf.chunk_bytes, "unix": self.unix_name if self._unix else None,
                   "relay_id": self.relay_id, "signature": buf.signature})

    def _op_wait(self, peer: Peer, h: dict, plen: int) -> None:
        v, wait_s = int(h["version"]), float(h.get("wait_s", 0.0))
        if self._wait_for(lambda: self._newest_complete() >= v, wait_s):
            peer.send({"op": "ready", "version": self._newest_complete()})
        else:
            peer.send(error_frame("timeout", f"version {v} not complete within {wait_s:.3g}s "
                                             f"(holding {self.versions_held()})"))

    def _pinned_complete(self, version: int) -> Optional[VersionBuf]:
        """The complete buffer of ``version``, pinned (caller unpins), or None."""
        with self._cond:
            buf = self._versions.get(version)
            if buf is None or not buf.complete:
                return None
            buf.pins += 1
            return buf

    def _op_read(self, peer: Peer, h: dict, plen: int) -> None:
        v, off, n = int(h["version"]), int(h.get("offset", 0)), h.get("nbytes")
        buf = self._pinned_complete(v)
        if buf is None:
            peer.send(error_frame("gone", f"version {v} not held (holding {self.versions_held()})"))
            return
        try:
            n = buf.total - off if n is None else int(n)
            if off < 0 or n < 0 or off + n > buf.total:
                peer.send(error_frame("bad_request", f"read range [{off}, {off + n}) outside version {v} "
                                                     f"of {buf.total} bytes"))
                return
            whole = off == 0 and n == buf.total and buf.signature is not None
            if whole and all(x is not None and "tag" in x for x in buf.vouch):
                # The learner's chunk tags vouch for the bytes: the client hashes once, we not at all.
                peer.send({"op": "data", "version": v, "chunk_bytes": buf.chunk_bytes, "signature": buf.signature,
                           "chunks": [[x["digest"], x["tag"]] for x in buf.vouch]},
                          [memoryview(buf.mm)[off:off + n]], payload_mac=False)
            else:
                peer.send({"op": "data", "version": v}, [memoryview(buf.mm)[off:off + n]])
        finally:
            self._unpin(buf)

    def _op_map(self, peer: Peer, h: dict, plen: int) -> Optional[bool]:
        """Pass the memfd; the pin lasts until the client unmaps (it closes this connection then)."""
        v = int(h["version"])
        buf = self._pinned_complete(v)
        if buf is None:
            peer.send(error_frame("gone", f"version {v} not held (holding {self.versions_held()})"))
            return None
        mapped = False
        try:
            if buf.fd is None:
                peer.send(error_frame("gone", f"version {v} is not memfd-backed on this host"))
                return None
            peer.send({"op": "mapped", "version": v, "total_bytes": buf.total})
            socket.send_fds(peer.sock, [b"F"], [buf.fd])
            self.counters["maps"] += 1
            mapped = True
            peer.settimeout(None)
            while peer.sock.recv(64):
                pass
        finally:
            self._unpin(buf)
            if mapped:  # counted after the unpin: whoever sees the count may rely on the buffer being free
                self.counters["unmaps"] += 1
        return True

    # ---- receiving pushes
    def _op_push(self, peer: Peer, h: dict, plen: int) -> None:
        v = int(h["version"])
        m = Manifest.from_dict(h["manifest"], f"push of version {v} from {peer.name}")
        chunk_bytes = int(h["chunk_bytes"])
        refusal = self._push_refusal(v, m, chunk_bytes, h.get("signature"))
        if refusal is not None:
            peer.send(error_frame(*refusal))
            return
        if not self._settle_republish(peer, v, m, chunk_bytes, h):
            return
        with self._cond:
            buf = self._versions.get(v)
            complete = sorted((x for x, b in self._versions.items() if b.complete), reverse=True)
            obsolete = buf is None and len(complete) >= self.cfg.keep_in_memory and v < complete[-1]
            if buf is None and not obsolete:
                pending = sum(b.unverified for b in self._versions.values())
                if pending + m.total_bytes > self.cfg.unverified_cap:
                    self.counters["pushes_refused"] += 1
                    peer.send(error_frame("busy", f"push of version {v}: {m.total_bytes} bytes announced while "
                                                  f"{pending} are not yet verified; relay.max_unverified_bytes="
                                                  f"{self.cfg.unverified_cap}"))
                    return
                buf = self._versions[v] = self._new_buf(m, chunk_bytes)
                buf.signature, buf.publish = h.get("signature"), h.get("publish")
                if self._store is not None and self.cfg.store_check_s > 0:
                    buf.cleared = False
                    buf.pins += 1  # the checker's pin, released when it ends
                    self._start_store_check(buf)
                self._cond.notify_all()
            if buf is not None:
                buf.pins += 1
                buf.receivers += 1
        if obsolete:
            peer.send({"op": "have", "complete": False, "obsolete": True, "chunks": []})
            return
        try:
            if (buf.total != m.total_bytes or buf.chunk_bytes != chunk_bytes or buf.manifest != m
                    or (buf.signature, buf.publish) != (h.get("signature"), h.get("publish"))):
                peer.send(error_frame("conflict", f"version {v}: still arriving from another publish (held with "
                                                  f"{buf.total} bytes / {buf.chunk_bytes}-byte chunks, pushed "
                                                  f"with {m.total_bytes} / {chunk_bytes})"))
                return
            if buf.complete:
                peer.send({"op": "have", "complete": True, "obsolete": False, "chunks": []})
                return
            peer.send({"op": "have", "complete": False, "obsolete": False,
                       "chunks": [i for i in range(buf.n) if buf.have[i]]})
            self._receive_chunks(peer, buf)
        finally:
            with self._cond:
                buf.receivers -= 1
                if not buf.received and buf.receivers == 0:
                    self._drop_partial_locked(buf)
            self._unpin(buf)

    # ---- a version published again (a restarted learner publishes its last versions once more)
    def _settle_republish(self, peer: Peer, v: int, m: Manifest, chunk_bytes: int, h: dict) -> bool:
        """When this relay holds all of ``v`` from another publish: the same bytes are kept (the
        sender is told it is complete; False) and other bytes are dropped, so that this push
        replaces them (True). True, with nothing done, in every other case."""
        with self._cond:
            buf = self._versions.get(v)
            if (buf is None or not buf.received
                    or (buf.signature, buf.publish) == (h.get("signature"), h.get("publish"))):
                return True
            buf.pins += 1
        try:
            if buf.total != m.total_bytes or buf.chunk_bytes != chunk_bytes or buf.manifest != m:
                differs = "its layout"
            else:
                vouches = self._read_vouches(peer, buf)
                if vouches is None:
                    return False  # the sender gave this version up
                differs = self._first_other_chunk(peer, buf, vouches, h.get("signature"))
        finally:
            self._unpin(buf)
        if differs is None:
            self.counters["republished_same"] += 1
            peer.send({"op": "have", "complete": True, "obsolete": False, "chunks": []})
            return False
        with self._cond:
            if self._versions.get(v) is buf:
                del self._versions[v]
                buf.evicted = True
                for addr, last in self._delivered.items():  # successors hold the old bytes: forward anew
                    self._delivered[addr] = min(last, v - 1)
                self._recycle_locked(buf)
                self.counters["republished_replaced"] += 1
                self._cond.notify_all()
        log.warning("relay %s: version %d published again with other bytes (%s differs); the new publish "
                    "replaces the one held", self.relay_id[:8], v, differs)
        return True

    def _read_vouches(self, peer: Peer, buf: VersionBuf) -> Optional[list]:
        """Ask the sender for every chunk's vouch (what its chunk headers would carry); None if it
        aborts the version instead."""
        peer.send({"op": "have", "complete": False, "obsolete": False, "chunks": [], "compare": True})
        r, _ = peer.recv(f"vouches of version {buf.version}")
        while r["op"] == "keepalive":  # the sender waits for its own upstream's chunks
            r, _ = peer.recv(f"vouches of version {buf.version}")
        if r["op"] == "abort":
            return None
        vouches = r.get("chunks") if r["op"] == "vouches" else None
        if not isinstance(vouches, list) or len(vouches) != buf.n or not all(isinstance(x, dict) for x in vouches):
            raise WireError(f"{peer.name}: expected vouches for the {buf.n} chunks of version {buf.version}, "
                            f"got {str(r)[:200]}")
        return vouches

    def _first_other_chunk(self, peer: Peer, buf: VersionBuf, vouches: list, signature: object) -> Optional[str]:
        """'chunk i' for the first vouch that differs from the held chunk's, or None when all are
        equal. With a key each vouch must carry the new publish's learner tag."""
        for i, vouch in enumerate(vouches):
            if self._key is not None:
                if not auth.verify_chunk(self._verifier, signature, i, vouch.get("digest"), vouch.get("tag")):
                    raise AuthError(f"{peer.name}: vouch {i} of version {buf.version} lacks a valid learner tag")
                if vouch["digest"] != buf.vouch[i]["digest"]:
                    return f"chunk {i}"
            elif vouch.get("crc") != buf.vouch[i]["crc"]:
                return f"chunk {i}"
        return None

    def _push_refusal(self, v: int, m: Manifest, chunk_bytes: int, signature: object) -> Optional[tuple[str, str]]:
        """(kind, message) of why a push is refused, or None. Pure checks on the announcement."""
        if v != m.version:
            return "bad_request", f"push of version {v} carries the manifest of version {m.version}"
        if chunk_bytes < 1:
            return "bad_request", f"push of version {v}: chunk_bytes={chunk_bytes}: must be >= 1"
        if m.total_bytes > self.cfg.unverified_cap:
            self.counters["pushes_refused"] += 1
            return "too_large", (f"push of version {v}: {m.total_bytes} bytes announced, above "
                                 f"relay.max_unverified_bytes={self.cfg.unverified_cap}")
        if self._key is not None and not auth.verify_version(self._verifier, v, m.digest(), signature):
            self.counters["pushes_refused"] += 1
            return "forged", f"push of version {v}: no valid learner signature over the version and manifest"
        return None

    def _drop_partial_locked(self, buf: VersionBuf) -> None:
        """Forget an unfinished version whose last sender left: its bytes are freed (or pooled)."""
        if self._versions.get(buf.version) is buf:
            del self._versions[buf.version]
            buf.evicted = True
            self.counters["partial_dropped"] += 1
            self._cond.notify_all()

    def _receive_chunks(self, peer: Peer, buf: VersionBuf) -> None:
        while True:
            h, plen = peer.recv(f"chunks of version {buf.version}")
            op = h["op"]
            if op == "keepalive":
                continue
            if op == "abort":
                return
            if op == "end":
                with self._cond:
                    missing = [i for i in range(buf.n) if not buf.have[i]]
                peer.send({"op": "missing", "chunks": missing})
                if not missing:
                    return
                continue
            if op != "chunk":
                raise WireError(f"{peer.name}: unexpected {op!r} inside push of version {buf.version}")
            self._receive_chunk(peer, buf, h, plen)

    def _chunk_vouch(self, peer: Peer, buf: VersionBuf, h: dict, idx: int) -> dict:
        """The header fields that vouch for a chunk's bytes; with a key, the learner's tag must hold."""
        if self._key is None:
            return {"crc": int(h["crc"])}
        if not auth.verify_chunk(self._verifier, buf.signature, idx, h.get("digest"), h.get("tag")):
            raise AuthError(f"{peer.name}: chunk {idx} of version {buf.version} lacks a valid learner tag")
        return {"digest": h["digest"], "tag": h["tag"]}

    @staticmethod
    def _bytes_match(mv: memoryview, vouch: dict) -> bool:
        if "digest" in vouch:
            return hashlib.sha256(mv).hexdigest() == vouch["digest"]
        return crc32_of(mv) == vouch["crc"]

    def _receive_chunk(self, peer: Peer, buf: VersionBuf, h: dict, plen: int) -> None:
        idx = int(h["index"])
        vouch = self._chunk_vouch(peer, buf, h, idx)
        what = f"chunk {idx} of version {buf.version}"
        start, stop = chunk_span(idx, buf.total, buf.chunk_bytes) if 0 <= idx < buf.n else (0, -1)
        if plen != stop - start:
            raise WireError(f"{peer.name}: {what} has {plen} bytes, expected {stop - start}")
        if buf.have[idx]:  # duplicate (second upstream): never overwrite verified bytes
            peer.discard(plen, what)
            return
        mv = buf.view(idx)
        peer.recv_into(mv, what)
        if not self._bytes_match(mv, vouch):
            self.counters["bad_chunks"] += 1
            return  # left missing: the sender resends it after 'end'
        with self._cond:
            if not buf.have[idx]:
                buf.have[idx], buf.vouch[idx] = True, vouch
                buf.nhave += 1
                buf.bytes_have += stop - start
                buf.order.append(idx)
                self.counters["chunks_in"] += 1
                self._note_complete_locked(buf)
            self._cond.notify_all()

    def _note_complete_locked(self, buf: VersionBuf) -> None:
        if buf.complete and not buf.counted:
            buf.counted = True
            self.counters["versions_in"] += 1
            self._evict_locked()

    # ---- the store check
    def _start_store_check(self, buf: VersionBuf) -> None:
        """Start ``buf``'s store check (caller holds the lock); without a thread to run it, the
        version is dropped at once, as one the store did not confirm."""
        try:
            threading.Thread(target=self._check_store, args=(buf,), daemon=True,
                             name=f"relay-store-check-v{buf.version}").start()
        except RuntimeError as e:
            buf.pins -= 1
            self._versions.pop(buf.version, None)
            buf.evicted = True
            self.counters["store_refused"] += 1
            self._conn_errors.append(f"store check: version {buf.version}: no thread to run it: {e}")
            log.warning("relay %s: dropped version %d: cannot start its store check: %s", self.relay_id[:8],
                        buf.version, e)

    def _check_store(self, buf: VersionBuf) -> None:
        """Clear ``buf`` once the store holds its version with the same layout; drop it if the store
        has another layout, has moved past it without it, or does not commit it in time."""
        try:
            try:
                verdict = self._store_verdict(buf)
            except Exception as e:  # noqa: BLE001 - an unreadable store clears nothing; say why
                verdict = f"version {buf.version}: store check failed: {type(e).__name__}: {e}"
            with self._cond:
                if verdict is None:
                    buf.cleared = True
                    self.counters["store_cleared"] += 1
                    self._note_complete_locked(buf)
                elif self._versions.get(buf.version) is buf:
                    del self._versions[buf.version]
                    buf.evicted = True
                    self.counters["store_refused"] += 1
                    self._conn_errors.append(f"store check: {verdict}")
                    log.warning("relay %s: dropped %s", self.relay_id[:8], verdict)
                self._cond.notify_all()
        finally:
            self._unpin(buf)

    def _store_verdict(self, buf: VersionBuf) -> Optional[str]:
        """None when the store has committed ``buf``'s version with its layout, else why not."""
        from laminar_jax.relay.store import VersionNotFound

        v, deadline, pause = buf.version, time.monotonic() + self.cfg.store_check_s, 0.01
        while True:
            if buf.evicted or self._stopping.is_set():
                return f"version {v}: evicted or stopping before the store check ended"
            try:
                if self._store.manifest(v).layout_digest() == buf.manifest.layout_digest():
                    return None
                return f"version {v}: the weight store holds another layout for this version"
            except VersionNotFound:
                pass
            newest = self._store.latest()
            if newest is not None and newest > v:
                return f"version {v}: not in the weight store, which has moved on to version {newest}"
            if time.monotonic() > deadline:
                return (f"version {v}: not committed to the weight store within relay.store_check_s="
                        f"{self.cfg.store_check_s}s (newest there: {newest})")
            self._stopping.wait(pause)
            pause = min(2 * pause, 0.25)

    # ---- forwarding
    def _forward_loop(self) -> None:
        last_ping = time.monotonic()
        while not self._stopping.is_set():
            with self._cond:  # pick and pin together: an unpinned evicted buffer may be recycled
                buf = self._versions[max(self._versions)] if self._versions else None
                if buf is not None:
                    buf.pins += 1
            try:
                lk = self._down.link() if self._down.addresses else None
                if lk is None or buf is None or self._delivered.get(lk[0], -1) >= buf.version:
                    if lk is not None and time.monotonic() - last_ping > self.cfg.heartbeat_s:
                        self._down.ping()
                        last_ping = time.monotonic()
                    with self._cond:
                        self._cond.wait(self.cfg.heartbeat_s)
                    continue
                addr, outcome = self._down.deliver(_BufSource(self, buf))
                if outcome != "superseded":
                    self._delivered[addr] = buf.version
                self.counters[f"forward_{outcome}"] += 1
            except (UpstreamStalled, NoRelayReachable) as e:
                self._conn_errors.append(f"forwarder: {e}")
                self._stopping.wait(self.cfg.heartbeat_s)
            finally:
                if buf is not None:
                    self._unpin(buf)
