"""A relay's pull service: clients wait for a version, then read its bytes over TCP or map its
memfd over the unix socket (the pin lasts until they unmap)."""

from __future__ import annotations

import collections
import socket
from typing import Optional

from laminar_jax.relay.versions import HeldVersions
from laminar_jax.net.wire import Peer, error_frame


class PullService:
    """Answers pull, wait, read and map from ``held``. ``unix``: the abstract unix socket name
    clients map through (None: local pulls read over TCP)."""

    def __init__(self, held: HeldVersions, counters: collections.Counter, relay_id: str):
        self.held, self.counters, self.relay_id = held, counters, relay_id
        self.unix: Optional[str] = None

    def pull(self, peer: Peer, h: dict, plen: int) -> None:
        newer, wait_s = int(h.get("newer_than", -1)), float(h.get("wait_s", 0.0))
        held = self.held
        if not held.wait_for(lambda: held.newest_complete() > newer, wait_s):
            peer.send(error_frame("timeout", f"no version newer than {newer} within {wait_s:.3g}s "
                                             f"(holding {self.held.complete()})"))
            return
        with held.cond:
            buf = held.bufs[held.newest_complete()]
        self.counters["pulls"] += 1
        peer.send({"op": "pulled", "version": buf.version, "manifest": buf.manifest.to_dict(),
                   "chunk_bytes": buf.chunk_bytes, "unix": self.unix,
                   "relay_id": self.relay_id, "signature": buf.signature})

    def wait(self, peer: Peer, h: dict, plen: int) -> None:
        v, wait_s = int(h["version"]), float(h.get("wait_s", 0.0))
        held = self.held
        if held.wait_for(lambda: held.newest_complete() >= v, wait_s):
            peer.send({"op": "ready", "version": held.newest_complete()})
        else:
            peer.send(error_frame("timeout", f"version {v} not complete within {wait_s:.3g}s "
                                             f"(holding {self.held.complete()})"))

    def read(self, peer: Peer, h: dict, plen: int) -> None:
        v, off, n = int(h["version"]), int(h.get("offset", 0)), h.get("nbytes")
        buf = self.held.pinned_complete(v)
        if buf is None:
            peer.send(error_frame("gone", f"version {v} not held (holding {self.held.complete()})"))
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
            self.held.unpin(buf)

    def map(self, peer: Peer, h: dict, plen: int) -> Optional[bool]:
        """Pass the memfd; the pin lasts until the client unmaps (it closes this connection then)."""
        v = int(h["version"])
        buf = self.held.pinned_complete(v)
        if buf is None:
            peer.send(error_frame("gone", f"version {v} not held (holding {self.held.complete()})"))
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
            self.held.unpin(buf)
            if mapped:  # counted after the unpin: whoever sees the count may rely on the buffer being free
                self.counters["unmaps"] += 1
        return True
