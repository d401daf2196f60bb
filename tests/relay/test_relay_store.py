"""WeightStore: bit-exact round trips, atomic publish under SIGKILL, leases and gc."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from laminar_jax.relay.manifest import ManifestError
from laminar_jax.relay import store as store_mod
from laminar_jax.relay.store import VersionNotFound, WeightStore
from tests.subprocess_env import child_env



def _weights(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**16, size=(33, 17), dtype=np.uint16)
    return {
        "['embed']": rng.standard_normal((64, 48), dtype=np.float32),
        "['layers'][0]['w']": bits.view(ml_dtypes.bfloat16),  # every bf16 bit pattern incl. NaNs
        "['layers'][0]['b']": np.full(48, -0.0, np.float32),  # equals the zarr fill value up to sign
        "['step']": np.array(seed, np.int64),
        "['empty']": np.zeros((0, 5), np.float16),
    }


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("fmt", ["zarr3", "zarr3_ocdbt", "packed"])
def test_roundtrip_is_bit_identical(tmp_path, fmt):
    store = WeightStore(str(tmp_path / "s"), format=fmt)
    assert store.latest() is None and store.versions() == []
    w1, w2 = _weights(1), _weights(2)
    store.write(1, w1)
    store.write(2, w2)
    assert store.versions() == [1, 2] and store.latest() == 2
    for v, w in ((1, w1), (2, w2)):
        got = store.read(v)
        assert list(got) == list(w)
        assert all(_same_bits(got[k], w[k]) for k in w)
    part = store.read(2, names=["['step']"])
    assert list(part) == ["['step']"] and int(part["['step']"]) == 2


def test_write_rejects_stale_version_and_bad_input(tmp_path):
    store = WeightStore(str(tmp_path / "s"))
    store.write(5, _weights(5))
    with pytest.raises(ValueError, match="version 5 must be > newest committed version 5"):
        store.write(5, _weights(5))
    with pytest.raises(ManifestError, match=r"\['x'\].*np.ndarray"):
        store.write(6, {"['x']": [1.0, 2.0]})
    with pytest.raises(VersionNotFound, match="version 4 not found"):
        store.read(4)


def test_checksum_catches_corrupted_data(tmp_path):
    store = WeightStore(str(tmp_path / "s"), format="zarr3")
    m = store.write(1, _weights(1))
    entry = next(e for e in m.entries if e.name == "['embed']")
    chunk_dir = tmp_path / "s" / m.data / entry.key / "c"
    chunk = next(p for p in chunk_dir.rglob("*") if p.is_file())
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match=r"\['embed'\]\" checksum 0x[0-9a-f]+ != manifest 0x"):
        store.read(1)


def test_packed_format_checks_its_parts(tmp_path, monkeypatch):
    # Several parts per version (a tiny part size here), each a plain object: a flipped byte is caught
    # by the array's checksum, a missing part is named.
    monkeypatch.setattr(store_mod, "PACKED_PART_BYTES", 4096)
    store = WeightStore(str(tmp_path / "s"), format="packed")
    w = _weights(1)
    m = store.write(1, w)
    parts = sorted((tmp_path / "s" / m.data / "packed").iterdir())
    assert len(parts) == -(-m.total_bytes // 4096) > 1
    assert all(_same_bits(store.read(1)[k], w[k]) for k in w)
    got = store.read(1, names=["['step']", "['empty']"])
    assert int(got["['step']"]) == 1 and got["['empty']"].shape == (0, 5)
    got["['step']"][...] = 7  # readers get writable arrays, as from the zarr formats
    entry = next(e for e in m.entries if e.name == "['embed']")
    part = parts[(entry.offset + 100) // 4096]
    good = part.read_bytes()
    raw = bytearray(good)
    raw[(entry.offset + 100) % 4096] ^= 0xFF
    part.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match=r"\['embed'\]\" checksum 0x[0-9a-f]+ != manifest 0x"):
        store.read(1)
    part.write_bytes(good)
    parts[-1].unlink()  # holds the arrays after ['embed'] only: a read of ['embed'] never needs it
    assert _same_bits(store.read(1, names=["['embed']"])["['embed']"], w["['embed']"])
    with pytest.raises(ManifestError, match=r"version 1: part \d+ of its packed data is missing"):
        store.read(1)
    store.write(2, _weights(2))
    store.write(3, _weights(3))
    store.write(4, _weights(4))
    assert store.gc().deleted == (1,) and not (tmp_path / "s" / m.data).exists()


_WRITER = textwrap.dedent("""
    import sys, numpy as np
    from laminar_jax.relay.store import WeightStore
    store = WeightStore(sys.argv[1], keep_last=1000)
    # Not latest(): a writer killed between a version's manifest (the commit) and LATEST leaves
    # LATEST one behind, and the next version must be above every committed one.
    v = (store.newest_committed() or 0) + 1
    while True:
        store.write(v, {f"w{i:02d}": np.full((1 << 18,), v, np.float32) for i in range(48)})  # 48 MB
        print(v, flush=True)
        v += 1
""")


def _reader(store: WeightStore, stop: threading.Event, seen: list, errors: list) -> None:
    while not stop.is_set():
        try:
            v = store.latest()
            if v is None:
                continue
            flat = store.read(v)
            if len(flat) != 48 or any(not np.all(a == v) for a in flat.values()):
                errors.append(f"version {v} read back wrong")
            seen.append(v)
        except Exception as e:  # noqa: BLE001 - any failure is a test failure
            errors.append(repr(e))


def _kill_mid_version(url: str, data_dir, store: WeightStore) -> str:
    """Start a writer, let it commit two versions, SIGKILL it as soon as the next version's data
    exists without its manifest; returns that data prefix (the writer may still have committed it
    between the look and the kill: the caller checks)."""
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, url], stdout=subprocess.PIPE, text=True,
                              env=child_env())
    try:
        first = store.latest() or 0
        deadline = time.monotonic() + 60
        while (store.latest() or 0) < first + 2:  # a few versions committed first
            assert time.monotonic() < deadline and writer.poll() is None, "writer made no progress"
            time.sleep(0.01)
        while True:
            assert time.monotonic() < deadline, "never caught the writer mid-version"
            committed = set(store.versions())
            inflight = [d for d in os.listdir(data_dir) if int(d[1:13]) not in committed and os.listdir(data_dir / d)]
            if inflight:
                writer.send_signal(signal.SIGKILL)
                writer.wait(10)
                return inflight[0]
            time.sleep(0.001)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(10)
        writer.stdout.close()


def test_sigkill_mid_publish_never_exposes_a_partial_version(tmp_path):
    url = str(tmp_path / "store")
    store = WeightStore(url, keep_last=1000)
    stop, seen, errors = threading.Event(), [], []
    reader = threading.Thread(target=_reader, args=(store, stop, seen, errors), daemon=True)
    reader.start()
    try:
        # A version's write is short (one 48 MB object in the default format): a writer that
        # commits between the look and the kill is killed later instead, and another one is tried.
        for _ in range(5):
            prefix = _kill_mid_version(url, tmp_path / "store" / "data", store)
            if int(prefix[1:13]) not in store.versions():
                break
        time.sleep(0.2)
    finally:
        stop.set()
        reader.join(30)
    partial = int(prefix[1:13])
    assert errors == [], errors[:3]
    assert seen, "the reader never read a version"
    assert partial not in store.versions()
    assert store.latest() == max(store.versions()) == partial - 1
    with pytest.raises(VersionNotFound):
        store.read(partial)
    # Every dead writer's data no manifest references (this one's, and any a retry left behind).
    referenced = {store.manifest(v).data.split("/")[1] for v in store.versions()}
    dead = sorted(set(os.listdir(tmp_path / "store" / "data")) - referenced)
    assert prefix in dead
    # A restarted writer republishes that version; gc then removes the dead writers' data.
    store.write(partial, {"w": np.zeros(3, np.float32)})
    assert store.gc(orphans=False).orphans == ()  # a frequent caller may skip the scan
    report = store.gc()
    assert sorted(report.orphans) == [f"data/{d}/" for d in dead]
    assert store.read(partial)["w"].shape == (3,)


def test_gc_keeps_the_data_of_a_version_whose_manifest_does_not_parse_and_goes_on(tmp_path):
    store = WeightStore(str(tmp_path / "s"), keep_last=5)
    for v in range(1, 4):
        store.write(v, _weights(v))
    data_of_2 = store.manifest(2).data
    store._kv.write("manifests/v000000000002.json", b'{"version": 2, "data": ').result()  # torn by hand
    store._kv.write(f"data/v000000000001-{'0' * 8}/w", b"an orphan").result()  # a killed writer's
    with pytest.raises(ManifestError, match="v000000000002.json"):
        store.manifest(2)
    report = store.gc()  # raised ManifestError before, so no orphan was ever removed
    assert report.unreadable == (2,) and report.deleted == ()
    assert report.orphans == (f"data/v000000000001-{'0' * 8}/",)
    assert any(k.startswith(data_of_2) for k in store._list("data/")), "version 2's data was deleted"
    assert _same_bits(store.read(3)["['embed']"], _weights(3)["['embed']"])


def test_leases_pin_versions_against_gc(tmp_path):
    store = WeightStore(str(tmp_path / "s"), keep_last=2)
    for v in range(1, 4):
        store.write(v, _weights(v))
    lease = store.lease(1, "rollout-0", ttl_s=60)
    for v in range(4, 6):
        store.write(v, _weights(v))
    report = store.gc()
    assert report.deleted == (2, 3) and report.kept_leased == (1,)
    assert store.versions() == [1, 4, 5]
    assert _same_bits(store.read(1)["['embed']"], _weights(1)["['embed']"])  # pinned reader still reads
    lease.release()
    assert store.gc().deleted == (1,)
    assert store.versions() == [4, 5]
    with pytest.raises(VersionNotFound):
        store.lease(1, "late-reader")


def test_expired_lease_no_longer_pins(tmp_path):
    store = WeightStore(str(tmp_path / "s"), keep_last=1)
    store.write(1, _weights(1))
    store.write(2, _weights(2))
    with store.lease(1, "slow", ttl_s=0.2):
        assert store.gc().kept_leased == (1,)
        time.sleep(0.3)
        assert store.gc().deleted == (1,)
    with pytest.raises(ValueError, match="holder"):
        store.lease(2, "bad holder/name")


def _point_latest_at(store: WeightStore, version: int) -> None:
    store._kv.write("LATEST", ('{"version": %d}' % version).encode()).result()


def test_a_dangling_or_uncommitted_latest_is_repaired_by_the_newest_committed_version(tmp_path):
    store = WeightStore(str(tmp_path / "s"), keep_last=5)
    for v in (1, 2, 3):
        store.write(v, _weights(v))
    _point_latest_at(store, 9)  # dangling: gc removed it under a resumed learner
    assert store.latest() == 3
    store.write(4, _weights(4))  # the writer goes on from the newest committed version
    assert store.latest() == 4 and store._latest_hint() == 4
    # Uncommitted: the data of version 5 exist, its manifest does not (killed before the commit).
    store.write(5, _weights(5))
    store._kv.delete_range(store._kv.KeyRange("manifests/v000000000005.json", "manifests/v000000000005.json\0")).result()
    _point_latest_at(store, 5)
    fresh = WeightStore(str(tmp_path / "s"), keep_last=5)  # what a resume or an export opens
    assert fresh.latest() == 4 and _same_bits(fresh.read(fresh.latest())["['step']"], np.array(4, np.int64))
    fresh.write(5, _weights(55))  # the number is free again; the commit rewrites LATEST
    assert fresh.latest() == 5 and fresh.read(5)["['step']"] == 55


def test_retracting_to_a_collected_version_leaves_latest_on_a_committed_one(tmp_path):
    store = WeightStore(str(tmp_path / "s"), keep_last=2)
    for v in (1, 2, 3, 4):
        store.write(v, _weights(v))
        store.gc()
    assert store.versions() == [3, 4]
    assert store.retract_newer_than(2) == [3, 4]  # resume from a checkpoint at version 2 (collected)
    assert store.latest() is None and store._latest_hint() is None
    store.write(3, _weights(33))
    assert store.latest() == 3


class FakeDanglingStore:
    """A store whose LATEST names a version it cannot read (the old bug's state)."""

    url = "fake://dangling/"

    def latest(self):
        return 7

    def lease(self, version, holder):
        raise VersionNotFound(f"version {version} gone")


def test_pull_with_store_fallback_respects_its_deadline_on_a_dangling_version():
    from laminar_jax.relay.client import RelayClient

    client = RelayClient([], store=FakeDanglingStore())
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no newer version within 1.0s"):
        client.pull(newer_than=3, timeout=1.0)
    assert time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("fmt", ["zarr3", "zarr3_ocdbt"])
def test_a_runs_weight_plane_writes_the_configured_store_format(tmp_path, fmt):
    # relay.store_format reaches the run's store (it once did not: every run wrote the default format),
    # and the run's export reads it back in that format.
    from laminar_jax.config import default_config
    from laminar_jax.weights.plane import WeightsPlane

    cfg = default_config()
    cfg.relay.store_format = fmt
    plane = WeightsPlane(cfg, str(tmp_path), [], lambda: None, lambda: "", 10.0, b"k" * 32)
    assert plane.store.format == fmt
    m = plane.store.write(1, _weights(1))
    stored = {p.name for p in (tmp_path / "weights" / m.data).iterdir()}
    assert "packed" not in stored and ("a00000" in stored) == (fmt == "zarr3")  # not the default layout
    assert not any(e.key == store_mod.PACKED_KEY for e in m.entries)
    assert _same_bits(WeightStore.from_config(cfg.relay, str(tmp_path / "weights")).read(1)["['embed']"],
                      _weights(1)["['embed']"])


def test_a_dead_writers_lock_file_does_not_corrupt_the_next_write_of_its_key(tmp_path):
    # What a writer SIGKILLed while writing version 5's manifest leaves: tensorstore's lock file for
    # the key, holding part of that (longer) manifest. The restarted writer republishes version 5.
    store = WeightStore(str(tmp_path / "store"))
    store.write(4, {"w": np.ones(3, np.float32)})
    os.makedirs(tmp_path / "store" / "manifests", exist_ok=True)
    (tmp_path / "store" / "manifests" / "v000000000005.json.__lock").write_bytes(b'{"version": 5, ' + b"x" * 4096)
    (tmp_path / "store" / "LATEST.__lock").write_bytes(b'{"version": 5}' + b" " * 4096)
    store.write(5, {"w": np.zeros(3, np.float32)})
    assert store.manifest(5).version == 5 and store.read(5)["w"].tolist() == [0.0, 0.0, 0.0]
    assert store.latest() == 5 and store._latest_hint() == 5
    assert not any(n.endswith(".__lock") for n in os.listdir(tmp_path / "store" / "manifests"))
