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
    push {version, manifest, ...}      -> the push sub-protocol (receive.py)
    set_successors {addresses}         -> ok
    stop                               -> ok, then the server stops

The server accepts and serves connections and answers pulls; its parts live beside it:
versions.py (the held versions: buffers, pins, eviction, reuse), pulls.py (pull, wait, read,
map), receive.py (pushes), store_check.py (a pushed version waits for the weight store's commit),
forward.py (sending on down the chain).

With the run's keys (``keys=``, auth.RunKeys without the private key) every connection is
authenticated with the link key (wire.py, auth.py): a peer without it is dropped at its first
message, counted in ``stats()["auth_rejected"]`` and logged once per address; every handshake
runs on one thread under one deadline and caps (gate.py). Pushes must carry the learner's
signatures (receive.py).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Optional, Sequence

from laminar_jax.net import auth
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.forward import Forwarder
from laminar_jax.relay.gate import HandshakeGate
from laminar_jax.relay.manifest import ManifestError
from laminar_jax.relay.pulls import PullService
from laminar_jax.relay.push import Downstream
from laminar_jax.relay.ratelimit import make_limiter
from laminar_jax.relay.receive import PushReceiver
from laminar_jax.relay.store_check import StoreCheck
from laminar_jax.relay.versions import HeldVersions
from laminar_jax.net.wire import AuthError, IdleTimeout, Peer, PeerClosed, WireError, error_frame
from laminar_jax.threads import Worker

log = logging.getLogger(__name__)


class RelayServer:
    """See the module docstring. ``start()`` binds ``cfg.host:port`` (ephemeral when 0)."""

    def __init__(self, config: RelaySection = RelaySection(), successors: Sequence[str] = (),
                 port: Optional[int] = None, keys: Optional[auth.RunKeys] = None, store: Any = None):
        """``store``: the WeightStore pushes are checked against (default: built from
        ``config.store_url`` at start() when ``config.store_check_s`` > 0; None without a store)."""
        config.validate("relay")
        keys = auth.check_keys(keys, "RelayServer")
        self.cfg, self._key = config, keys and keys.link
        self._verifier = None if keys is None else keys.verifier()  # the learner's public key
        self._rejected_from: set[str] = set()  # addresses already logged for failing authentication
        self.relay_id = uuid.uuid4().hex
        self.unix_name = f"\0laminar-relay-{self.relay_id}"
        self._port = config.base_port if port is None else port
        self._stopping = threading.Event()
        self._threads: list[Worker] = []
        self._conns: set[socket.socket] = set()
        self._conn_errors: collections.deque[str] = collections.deque(maxlen=20)
        self._down = Downstream(config, successors, make_limiter(config.link_rate_bytes_per_s,
                                                                 config.link_burst_bytes), "relay forwarder",
                                key=self._key)
        self._tcp: Optional[socket.socket] = None
        self._unix: Optional[socket.socket] = None
        self.counters = collections.Counter()
        name = self.relay_id[:8]
        self._held = HeldVersions(config, self.counters, self._stopping)
        self._cond = self._held.cond  # one lock for the held versions and the connection set
        self._check = StoreCheck(config, self._held, store, self._conn_errors, name)
        self._forwarder = Forwarder(config, self._held, self._down, self._conn_errors)
        self._receiver = PushReceiver(config, self._held, self._check, self._key, self._verifier,
                                      self._forwarder.resend_from, name)
        self._pulls = PullService(self._held, self.counters, self.relay_id)
        self._ops = {"hello": self._op_hello, "ping": self._op_ping, "versions": self._op_versions,
                     "set_successors": self._op_set_successors, "stop": self._op_stop, "push": self._receiver.push,
                     "pull": self._pulls.pull, "wait": self._pulls.wait, "read": self._pulls.read,
                     "map": self._pulls.map}
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
        if self._check.store is None and self.cfg.store_url and self.cfg.store_check_s > 0:
            from laminar_jax.relay.store import WeightStore

            self._check.store = WeightStore.from_config(self.cfg)
        self._tcp = socket.create_server((self.cfg.host, self._port), backlog=64)
        try:
            self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._unix.bind(self.unix_name)
            self._unix.listen(64)
        except (AttributeError, OSError):
            self._unix = None  # no abstract unix sockets here: local pulls use TCP
        self._pulls.unix = self.unix_name if self._unix else None
        self._gate.add_listener(self._tcp, "tcp")
        if self._unix is not None:
            self._gate.add_listener(self._unix, "unix")
        self._spawn("relay-gate", self._gate.run, self._stopping)
        self._spawn("relay-forwarder", self._forwarder.run)
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

    def _spawn(self, name: str, fn, *args) -> Worker:
        worker = Worker(name, lambda: fn(*args), stop_on_failure=False)
        self._threads.append(worker)
        return worker.start()

    # ---- state
    def set_successors(self, addresses: Sequence[str]) -> None:
        with self._cond:
            self._down.set_addresses(addresses)
            self._cond.notify_all()

    def versions_held(self) -> list[int]:
        """Complete versions in memory, ascending."""
        return self._held.complete()

    def stats(self) -> dict:
        return {"complete": self.versions_held(), "partial": self._held.partial(),
                "successors": list(self._down.addresses), "link_switches": self._down.switches,
                "link_errors": list(self._down.errors), "conn_errors": list(self._conn_errors), **self.counters}

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
                handler = self._ops.get(str(header["op"]))
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
