"""The per-run relay key and per-connection message authentication.

A run has one secret (``run_key(run_dir)``): 32 random bytes, created once, kept in
``<run_dir>/relay.key`` with owner-only permissions. It is handed to children over stdin or in
their constructor arguments, never in argv, environment or logs.

Connection handshake (when a key is set): on accept the server sends ``b"LMC1"`` + a 16-byte
random nonce; the client answers with its own 16-byte nonce, then frames flow as usual. Every
frame then carries two HMAC-SHA256 tags: one after its header (so a peer without the key is
refused before any payload is read or buffered) and one after its payload. Both tags cover the
direction, both nonces and a per-direction frame counter, so a frame cannot be replayed, reordered,
reflected back, or moved to another connection.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
from typing import Optional

KEY_FILE = "relay.key"
KEY_BYTES = 32
NONCE_BYTES = 16
TAG_BYTES = 32
CHALLENGE_MAGIC = b"LMC1"
_COUNTER = struct.Struct("<Q")


def run_key(run_dir: str) -> bytes:
    """The run's relay key: read ``<run_dir>/relay.key``, creating it (mode 0600) on first use."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, KEY_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_key(path)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(KEY_BYTES).hex() + "\n")
    return load_key(path)


def load_key(path: str) -> bytes:
    """Read a key file; refuses one that others may read (the key would not be secret)."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"{path}: relay key file has mode {oct(mode & 0o777)}; must be owner-only (0600)")
    with open(path) as f:
        text = f.read().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path}: relay key file must hold {KEY_BYTES} bytes as hex") from None
    check_key(key, path)
    return key


def check_key(key: Optional[bytes], what: str = "relay key") -> Optional[bytes]:
    if key is not None and (not isinstance(key, bytes) or len(key) < 16):
        raise ValueError(f"{what}: must be bytes of length >= 16 (got {type(key).__name__})")
    return key


class Session:
    """MAC state of one authenticated connection, seen from one side."""

    def __init__(self, key: bytes, server_nonce: bytes, client_nonce: bytes, is_server: bool):
        self._base = hmac.new(key, server_nonce + client_nonce, hashlib.sha256)
        self._send_label, self._recv_label = (b"s2c", b"c2s") if is_server else (b"c2s", b"s2c")
        self.sent = 0
        self.received = 0

    def _mac(self, label: bytes, counter: int, prefix: bytes, header: bytes) -> "hmac.HMAC":
        h = self._base.copy()
        h.update(label + _COUNTER.pack(counter) + prefix + header)
        return h

    def send_mac(self, prefix: bytes, header: bytes) -> "hmac.HMAC":
        """A running MAC for the next outgoing frame (header tag = digest now; payload tag after updates)."""
        h = self._mac(self._send_label, self.sent, prefix, header)
        self.sent += 1
        return h

    def recv_mac(self, prefix: bytes, header: bytes) -> "hmac.HMAC":
        h = self._mac(self._recv_label, self.received, prefix, header)
        self.received += 1
        return h


def payload_tag(h: "hmac.HMAC") -> bytes:
    """The tag after the payload: distinct from the header tag even for an empty payload."""
    h = h.copy()
    h.update(b"end")
    return h.digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def tags_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def sign_version(key: bytes, version: int, digest: str, nonce: Optional[bytes] = None) -> str:
    """The learner's signature over a version number and its manifest digest (hex), as
    ``"<publish nonce>:<mac>"``: the nonce tells two publishes of one number apart (a resumed
    learner publishes the numbers after its checkpoint again, with other weights)."""
    nonce = os.urandom(8) if nonce is None else nonce
    msg = b"laminar-version\0" + _COUNTER.pack(version & (2**64 - 1)) + nonce + digest.encode()
    return nonce.hex() + ":" + hmac.new(key, msg, hashlib.sha256).hexdigest()


def verify_version(key: bytes, version: int, digest: str, signature: object) -> bool:
    if not isinstance(signature, str) or signature.count(":") != 1:
        return False
    nonce_hex, _ = signature.split(":")
    try:
        nonce = bytes.fromhex(nonce_hex)
    except ValueError:
        return False
    return hmac.compare_digest(sign_version(key, version, digest, nonce), signature)


def chunk_tag(key: bytes, version_signature: str, index: int, digest: str) -> str:
    """The learner's tag on one chunk: binds its SHA-256 to the signed version and its index, so a
    relay checks a chunk with one hash of its bytes and forwards it without hashing again."""
    msg = b"laminar-chunk\0" + version_signature.encode() + _COUNTER.pack(index) + digest.encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def verify_chunk(key: bytes, version_signature: object, index: int, digest: object, tag: object) -> bool:
    return (isinstance(version_signature, str) and isinstance(digest, str) and isinstance(tag, str)
            and hmac.compare_digest(chunk_tag(key, version_signature, index, digest), tag))
