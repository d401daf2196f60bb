"""A relay's push receiver: takes a version chunk by chunk from an upstream (the publisher or the
previous relay; push.py is the sub-protocol) into a held buffer, verifying every chunk.

With the run's keys, pushes must carry the learner's Ed25519 signature over the version and
manifest digest, and each chunk its signed SHA-256. A push is refused when its announced size,
added to the bytes announced but not yet verified by all unfinished pushes, exceeds
``max_unverified_bytes``; an unfinished version is dropped (its memory freed) when its sender
disconnects or stays silent past ``io_timeout_s``. A version published again (a restarted learner
publishes its last versions once more) keeps the held bytes when they are the same and is
replaced when they differ.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Optional

from laminar_jax.net import auth
from laminar_jax.relay.config import RelaySection
from laminar_jax.relay.manifest import Manifest, chunk_span, crc32_of
from laminar_jax.relay.store_check import StoreCheck
from laminar_jax.relay.versions import HeldVersions, VersionBuf
from laminar_jax.net.wire import AuthError, Peer, WireError, error_frame

log = logging.getLogger("laminar_jax.relay.server")


class PushReceiver:
    """Serves ``push`` requests into ``held``. ``key``/``verifier``: the link key and the learner's
    public key (None: no signatures). ``on_replaced(v)``: called under the lock when version ``v``
    is replaced by other bytes, so successors get the new ones."""

    def __init__(self, config: RelaySection, held: HeldVersions, check: StoreCheck, key: Optional[bytes],
                 verifier: Any, on_replaced: Callable[[int], None], name: str):
        self.cfg, self.held, self.check = config, held, check
        self._key, self._verifier, self._on_replaced, self.name = key, verifier, on_replaced, name

    def push(self, peer: Peer, h: dict, plen: int) -> None:
        held, counters = self.held, self.held.counters
        v = int(h["version"])
        m = Manifest.from_dict(h["manifest"], f"push of version {v} from {peer.name}")
        chunk_bytes = int(h["chunk_bytes"])
        refusal = self._refusal(v, m, chunk_bytes, h.get("signature"))
        if refusal is not None:
            peer.send(error_frame(*refusal))
            return
        if not self._settle_republish(peer, v, m, chunk_bytes, h):
            return
        with held.cond:
            buf = held.bufs.get(v)
            complete = sorted((x for x, b in held.bufs.items() if b.complete), reverse=True)
            obsolete = buf is None and len(complete) >= self.cfg.keep_in_memory and v < complete[-1]
            if buf is None and not obsolete:
                pending = sum(b.unverified for b in held.bufs.values())
                if pending + m.total_bytes > self.cfg.unverified_cap:
                    counters["pushes_refused"] += 1
                    peer.send(error_frame("busy", f"push of version {v}: {m.total_bytes} bytes announced while "
                                                  f"{pending} are not yet verified; relay.max_unverified_bytes="
                                                  f"{self.cfg.unverified_cap}"))
                    return
                buf = held.bufs[v] = held.new_buf(m, chunk_bytes)
                buf.signature, buf.publish = h.get("signature"), h.get("publish")
                if self.check.active:
                    buf.cleared = False
                    buf.pins += 1  # the checker's pin, released when it ends
                    self.check.start(buf)
                held.cond.notify_all()
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
            with held.cond:
                buf.receivers -= 1
                if not buf.received and buf.receivers == 0 and held.drop_locked(buf, "partial_dropped"):
                    held.cond.notify_all()  # an unfinished version whose last sender left
            held.unpin(buf)

    # ---- a version published again
    def _settle_republish(self, peer: Peer, v: int, m: Manifest, chunk_bytes: int, h: dict) -> bool:
        """When this relay holds all of ``v`` from another publish: the same bytes are kept (the
        sender is told it is complete; False) and other bytes are dropped, so that this push
        replaces them (True). True, with nothing done, in every other case."""
        held = self.held
        with held.cond:
            buf = held.bufs.get(v)
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
            held.unpin(buf)
        if differs is None:
            held.counters["republished_same"] += 1
            peer.send({"op": "have", "complete": True, "obsolete": False, "chunks": []})
            return False
        with held.cond:
            if held.drop_locked(buf, "republished_replaced"):
                self._on_replaced(v)  # successors hold the old bytes
                held.recycle_locked(buf)
                held.cond.notify_all()
        log.warning("relay %s: version %d published again with other bytes (%s differs); the new publish "
                    "replaces the one held", self.name, v, differs)
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

    def _refusal(self, v: int, m: Manifest, chunk_bytes: int, signature: object) -> Optional[tuple[str, str]]:
        """(kind, message) of why a push is refused, or None. Pure checks on the announcement."""
        if v != m.version:
            return "bad_request", f"push of version {v} carries the manifest of version {m.version}"
        if chunk_bytes < 1:
            return "bad_request", f"push of version {v}: chunk_bytes={chunk_bytes}: must be >= 1"
        if m.total_bytes > self.cfg.unverified_cap:
            self.held.counters["pushes_refused"] += 1
            return "too_large", (f"push of version {v}: {m.total_bytes} bytes announced, above "
                                 f"relay.max_unverified_bytes={self.cfg.unverified_cap}")
        if self._key is not None and not auth.verify_version(self._verifier, v, m.digest(), signature):
            self.held.counters["pushes_refused"] += 1
            return "forged", f"push of version {v}: no valid learner signature over the version and manifest"
        return None

    # ---- chunks
    def _receive_chunks(self, peer: Peer, buf: VersionBuf) -> None:
        while True:
            h, plen = peer.recv(f"chunks of version {buf.version}")
            op = h["op"]
            if op == "keepalive":
                continue
            if op == "abort":
                return
            if op == "end":
                with self.held.cond:
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
        if not _bytes_match(mv, vouch):
            self.held.counters["bad_chunks"] += 1
            return  # left missing: the sender resends it after 'end'
        with self.held.cond:
            if not buf.have[idx]:
                buf.have[idx], buf.vouch[idx] = True, vouch
                buf.nhave += 1
                buf.bytes_have += stop - start
                buf.order.append(idx)
                self.held.counters["chunks_in"] += 1
                self.held.note_complete_locked(buf)
            self.held.cond.notify_all()


def _bytes_match(mv: memoryview, vouch: dict) -> bool:
    if "digest" in vouch:
        return hashlib.sha256(mv).hexdigest() == vouch["digest"]
    return crc32_of(mv) == vouch["crc"]
