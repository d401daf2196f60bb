"""The relay's front door: accepts connections and runs every handshake on one selector thread.

Nothing unauthenticated gets a thread of its own. One thread accepts on the relay's listening
sockets and walks each new connection through its handshake without blocking: with a run key the
nonce exchange (auth.py), then, with or without a key, the connection's first frame up to and
including its header tag. Only a connection whose first header authenticated (or any one that
sent a well-formed first header, on a relay without a key) is handed to ``admit``, which gives it
a thread.

Bounds, all from the relay config:
- ``handshake_timeout_s``: one deadline for the whole handshake, however the bytes trickle in;
- ``max_handshakes_per_source`` connections in handshake at once from one address: one more is
  closed at once, before a byte is read; ``max_handshakes`` from all addresses: one more closes
  the connection longest in handshake (a genuine handshake takes milliseconds, so a flood from
  many addresses cannot hold the door shut against a genuine peer);
- a first header is at most ``PRE_AUTH_MAX_HEADER`` bytes, buffered only as it arrives, so the
  handshakes hold at most ``max_handshakes`` x that much.
A failing ``accept`` (out of file descriptors, say) or ``admit`` is logged and counted, never
fatal: the gate pauses that listener briefly and goes on.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from typing import Callable, Optional

from laminar_jax.net import auth
from laminar_jax.relay.config import RelaySection
from laminar_jax.net.wire import MAGIC, PREFIX_BYTES, AuthError, Peer, WireError

log = logging.getLogger(__name__)
PRE_AUTH_MAX_HEADER = 1 << 20  # a connection's first header, read before its tag can be checked
ACCEPT_PAUSE_S = 0.05  # a listener whose accept failed rests this long (EMFILE would spin otherwise)
RECV_SLICE = 64 << 10


class HandshakeFailed(WireError):
    """A connection failed its handshake (the message says why); ``silent``: it sent nothing."""

    def __init__(self, message: str, silent: bool = False):
        super().__init__(message)
        self.silent = silent


class _Pending:
    """One connection in handshake: what it has sent so far and what it must send next."""

    def __init__(self, sock: socket.socket, kind: str, source: str, name: str, deadline: float,
                 key: Optional[bytes]):
        self.sock, self.kind, self.source, self.deadline = sock, kind, source, deadline
        self.peer = Peer(sock, name)
        self.peer.max_header = PRE_AUTH_MAX_HEADER
        self.server_nonce = auth.new_nonce() if key is not None else b""
        self.stage = "nonce" if key is not None else "prefix"
        self.need = auth.NONCE_BYTES if key is not None else PREFIX_BYTES
        self.buf = bytearray()
        self.raw_prefix = self.raw_header = b""
        self.got_any = False
        self.first: Optional[tuple[dict, int]] = None  # the first frame's (header, payload length)


class HandshakeGate:
    """See the module docstring. ``admit(peer, kind, source, first)`` gets each connection whose
    handshake succeeded (``first``: its first frame's (header, payload length)) and owns it from
    then on; ``reject(source, error)`` hears of each one that failed."""

    def __init__(self, cfg: RelaySection, key: Optional[bytes], admit: Callable, reject: Callable,
                 counters: collections.Counter, label: str):
        self.cfg, self.key, self.admit, self.reject = cfg, key, admit, reject
        self.counters, self.label = counters, label
        self._sel = selectors.DefaultSelector()
        self._pending: dict[socket.socket, _Pending] = {}
        self._per_source: collections.Counter = collections.Counter()
        self._paused: dict[socket.socket, tuple[float, str]] = {}  # listener -> (resume at, kind)
        self._refused_from: set[str] = set()  # sources already logged for going past a cap
        self._stopping = threading.Event()

    def add_listener(self, lsock: socket.socket, kind: str) -> None:
        lsock.setblocking(False)
        self._sel.register(lsock, selectors.EVENT_READ, kind)

    @property
    def pending(self) -> int:
        return len(self._pending)

    # ---- the gate thread
    def run(self, stopping: threading.Event) -> None:
        """Serve until ``stopping`` is set; closes every connection still in handshake on exit."""
        self._stopping = stopping
        try:
            while not stopping.is_set():
                self._resume_listeners()
                ready = [skey for skey, _ in self._sel.select(self._select_timeout())]
                # Handshakes first: slots that peers gave up (closed) free up before new ones are counted.
                for skey in ready:
                    if not isinstance(skey.data, str):
                        self._step(skey.data)
                self._expire()
                for skey in ready:
                    if isinstance(skey.data, str):
                        self._accept(skey.fileobj, skey.data)
        finally:
            for p in list(self._pending.values()):
                self._drop(p)
            self._sel.close()

    def _select_timeout(self) -> float:
        soonest = min((p.deadline for p in self._pending.values()), default=None)
        wait = 0.2 if soonest is None else max(0.0, min(0.2, soonest - time.monotonic()))
        if self._paused:
            wait = min(wait, ACCEPT_PAUSE_S)
        return wait

    def _resume_listeners(self) -> None:
        now = time.monotonic()
        for lsock, (at, kind) in list(self._paused.items()):
            if now >= at:
                del self._paused[lsock]
                try:
                    self._sel.register(lsock, selectors.EVENT_READ, kind)
                except (ValueError, OSError):  # closed by stop()
                    pass

    # ---- accepting
    def _accept(self, lsock: socket.socket, kind: str) -> None:
        for _ in range(64):  # drain a burst, but let handshakes in progress have their turn
            try:
                sock, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS, ...: survive, rest this listener a moment
                if self._stopping.is_set():  # stop() closed the listener
                    return
                self.counters["accept_failed"] += 1
                log.warning("%s: accept on the %s socket failed (%s); retrying in %.2fs", self.label, kind, e,
                            ACCEPT_PAUSE_S)
                try:
                    self._sel.unregister(lsock)
                    self._paused[lsock] = (time.monotonic() + ACCEPT_PAUSE_S, kind)
                except (KeyError, ValueError):
                    pass
                return
            self.counters["connections"] += 1
            source = addr[0] if kind == "tcp" else "unix socket"
            if self._per_source[source] >= self.cfg.max_handshakes_per_source:
                self._refuse(sock, source)
                continue
            if len(self._pending) >= self.cfg.max_handshakes:
                self._evict_oldest()
            self._start(sock, kind, source, addr)

    def _refuse(self, sock: socket.socket, source: str) -> None:
        sock.close()
        self.counters["handshakes_refused"] += 1
        self._log_once(source, f"closed a connection from {source} at once: {self._per_source[source]} from that "
                               f"address are in handshake (relay.max_handshakes_per_source="
                               f"{self.cfg.max_handshakes_per_source})")

    def _evict_oldest(self) -> None:
        """Make room for a new connection by closing the one longest in handshake. A genuine peer
        finishes its handshake within milliseconds, so the oldest is the likeliest to be hostile,
        and a newcomer is never turned away by connections that merely sit there."""
        p = next(iter(self._pending.values()))  # dicts keep insertion order: the oldest first
        self._drop(p)
        self.counters["handshakes_evicted"] += 1
        self._log_once(p.source, f"closed a connection from {p.source} still in handshake after "
                                 f"{self.cfg.handshake_timeout_s - (p.deadline - time.monotonic()):.2f}s to make "
                                 f"room: relay.max_handshakes={self.cfg.max_handshakes} are in handshake")

    def _log_once(self, source: str, message: str) -> None:
        if source not in self._refused_from and len(self._refused_from) < 4096:
            self._refused_from.add(source)
            log.warning("%s: %s; further ones from this address are only counted", self.label, message)

    def _start(self, sock: socket.socket, kind: str, source: str, addr) -> None:
        name = f"{kind} peer {addr[0]}:{addr[1]}" if kind == "tcp" else "unix peer"
        p = _Pending(sock, kind, source, name, time.monotonic() + self.cfg.handshake_timeout_s, self.key)
        try:
            sock.setblocking(False)
            if kind == "tcp":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.key is not None:  # 20 bytes into an empty send buffer: never partial
                challenge = auth.CHALLENGE_MAGIC + p.server_nonce
                if sock.send(challenge) != len(challenge):
                    raise OSError("short send of the auth challenge")
            self._sel.register(sock, selectors.EVENT_READ, p)
        except OSError:
            sock.close()
            return
        self._pending[sock] = p
        self._per_source[source] += 1

    # ---- handshakes
    def _step(self, p: _Pending) -> None:
        """Read what ``p`` has sent (never past its first header tag); hand it on once complete."""
        try:
            while True:
                try:
                    data = p.sock.recv(min(RECV_SLICE, p.need - len(p.buf)))
                except (BlockingIOError, InterruptedError):
                    return
                if not data:
                    raise HandshakeFailed(f"{p.peer.name}: closed during the handshake ({p.stage})",
                                          silent=not p.got_any)
                p.got_any = True
                p.buf += data
                if len(p.buf) == p.need and self._advance(p):
                    self._hand_over(p)
                    return
        except (OSError, WireError, ValueError) as e:  # ValueError: the first header's JSON
            self._fail(p, e if p.got_any or not isinstance(e, OSError) else HandshakeFailed(str(e), silent=True))
        except Exception as e:  # noqa: BLE001 - e.g. RecursionError from a deeply nested header: this peer's fault
            log.warning("%s: %s broke its handshake: %s: %s", self.label, p.peer.name, type(e).__name__, e)
            self._fail(p, e)

    def _advance(self, p: _Pending) -> bool:
        """Move to the next stage on a full buffer; True once the first header is in and checked."""
        got, p.buf = bytes(p.buf), bytearray()
        if p.stage == "nonce":
            if got[:4] == MAGIC:
                raise AuthError(f"{p.peer.name}: unauthenticated request (the peer has no run key)")
            p.peer.session = auth.Session(self.key, p.server_nonce, got, is_server=True)
            p.stage, p.need = "prefix", PREFIX_BYTES
            return False
        if p.stage == "prefix":
            p.raw_prefix = got
            hlen, _ = p.peer.check_prefix(got, "a request")
            if hlen == 0:
                raise WireError(f"{p.peer.name}: empty header in its first frame")
            p.stage, p.need = "header", hlen
            return False
        if p.stage == "header":
            p.raw_header = got
            if self.key is None:
                return self._parse(p, got, b"")
            p.stage, p.need = "tag", auth.TAG_BYTES
            return False
        return self._parse(p, p.raw_header, got)

    def _parse(self, p: _Pending, raw: bytes, tag: bytes) -> bool:
        p.first = p.peer.parse_head(p.raw_prefix, raw, tag, "a request")
        return True

    def _hand_over(self, p: _Pending) -> None:
        self._forget(p)
        p.peer.max_header = Peer.max_header
        try:
            p.sock.setblocking(True)
            p.sock.settimeout(self.cfg.io_timeout_s)
        except OSError as e:
            self._fail(p, e)
            return
        try:
            self.admit(p.peer, p.kind, p.source, p.first)
        except Exception as e:  # noqa: BLE001 - one connection's failure must not end the gate
            self.counters["admit_failed"] += 1
            log.warning("%s: could not serve %s: %s: %s", self.label, p.peer.name, type(e).__name__, e)
            p.peer.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for p in [p for p in self._pending.values() if now >= p.deadline]:
            self.counters["handshake_timeouts"] += 1
            self._fail(p, HandshakeFailed(
                f"{p.peer.name}: handshake not done within relay.handshake_timeout_s="
                f"{self.cfg.handshake_timeout_s}s (stuck at {p.stage}, {len(p.buf)}/{p.need} bytes)"))

    def _fail(self, p: _Pending, err: BaseException) -> None:
        self._drop(p)
        if not getattr(err, "silent", False):
            self.reject(p.source, err)

    def _forget(self, p: _Pending) -> None:
        if self._pending.pop(p.sock, None) is not None:
            self._per_source[p.source] -= 1
            if self._per_source[p.source] <= 0:
                del self._per_source[p.source]
            try:
                self._sel.unregister(p.sock)
            except (KeyError, ValueError):
                pass

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        p.peer.close()
