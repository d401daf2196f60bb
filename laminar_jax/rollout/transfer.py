"""Moving a live sequence between processes over TCP, authenticated with the run key.

Same framing and handshake as the relay (net/wire.py, net/auth.py): with a key, the listener
sends a nonce challenge and every frame carries HMAC tags over header and payload, so a peer
without the key is dropped at its first message, before any payload byte is read.

    listener = SequenceListener(key=key, host="127.0.0.1").start()   # .address -> 'host:port'
    send_sequence(listener.address, seq, key=key, timeout_s=30)       # -> the receiver's slot reply
    seq, reply_fn = listener.accept(timeout_s=30)                     # receiver side

Frames: ``move {uid, nbytes}`` + SequenceState.to_bytes() -> ``moved {...}`` (the receiver's
answer, e.g. the slot it took) or ``error {kind, message}``. No pickle crosses the connection.
Within one Ray cluster, repack moves go through Ray's own RPC instead (see docs/DEPLOY.md).
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable, Optional

from laminar_jax.net import auth
from laminar_jax.net.wire import (AuthError, Peer, WireError, client_handshake, error_frame, parse_address,
                                    server_handshake)
from laminar_jax.rollout.records import SequenceState

MAX_SEQUENCE_BYTES = 1 << 30  # a live sequence is its tokens and sampler state, never this large
PRE_AUTH_MAX_HEADER = 1 << 16
log = logging.getLogger(__name__)


def send_sequence(address: str, seq: SequenceState, key: Optional[bytes], timeout_s: float) -> dict:
    """Send ``seq`` to the listener at 'host:port' and return its ``moved`` answer (a dict).
    Raises RemoteError when the receiver refused it, AuthError / WireError / TimeoutError otherwise."""
    auth.check_key(key, "send_sequence key")
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise WireError(f"sequence receiver {address}: cannot connect: {e}") from None
    sock.settimeout(timeout_s)
    try:
        peer = client_handshake(sock, f"sequence receiver {address}", key, timeout_s)
        payload = seq.to_bytes()
        peer.send({"op": "move", "uid": seq.uid, "nbytes": len(payload)}, [payload])
        reply, _ = peer.expect("moved", f"the receiver's answer for {seq.uid!r}")
        return reply
    finally:
        sock.close()


class SequenceListener:
    """Accepts moved sequences one connection at a time (the caller imports each into its server)."""

    def __init__(self, key: Optional[bytes], host: str = "127.0.0.1", port: int = 0):
        self.key = auth.check_key(key, "SequenceListener key")
        self.host, self.port = host, port
        self.rejected = 0  # connections dropped for failing authentication
        self._sock: Optional[socket.socket] = None

    def start(self) -> "SequenceListener":
        self._sock = socket.create_server((self.host, self.port), backlog=8)
        return self

    @property
    def address(self) -> str:
        if self._sock is None:
            raise RuntimeError("SequenceListener.address: call start() first")
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> "SequenceListener":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def accept(self, timeout_s: float) -> tuple[SequenceState, Callable[[dict], None]]:
        """Wait (at most ``timeout_s``) for one authenticated sequence. Returns it and ``answer(dict)``,
        which sends the ``moved`` reply and closes the connection. A peer that fails authentication
        is dropped, counted in ``rejected``, and the wait goes on."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"sequence listener {self.address}: no authenticated sequence within {timeout_s}s "
                                   f"({self.rejected} connections refused)")
            self._sock.settimeout(left)
            try:
                conn, addr = self._sock.accept()
            except socket.timeout:
                continue
            conn.settimeout(max(0.1, left))
            got = self._receive(Peer(conn, f"sequence sender {addr[0]}:{addr[1]}"))
            if got is not None:
                return got

    def _receive(self, peer: Peer) -> Optional[tuple[SequenceState, Callable[[dict], None]]]:
        try:
            if self.key is not None:
                peer.max_header = PRE_AUTH_MAX_HEADER
                server_handshake(peer, self.key)
            header, plen = peer.recv("a moved sequence")
            if header["op"] != "move" or not 0 < plen <= MAX_SEQUENCE_BYTES:
                peer.send(error_frame("bad_request", f"expected one 'move' frame of 1..{MAX_SEQUENCE_BYTES} bytes, "
                                                     f"got {header['op']!r} with {plen}"))
                peer.close()
                return None
            seq = SequenceState.from_bytes(peer.recv_payload(plen, f"sequence {header.get('uid')!r}"))
        except AuthError as e:
            self.rejected += 1
            if self.rejected == 1:  # logged once: a scanner must not flood the log
                log.warning("sequence listener %s: dropped %s: %s (further ones are only counted)",
                            self.address, peer.name, e)
            peer.close()
            return None
        except (WireError, OSError, ValueError):
            peer.close()
            return None

        def answer(reply: dict) -> None:
            try:
                peer.send({**reply, "op": "moved"})
            finally:
                peer.close()

        return seq, answer
