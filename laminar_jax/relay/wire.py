"""Framing for relay connections: length-prefixed JSON headers followed by raw bytes.

Frame = magic ``b"LMR1"`` | u32 header length | u64 payload length | JSON header | payload.
Every header is an object with an ``"op"`` string. No pickle ever crosses a connection.
Reads and writes are bounded by the socket timeout; errors name the peer and what was awaited.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any, Optional, Sequence

MAGIC = b"LMR1"
_PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 64 << 20
SLICE = 1 << 20  # bytes per send call, so rate limiting stays smooth


class WireError(ConnectionError):
    """The peer broke the protocol or the connection; the message names the peer and the wait."""


class PeerClosed(WireError):
    """The peer closed the connection cleanly before the first byte of a frame."""


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


class Peer:
    """A socket plus the name used in error messages."""

    def __init__(self, sock: socket.socket, name: str):
        self.sock, self.name = sock, name

    def settimeout(self, seconds: Optional[float]) -> None:
        self.sock.settimeout(seconds)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, header: dict, segments: Sequence[Any] = (), limiter: Any = None) -> None:
        """Send one frame; ``segments`` are buffers whose concatenation is the payload."""
        hdr = json.dumps(header, separators=(",", ":")).encode()
        total = sum(_seg_len(s) for s in segments)
        try:
            self.sock.sendall(_PREFIX.pack(MAGIC, len(hdr), total) + hdr)
            for seg in segments:
                mv = memoryview(seg).cast("B")
                for lo in range(0, mv.nbytes, SLICE):
                    piece = mv[lo:lo + SLICE]
                    if limiter is not None:
                        limiter.acquire(piece.nbytes)
                    self.sock.sendall(piece)
        except socket.timeout:
            raise TimeoutError(f"{self.name}: timed out sending {header.get('op')!r} "
                               f"({total} payload bytes)") from None
        except OSError as e:
            raise WireError(f"{self.name}: connection lost sending {header.get('op')!r}: {e}") from None

    def _recv_exact(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf), what)
        return bytes(buf)

    def recv_into(self, mv: memoryview, what: str) -> None:
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
            raise TimeoutError(f"{self.name}: timed out waiting for {what} ({pos}/{n} bytes)") from None
        except WireError:
            raise
        except OSError as e:
            raise WireError(f"{self.name}: connection lost waiting for {what}: {e}") from None

    def recv(self, what: str) -> tuple[dict, int]:
        """Receive a frame's header; returns (header, payload length). Payload is left unread."""
        magic, hlen, plen = _PREFIX.unpack(self._recv_exact(_PREFIX.size, what))
        if magic != MAGIC or hlen > MAX_HEADER:
            raise WireError(f"{self.name}: bad frame (magic={magic!r}, header={hlen} bytes) waiting for {what}")
        try:
            header = json.loads(self._recv_exact(hlen, what))
        except ValueError as e:
            raise WireError(f"{self.name}: header of {what} is not JSON: {e}") from None
        if not isinstance(header, dict) or not isinstance(header.get("op"), str):
            raise WireError(f"{self.name}: header of {what} lacks an 'op' string: {header!r:.200}")
        return header, plen

    def recv_payload(self, n: int, what: str) -> bytes:
        return self._recv_exact(n, what)

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


def connect(address: str, connect_timeout: float, io_timeout: float) -> Peer:
    """TCP connection to 'host:port' with Nagle off; errors name the address."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout)
    except socket.timeout:
        raise TimeoutError(f"relay {address}: connect timed out after {connect_timeout}s") from None
    except OSError as e:
        raise WireError(f"relay {address}: cannot connect: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(io_timeout)
    return Peer(sock, f"relay {address}")


def error_frame(kind: str, message: str) -> dict:
    return {"op": "error", "kind": kind, "message": message}
