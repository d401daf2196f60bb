"""Versioned weight store on tensorstore: each version's packed layout in a few objects (format
'packed', the default), or zarr3 arrays, optionally inside one OCDBT database.

Key layout under the store root (any tensorstore kvstore: file://, gs://, s3://, memory://):

    data/v{V:012d}-{nonce}/packed/p{j:06d} bytes [j*P, (j+1)*P) of version V's packed layout
                                          (manifest.py), P = PACKED_PART_BYTES (written first)
    data/v{V:012d}-{nonce}/a{i:05d}/...   formats 'zarr3', 'zarr3_ocdbt': zarr3 array i of version V
    manifests/v{V:012d}.json              the commit point: a version exists iff this key exists
    LATEST                                {"version": V}, moved forward after the manifest
    leases/v{V:012d}/{holder}.json        {"expires_at": unix time}; gc() spares leased versions

Atomicity: a single-key write is atomic on every kvstore, and the manifest is written only after
every array write has completed (tensorstore's file driver fsyncs). A writer killed mid-version
leaves an unreferenced ``data/`` prefix that no reader can reach; gc() removes it. On a file://
store it may also leave tensorstore's lock file of the key it was writing, which the key's next
write would otherwise keep the tail of (``_put`` removes it first).
Single writer per store (the learner); any number of readers and gc callers.

``LATEST`` is a hint, the manifests are the truth: a ``LATEST`` naming a version without a
manifest (removed by gc under a resumed learner, or never committed) is ignored and the newest
committed version wins; the next commit or retract rewrites it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, NamedTuple, Optional

import numpy as np

from laminar_jax.relay.manifest import (Manifest, ManifestError, check_flat, chunk_segments, chunk_span,
                                        contiguous, crc32_of, dtype_from_name, first_array, num_chunks, plan_layout,
                                        views)

CHUNK_TARGET = 64 << 20  # bytes per zarr chunk: big enough for throughput, small enough to parallelise
PACKED_PART_BYTES = 64 << 20  # bytes per object of a 'packed' version (written and read in parallel)
PACKED_KEY = "packed/"  # every entry's key in a 'packed' version's manifest: its bytes are at entry.offset
FORMATS = ("zarr3", "zarr3_ocdbt", "packed")
_HOLDER = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


class VersionNotFound(KeyError):
    """The version has no manifest in the store (never committed, or garbage-collected)."""

    def __str__(self) -> str:
        return str(self.args[0])


class GcReport(NamedTuple):
    deleted: tuple[int, ...]  # versions removed
    kept_leased: tuple[int, ...]  # versions past keep_last spared because a lease is live
    orphans: tuple[str, ...]  # data prefixes of uncommitted versions removed
    # Committed versions whose manifest could not be parsed: which data prefix they reference is
    # unknown, so every data prefix of their number was kept (an operator decides; gc goes on).
    unreadable: tuple[int, ...] = ()


def normalize_url(url_or_path: str) -> str:
    """Local paths become file:// URLs; the result always ends with '/'."""
    if "://" not in url_or_path:
        url_or_path = "file://" + os.path.abspath(url_or_path)
    return url_or_path if url_or_path.endswith("/") else url_or_path + "/"


def _vkey(version: int) -> str:
    return f"v{version:012d}"


def _prefix_range(prefix: str):
    import tensorstore as ts

    return ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=prefix[:-1] + chr(ord(prefix[-1]) + 1))


def _zarr_chunks(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Chunk along axis 0 so one chunk holds about CHUNK_TARGET bytes."""
    if not shape:
        return []
    row = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
    return [max(1, min(shape[0], CHUNK_TARGET // row))] + [max(1, s) for s in shape[1:]]


class Lease:
    """A reader's pin on a stored version; use as a context manager or call release()."""

    def __init__(self, store: "WeightStore", version: int, holder: str, ttl_s: float):
        self.store, self.version, self.holder, self.ttl_s = store, version, holder, ttl_s
        self.key = f"leases/{_vkey(version)}/{holder}.json"
        self.released = False

    def renew(self, ttl_s: Optional[float] = None) -> None:
        self.ttl_s = ttl_s or self.ttl_s
        self.store._put(self.key, json.dumps({"expires_at": time.time() + self.ttl_s}).encode())

    def release(self) -> None:
        if not self.released:
            self.store._kv.delete_range(_prefix_range(self.key)).result()
            self.released = True

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class WeightStore:
    """Versions of a flat weight dict, each written atomically; see the module docstring."""

    def __init__(self, url_or_path: str, keep_last: int = 3, format: str = "packed",
                 verify: bool = True, lease_ttl_s: float = 120.0, io_threads: int = 4):
        import tensorstore as ts

        if keep_last < 1:
            raise ValueError(f"WeightStore.keep_last={keep_last}: must be >= 1")
        if format not in FORMATS:
            raise ValueError(f"WeightStore.format={format!r}: must be one of {FORMATS}")
        self.url = normalize_url(url_or_path)
        if self.url.startswith("file://"):  # weights are the run's: owner-only, like the run dir
            os.makedirs(self.url[len("file://"):], mode=0o700, exist_ok=True)
        self.keep_last, self.format, self.verify, self.lease_ttl_s = keep_last, format, verify, lease_ttl_s
        self._kv = ts.KvStore.open(self.url).result()
        self._base = self._kv.spec().to_json()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="weightstore")

    @classmethod
    def from_config(cls, cfg: Any, url: Optional[str] = None) -> "WeightStore":
        """The store a RelaySection describes, at ``url`` (default: its store_url): every reader and
        writer of one run opens it this way, so they agree on its format."""
        url = url or cfg.store_url
        if url is None:
            raise ValueError("relay.store_url is None: no store configured")
        return cls(url, keep_last=cfg.keep_last, format=cfg.store_format,
                   verify=cfg.verify_reads, lease_ttl_s=cfg.lease_ttl_s)

    @classmethod
    def of_run(cls, cfg: Any, run_dir: str) -> "WeightStore":
        """A run's store: ``relay.store_url``, or the run directory's ``weights`` (run_store_url)."""
        return cls.from_config(cfg, run_store_url(cfg, run_dir))

    def __repr__(self) -> str:
        return f"WeightStore({self.url!r})"

    # ---- keys and specs
    def _sub(self, path: str) -> dict:
        return dict(self._base, path=self._base.get("path", "") + path)

    def _array_spec(self, data: str, key: str) -> dict:
        if self.format == "zarr3_ocdbt":
            kv = {"driver": "ocdbt", "base": self._sub(data), "path": key + "/"}
        else:
            kv = self._sub(data + key + "/")
        return {"driver": "zarr3", "kvstore": kv}

    def _local_dir(self, sub: str) -> Optional[str]:
        """Filesystem path of ``sub`` for a file:// store, else None."""
        if self._base.get("driver") != "file":
            return None
        return os.path.join(self._base["path"], sub)

    def _put(self, key: str, value: bytes) -> None:
        """Write one key, first removing a lock file a killed writer left for it on a file:// store.
        tensorstore's file kvstore writes ``<key>.__lock`` and renames it into place, and does not
        truncate a lock file it finds: after a writer died mid-write, the key's next write would
        commit its bytes followed by the dead write's tail (a manifest republished after a SIGKILL
        read as invalid JSON). Each key written here has one writer (manifests and LATEST the
        publishing learner, a lease its holder), so a lock file found before a write is a dead one's."""
        local = self._local_dir(key)
        if local is not None:
            try:
                os.remove(local + ".__lock")
            except FileNotFoundError:
                pass
        self._kv.write(key, value).result()

    def _list(self, prefix: str) -> list[str]:
        return sorted(k.decode() for k in self._kv.list(_prefix_range(prefix)).result())

    # ---- reading
    def versions(self) -> list[int]:
        """Committed versions, ascending."""
        out = []
        for k in self._list("manifests/"):
            m = re.fullmatch(r"manifests/v(\d{12})\.json", k)
            if m:
                out.append(int(m.group(1)))
        return out

    def newest_committed(self) -> Optional[int]:
        """The newest version with a manifest, from a listing (None for an empty store): the writer's
        view. ``latest()`` trusts the LATEST hint when its version is committed, so it names the
        version before when a writer died between a manifest and LATEST; a writer numbering or
        checking its own versions must not be misled by that."""
        committed = self.versions()
        return committed[-1] if committed else None

    def latest(self) -> Optional[int]:
        """The newest committed version (None for an empty store): what LATEST points to when
        that version has its manifest, else (a dangling or uncommitted LATEST) the newest version
        that has one."""
        hint = self._latest_hint()
        if hint is not None and self._kv.read(f"manifests/{_vkey(hint)}.json").result().state == "value":
            return hint
        return self.newest_committed()

    def _latest_hint(self) -> Optional[int]:
        r = self._kv.read("LATEST").result()
        if r.state != "value":
            return None
        try:
            return int(json.loads(r.value)["version"])
        except (ValueError, KeyError, TypeError):
            return None  # a torn or garbled LATEST is only a hint: the manifests decide

    def manifest(self, version: int) -> Manifest:
        key = f"manifests/{_vkey(version)}.json"
        r = self._kv.read(key).result()
        if r.state != "value":
            raise VersionNotFound(f"{self.url}: version {version} not found (no {key}; have {self.versions()})")
        return Manifest.from_json(bytes(r.value), f"{self.url}{key}")

    def read(self, version: int, names: Optional[list[str]] = None) -> dict[str, np.ndarray]:
        """The version's arrays (all, or ``names``), checksums verified when ``verify``."""
        import tensorstore as ts

        m = self.manifest(version)
        entries = [e for e in m.entries if names is None or e.name in names]
        if names is not None and len(entries) != len(set(names)):
            missing = sorted(set(names) - {e.name for e in entries})
            raise KeyError(f"{self.url}: version {version} has no arrays {missing[:5]}")
        if m.entries and all(e.key == PACKED_KEY for e in m.entries):
            arrays = self._read_packed(m, entries)
        else:
            ctx = ts.Context()
            futs = [ts.open(self._array_spec(m.data, e.key), open=True, read=True, context=ctx) for e in entries]
            reads = [f.result().read() for f in futs]
            arrays = [np.asarray(r.result()) for r in reads]
        out = {}
        for e, a in zip(entries, arrays):
            if a.dtype != dtype_from_name(e.dtype) or a.shape != e.shape:
                raise ManifestError(f"{self.url}: version {version} array {e.name!r} is {a.dtype}{a.shape}, "
                                    f"manifest says {e.dtype}{e.shape}")
            out[e.name] = a
        if self.verify:
            sums = list(self._pool.map(lambda e: (e, crc32_of(out[e.name])), entries))
            for e, crc in sums:
                if crc != e.checksum:
                    raise ManifestError(f"{self.url}: version {version} array {e.name!r} checksum "
                                        f"{crc:#010x} != manifest {e.checksum or 0:#010x}")
        return out

    # ---- writing
    def write(self, version: int, flat: Mapping[str, np.ndarray]) -> Manifest:
        """Write a whole version, then commit it (manifest, then LATEST). Atomic for readers."""
        import tensorstore as ts

        check_flat(flat, f"WeightStore.write(version={version})")
        have = self.newest_committed()
        if have is not None and version <= have:
            raise ValueError(f"{self.url}: version {version} must be > newest committed version {have}")
        flat = {k: contiguous(v) for k, v in flat.items()}
        data = f"data/{_vkey(version)}-{uuid.uuid4().hex[:8]}/"
        sums = dict(zip(flat, self._pool.map(crc32_of, flat.values())))
        if self.format == "packed":
            m = plan_layout(flat, version, checksums=sums, keys={k: PACKED_KEY for k in flat}, data=data)
            self._write_packed(m, flat)
            return self._commit(m)
        keys = {name: f"a{i:05d}" for i, name in enumerate(flat)}
        ctx = ts.Context()
        opens = []
        for name, a in flat.items():
            spec = self._array_spec(data, keys[name])
            spec["metadata"] = {"codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                                "chunk_grid": {"name": "regular", "configuration": {
                                    "chunk_shape": _zarr_chunks(a.shape, a.dtype.itemsize)}}}
            spec["store_data_equal_to_fill_value"] = True
            opens.append(ts.open(spec, create=True, dtype=ts.dtype(a.dtype.name), shape=a.shape, context=ctx))
        writes = [f.result().write(a) for f, a in zip(opens, flat.values())]
        for w in writes:
            w.result()
        return self._commit(plan_layout(flat, version, checksums=sums, keys=keys, data=data))

    def _commit(self, m: Manifest) -> Manifest:
        self._put(f"manifests/{_vkey(m.version)}.json", m.to_json())
        self._move_latest(m.version)
        return m

    def _write_packed(self, m: Manifest, flat: Mapping[str, np.ndarray]) -> None:
        """The version's packed layout as objects of PACKED_PART_BYTES: a few key writes per version
        instead of a zarr array (metadata + chunks) per weight, which dominated small versions."""
        arrays = [(e, flat[e.name]) for e in m.entries]
        offsets = [e.offset for e in m.entries]
        futs = []
        for j in range(num_chunks(m.total_bytes, PACKED_PART_BYTES)):
            start, stop = chunk_span(j, m.total_bytes, PACKED_PART_BYTES)
            part = b"".join(chunk_segments(arrays, start, stop, first_array(offsets, start)))
            futs.append(self._kv.write(f"{m.data}{PACKED_KEY}p{j:06d}", part))
        for f in futs:
            f.result()

    def _read_packed(self, m: Manifest, entries: list) -> list[np.ndarray]:
        """The parts holding ``entries`` (all of them for a whole read), in parallel."""
        part = PACKED_PART_BYTES
        need = sorted({j for e in entries if e.nbytes
                       for j in range(e.offset // part, (e.offset + e.nbytes - 1) // part + 1)})
        futs = {j: self._kv.read(f"{m.data}{PACKED_KEY}p{j:06d}") for j in need}
        buf = bytearray(m.total_bytes)  # writable arrays, as the zarr formats return
        for j, f in futs.items():
            r = f.result()
            lo, hi = chunk_span(j, m.total_bytes, part)
            if r.state != "value" or len(r.value) != hi - lo:
                raise ManifestError(f"{self.url}: version {m.version}: part {j} of its packed data is "
                                    + ("missing" if r.state != "value" else f"{len(r.value)} bytes, not {hi - lo}"))
            buf[lo:hi] = r.value
        every = views(buf, m)
        return [every[e.name] for e in entries]

    def _move_latest(self, version: int) -> None:
        cur = self.latest()
        if cur is None or version >= cur or self._latest_hint() != cur:
            self._put("LATEST", json.dumps({"version": max(version, cur or version)}).encode())

    # ---- leases and gc
    def lease(self, version: int, holder: str, ttl_s: Optional[float] = None) -> Lease:
        """Pin ``version`` against gc for ``ttl_s`` seconds (renewable); raises VersionNotFound."""
        if not _HOLDER.match(holder):
            raise ValueError(f"lease holder {holder!r}: must match {_HOLDER.pattern}")
        lease = Lease(self, version, holder, ttl_s or self.lease_ttl_s)
        for attempt in range(3):
            try:
                lease.renew()
                break
            except ValueError as e:  # gc removed this version's lease folder under the write
                self.manifest(version)  # raises VersionNotFound when the version is gone
                if attempt == 2:
                    raise ValueError(f"{self.url}: could not write lease {lease.key}: {e}") from e
        try:
            self.manifest(version)  # after the lease is written: gc re-checks leases before deleting
        except VersionNotFound:
            lease.release()
            raise
        return lease

    def _live_leases(self, version: int, now: float) -> list[str]:
        live = []
        for k in self._list(f"leases/{_vkey(version)}/"):
            r = self._kv.read(k).result()
            try:
                expires = float(json.loads(r.value)["expires_at"]) if r.state == "value" else 0.0
            except (ValueError, KeyError, TypeError):
                expires = 0.0
            if expires > now:
                live.append(k)
            else:
                self._kv.delete_range(_prefix_range(k)).result()
        return live

    def gc(self, orphans: bool = True) -> GcReport:
        """Delete versions beyond the newest keep_last that no live lease pins, and (``orphans``)
        orphaned data.

        Order per version: delete the manifest (invisible), re-check leases (a reader may have
        leased it meanwhile: then restore the manifest), then delete the data. Orphans come only
        from writers killed mid-version, so a frequent caller may scan for them now and then
        (the scan lists every data key of the store).
        """
        versions = self.versions()
        latest = self.latest()
        doomed = [v for v in versions[:-self.keep_last] if v != latest]
        deleted, spared = [], []
        now = time.time()
        for v in doomed:
            if self._live_leases(v, now):
                spared.append(v)
                continue
            key = f"manifests/{_vkey(v)}.json"
            raw = self._kv.read(key).result()
            self._kv.delete_range(_prefix_range(key)).result()
            if self._live_leases(v, time.time()):
                self._put(key, raw.value)
                spared.append(v)
                continue
            self._kv.delete_range(_prefix_range(f"data/{_vkey(v)}-")).result()
            deleted.append(v)
        removed, unreadable = self._gc_orphans(set(self.versions()), max(versions, default=-1)) if orphans else ([], [])
        return GcReport(tuple(deleted), tuple(spared), tuple(removed), tuple(unreadable))

    def retract_newer_than(self, version: int) -> list[int]:
        """Withdraw every committed version > ``version`` (a learner resumed from an older checkpoint
        publishes those numbers again with other weights). Manifests go first, so readers never see
        a half-deleted version; LATEST moves back to ``version``."""
        doomed = [v for v in self.versions() if v > version]
        for v in reversed(doomed):
            self._kv.delete_range(_prefix_range(f"manifests/{_vkey(v)}.json")).result()
            self._kv.delete_range(_prefix_range(f"data/{_vkey(v)}-")).result()
        # LATEST names a committed version, never ``version`` itself when gc already removed it.
        left = self.versions()
        if left:
            self._put("LATEST", json.dumps({"version": left[-1]}).encode())
        else:
            self._kv.delete_range(_prefix_range("LATEST")).result()
        return doomed

    def _gc_orphans(self, committed: set[int], newest: int) -> tuple[list[str], list[int]]:
        """Data prefixes no manifest references, of versions <= the newest committed one.

        Newer uncommitted prefixes may belong to a write in progress and are left alone; so are all
        prefixes of a version whose manifest does not parse (returned beside the removed ones): it may
        reference any of them, and a corrupt manifest must not cost the data beside it.
        """
        prefixes = {k.split("/")[1] for k in self._list("data/") if k.count("/") >= 2}
        unreadable: list[int] = []
        local = self._local_dir("data/")
        if local is not None and os.path.isdir(local):  # lock files of a killed writer are not listed
            prefixes |= set(os.listdir(local))
        referenced = set()
        for v in committed:
            try:
                referenced.add(self.manifest(v).data.split("/")[1])
            except VersionNotFound:
                pass
            except ManifestError:
                unreadable.append(v)
        removed = []
        for p in sorted(prefixes - referenced):
            m = re.fullmatch(r"v(\d{12})-[0-9a-f]+", p)
            if m and int(m.group(1)) <= newest and int(m.group(1)) not in unreadable:
                self._kv.delete_range(_prefix_range(f"data/{p}/")).result()
                if local is not None:
                    shutil.rmtree(os.path.join(local, p), ignore_errors=True)
                removed.append(f"data/{p}/")
        return removed, unreadable


def run_store_url(cfg: Any, run_dir: str) -> str:
    """Where a run's versions live: the RelaySection's store_url, else ``<run_dir>/weights``."""
    return cfg.store_url or os.path.join(run_dir, "weights")
