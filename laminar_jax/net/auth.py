"""The run's keys: a shared link key for every relay connection, and the learner's signing key.

A run has two secrets, both created once in its run dir (owner-only, 0600) and reused on resume:
- ``relay.key``, the *link key* (32 random bytes): every relay connection authenticates with it.
  Every relay, rollout host and the learner hold it.
- ``learner.key``, the learner's Ed25519 private key: it alone signs each version (its number and
  manifest digest) and each chunk's SHA-256. Relays and rollout hosts get only the public key
  (``learner.pub``), so a host holding the link key still cannot publish a version a relay or a
  rollout server accepts. ``run_keys(run_dir)`` loads (or creates) all of it as a ``RunKeys``;
  ``RunKeys.for_hosts()`` is what goes to relays and rollout hosts. Keys are handed to children
  over stdin or in constructor arguments, never in argv, environment or logs.

Connection handshake (when a key is set): on accept the server sends ``b"LMC1"`` + a 16-byte
random nonce; the client answers with its own 16-byte nonce, then frames flow as usual. Every
frame then carries two HMAC-SHA256 tags: one after its header (so a peer without the key is
refused before any payload is read or buffered) and one after its payload. Both tags cover the
direction, both nonces and a per-direction frame counter, so a frame cannot be replayed, reordered,
reflected back, or moved to another connection.

Files at rest: a key file, or the run dir, that another user owns is refused (that user could
read or replace the key); so is a key file others may read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import stat
import struct
from typing import Optional

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_FILE = "relay.key"
LEARNER_KEY_FILE = "learner.key"
LEARNER_PUB_FILE = "learner.pub"
KEY_BYTES = 32
ED25519_BYTES = 32
NONCE_BYTES = 16
TAG_BYTES = 32
CHALLENGE_MAGIC = b"LMC1"
_COUNTER = struct.Struct("<Q")


def owner_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_owner(path: str, what: str, st: Optional[os.stat_result] = None) -> os.stat_result:
    """Refuse ``path`` unless this process's user owns it (another owner could read or swap it)."""
    st = os.stat(path) if st is None else st
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path}: {what} is owned by {owner_name(st.st_uid)}, not by this process's user "
                              f"{owner_name(os.geteuid())}; refusing it (that user could read or replace it)")
    return st


def private_dir(path: str, what: str = "run dir") -> str:
    """Create ``path`` owner-only (0700) if missing; refuse one another user owns."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_owner(path, what)
    return path


def _create_once(path: str, text: str) -> None:
    """Write ``text`` to a new owner-only file at ``path``; an existing one is left as is."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(text)


def run_key(run_dir: str) -> bytes:
    """The run's link key: read ``<run_dir>/relay.key``, creating it (mode 0600) on first use."""
    private_dir(run_dir)
    path = os.path.join(run_dir, KEY_FILE)
    _create_once(path, os.urandom(KEY_BYTES).hex() + "\n")
    return load_key(path)


def _read_secret(path: str, nbytes: int, what: str) -> bytes:
    """A hex secret from an owner-only file this user owns."""
    st = check_owner(path, what)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"{path}: {what} file has mode {oct(st.st_mode & 0o777)}; must be owner-only (0600)")
    with open(path) as f:
        text = f.read().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path}: {what} file must hold {nbytes} bytes as hex") from None
    if len(key) != nbytes:
        raise ValueError(f"{path}: {what} file must hold {nbytes} bytes as hex (holds {len(key)})")
    return key


def load_key(path: str) -> bytes:
    """Read a link key file; refuses one others may read or another user owns."""
    return check_key(_read_secret(path, KEY_BYTES, "relay key"), path)


def load_public_key(path: str) -> bytes:
    """Read a learner.pub file (hex): the learner's public key. Refused if another user owns it
    (that user could swap in their own)."""
    check_owner(path, "learner public key")
    with open(path) as f:
        text = f.read().strip()
    try:
        return check_public(bytes.fromhex(text), path)
    except ValueError:
        raise ValueError(f"{path}: learner public key file must hold {ED25519_BYTES} bytes as hex") from None


def check_key(key: Optional[bytes], what: str = "relay key") -> Optional[bytes]:
    if key is not None and (not isinstance(key, bytes) or len(key) < 16):
        raise ValueError(f"{what}: must be bytes of length >= 16 (got {type(key).__name__})")
    return key


def check_public(public: bytes, what: str) -> bytes:
    if not isinstance(public, bytes) or len(public) != ED25519_BYTES:
        raise ValueError(f"{what}: the learner's public key must be {ED25519_BYTES} bytes")
    return public


@dataclasses.dataclass(frozen=True, repr=False)
class RunKeys:
    """The run's keys (see the module docstring). ``private`` is None everywhere but the learner."""

    link: bytes
    public: bytes
    private: Optional[bytes] = None

    def __post_init__(self) -> None:
        check_key(self.link, "RunKeys.link")
        check_public(self.public, "RunKeys.public")
        if self.private is not None and _public_of(self.private) != self.public:
            raise ValueError("RunKeys.private: not the private key of RunKeys.public")

    def __repr__(self) -> str:  # never print a secret
        return f"RunKeys(public={self.public.hex()[:16]}..., private={'held' if self.private else 'none'})"

    @classmethod
    def generate(cls) -> "RunKeys":
        """Fresh keys held in memory only (tests, benchmarks)."""
        private = os.urandom(ED25519_BYTES)
        return cls(os.urandom(KEY_BYTES), _public_of(private), private)

    def for_hosts(self) -> "RunKeys":
        """These keys less the learner's private key: what relays and rollout hosts get."""
        return RunKeys(self.link, self.public)

    def signer(self, what: str) -> Ed25519PrivateKey:
        if self.private is None:
            raise ValueError(f"{what}: signing versions needs the learner's private key (auth.run_keys on the "
                             "learner); relays and rollout hosts hold only the public key")
        return Ed25519PrivateKey.from_private_bytes(self.private)

    def verifier(self) -> Ed25519PublicKey:
        return Ed25519PublicKey.from_public_bytes(self.public)


def _public_of(private: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(private).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def run_keys(run_dir: str) -> RunKeys:
    """The run's keys, created on first use: ``relay.key`` and ``learner.key`` (0600), and
    ``learner.pub``. A resumed run gets the same keys."""
    link = run_key(run_dir)
    path = os.path.join(run_dir, LEARNER_KEY_FILE)
    _create_once(path, os.urandom(ED25519_BYTES).hex() + "\n")
    private = _read_secret(path, ED25519_BYTES, "learner signing key")
    keys = RunKeys(link, _public_of(private), private)
    pub = os.path.join(run_dir, LEARNER_PUB_FILE)
    _create_once(pub, keys.public.hex() + "\n")
    if load_public_key(pub) != keys.public:
        raise ValueError(f"{pub}: does not match {path}; remove {pub} to have it written again")
    return keys


def check_keys(keys: object, what: str, signing: bool = False) -> Optional[RunKeys]:
    """``keys`` as passed to a relay part: None (no authentication) or a RunKeys; a host part
    (``signing=False``) must not get the private key, the learner's publisher must."""
    if keys is None:
        return None
    if not isinstance(keys, RunKeys):
        raise TypeError(f"{what}: keys must be an auth.RunKeys (auth.run_keys(run_dir)), got {type(keys).__name__}")
    if signing and keys.private is None:
        raise ValueError(f"{what}: the publisher signs versions and needs the learner's private key")
    if not signing and keys.private is not None:
        raise ValueError(f"{what}: relays and rollout hosts take only the learner's public key: pass "
                         "keys.for_hosts()")
    return keys


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


def _version_message(version: int, digest: str, nonce: bytes) -> bytes:
    return b"laminar-version\0" + _COUNTER.pack(version & (2**64 - 1)) + nonce + digest.encode()


def sign_version(signer: Ed25519PrivateKey, version: int, digest: str, nonce: Optional[bytes] = None) -> str:
    """The learner's Ed25519 signature over a version number and its manifest digest (hex), as
    ``"<publish nonce>:<signature>"``: the nonce tells two publishes of one number apart (a resumed
    learner publishes the numbers after its checkpoint again, with other weights)."""
    nonce = os.urandom(8) if nonce is None else nonce
    return nonce.hex() + ":" + signer.sign(_version_message(version, digest, nonce)).hex()


def _verify(verifier: Ed25519PublicKey, signature_hex: object, msg: bytes) -> bool:
    try:
        verifier.verify(bytes.fromhex(signature_hex), msg)  # type: ignore[arg-type]
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def verify_version(verifier: Ed25519PublicKey, version: int, digest: str, signature: object) -> bool:
    if not isinstance(signature, str) or signature.count(":") != 1:
        return False
    nonce_hex, sig = signature.split(":")
    try:
        nonce = bytes.fromhex(nonce_hex)
    except ValueError:
        return False
    return _verify(verifier, sig, _version_message(version, digest, nonce))


def _chunk_message(version_signature: str, index: int, digest: str) -> bytes:
    return b"laminar-chunk\0" + version_signature.encode() + _COUNTER.pack(index) + digest.encode()


def chunk_tag(signer: Ed25519PrivateKey, version_signature: str, index: int, digest: str) -> str:
    """The learner's Ed25519 signature on one chunk: binds its SHA-256 to the signed version and its
    index, so a relay checks a chunk with one hash of its bytes and forwards it without hashing again."""
    return signer.sign(_chunk_message(version_signature, index, digest)).hex()


def verify_chunk(verifier: Ed25519PublicKey, version_signature: object, index: int, digest: object,
                 tag: object) -> bool:
    return (isinstance(version_signature, str) and isinstance(digest, str) and isinstance(tag, str)
            and _verify(verifier, tag, _chunk_message(version_signature, index, digest)))
