"""Sending one version over a relay link, chunk by chunk, and keeping a link to the nearest live relay.

Push protocol (sender -> receiver, one TCP connection, several versions one after another):

    push {version, manifest, chunk_bytes, publish}
                                            -> have {chunks, complete, obsolete[, compare]}
    vouches {version, chunks}               -> have {chunks, complete, obsolete}
      (only after a have with compare: the receiver holds this version from another publish, i.e.
      the learner published it again after a restart; the sender sends every chunk's vouch, as in
      its chunk headers, and the receiver answers complete when they equal what it holds, else
      drops what it holds and takes this publish's chunks)
    chunk {version, index, crc} + bytes     (no reply; bytes land straight in the receiver's buffer)
      or, with the run's keys: chunk {version, index, digest, tag}: the SHA-256 of the bytes and
      the learner's Ed25519 signature on it (auth.chunk_tag); relays store both and forward them unchanged
    keepalive                               (no reply; sent while waiting for upstream chunks)
    end {version}                           -> missing {chunks}   (checksum failures: resent, repeat)
    abort {version}                         (no reply; the sender gave up on this version)

Used by the publisher (to the master relay) and by every relay (to its successor).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from laminar_jax.net import auth
from laminar_jax.relay.manifest import Manifest, chunk_segments, chunk_span, crc32_of, first_array, num_chunks
from laminar_jax.net.wire import Peer, RemoteError, WireError, connect


class NoRelayReachable(ConnectionError):
    """No relay in the list accepted a connection; the message names each one's error."""


class UpstreamStalled(TimeoutError):
    """The sender itself waited too long for chunks from its own upstream."""


class ChunkSource(Protocol):
    manifest: Manifest
    chunk_bytes: int
    signature: Optional[str]  # the learner's signature over version + manifest digest (None: no key)
    publish: str  # this publish's id: a version published again (a restarted learner) has another

    def ready_since(self, pos: int, timeout: float) -> list[int]:
        """Chunks that became sendable after the first ``pos`` of them, in the order they did
        (waiting up to ``timeout`` for one); every chunk appears once in this log."""
        ...

    def chunk(self, index: int) -> tuple[list[Any], dict]:
        """(payload segments, header fields that vouch for them: {"crc"} or {"digest", "tag"})."""
        ...

    def superseded(self) -> bool: ...


class ArraysSource:
    """Chunks of a version held as separate host arrays (the publisher's side); always ready."""

    def __init__(self, manifest: Manifest, arrays: dict[str, np.ndarray], chunk_bytes: int,
                 signer: Optional[Any] = None):
        """``signer``: the learner's Ed25519PrivateKey (RunKeys.signer); None sends CRCs, unsigned."""
        self.manifest, self.chunk_bytes = manifest, chunk_bytes
        self.signer = signer
        self.signature = None if signer is None else auth.sign_version(signer, manifest.version, manifest.digest())
        self.publish = secrets.token_hex(8)
        self._pairs = [(e, arrays[e.name]) for e in manifest.entries]
        self._offsets = [e.offset for e in manifest.entries]
        self.n = num_chunks(manifest.total_bytes, chunk_bytes)

    def ready_since(self, pos: int, timeout: float) -> list[int]:
        return list(range(pos, self.n))

    def chunk(self, index: int) -> tuple[list[Any], dict]:
        start, stop = chunk_span(index, self.manifest.total_bytes, self.chunk_bytes)
        segs = chunk_segments(self._pairs, start, stop, first_array(self._offsets, start))
        if self.signer is not None:  # one SHA-256 per chunk, here only; relays forward the tag as is
            h = hashlib.sha256()
            for s in segs:
                h.update(memoryview(s).cast("B"))
            digest = h.hexdigest()
            return segs, {"digest": digest, "tag": auth.chunk_tag(self.signer, self.signature, index, digest)}
        crc = 0
        for s in segs:
            crc = crc32_of(s, crc)
        return segs, {"crc": crc}

    def superseded(self) -> bool:
        return False


class _Superseded(Exception):
    """The source gave the version up (evicted, or a newer one arrived) before it was all ready."""


def _ready_chunks(peer: Peer, src: ChunkSource, v: int, n: int, heartbeat_s: float, io_timeout_s: float):
    """Each chunk index once, as the source makes it ready; keepalives go out while it waits.
    Raises _Superseded (after telling the receiver) or UpstreamStalled."""
    pos, seen = 0, set()  # pos: how much of the source's ready log has been walked
    last_progress = time.monotonic()
    while len(seen) < n:
        ready = src.ready_since(pos, heartbeat_s)
        if not ready:
            if src.superseded():
                peer.send({"op": "abort", "version": v})
                raise _Superseded()
            if time.monotonic() - last_progress > io_timeout_s:
                raise UpstreamStalled(f"waited {io_timeout_s}s for chunks {sorted(set(range(n)) - seen)[:8]}"
                                      f" of version {v} from upstream")
            peer.send({"op": "keepalive"})
            continue
        pos += len(ready)
        seen.update(ready)
        yield from ready
        last_progress = time.monotonic()


def push_version(peer: Peer, src: ChunkSource, limiter: Any, heartbeat_s: float, io_timeout_s: float,
                 max_retries: int) -> str:
    """Deliver one version over ``peer``; returns 'delivered', 'skipped' or 'superseded'.

    Chunks go out in the order the source makes them ready (a relay forwards each chunk as soon as
    it has verified it), skipping those the receiver already holds.
    """
    m, v = src.manifest, src.manifest.version
    n = num_chunks(m.total_bytes, src.chunk_bytes)
    hello = {"op": "push", "version": v, "manifest": m.to_dict(), "chunk_bytes": src.chunk_bytes,
             "publish": src.publish}
    if src.signature is not None:
        hello["signature"] = src.signature
    try:
        reply, _ = peer.request(hello, "have", f"push handshake of version {v}")
        if reply.get("compare"):  # every vouch is known only once every chunk is ready
            for _ in _ready_chunks(peer, src, v, n, heartbeat_s, io_timeout_s):
                pass
            reply, _ = peer.request({"op": "vouches", "version": v, "chunks": [src.chunk(i)[1] for i in range(n)]},
                                    "have", f"comparison of version {v} with the receiver's earlier publish of it")
        if reply.get("complete") or reply.get("obsolete"):
            return "skipped"
        sent = set(int(i) for i in reply.get("chunks", ()))
        chunks = _ready_chunks(peer, src, v, n, heartbeat_s, io_timeout_s) if len(sent) < n else ()
        for idx in chunks:
            if idx not in sent:
                _send_chunk(peer, src, v, idx, limiter)
                sent.add(idx)
            if len(sent) == n:  # not a wait for chunks the receiver already holds
                break
    except _Superseded:
        return "superseded"
    for _ in range(max_retries + 1):
        reply, _ = peer.request({"op": "end", "version": v}, "missing", f"end-of-push ack of version {v}")
        missing = [int(i) for i in reply.get("chunks", ())]
        if reply.get("obsolete") or not missing:
            return "delivered"
        for idx in missing:
            _send_chunk(peer, src, v, idx, limiter)
    raise WireError(f"{peer.name}: chunks {missing[:8]} of version {v} still fail their checksum "
                    f"after {max_retries} resends")


def _send_chunk(peer: Peer, src: ChunkSource, version: int, idx: int, limiter: Any) -> None:
    segs, vouch = src.chunk(idx)
    peer.send({"op": "chunk", "version": version, "index": idx, **vouch}, segs, limiter,
              payload_mac="tag" not in vouch)


class Downstream:
    """A link to the nearest live relay of an ordered list; dead ones are skipped for dead_retry_s."""

    def __init__(self, cfg: Any, addresses: Sequence[str], limiter: Any, name: str, key: Optional[bytes] = None):
        self.cfg, self.limiter, self.name, self.key = cfg, limiter, name, key
        self.addresses: tuple[str, ...] = tuple(addresses)
        self._dead_until: dict[str, float] = {}
        self._link: Optional[tuple[str, Peer]] = None
        self.switches = 0  # times the link moved to another relay
        self.errors: list[str] = []  # recent link errors, newest last

    def set_addresses(self, addresses: Sequence[str]) -> None:
        self.addresses = tuple(addresses)
        if self._link and self._link[0] not in self.addresses:
            self.close()

    def close(self) -> None:
        if self._link:
            self._link[1].close()
            self._link = None

    def mark_dead(self, addr: str, err: BaseException) -> None:
        self._dead_until[addr] = time.monotonic() + self.cfg.dead_retry_s
        self.errors = (self.errors + [f"{addr}: {err}"])[-20:]
        if self._link and self._link[0] == addr:
            self.close()

    def link(self) -> Optional[tuple[str, Peer]]:
        """The nearest live relay, reconnecting (or moving back to a revived nearer one) as needed."""
        now = time.monotonic()
        for addr in self.addresses:
            if self._link and self._link[0] == addr:
                return self._link
            if self._dead_until.get(addr, 0.0) > now:
                continue
            try:
                peer = connect(addr, self.cfg.connect_timeout_s, self.cfg.io_timeout_s, self.key)
                peer.request({"op": "ping"}, "pong", "ping after connect")
            except (OSError, WireError, RemoteError) as e:
                self.mark_dead(addr, e)
                continue
            if self._link:
                self.switches += 1
            self.close()
            self._link = (addr, peer)
            return self._link
        return None

    def ping(self) -> bool:
        """Keep the idle link alive and notice a dead successor; False if it failed."""
        if not self._link:
            return False
        addr, peer = self._link
        try:
            peer.settimeout(max(1.0, 4 * self.cfg.heartbeat_s))
            peer.request({"op": "ping"}, "pong", "heartbeat")
            peer.settimeout(self.cfg.io_timeout_s)
            return True
        except (OSError, WireError, RemoteError) as e:
            self.mark_dead(addr, e)
            return False

    def deliver(self, src: ChunkSource) -> tuple[str, str]:
        """Push ``src`` to the nearest live relay, failing over along the list; (address, outcome)."""
        v = src.manifest.version
        stale_ok = True  # one reconnect for a kept-open link the relay closed while idle
        while True:
            reused = self._link is not None
            lk = self.link()
            if lk is None:
                raise NoRelayReachable(f"{self.name}: no relay reachable for version {v} among "
                                       f"{list(self.addresses)}; recent errors: {self.errors[-4:]}")
            addr, peer = lk
            try:
                return addr, push_version(peer, src, self.limiter, self.cfg.heartbeat_s,
                                          self.cfg.io_timeout_s, self.cfg.max_chunk_retries)
            except UpstreamStalled:
                self.close()  # the link is mid-version; start clean next time
                raise
            except (OSError, WireError, RemoteError) as e:
                if reused and stale_ok and not isinstance(e, RemoteError):  # a transport error, not the relay's answer
                    stale_ok = False
                    self.errors = (self.errors + [f"{addr}: {e} (idle link; reconnecting)"])[-20:]
                    self.close()
                    continue
                self.mark_dead(addr, e)
