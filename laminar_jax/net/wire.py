"""Framing for relay connections: length-prefixed JSON headers followed by raw bytes.

Frame = magic ``b"LMR1"`` | u32 header length | u64 payload length | JSON header | payload.
Every header is an object with an ``"op"`` string. No pickle ever crosses a connection.
Reads and writes are bounded by the socket timeout; errors name the peer and what was awaited.

With a run key (see auth.py) a connection starts with a nonce exchange and every frame is
magic ``b"LMA1"`` | lengths | header | header tag | payload | payload tag: the header tag is
checked before any payload byte is read, the payload tag once the last payload byte is in.
Ops in ``APP_AUTHENTICATED`` (chunks, whole-version reads) may be sent with ``"pm": 0`` in their header and no payload
tag: their bytes carry the learner's own per-chunk tag (auth.chunk_tag), checked by the receiver,
so a relay forwards them without hashing them again.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any, Optional, Sequence

from laminar_jax.net import auth

MAGIC = b"LMR1"
MAGIC_AUTH = b"LMA1"
_PREFIX = struct.Struct("<4sIQ")
PREFIX_BYTES = _PREFIX.size
MAX_HEADER = 64 << 20
APP_AUTHENTICATED = frozenset({"chunk", "data"})
SLICE = 1 << 20  # bytes per send call, so rate limiting stays smooth


class WireError(ConnectionError):
    """The peer broke the protocol or the connection; the message names the peer and the wait."""


class PeerClosed(WireError):
    """The peer closed the connection cleanly before the first byte of a frame."""


class AuthError(WireError):
    """A peer failed authentication: no key, a wrong key, a tampered or replayed frame."""


class RemoteError(RuntimeError):
    """The peer answered with an error frame (``op == "error"``)."""

    def __init__(self, peer: str, kind: str, message: str):
        super().__init__(f"{peer}: {kind}: {message}")
        self.kind = kind


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"relay address {address!r}: must be 'host:port'")
    return host, int(port)


def _seg_len(seg: Any) -> int:
    return memoryview(seg).nbytes


class IdleTimeout(TimeoutError):
    """A read timed out before its first byte arrived (between frames: the peer went quiet)."""


class Peer:
    """A socket plus the name used in error messages."""

    max_header = MAX_HEADER

    def __init__(self, sock: socket.socket, name: str, session: Optional[auth.Session] = None):
        self.sock, self.name, self.session = sock, name, session
        self._rx_mac: Any = None  # running MAC of the payload being read (authenticated peers)
        self._rx_left = 0  # payload bytes of the current frame not read yet

    def settimeout(self, seconds: Optional[float]) -> None:
        self.sock.settimeout(seconds)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, header: dict, segments: Sequence[Any] = (), limiter: Any = None,
             payload_mac: bool = True) -> None:
        """Send one frame; ``segments`` are buffers whose concatenation is the payload.
        ``payload_mac=False`` (ops in APP_AUTHENTICATED only) leaves the payload to the
        application's own tag."""
        if not payload_mac and self.session is not None:
            if header.get("op") not in APP_AUTHENTICATED:
                raise ValueError(f"op {header.get('op')!r} must authenticate its payload on the wire")
            header = dict(header, pm=0)
        hdr = json.dumps(header, separators=(",", ":")).encode()
        total = sum(_seg_len(s) for s in segments)
        mac = None
        try:
            if self.session is None:
                self.sock.sendall(_PREFIX.pack(MAGIC, len(hdr), total) + hdr)
            else:
                prefix = _PREFIX.pack(MAGIC_AUTH, len(hdr), total)
                mac = self.session.send_mac(prefix, hdr)
                head = prefix + hdr + mac.digest()
                if header.get("pm") == 0:
                    mac = None
                    self.sock.sendall(head)
                else:
                    self.sock.sendall(head + auth.payload_tag(mac) if total == 0 else head)
            for seg in segments:
                mv = memoryview(seg).cast("B")
                for lo in range(0, mv.nbytes, SLICE):
                    piece = mv[lo:lo + SLICE]
                    if limiter is not None:
                        limiter.acquire(piece.nbytes)
                    if mac is not None:
                        mac.update(piece)
                    self.sock.sendall(piece)
            if mac is not None and total:
                self.sock.sendall(auth.payload_tag(mac))
        except socket.timeout:
            raise TimeoutError(f"{self.name}: timed out sending {header.get('op')!r} "
                               f"({total} payload bytes)") from None
        except OSError as e:
            raise WireError(f"{self.name}: connection lost sending {header.get('op')!r}: {e}") from None

    def _recv_exact(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        self._read_into(memoryview(buf), what)
        return bytes(buf)

    def recv_into(self, mv: memoryview, what: str) -> None:
        """Read the next ``mv.nbytes`` payload bytes of the current frame into ``mv``."""
        self._read_into(mv, what)
        if self._rx_mac is not None:
            if mv.nbytes > self._rx_left:
                raise WireError(f"{self.name}: read of {mv.nbytes} bytes past the payload of {what}")
            self._rx_mac.update(mv)
            self._rx_left -= mv.nbytes
            if self._rx_left == 0:
                self._check_payload_tag(what)

    def _check_payload_tag(self, what: str) -> None:
        tag = self._recv_exact(auth.TAG_BYTES, what)
        mac, self._rx_mac = self._rx_mac, None
        if not auth.tags_equal(tag, auth.payload_tag(mac)):
            raise AuthError(f"{self.name}: payload of {what} failed authentication (tampered or corrupted)")

    def _read_into(self, mv: memoryview, what: str) -> None:
        pos, n = 0, mv.nbytes
        try:
            while pos < n:
                got = self.sock.recv_into(mv[pos:], n - pos)
                if got == 0:
                    if pos == 0:
                        raise PeerClosed(f"{self.name}: connection closed while waiting for {what}")
                    raise WireError(f"{self.name}: connection closed while waiting for {what} "
                                    f"({pos}/{n} bytes)")
                pos += got
        except socket.timeout:
            cls = IdleTimeout if pos == 0 else TimeoutError
            raise cls(f"{self.name}: timed out waiting for {what} ({pos}/{n} bytes)") from None
        except WireError:
            raise
        except OSError as e:
            raise WireError(f"{self.name}: connection lost waiting for {what}: {e}") from None

    def recv(self, what: str) -> tuple[dict, int]:
        """Receive a frame's header; returns (header, payload length). Payload is left unread."""
        if self._rx_left:
            raise WireError(f"{self.name}: {self._rx_left} payload bytes of the previous frame left unread")
        raw_prefix = self._recv_exact(_PREFIX.size, what)
        hlen, _ = self.check_prefix(raw_prefix, what)
        raw = self._recv_exact(hlen, what)
        tag = self._recv_exact(auth.TAG_BYTES, what) if self.session is not None else b""
        return self.parse_head(raw_prefix, raw, tag, what)

    def check_prefix(self, raw_prefix: bytes, what: str) -> tuple[int, int]:
        """(header length, payload length) of a frame prefix; raises on a bad magic or header size."""
        magic, hlen, plen = _PREFIX.unpack(raw_prefix)
        want = MAGIC if self.session is None else MAGIC_AUTH
        if magic != want or hlen > self.max_header:
            if magic == auth.CHALLENGE_MAGIC:
                raise AuthError(f"{self.name}: the peer requires the run key (it sent an auth challenge) and "
                                f"this side has none")
            if magic == MAGIC and self.session is not None:
                raise AuthError(f"{self.name}: unauthenticated frame (the peer has no run key) waiting for {what}")
            raise WireError(f"{self.name}: bad frame (magic={magic!r}, header={hlen} bytes) waiting for {what}")
        return hlen, plen

    def parse_head(self, raw_prefix: bytes, raw: bytes, tag: bytes, what: str) -> tuple[dict, int]:
        """The (header, payload length) of a frame whose prefix, header and header tag (empty
        without a session) were read; checks the tag before the JSON is parsed. The payload is
        left to recv_into (its tag is checked once its last byte is in)."""
        _, plen = self.check_prefix(raw_prefix, what)
        if self.session is not None:
            mac = self.session.recv_mac(raw_prefix, raw)
            if not auth.tags_equal(tag, mac.digest()):
                raise AuthError(f"{self.name}: frame failed authentication (wrong key, tampered or replayed) "
                                f"waiting for {what}")
        try:
            header = json.loads(raw)
        except ValueError as e:
            raise WireError(f"{self.name}: header of {what} is not JSON: {e}") from None
        if not isinstance(header, dict) or not isinstance(header.get("op"), str):
            raise WireError(f"{self.name}: header of {what} lacks an 'op' string: {header!r:.200}")
        if self.session is not None:
            if header.get("pm") == 0:  # the payload carries the application's own tag
                if header["op"] not in APP_AUTHENTICATED:
                    raise AuthError(f"{self.name}: op {header['op']!r} sent without a payload tag")
            else:
                self._rx_mac, self._rx_left = mac, plen
                if plen == 0:
                    self._check_payload_tag(what)
        return header, plen

    def recv_payload(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf), what)
        return bytes(buf)

    def discard(self, n: int, what: str) -> None:
        buf = memoryview(bytearray(min(n, SLICE)))
        while n > 0:
            k = min(n, buf.nbytes)
            self.recv_into(buf[:k], what)
            n -= k

    def expect(self, op: str, what: str) -> tuple[dict, int]:
        """recv() that raises RemoteError on an error frame and WireError on another op."""
        header, plen = self.recv(what)
        if header["op"] == "error":
            raise RemoteError(self.name, str(header.get("kind", "error")), str(header.get("message", "")))
        if header["op"] != op:
            raise WireError(f"{self.name}: expected {op!r} for {what}, got {header['op']!r}")
        return header, plen

    def request(self, header: dict, reply_op: str, what: str) -> tuple[dict, int]:
        self.send(header)
        return self.expect(reply_op, what)


def client_handshake(sock: socket.socket, name: str, key: Optional[bytes], timeout: float) -> Peer:
    """The client side of the nonce exchange (see auth.py); a plain Peer when ``key`` is None."""
    peer = Peer(sock, name)
    if key is None:
        return peer
    old = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        challenge = peer._recv_exact(len(auth.CHALLENGE_MAGIC) + auth.NONCE_BYTES, "the auth challenge")
    except TimeoutError:
        raise AuthError(f"{name}: no auth challenge within {timeout}s (does the relay run without the run key?)") \
            from None
    if challenge[:4] != auth.CHALLENGE_MAGIC:
        raise AuthError(f"{name}: expected an auth challenge, got {challenge[:4]!r} (the relay runs without a key)")
    client_nonce = auth.new_nonce()
    try:
        sock.sendall(client_nonce)
    except OSError as e:
        raise WireError(f"{name}: connection lost sending the auth nonce: {e}") from None
    sock.settimeout(old)
    peer.session = auth.Session(key, challenge[4:], client_nonce, is_server=False)
    return peer


def server_handshake(peer: Peer, key: bytes) -> None:
    """The server side: send a fresh nonce, read the client's. A keyless client's first frame
    shows up here as the frame magic instead of a nonce."""
    server_nonce = auth.new_nonce()
    try:
        peer.sock.sendall(auth.CHALLENGE_MAGIC + server_nonce)
    except OSError as e:
        raise WireError(f"{peer.name}: connection lost sending the auth challenge: {e}") from None
    client_nonce = peer._recv_exact(auth.NONCE_BYTES, "the client's auth nonce")
    if client_nonce[:4] == MAGIC:
        raise AuthError(f"{peer.name}: unauthenticated request (the peer has no run key)")
    peer.session = auth.Session(key, server_nonce, client_nonce, is_server=True)


def connect(address: str, connect_timeout: float, io_timeout: float, key: Optional[bytes] = None) -> Peer:
    """TCP connection to 'host:port' with Nagle off; with ``key``, authenticated. Errors name the address."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout)
    except socket.timeout:
        raise TimeoutError(f"relay {address}: connect timed out after {connect_timeout}s") from None
    except OSError as e:
        raise WireError(f"relay {address}: cannot connect: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(io_timeout)
    try:
        return client_handshake(sock, f"relay {address}", key, connect_timeout)
    except BaseException:
        sock.close()
        raise


def error_frame(kind: str, message: str) -> dict:
    return {"op": "error", "kind": kind, "message": message}
