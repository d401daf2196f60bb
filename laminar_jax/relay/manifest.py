"""Manifest of a weight version and the packed byte layout shared by the store and the relays.

A version is a flat ``dict[str, np.ndarray]``. Its *packed layout* places array ``i`` at
``offset_i`` (aligned to ``ALIGN`` bytes) in one contiguous buffer of ``total_bytes``; relays
cut that buffer into fixed-size chunks ``[k*C, min((k+1)*C, total))``. Checksums are CRC-32
(zlib) of the raw little-endian bytes. Pure: no I/O here.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import json
import zlib
from typing import Any, Mapping, Optional, Sequence

import numpy as np

ALIGN = 64
FORMAT = "laminar-relay/1"


class ManifestError(ValueError):
    """A manifest or a weight dict is malformed; the message names the source and field."""


def dtype_name(dt: Any) -> str:
    """Portable dtype name ('float32', 'bfloat16', ...); rejects big-endian and non-numeric dtypes."""
    dt = np.dtype(dt)
    if dt.byteorder == ">" or dt.kind in "OUSMm" or dt.fields is not None or dt.subdtype is not None:
        raise ManifestError(f"dtype {dt!r}: must be a little-endian numeric dtype")
    if dt.kind == "V":  # only ml_dtypes types (bfloat16, float8_*, int4) are acceptable raw types
        dtype_from_name(dt.name)
    return dt.name


def dtype_from_name(name: str) -> np.dtype:
    """Inverse of dtype_name; ml_dtypes names (bfloat16, float8_*) resolve through ml_dtypes."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        if hasattr(ml_dtypes, name):
            return np.dtype(getattr(ml_dtypes, name))
        raise ManifestError(f"dtype {name!r}: unknown (not numpy, not ml_dtypes)") from None


def contiguous(a: np.ndarray) -> np.ndarray:
    """C-contiguous array of the same shape (np.ascontiguousarray would turn 0-d into 1-d)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


def crc32_of(buf: Any, crc: int = 0) -> int:
    """CRC-32 of a buffer (array, bytes, memoryview); zlib releases the GIL on large inputs."""
    if isinstance(buf, np.ndarray):
        buf = contiguous(buf).reshape(-1).view(np.uint8)
    return zlib.crc32(buf, crc) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
    """One array of a version: where it lives in the packed buffer and in the store."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    checksum: Optional[int] = None  # crc32 of the array's bytes; None where not computed (relay)
    key: Optional[str] = None  # store sub-path of the array; None outside the store


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything needed to rebuild a version's arrays from its bytes."""

    version: int
    entries: tuple[ArrayEntry, ...]
    total_bytes: int
    data: Optional[str] = None  # store prefix holding the arrays (None outside the store)
    format: str = FORMAT

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["entries"] = [dict(e, shape=list(e["shape"])) for e in d["entries"]]
        return d

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    def digest(self) -> str:
        """SHA-256 (hex) of the manifest's canonical JSON: what the learner signs with the version."""
        return hashlib.sha256(json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True).encode()).hexdigest()

    def layout_digest(self) -> str:
        """SHA-256 of the version number and packed layout only (names, shapes, dtypes, offsets): what a
        relay's push manifest and the store's manifest of one publish have in common (the store's adds
        checksums and array keys)."""
        bare = dataclasses.replace(self, data=None, entries=tuple(
            dataclasses.replace(e, checksum=None, key=None) for e in self.entries))
        return bare.digest()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str) -> "Manifest":
        def need(obj, key, kind, where):
            if key not in obj or not isinstance(obj[key], kind) or isinstance(obj[key], bool) and kind is int:
                raise ManifestError(f"{source}: field {where}{key}={obj.get(key)!r}: must be {kind.__name__}")
            return obj[key]

        if not isinstance(d, Mapping):
            raise ManifestError(f"{source}: must be a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise ManifestError(f"{source}: field format={d.get('format')!r}: must be {FORMAT!r}")
        entries = []
        for i, e in enumerate(need(d, "entries", list, "")):
            where = f"entries[{i}]."
            shape = need(e, "shape", list, where)
            if not all(isinstance(s, int) and s >= 0 for s in shape):
                raise ManifestError(f"{source}: field {where}shape={shape!r}: must be non-negative ints")
            entries.append(ArrayEntry(
                name=need(e, "name", str, where), shape=tuple(shape), dtype=need(e, "dtype", str, where),
                offset=need(e, "offset", int, where), nbytes=need(e, "nbytes", int, where),
                checksum=e.get("checksum"), key=e.get("key")))
        m = cls(version=need(d, "version", int, ""), entries=tuple(entries),
                total_bytes=need(d, "total_bytes", int, ""), data=d.get("data"))
        check_layout(m, source)
        return m

    @classmethod
    def from_json(cls, raw: bytes, source: str) -> "Manifest":
        try:
            d = json.loads(raw)
        except ValueError as e:
            raise ManifestError(f"{source}: not valid JSON ({e})") from None
        return cls.from_dict(d, source)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def check_flat(flat: Mapping[str, Any], what: str = "weights") -> None:
    """Raise ManifestError naming the first entry that is not a named numpy array."""
    if not isinstance(flat, Mapping):
        raise ManifestError(f"{what}: must be a dict[str, np.ndarray], got {type(flat).__name__}")
    for name, a in flat.items():
        if not isinstance(name, str) or not name:
            raise ManifestError(f"{what}: key {name!r}: must be a non-empty str")
        if not isinstance(a, np.ndarray):
            raise ManifestError(f"{what}[{name!r}]: must be np.ndarray, got {type(a).__name__}")
        try:
            dtype_name(a.dtype)
        except ManifestError as e:
            raise ManifestError(f"{what}[{name!r}]: {e}") from None


def plan_layout(flat: Mapping[str, np.ndarray], version: int,
                checksums: Optional[Mapping[str, int]] = None,
                keys: Optional[Mapping[str, str]] = None, data: Optional[str] = None) -> Manifest:
    """Manifest with the packed layout of ``flat`` (dict order), offsets aligned to ALIGN."""
    check_flat(flat)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ManifestError(f"version={version!r}: must be an int >= 0")
    entries, off = [], 0
    for name, a in flat.items():
        entries.append(ArrayEntry(name, tuple(int(s) for s in a.shape), dtype_name(a.dtype), off, int(a.nbytes),
                                  None if checksums is None else int(checksums[name]),
                                  None if keys is None else keys[name]))
        off = _aligned(off + int(a.nbytes))
    return Manifest(version, tuple(entries), off, data)


def check_layout(m: Manifest, source: str) -> None:
    """Offsets in bounds, non-overlapping, nbytes consistent with shape x dtype."""
    end, seen = 0, set()
    for i, e in enumerate(m.entries):
        if e.name in seen:
            raise ManifestError(f"{source}: entries[{i}].name={e.name!r}: duplicate")
        seen.add(e.name)
        want = int(np.prod(e.shape, dtype=np.int64)) * dtype_from_name(e.dtype).itemsize
        if e.nbytes != want:
            raise ManifestError(f"{source}: entries[{i}].nbytes={e.nbytes}: must be {want} for {e.shape} {e.dtype}")
        if e.offset < end or e.offset + e.nbytes > m.total_bytes:
            raise ManifestError(f"{source}: entries[{i}].offset={e.offset}: overlaps or exceeds total_bytes")
        end = e.offset + e.nbytes


def views(buf: Any, m: Manifest) -> dict[str, np.ndarray]:
    """Zero-copy arrays over a packed buffer (read-only if the buffer is)."""
    out = {}
    for e in m.entries:
        dt = dtype_from_name(e.dtype)
        n = e.nbytes // dt.itemsize if dt.itemsize else 0
        out[e.name] = np.frombuffer(buf, dtype=dt, count=n, offset=e.offset).reshape(e.shape)
    return out


def num_chunks(total_bytes: int, chunk_bytes: int) -> int:
    """ceil(total / C), and at least 1 so an empty version still has one (empty) chunk."""
    return max(1, -(-total_bytes // chunk_bytes))


def chunk_span(index: int, total_bytes: int, chunk_bytes: int) -> tuple[int, int]:
    """Byte range [start, stop) of chunk ``index``."""
    start = index * chunk_bytes
    return start, min(start + chunk_bytes, total_bytes)


def choose_chunk_bytes(total_bytes: int, max_chunk: int, min_chunk: int, link_rate: float,
                       chunk_time_s: float, pipeline_chunks: int) -> int:
    """Chunk size C for a version of ``total_bytes`` sent over links of ``link_rate`` bytes/s (0 = unlimited).

        C = min(max_chunk, max(min_chunk, min(ceil(total / pipeline_chunks), link_rate * chunk_time_s)))

    rounded up to a multiple of 4096 (never above ``max_chunk``). Why: a relay forwards a chunk
    only once it holds all of it, so a chain of n relays delivers in about
    ``total / rate + (n - 1) * C / rate``: the per-hop cost is one chunk time. ``chunk_time_s`` bounds
    it on rate-limited links; ``pipeline_chunks`` keeps the fill a small fraction of a hop when the
    link is unlimited; ``min_chunk`` bounds the per-chunk overhead (one header, one checksum call).
    """
    want = -(-max(1, total_bytes) // max(1, pipeline_chunks))
    if link_rate > 0:
        want = min(want, int(link_rate * chunk_time_s))
    c = max(min_chunk, want)
    c = -(-c // 4096) * 4096
    return max(1, min(max_chunk, c))


def chunk_segments(arrays: Sequence[tuple[ArrayEntry, np.ndarray]], start: int, stop: int,
                   first: int = 0) -> list[Any]:
    """Buffers whose concatenation is packed[start:stop], built without copying array data.

    ``arrays`` holds (entry, contiguous array) in layout order; alignment gaps become zero bytes.
    ``first``: index of an array at or before the one holding ``start`` (see ``first_array``), so
    cutting a version into k chunks costs O(k + arrays), not O(k * arrays).
    """
    segs, pos = [], start
    for e, a in itertools.islice(arrays, first, None):
        lo, hi = max(e.offset, start), min(e.offset + e.nbytes, stop)
        if hi <= lo:
            if e.offset >= stop:
                break
            continue
        if lo > pos:
            segs.append(bytes(lo - pos))
        flat = a.reshape(-1).view(np.uint8)
        segs.append(memoryview(flat[lo - e.offset:hi - e.offset]))
        pos = hi
    if stop > pos:
        segs.append(bytes(stop - pos))
    return segs


def first_array(offsets: Sequence[int], start: int) -> int:
    """Index of the last array whose offset is <= start (0 if none): where a chunk's segments begin."""
    return max(0, bisect.bisect_right(offsets, start) - 1)
